"""The tables of run.toml and of a site profile, one module per table.

``run`` ([job], [env] and RunSpec, the whole file), ``model`` ([model], [model.lora]), ``data``
([data]), ``train`` ([train]),
``pipeline`` ([train.pipeline]), ``eval``, ``command``, ``serve``, ``sweep``, ``watchdogs``, and
``site`` (the site profile). A new key is a field here, with its description.
"""
