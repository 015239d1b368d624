"""Your cluster described: what Slurm says of it, written down as a site profile.

``inventory`` reads Slurm's records of partitions and nodes (``scontrol show partition`` and
``show node``, through the client) into typed facts: each partition's default flag, time limit
and state, each node's CPUs, memory, GPUs and features, and the distinct machine shapes of a
partition. ``profile_writer`` turns them, with what Slurm cannot say (the network interface, the
runs root, the Python environment: ``jobgen site init``'s flags), into a commented site profile
that the spec accepts; ``config_dir`` is where a user's own profiles live
(``$XDG_CONFIG_HOME/jobgen/sites``) and writes one there.
"""
