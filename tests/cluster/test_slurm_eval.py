"""Early stopping on the dev cluster: a 2-node run with a held-out split and patience
stops as planned (COMPLETED, the reason as the job's comment, the queued task exits at
once), keeps its best checkpoint past keep_checkpoints, and ``jobgen export --best`` gives
that checkpoint's weights as a model that loads."""

from __future__ import annotations

import json

import pytest

from helpers import assert_cancelled, checkpoint_tensors, jobgen, read_jsonl, submit, wait_for, wait_until_gone
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def task_exit(run, array_task: int) -> dict | None:
    return next(
        (r for r in read_jsonl(run / "tasks.jsonl") if r.get("array_task") == str(array_task) and r["event"] == "exit"),
        None,
    )


def test_a_two_node_run_stops_early_keeps_the_best_and_exports_it(cluster_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    # min_delta larger than any gain: the first evaluation (step 3) stays the best, and the
    # run stops at the second evaluation after it (step 9), whatever the losses.
    spec, run = cluster_run(
        "early",
        nodes=2,
        procs_per_node=1,
        time_limit="5m",
        array=2,
        keep_checkpoints=1,
        save_every_steps=1,
        eval={"split": 0.1, "every_steps": 3, "patience": 2, "min_delta": 10.0},
    )
    job = submit(spec)
    first = wait_for(lambda: task_exit(run, 1), 240, "task 1 to stop early")
    assert first["exit_code"] == 0 and first["end_step"] == 9, first
    best_loss = json.loads((run / "checkpoints" / "best.json").read_text())["eval_loss"]
    reason = f"early stop: no eval improvement since step 3 (best eval loss {best_loss:.4f})"
    assert first["exit_reason"] == reason, first
    assert json.loads((run / "done").read_text())["reason"] == reason
    wait_until_gone([job], timeout=120)

    (record,) = slurm.show_job(int(first["job_id"])) or [{}]
    assert (record.get("JobState"), record.get("ExitCode")) == ("COMPLETED", "0:0"), record
    assert record["Comment"] == f"jobgen: {reason} (exit 0)", record
    view = json.loads(jobgen("status", str(run), "--json", check=True).stdout)
    assert view["state"] == "finished" and view["step"] == 9, view
    assert (view["eval_best"]["step"], view["eval_last"]["step"]) == (3, 9), view
    assert_cancelled(job, ["2"], "the run finished in task ")  # task 2 never took the nodes (issue 47)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "eval"] == [3, 6, 9]

    # keep_checkpoints = 1 with a save every step: the newest, and the best.
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000009"]
    target = tmp_path / "best-model"
    exported = jobgen("export", str(run), "--to", str(target), "--best")
    assert exported.returncode == 0 and "exported step-00000003" in exported.stdout, exported.stderr
    weights = AutoModelForCausalLM.from_pretrained(target).state_dict()
    trained = checkpoint_tensors(run / "checkpoints" / "step-00000003")
    assert set(weights) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(weights[name], tensor.to(weights[name].dtype)), name
