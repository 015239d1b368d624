"""``jobgen samples RUN``: the answers the trainer gave to ``[eval] prompts``, side by side
across evaluations, read from the run's ``samples.jsonl`` (a line per prompt per evaluation).

A step evaluated twice (a job that got past its last checkpoint, then the next job that
redid those steps) shows the newest answer: the one the kept weights gave.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

from jobgen.base.safe_read import is_int
from jobgen.base.visible import visible
from jobgen.runs.jsonl_records import read_newest_records, read_records
from jobgen.runs.rundir import RunDir


class NoSamples(RuntimeError):
    """The run has no samples (yet), or none at the step asked for."""


class Samples(dict):
    """prompt -> step -> completion, and whether older evaluations were left out."""

    def __init__(self, table: dict[str, dict[int, str]], left_out: bool = False):
        super().__init__(table)
        self.left_out = left_out


# The fields of a line of samples.jsonl that jobgen shows (jobgen.runs.goodput.read_records).
SAMPLE_FIELDS = (
    {"prompt": (lambda v: isinstance(v, str), "a string"), "step": (is_int, "a step")},
    {"completion": (lambda v: isinstance(v, str), "a string")},
)


def read_samples(
    run: RunDir, step: int | None = None, warn: Callable[[str], None] = lambda _: None, last: int | None = None
) -> Samples:
    """prompt -> step -> completion, prompts in the order first answered, steps ascending:
    every step's, ``step``'s alone, or (``last``) the last evaluations', read from the
    file's end. Lines that are no samples are skipped, and ``warn`` is told once how many and
    why."""
    if step is None and last is not None:

        def enough(newest_first: list[dict[str, Any]]) -> bool:  # a step older than the last ones began
            return len({x["step"] for x in newest_first}) > last

        lines, left_out = read_newest_records(run.samples, SAMPLE_FIELDS, "sample", enough)
    else:
        lines, left_out = read_records(run.samples, SAMPLE_FIELDS, "sample"), False
    if lines.warning():
        warn(lines.warning())
    if not lines:
        raise NoSamples(f"{run.samples}: no samples yet (they come with [eval] prompts, at each evaluation)")
    if last is not None and step is None:
        newest = list(dict.fromkeys(x["step"] for x in reversed(lines)))  # in the order written, newest first
        keep, left_out = set(newest[:last]), left_out or len(newest) > last
    table: dict[str, dict[int, str]] = {}
    for line in lines:
        if (step is None or line["step"] == step) and (last is None or step is not None or line["step"] in keep):
            table.setdefault(line["prompt"], {})[line["step"]] = line.get("completion") or ""
    if not table:
        steps = sorted({x["step"] for x in lines})
        raise NoSamples(f"{run.samples}: no samples at step {step} (steps with samples: {steps})")
    return Samples({prompt: dict(sorted(by_step.items())) for prompt, by_step in table.items()}, left_out)


def format_samples(table: dict[str, dict[int, str]], width: int = 100) -> str:
    """Each prompt, then its answer at every step, one under the other, wrapped to ``width``.
    Both are a model's or a person's text: every control character in them is shown as an
    escape (jobgen.base.visible), never sent to the terminal."""
    steps = sorted({s for by_step in table.values() for s in by_step})
    label = max(len(f"step {s}") for s in steps)
    out: list[str] = []
    for number, (prompt, by_step) in enumerate(table.items(), start=1):
        out.append(f"prompt {number}: {visible(prompt)}")
        for step, completion in by_step.items():
            head = f"  {f'step {step}':>{label}} | "
            text = visible(" ".join(completion.split())) or "(nothing: the end of turn came first)"
            wrapped = textwrap.wrap(text, width=max(20, width - len(head))) or [""]
            out.append(head + wrapped[0])
            out.extend(" " * (len(head) - 2) + "| " + line for line in wrapped[1:])
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def samples_json(table: dict[str, dict[int, str]]) -> list[dict[str, Any]]:
    return [
        {"prompt": prompt, "completions": [{"step": step, "completion": text} for step, text in by_step.items()]}
        for prompt, by_step in table.items()
    ]
