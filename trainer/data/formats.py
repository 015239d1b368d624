"""The row formats of ``[data] format``: each row becomes text *segments* with a loss role.

- ``alpaca``: the Stanford Alpaca prompt (instruction, optional input) as prompt,
  ``output`` as the target (:func:`alpaca_segments`);
- ``chat``: ``messages`` rendered turn by turn with the tokenizer's chat template
  (ChatML when it has none): targets are each assistant turn's content and its
  end-of-turn token (:func:`chat_segments`);
- ``template``: a sandboxed Jinja template over the row; the text rendered from
  ``response_column`` is the target, the rest is prompt (:func:`template_segments`).

:mod:`trainer.data.build` tokenizes the segments and builds the labels from their roles.
"""

from __future__ import annotations

from typing import Any

from jobgen.spec.tables.data import DataSpec

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# Used for format "chat" when the tokenizer has no chat template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Segment roles.
PROMPT = 0  # no loss
TARGET = 1  # loss on every token
TURN_END = 2  # loss up to and including the first special token (end of turn), none after it

# Stands in for the response column when locating the response in a template rendering.
_SENTINEL = "\u2063JOBGEN-RESPONSE\u2063"


class DataError(ValueError):
    """Bad data: a missing file or column, a malformed row. The message names the path and row."""

    def for_source(self, prefix: str) -> DataError:
        """This error worded for the source ``prefix`` (``data.sources[1]``): the data modules
        word theirs for ``data.path``, the one-source case (``prefix`` "data")."""
        if prefix == "data":
            return self
        return DataError(f"{prefix}.path: {str(self).removeprefix('data.path: ')}")


def jinja_env():
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # StrictUndefined: a column the template names but the row lacks is an error, not "".
    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)


def template_variables(template: str) -> set[str]:
    from jinja2 import meta

    return set(meta.find_undeclared_variables(jinja_env().parse(template)))


def row_text(row: dict[str, Any], column: str, where: str, *, optional: bool = False) -> str:
    value = row.get(column)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        kind = "missing (null)" if value is None else f"a {type(value).__name__}, not a string"
        raise DataError(f"{where}: column '{column}' is {kind}")
    return value


def alpaca_segments(row: dict[str, Any], where: str) -> list[tuple[str, int]]:
    instruction = row_text(row, "instruction", where)
    extra = row_text(row, "input", where, optional=True)
    output = row_text(row, "output", where)
    if extra.strip():
        prompt = ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra)
    else:
        prompt = ALPACA_PROMPT.format(instruction=instruction)
    return [(prompt, PROMPT), (output, TARGET)]


def template_segments(row: dict[str, Any], spec: DataSpec, compiled, where: str) -> list[tuple[str, int]]:
    """Render twice, once with a sentinel for the response, to find where the response sits."""
    from jinja2 import UndefinedError

    row_text(row, spec.response_column, where)
    try:
        real = compiled.render(**row)
        marked = compiled.render(**{**row, spec.response_column: _SENTINEL})
    except UndefinedError as exc:
        raise DataError(f"{where}: template refers to something the row lacks: {exc.message}") from exc
    if marked.count(_SENTINEL) != 1:
        raise DataError(
            f"{where}: the template must render column '{spec.response_column}' exactly once and unchanged "
            f"(found {marked.count(_SENTINEL)} times); filters on the response column are not supported"
        )
    prefix, suffix = marked.split(_SENTINEL)
    if not (real.startswith(prefix) and real.endswith(suffix)) or len(prefix) + len(suffix) > len(real):
        raise DataError(f"{where}: the template renders the text around '{spec.response_column}' differently per row")
    response = real[len(prefix) : len(real) - len(suffix)]
    # Text after the response (rare) carries no loss; eos still does, so the model learns to stop.
    return [(prefix, PROMPT), (response, TARGET), (suffix, PROMPT)]


def chat_segments(messages: Any, render, where: str) -> list[tuple[str, int]]:
    """Turn-by-turn renderings of the conversation's prefixes: turn i is render(:i+1) minus render(:i).

    For an assistant turn, render(:i, add_generation_prompt=True) ends where the
    content starts, so the header is prompt. What follows the content up to the
    turn's first special token is its end-of-turn token (target); anything after
    it (ChatML's newline) is not. A template that strips or rewrites the content
    gets the whole turn body as target.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    clean = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"{where}: message {j} has no 'role'")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {j} ({message['role']}) has no string 'content'")
        # datasets fills keys that only some messages have with None; templates test for presence.
        clean.append({k: v for k, v in message.items() if v is not None})

    segments: list[tuple[str, int]] = []
    done = ""
    for i, message in enumerate(clean):
        full = render(clean[: i + 1], False)
        if not full.startswith(done):
            raise DataError(
                f"{where}: the chat template does not render conversation prefixes consistently "
                f"(turn {i} changes the text of earlier turns), so turns cannot be masked"
            )
        if message["role"] != "assistant":
            segments.append((full[len(done) :], PROMPT))
        else:
            if i == 0:
                raise DataError(f"{where}: the conversation starts with an assistant turn; it needs a prompt before it")
            header = render(clean[:i], True)
            if not (header.startswith(done) and full.startswith(header)):
                raise DataError(
                    f"{where}: the chat template's generation prompt is not a prefix of the rendered assistant turn {i}"
                )
            body = full[len(header) :]
            content = message["content"]
            segments.append((header[len(done) :], PROMPT))
            if content and body.startswith(content):
                segments += [(content, TARGET), (body[len(content) :], TURN_END)]
            else:
                segments.append((body, TARGET))
        done = full
    return segments


def chat_renderer(tokenizer):
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )

    return render


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text by itself (bos), and nothing it puts after (some add eos)."""
    probe = "a"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return list(full[:start])
    return []
