"""The ``[data]`` table of run.toml: the training data, its format and how rows become
sequences. The trainer reads it in trainer/data/.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from jobgen.spec.fields import SpecModel


class DataSpec(SpecModel):
    """The training data."""

    path: str = Field(
        description="JSONL/JSON/CSV/Parquet file, a save_to_disk directory (relative to run.toml), or a hub dataset id."
    )
    format: Literal["alpaca", "chat", "text", "template", "tokenized"] = Field(
        "alpaca",
        description=(
            "How rows become prompt + response. 'tokenized': the rows are token ids already (column input_ids, "
            "and labels, -100 where no loss is taken, else every token is a target), of the model's tokenizer."
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

    @field_validator("template")
    @classmethod
    def _template_matches_format(cls, template: str | None, info: ValidationInfo) -> str | None:
        fmt = info.data.get("format")
        if fmt == "template" and not template:
            raise ValueError("format = 'template' needs a 'template'")
        if fmt not in (None, "template") and template:
            raise ValueError(f"'template' is only used with format = 'template' (format is '{fmt}')")
        if template:
            _parse_template(template)  # a syntax error is found here, not on the cluster
        return template

    @field_validator("response_column")
    @classmethod
    def _template_uses_response(cls, column: str, info: ValidationInfo) -> str:
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
