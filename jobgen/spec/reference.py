"""Markdown reference of run.toml and of a site profile (``jobgen schema --markdown``),
generated from the pydantic models: the field descriptions are the one documentation,
and ``docs/reference/*.md`` are this module's output (tests/unit/test_reference_docs.py).

Types are written as a user writes them in TOML (``duration like "30m"``, ``list of
strings``), defaults as TOML values. The output depends on the models only.
"""

from __future__ import annotations

import inspect
import json
import types
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from jobgen.base.durations import parse_duration
from jobgen.spec.tables.run import RunSpec
from jobgen.spec.tables.site import SiteProfile

RUN_COMMAND = "jobgen schema --markdown > docs/reference/run-toml.md"
SITE_COMMAND = "jobgen schema --site --markdown > docs/reference/site.md"

# Annotated types recognised by one of their validators: name of the validator function -> how to write it.
_NAMED_STRINGS = {
    "_valid_threshold": 'amount like "20%" or "500G"',
    "_check_size": 'size like "80GiB"',
}
_PLURALS = {"string": "strings", "integer": "integers", "number": "numbers", "boolean": "booleans"}


def _validator_names(meta: tuple[Any, ...]) -> set[str]:
    """Names of the functions of the Before/AfterValidators in an Annotated's metadata."""
    funcs = (getattr(m, "func", None) for m in meta)
    return {getattr(f, "__name__", "") for f in funcs if f is not None}


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip_none(tp: Any) -> Any:
    """``X | None`` -> ``X`` (TOML has no null: leaving a key out is how it is unset)."""
    if get_origin(tp) in (Union, types.UnionType):
        rest = [a for a in get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
        if len(rest) < len(get_args(tp)):
            return Union[tuple(rest)]  # noqa: UP007 (built from a list: no X | Y spelling)
    return tp


def toml_type(tp: Any) -> str:
    """How a value of this annotation is written in TOML, in words."""
    tp = _strip_none(tp)
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *meta = get_args(tp)
        names = _validator_names(tuple(meta))
        if parse_duration.__name__ in names:
            return 'duration like "30m"'
        for name, words in _NAMED_STRINGS.items():
            if name in names:
                return words
        return toml_type(inner)
    if origin is Literal:
        return "one of " + " / ".join(json.dumps(v) for v in get_args(tp))
    if origin is list:
        item = toml_type(get_args(tp)[0])
        return "list of " + _PLURALS.get(item, item)
    if origin is dict:
        return "table of " + _PLURALS.get(toml_type(get_args(tp)[1]), "values")
    if origin in (Union, types.UnionType):
        return " or ".join(toml_type(a) for a in get_args(tp))
    if _is_model(tp):
        return "table"
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return simple.get(tp, getattr(tp, "__name__", str(tp)))


def _bounds(meta: list[Any]) -> str:
    parts = []
    for m in meta:
        for cls, attr, sign in ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<")):
            if isinstance(m, cls):
                parts.append(f"{sign} {_toml_value(getattr(m, attr))}")
        if isinstance(m, at.MinLen) and m.min_length:
            parts.append(f"at least {m.min_length}")
    return ", ".join(parts)


def field_type(field: FieldInfo) -> str:
    text = toml_type(field.rebuild_annotation())
    bounds = _bounds(list(field.metadata))
    return f"{text} ({bounds})" if bounds else text


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def field_default(field: FieldInfo) -> str:
    """The default as TOML, ``required``, or ``not set`` (no value: the key is left out)."""
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is None or value is PydanticUndefined:
        return "not set"
    if isinstance(value, BaseModel):
        return "see the table"
    return f"`{_toml_value(value)}`"


def _model_of(field: FieldInfo) -> type[BaseModel] | None:
    tp = _strip_none(field.annotation)
    return tp if _is_model(tp) else None


def _doc(model: type[BaseModel]) -> str:
    doc = inspect.cleandoc(model.__doc__ or "")
    return " ".join(doc.split()).replace("``", "`")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _key_rows(model: type[BaseModel], table: str, parent: FieldInfo | None = None) -> Iterator[str]:
    # A table whose own default is not its class's (site.python: kind = "none") shows that default.
    instance = parent.default_factory() if parent is not None and parent.default_factory else None  # type: ignore[call-arg]
    changed = instance.model_dump(mode="json", exclude_defaults=True) if isinstance(instance, BaseModel) else {}
    for name, field in model.model_fields.items():
        sub = _model_of(field)
        full = f"{table}.{name}" if table else name
        kind = f"table, see [`[{full}]`](#{_anchor(full)})" if sub else field_type(field)
        default = "see the table" if sub else field_default(field)
        if name in changed and not sub:
            default = f"`{_toml_value(changed[name])}`"
        yield f"| `{name}` | {_cell(kind)} | {_cell(default)} | {_cell(field.description or '')} |"


def _anchor(table: str) -> str:
    """GitHub's anchor of the heading ``[table]``: punctuation other than '-' and '_' dropped."""
    return table.replace(".", "").lower()


def _section(model: type[BaseModel], table: str, field: FieldInfo | None, level: int) -> list[str]:
    lines = [f"{'#' * level} [{table}]", ""]
    intro = " ".join(t for t in (_doc(model), field.description if field else "") if t)
    if field is not None and not field.is_required() and field_default(field) == "not set":
        intro += " Optional table: leave it out for none."
    if intro:
        lines += [intro, ""]
    lines += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    lines += list(_key_rows(model, table, field))
    lines.append("")
    return lines


def _tables(model: type[BaseModel], prefix: str, level: int) -> Iterator[list[str]]:
    """One section per sub-table of ``model``, depth first, in field order."""
    for name, field in model.model_fields.items():
        table = f"{prefix}.{name}" if prefix else name
        sub = _model_of(field)
        if sub is not None:
            yield _section(sub, table, field, level)
            yield from _tables(sub, table, level + 1)
        elif prefix == "" and get_origin(_strip_none(field.annotation)) is dict:
            yield _free_table(table, field, level)


def _free_table(table: str, field: FieldInfo, level: int) -> list[str]:
    """A table of user-chosen keys, such as [env]."""
    kind = toml_type(field.rebuild_annotation())
    return [f"{'#' * level} [{table}]", "", _cell(f"{field.description} Any keys: a {kind}."), ""]


def _header(title: str, command: str, intro: str) -> list[str]:
    return [
        f"<!-- Generated by `{command}` from the pydantic models in jobgen/; do not edit. -->",
        "",
        f"# {title}",
        "",
        intro,
        "",
        "Types are written as in TOML. *not set* means the key has no default value: leave it out.",
        "",
    ]


def _top_level_section() -> list[str]:
    site = (
        'Site profile: a name such as `"local"` (its file in ~/.config/jobgen/sites/ or the bundled ones), '
        "a path to a TOML file, or a "
        "`[site]` table with `profile` (a name or path) and overrides of any key of the profile, "
        "e.g. `network.debug = true` (see [site.md](site.md))."
    )
    return [
        "## Top level",
        "",
        "| Key | Type | Default | Description |",
        "| --- | --- | --- | --- |",
        f'| `site` | string or table | `"local"` | {_cell(site)} |',
        "",
    ]


def run_markdown() -> str:
    """The reference of run.toml."""
    lines = _header(
        "run.toml reference",
        RUN_COMMAND,
        "A run is one TOML file; its tables are below. Unknown keys are errors. "
        "`jobgen validate run.toml` checks a file; `jobgen schema` prints the JSON schema for editors.",
    )
    lines += _top_level_section()
    for section in _tables(RunSpec, "", 2):
        lines += section
    return _join(lines)


def site_markdown() -> str:
    """The reference of a site profile (<name>.toml)."""
    lines = _header(
        "Site profile reference",
        SITE_COMMAND,
        "A site profile (<name>.toml in $JOBGEN_SITE_PATH, ~/.config/jobgen/sites/ or jobgen's bundled "
        "profiles, or any path) holds what belongs to the cluster rather "
        "than to one job; a run names it with `site` and may override any key in a `[site]` table. "
        "Unknown keys are errors.",
    )
    lines += ["## Top level", "", _doc(SiteProfile), ""]
    lines += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    lines += list(_key_rows(SiteProfile, ""))
    lines.append("")
    for section in _tables(SiteProfile, "", 2):
        lines += section
    return _join(lines)


def _join(lines: list[str]) -> str:
    return "\n".join(lines).rstrip("\n") + "\n"


MARKDOWN: dict[bool, Callable[[], str]] = {False: run_markdown, True: site_markdown}
