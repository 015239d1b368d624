"""``jobgen serve`` and ``jobgen chat``: an OpenAI-compatible server for a run's model.

``submit`` (what is served, its export, the serve job), ``render`` (its batch script), ``node``
(what runs on the node: the engine, its address file), ``address`` (where it listens, decided on
the node), ``proxy`` and ``uds`` (the API key in front of an engine without one), ``records``
(serve.json and serve-job.json read as input), ``status`` (``--status``, ``--stop``) and ``chat``.
"""
