"""run.toml and site profiles: the pydantic models, their loading and checking, spec.json.

The tables themselves are ``spec.tables`` (one module per table; their descriptions are the
reference documentation, ``jobgen schema``). Here: the shared field types (``fields``), which
environment names a spec may set and which values are secrets (``env_names``), the loader that
resolves a site profile and reports every problem by file and key (``loader``), the result every
later step takes (``resolved``: ResolvedSpec, what spec.json holds, read back by ``spec_json``),
the checks of the files a spec names (``named_files``, ``data_files``), the global batch across
world sizes (``global_batch``), and the generated schema and reference (``schema``, ``reference``).
"""
