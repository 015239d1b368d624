"""The ``[data]`` table of run.toml: the training data, its format and how rows become
sequences. The trainer reads it in trainer/data/.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from jobgen.spec.fields import SpecModel

DataFormat = Literal["alpaca", "chat", "text", "template", "tokenized"]
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# The keys of [data] that say how one source's rows are read; a [[data.sources]] entry sets
# its own, the rest of [data] (max_length, packing, num_proc) is the mixture's.
SOURCE_KEYS = ("path", "format", "template", "response_column", "text_column")


class _ReadsRows(SpecModel):
    """What [data] and each of its sources check of how rows are read (their ``format``,
    ``template`` and ``response_column``, declared by each in its own place in the schema)."""

    @field_validator("template", check_fields=False)
    @classmethod
    def _template_matches_format(cls, template: str | None, info: ValidationInfo) -> str | None:
        return _checked_template(template, info)

    @field_validator("response_column", check_fields=False)
    @classmethod
    def _template_uses_response(cls, column: str, info: ValidationInfo) -> str:
        return _checked_response_column(column, info)


class DataSourceSpec(_ReadsRows):
    """One source of a mixture (``[[data.sources]]``): where its rows are, how they are read, and
    how much of the training it is."""

    path: str = Field(
        description=(
            "JSONL/JSON/CSV/Parquet/Arrow file, a directory of them or a save_to_disk directory (relative to "
            "run.toml), or a hub dataset id."
        )
    )
    name: str | None = Field(
        None,
        description=(
            "What metrics, status and evaluation call this source (letters, digits, '_', '.', '-'). "
            "Default: the file name without its suffix."
        ),
    )
    format: DataFormat = Field(
        "alpaca", description="How this source's rows become prompt + response (as data.format)."
    )
    template: str | None = Field(None, description="Jinja template over the row's columns, when format = 'template'.")
    response_column: str = Field("output", description="Column holding the response (format 'template').")
    text_column: str = Field("text", description="Column holding the text (format 'text').")
    weight: float | None = Field(
        None,
        gt=0,
        description=(
            "This source's share of the tokens trained on. The weights of the sources given one are normalised "
            "over what sources given epochs leave (weights 2, 1, 1 alone: 50 %, 25 %, 25 % of the tokens)."
        ),
    )
    epochs: float | None = Field(
        None,
        gt=0,
        description=(
            "Passes over this source in the whole run (train.max_steps global batches), instead of a weight: "
            "its rows take that share of the rows drawn. With no weighted source, the sources' shares are in "
            "proportion to their epochs times their rows."
        ),
    )

    @model_validator(mode="after")
    def _one_amount(self) -> DataSourceSpec:
        if (self.weight is None) == (self.epochs is None):
            raise ValueError("give a source either a weight (its share of the tokens) or epochs (passes over it)")
        if self.name is not None and not SOURCE_NAME.fullmatch(self.name):
            raise ValueError(f"name '{self.name}': use up to 64 letters, digits, '_', '.' or '-'")
        return self

    def display_name(self) -> str:
        """The name given, or the path's file name without its suffix (a hub id's last part)."""
        if self.name:
            return self.name
        stem = re.sub(r"\.[A-Za-z0-9]+$", "", self.path.rstrip("/").rsplit("/", 1)[-1])
        return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:64] or "data"


class DataSpec(_ReadsRows):
    """The training data: one source (``path``), or a mixture (``[[data.sources]]``)."""

    path: str | None = Field(
        None,
        description=(
            "JSONL/JSON/CSV/Parquet/Arrow file, a directory of them or a save_to_disk directory (relative to "
            "run.toml), or a hub dataset id. "
            "Give it, or data.sources."
        ),
    )
    sources: list[DataSourceSpec] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description=(
            "A mixture of sources instead of path: each read its own way and cached on its own (adding a source "
            "tokenizes only that one), drawn by weight in an order that the seed decides and resumes exactly. "
            "The keys format, template, response_column and text_column are then each source's, not [data]'s."
        ),
    )
    format: DataFormat = Field(
        "alpaca",
        description=(
            "How rows become prompt + response. 'tokenized': the rows are token ids already (column input_ids, "
            "and labels, -100 where no loss is taken, else every token is a target), of the model's tokenizer; "
            "Arrow files (save_to_disk, .arrow) whose rows all fit max_length are trained on where they lie, "
            "memory-mapped, not copied."
        ),
    )
    template: str | None = Field(
        None,
        description=(
            "Jinja template over the row's columns, when format = 'template', e.g. "
            "'### Input: {{input}}\\n\\n### Label: {{output}}'. The text rendered from response_column is the response."
        ),
    )
    response_column: str = Field(
        "output", description="Column holding the response (format 'template'); loss is computed on it only."
    )
    text_column: str = Field("text", description="Column holding the text (format 'text'); loss on all of it.")
    max_length: int = Field(
        1024, ge=8, le=1_048_576, description="Tokens per sequence; longer examples are truncated and counted."
    )
    packing: bool = Field(False, description="Pack examples into max_length rows without cross-example attention.")
    num_proc: int | None = Field(
        None,
        ge=1,
        le=1024,
        description=(
            "Processes each node's first rank tokenizes its share of the data with when the data is not cached "
            "yet (every node of the job takes a share). Default: every CPU the job has on that node, one per "
            "20000 rows at most (starting a worker costs more than it saves on small sets). The tokenized data, "
            "and its cache entry, are the same bytes whatever the number of processes and nodes."
        ),
    )

    @model_validator(mode="after")
    def _path_or_sources(self) -> DataSpec:
        if (self.path is None) == (self.sources is None):
            raise ValueError("give data.path (one source) or [[data.sources]] (a mixture), not both or neither")
        if self.sources is not None:
            # A value other than the default would be ignored: each source reads its rows its own
            # way. (Not model_fields_set: spec.json writes every key, defaults included.)
            fields = type(self).model_fields
            stray = [key for key in SOURCE_KEYS[1:] if getattr(self, key) != fields[key].default]
            if stray:
                raise ValueError(
                    f"data.{stray[0]} is set beside [[data.sources]], where each source has its own: "
                    "set it in the sources it applies to"
                )
            names = [source.display_name() for source in self.sources]
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise ValueError(
                    f"data.sources: the name(s) {', '.join(twice)} are given twice: set 'name' to tell them apart"
                )
        return self

    def source_specs(self) -> list[tuple[str, str, DataSpec]]:
        """(key prefix for errors, source name, the one-source [data] that reads it) for every
        source: ``data.path`` alone is the one source ``("data", its name, itself)``."""
        if self.sources is None:
            assert self.path is not None
            name = DataSourceSpec(path=self.path, weight=1.0).display_name()
            return [("data", name, self)]
        return [
            (
                f"data.sources[{i}]",
                source.display_name(),
                self.model_copy(update={**{key: getattr(source, key) for key in SOURCE_KEYS}, "sources": None}),
            )
            for i, source in enumerate(self.sources)
        ]

    def describe_sources(self) -> str | None:
        """A mixture's sources in words, for validate (None for data.path alone)."""
        if self.sources is None:
            return None
        words = [
            f"{s.display_name()} ({s.format}, "
            + (f"weight {s.weight:g})" if s.weight is not None else f"{s.epochs:g} epochs)")
            for s in self.sources
        ]
        return "data.sources: " + ", ".join(words)

    def paths(self) -> list[tuple[str, str]]:
        """(key, path) of every source: ``data.path``, or ``data.sources[i].path``."""
        return [(f"{prefix}.path", spec.path or "") for prefix, _name, spec in self.source_specs()]


def _checked_template(template: str | None, info: ValidationInfo) -> str | None:
    fmt = info.data.get("format")
    if fmt == "template" and not template:
        raise ValueError("format = 'template' needs a 'template'")
    if fmt not in (None, "template") and template:
        raise ValueError(f"'template' is only used with format = 'template' (format is '{fmt}')")
    if template:
        _parse_template(template)  # a syntax error is found here, not on the cluster
    return template


def _checked_response_column(column: str, info: ValidationInfo) -> str:
    template = info.data.get("template")  # absent when the template itself was invalid
    if info.data.get("format") == "template" and template:
        from jinja2 import meta

        if column not in meta.find_undeclared_variables(_parse_template(template)):
            # The trainer finds the response by rendering it; with none, every row fails.
            raise ValueError(
                f"the template never uses the response column '{column}'; "
                "name the column it renders as the response in response_column"
            )
    return column


def _parse_template(template: str):
    """The template's syntax tree, parsed as the trainer parses it (trainer.data.formats.jinja_env: a
    sandboxed environment with default delimiters; jobgen may not import trainer)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return ImmutableSandboxedEnvironment(keep_trailing_newline=True).parse(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"Jinja syntax error at line {exc.lineno} of the template: {exc.message}") from None
