"""A mixture of three sources (``[[data.sources]]``: alpaca, text and chat rows, each read its own
way and cached on its own) under torchrun on gloo, over 1,000 steps:

- the tokens drawn from each source are within 2 % of its weight (the metrics line's
  ``source_tokens``, counted from the rows every rank drew);
- a run stopped by the kill switch and resumed on 2 processes, then stopped again and resumed on
  1 (train.global_batch_size kept), trains on the same rows in the same steps, with the same
  losses as the uninterrupted run;
- evaluation holds out each source's share and reports its loss per source.
"""

from __future__ import annotations

import json

import pytest

from helpers import (
    DATA,
    losses,
    make_run,
    metric,
    read_jsonl,
    stopped_by_kill_switch,
    summary,
    torchrun,
)
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch

STEPS = 1000
WEIGHTS = {"math": 0.5, "prose": 0.3, "dialog": 0.2}


def sources(directory):
    """Three sources of other lengths and formats, from the example rows."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "math": [r for r in rows[:150]],
        "prose": [{"text": " ".join([r["instruction"], r["output"]] * 3)} for r in rows[150:300]],
        "dialog": [
            {"messages": [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]}
            for r in rows[300:]
        ],
    }
    for name, items in files.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    formats = {"math": "alpaca", "prose": "text", "dialog": "chat"}
    return [
        {"path": str(directory / f"{name}.jsonl"), "format": formats[name], "weight": WEIGHTS[name]} for name in files
    ]


def mixture_run(directory, tiny_model, data_dir, **extra):
    keys = {"max_steps": STEPS, "micro_batch_size": 2, "global_batch_size": 8, "parallelism": "ddp", "lr": 1e-3}
    data = {"path": None, "sources": sources(data_dir), "max_length": 256}
    return make_run(directory, tiny_model, data=data, **{**keys, **extra})


def source_tokens(run) -> dict[int, dict[str, int]]:
    return {r["step"]: r["source_tokens"] for r in read_jsonl(run / "metrics.jsonl") if "source_tokens" in r}


def test_three_sources_train_in_their_shares_and_resume_exactly_on_fewer_ranks(tmp_path, tiny_model):
    reference = mixture_run(tmp_path / "a", tiny_model, tmp_path / "data")
    proc = torchrun(reference, nproc=2, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    drawn = source_tokens(reference)[STEPS]
    total = sum(drawn.values())
    assert sum(metric(reference, "step_tokens").values()) == total  # every token counted, each once
    for name, weight in WEIGHTS.items():
        assert drawn[name] / total == pytest.approx(weight, rel=0.02), (name, drawn)
        assert f"data: mixture: {name}: " in out, out[-3000:]
    assert set(json.loads((reference / "metrics.json").read_text())["data_stats"]["sources"]) == set(WEIGHTS)

    run = mixture_run(tmp_path / "b", tiny_model, tmp_path / "data")
    first, out = stopped_by_kill_switch(run, 300)
    assert first["exit_code"] == ExitCode.KILL_SWITCH and first["end_step"] < 700, out[-3000:]
    second, out = stopped_by_kill_switch(run, first["end_step"] + 300)
    assert second["exit_code"] == ExitCode.KILL_SWITCH, out[-3000:]
    assert "read from the cache entry" in out  # each source's entry, tokenized once
    proc = torchrun(run, nproc=1, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (summary(run)["world_size"], summary(run)["grad_accum"]) == (1, 4)

    # The same rows in every step (the counts are integers: exact), the same losses.
    assert source_tokens(run) == source_tokens(reference)
    assert metric(run, "step_target_tokens") == metric(reference, "step_target_tokens")
    got, expected = losses(run), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, second["end_step"] + 1):  # 2 processes, as the reference: the same sums
        assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-5), step
    for step in range(second["end_step"] + 1, STEPS + 1):  # 1 process sums in another order
        assert got[step] == pytest.approx(expected[step], rel=1e-3, abs=1e-4), step


def test_each_source_holds_out_its_share_and_is_evaluated_apart(tmp_path, tiny_model):
    data = {"path": None, "sources": sources(tmp_path / "data"), "max_length": 256}
    keys = {"max_steps": 4, "micro_batch_size": 2, "parallelism": "ddp"}
    run = make_run(tmp_path / "e", tiny_model, data=data, eval={"split": 0.1, "every_steps": 2}, **keys)
    proc = torchrun(run, nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    for record in evals:
        per = record["eval_source_losses"]
        assert set(per) == set(WEIGHTS) and all(v > 0 for v in per.values()), record
        # The whole loss is the per-source losses weighted by their target tokens: between them.
        assert min(per.values()) <= record["eval_loss"] <= max(per.values())
