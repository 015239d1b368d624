"""Reading a run's JSON-lines records from the end (jobgen.runs.jsonl_records.read_newest_records)
and `jobgen samples`, which shows the last evaluations that way: the answer equals what a
full read gives for the same evaluations, on random histories (redone steps, damaged lines,
a torn last line, lines longer than a read block)."""

from __future__ import annotations

import json
import random

import pytest

from helpers import jobgen
from jobgen.report.samples import SAMPLE_FIELDS, read_samples
from jobgen.runs.jsonl_records import read_newest_records, read_records
from jobgen.runs.rundir import RunDir
from run_dirs import unsubmitted_run


def random_samples(rng: random.Random) -> str:
    """samples.jsonl of a run evaluated every 10 steps, its 1-3 prompts each time, whose tasks
    sometimes resume from an earlier checkpoint and evaluate the same steps again (the newest
    evaluation of a step is the one shown)."""
    lines, step = [], 0
    prompts = rng.sample(["hi", "2+2?", "Name a colour.", "x" * 70_000], rng.randint(1, 3))  # the spec's
    for _ in range(rng.choice([1, 3, 40, 400])):
        step = max(0, step - rng.choice([0, 0, 0, 20, 30])) + 10  # a resume redoes the steps after its checkpoint
        for prompt in prompts:
            lines.append(json.dumps({"step": step, "prompt": prompt, "completion": f"{prompt[:5]} at {step}"}))
            if rng.random() < 0.03:
                lines.append(rng.choice(["[1, 2]", '{"step": "ten", "prompt": "p"}', "garbage{", ""]))
    text = "\n".join(lines)
    return text + rng.choice(["\n", "", '\n{"step": 99999, "prompt": "cut sh'])


def expected(text_path, last: int) -> tuple[dict[str, dict[int, str]], bool]:
    """The full read's answer for the `last` evaluations written last."""
    lines = read_records(text_path, SAMPLE_FIELDS, "sample")
    newest = list(dict.fromkeys(x["step"] for x in reversed(lines)))[:last]
    table: dict[str, dict[int, str]] = {}
    for line in lines:
        if line["step"] in newest:
            table.setdefault(line["prompt"], {})[line["step"]] = line["completion"]
    return table, len(set(x["step"] for x in lines)) > last


@pytest.mark.parametrize("seed", range(24))
def test_the_last_evaluations_read_from_the_end_equal_a_full_reads(tmp_path, seed):
    rng = random.Random(seed)
    run = RunDir(tmp_path)
    run.samples.write_text(random_samples(rng))
    for last in (1, 2, 10, 1000):
        want, left_out = expected(run.samples, last)
        got = read_samples(run, last=last)
        # The same answers for the same steps; prompts in the order first answered among them.
        assert {p: dict(s) for p, s in got.items()} == want, (seed, last)
        assert got.left_out == left_out, (seed, last)
    full = read_records(run.samples, SAMPLE_FIELDS, "sample")
    every, left = read_newest_records(run.samples, SAMPLE_FIELDS, "sample", lambda _: False)
    assert (list(every), every.skipped, every.warning(), left) == (list(full), full.skipped, full.warning(), False)


def test_a_long_history_is_read_from_its_end_only(tmp_path):
    """A week of evaluations (50,000, 20 MB): the last 3 read a block, not the file."""
    run = RunDir(tmp_path)
    with run.samples.open("w") as fh:
        for step in range(10, 500_001, 10):
            fh.write(json.dumps({"step": step, "prompt": "hi", "completion": "x" * 300}) + "\n")
    blocks: list[int] = []
    reads = []

    def enough(newest_first) -> bool:
        blocks.append(len(newest_first))
        return len({x["step"] for x in newest_first}) > 3

    reads, left_out = read_newest_records(run.samples, SAMPLE_FIELDS, "sample", enough)
    assert left_out and len(blocks) == 2 and len(reads) < 300, (len(blocks), len(reads))
    assert sorted(read_samples(run, last=3)["hi"]) == [499_980, 499_990, 500_000]


def test_jobgen_samples_shows_the_last_evaluations_and_says_what_it_left_out(tmp_path):
    run = unsubmitted_run(tmp_path)
    run.samples.write_text(
        "".join(json.dumps({"step": s, "prompt": "hi", "completion": f"at {s}"}) + "\n" for s in range(1, 13))
    )
    shown = jobgen("samples", str(run.path))
    assert shown.returncode == 0, shown.stderr
    assert "step 3 |" in shown.stdout and "step 2 |" not in shown.stdout and "step 12 |" in shown.stdout
    assert "the last 10 evaluations; --last N for more, --all for every one" in shown.stderr
    every = jobgen("samples", str(run.path), "--all")
    assert "step 1 |" in every.stdout and every.stderr == ""
    two = jobgen("samples", str(run.path), "--last", "2", "--json")
    assert [c["step"] for c in json.loads(two.stdout)[0]["completions"]] == [11, 12]
