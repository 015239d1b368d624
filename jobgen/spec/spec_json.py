"""``spec.json``, the resolved spec a run was rendered from, as every command reads it: a
:class:`jobgen.spec.resolved.ResolvedSpec`, or :class:`jobgen.base.safe_read.DamagedFile` naming the
file and the first key that does not validate. Apart from :mod:`jobgen.base.safe_read`, which the
spec models' own modules use and so may not import them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobgen.base.safe_read import LARGEST_ID, DamagedFile, read_json
from jobgen.spec.resolved import ResolvedSpec


def read_spec(path: Path) -> ResolvedSpec:
    """``spec.json``: the resolved spec the run was rendered from. Raises :class:`DamagedFile`
    with the first key that does not validate (and how many more), FileNotFoundError when
    there is none."""
    from pydantic import ValidationError

    from jobgen.spec.loader import key_path
    from jobgen.spec.tables.run import RunSpec
    from jobgen.spec.tables.site import SiteProfile

    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("run"), dict) or not isinstance(data.get("site"), dict):
        raise DamagedFile(path, "not a jobgen spec (an object with the objects 'run' and 'site')")
    try:
        huge = _huge_integer(data)
    except RecursionError:
        raise DamagedFile(path, "nested too deep to read") from None
    if huge is not None:  # TOML integers are 64-bit: no spec jobgen wrote has one beyond
        raise DamagedFile(path, f"{huge}: an integer larger than any run.toml can give")
    for key in ("spec_file", "site_file"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise DamagedFile(path, f"{key}: not a path")
    validated = {}
    for part, model in (("run", RunSpec), ("site", SiteProfile)):
        try:
            validated[part] = model.model_validate(data[part])
        except ValidationError as exc:
            first, more = exc.errors()[0], len(exc.errors()) - 1
            where = ".".join(filter(None, (part, key_path(first["loc"]))))
            message = str(first["msg"]).removeprefix("Value error, ")
            raise DamagedFile(path, f"{where}: {message}" + (f" (and {more} more)" if more else "")) from None
        except RecursionError:
            raise DamagedFile(path, f"{part}: nested too deep to read") from None
    # Validated once: a listing of a thousand runs reads a thousand specs.
    return ResolvedSpec(
        run=validated["run"], site=validated["site"], spec_file=data.get("spec_file"), site_file=data.get("site_file")
    )


def _huge_integer(value: Any, where: str = "") -> str | None:
    """The key path of the first integer beyond :data:`LARGEST_ID` in ``value``, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return where or "the spec" if abs(value) > LARGEST_ID else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found = _huge_integer(child, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None
