"""jobgen compare: runs and sweep points side by side, from run directories built by hand
(spec.json, metrics.jsonl, checkpoints/best.json, sweep.json), without Slurm or a trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobgen.cli.main import main
from jobgen.report.compare import PENDING, BadReference, CompareError, compare, draw, label, short_names
from run_dirs import training_run_at_step_25


@pytest.fixture
def spec_json(tmp_path: Path) -> str:
    """The spec.json of a 60-step training run, as `jobgen submit` writes it."""
    return training_run_at_step_25(tmp_path).spec_file.read_text()


def fake_run(
    path: Path,
    spec_json: str,
    losses: dict[int, float],
    evals: dict[int, float] | None = None,
    best: dict[str, object] | None = None,
) -> Path:
    """A run directory with training lines (step -> loss), eval lines and best.json."""
    path.mkdir(parents=True)
    (path / "spec.json").write_text(spec_json)
    lines = [{"time": 1000.0 + s, "step": s, "loss": v, "job_id": "5"} for s, v in losses.items()]
    lines += [{"time": 1000.5 + s, "step": s, "event": "eval", "eval_loss": v} for s, v in (evals or {}).items()]
    lines.sort(key=lambda x: x["time"])
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if best is not None:
        (path / "checkpoints").mkdir()
        (path / "checkpoints" / "best.json").write_text(json.dumps(best))
    return path


def fake_sweep(directory: Path, spec_json: str) -> Path:
    """A sweep of four points: two evaluated, one trained without evaluations, one never started."""
    names = ["lr-0.0003_r-16", "lr-0.001_r-16", "lr-0.0003_r-32", "lr-0.001_r-32"]
    points = [
        {
            "name": name,
            "overrides": {"train.lr": float(name[3:].split("_")[0]), "model.lora.r": int(name[-2:])},
            "program": "train",
            "attempts": 1,
        }
        for name in names
    ]
    directory.mkdir(parents=True)
    (directory / "sweep.json").write_text(
        json.dumps({"format": 2, "name": "lr", "max_parallel": 2, "points": points, "jobs": []})
    )
    fake_run(directory / "points" / names[0], spec_json, {10: 2.5, 20: 2.0}, {10: 2.4, 20: 2.2})
    # best.json wins over the logged evaluations: the checkpoint the trainer chose.
    best = {"step": 10, "eval_loss": 2.1}
    fake_run(directory / "points" / names[1], spec_json, {10: 2.2, 20: 1.9}, {10: 2.1, 20: 2.3}, best=best)
    fake_run(directory / "points" / names[2], spec_json, {10: 2.6, 30: 1.5})
    return directory


def test_a_sweep_is_sorted_by_best_eval_loss_then_final_loss(tmp_path, spec_json):
    rows = compare([str(fake_sweep(tmp_path / "lr", spec_json))], None)
    assert [r.name for r in rows] == ["lr-0.001_r-16", "lr-0.0003_r-16", "lr-0.0003_r-32", "lr-0.001_r-32"]
    best, second, no_eval, pending = rows
    assert (best.best_eval_loss, best.best_eval_step, best.final_loss) == (2.1, 10, 1.9)
    assert (second.best_eval_loss, second.best_eval_step) == (2.2, 20)  # the lowest logged, without best.json
    assert (no_eval.best_eval_loss, no_eval.final_loss, no_eval.step, no_eval.max_steps) == (None, 1.5, 30, 60)
    assert pending.state == PENDING and (pending.step, pending.final_loss, pending.max_steps) == (None, None, None)
    assert best.overrides == {"train.lr": 0.001, "model.lora.r": 16} and best.sweep == "lr"


def test_plain_runs_without_evaluations_sort_by_final_loss(tmp_path, spec_json):
    low = fake_run(tmp_path / "low", spec_json, {10: 3.0, 20: 1.0})
    high = fake_run(tmp_path / "high", spec_json, {10: 0.5, 20: 2.0})  # lower once; the last loss counts
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "spec.json").write_text(spec_json)
    rows = compare([str(empty), str(high), str(low)], None)
    # Never submitted (no jobs.json): jobgen status knows no task of theirs, nor does compare.
    assert [(r.name, r.state, r.final_loss, r.overrides) for r in rows] == [
        ("low", "unknown", 1.0, {}),
        ("high", "unknown", 2.0, {}),
        ("empty", "unknown", None, {}),
    ]


def test_a_resumed_run_goes_on_from_the_steps_it_redid(tmp_path, spec_json):
    """Killed at step 30, resumed from the checkpoint of step 20: the curve and the final loss
    are the resumed task's, not the killed one's steps 25 and 30."""
    run = fake_run(tmp_path / "resumed", spec_json, {10: 3.0, 20: 2.0, 25: 1.8, 30: 1.7})
    again = [{"time": 2000.0 + s, "step": s, "loss": 1.9, "job_id": "6"} for s in (21, 22)]
    with (run / "metrics.jsonl").open("a") as fh:
        fh.writelines(json.dumps(x) + "\n" for x in again)
    (row,) = compare([str(run)], None, curves=True)
    assert row.train_curve == [(10, 3.0), (20, 2.0), (21, 1.9), (22, 1.9)] and (row.step, row.final_loss) == (22, 1.9)


def test_names_under_the_runs_root_and_each_run_once(tmp_path, spec_json):
    root = tmp_path / "runs"
    fake_sweep(root / "lr", spec_json)
    single = fake_run(root / "single", spec_json, {10: 4.0})
    point = str(root / "lr" / "points" / "lr-0.001_r-16")
    rows = compare(["single", "lr", str(single), point, "lr/lr-0.0003_r-32"], root)
    points = [p["name"] for p in json.loads((root / "lr" / "sweep.json").read_text())["points"]]
    assert sorted(r.name for r in rows) == sorted(["single", *points])


def test_the_table_has_a_column_per_override_and_the_json_every_field(tmp_path, spec_json):
    sweep = fake_sweep(tmp_path / "lr", spec_json)
    plain = fake_run(tmp_path / "baseline", spec_json, {10: 2.0}, {10: 2.15})
    result = CliRunner().invoke(main, ["compare", str(sweep), str(plain)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "train.lr", "model.lora.r", "STEP", "LOSS", "BEST", "EVAL"]
    assert lines[1].split() == ["lr-0.001_r-16", "unknown", "0.001", "16", "20/60", "1.9000", "2.1000", "(step", "10)"]
    assert lines[2].split() == ["baseline", "unknown", "-", "-", "10/60", "2.0000", "2.1500", "(step", "10)"]
    assert lines[5].split() == ["lr-0.001_r-32", "pending", "0.001", "32", "-", "-", "-"]
    assert lines[0].index("STEP") == lines[1].index("20/60") == lines[2].index("10/60")  # aligned

    result = CliRunner().invoke(main, ["compare", str(sweep), "--json"])
    assert result.exit_code == 0, result.output
    first = json.loads(result.stdout)[0]
    assert first == {
        "name": "lr-0.001_r-16",
        "run_dir": str(sweep / "points" / "lr-0.001_r-16"),
        "sweep": "lr",
        "state": "unknown",
        "overrides": {"train.lr": 0.001, "model.lora.r": 16},
        "step": 20,
        "max_steps": 60,
        "final_loss": 1.9,
        "best_eval_loss": 2.1,
        "best_eval_step": 10,
    }


def test_a_reference_that_is_neither_a_run_nor_a_sweep(tmp_path, spec_json):
    result = CliRunner().invoke(main, ["compare", str(tmp_path / "nowhere")], env={"JOBGEN_RUNS_ROOT": str(tmp_path)})
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "'" + str(tmp_path / "nowhere") + "' is neither a sweep" in result.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sweep.json").write_text('{"points": [{"overrides": {}}]}')
    with pytest.raises(BadReference, match=r"sweep\.json: points\[0\]\.name: not a point's name"):
        compare([str(broken)], None)
    (broken / "sweep.json").write_text('{"points": []}')
    result = CliRunner().invoke(main, ["compare", str(broken)])
    assert result.exit_code == 1 and "no runs to compare" in result.stderr


def test_labels_are_the_overrides_by_their_short_names(tmp_path, spec_json):
    rows = compare([str(fake_sweep(tmp_path / "lr", spec_json))], None)
    short = short_names(["train.lr", "model.lora.r"])
    assert label(rows[0], short) == "lr=0.001, r=16"
    assert short_names(["train.lr", "serve.lr"]) == {"train.lr": "train.lr", "serve.lr": "serve.lr"}
    plain = compare([str(fake_run(tmp_path / "plain", spec_json, {1: 1.0}))], None)
    assert label(plain[0], short) == "plain"


def test_the_figure_is_written(tmp_path, spec_json):
    pytest.importorskip("matplotlib")
    sweep = fake_sweep(tmp_path / "lr", spec_json)
    output = tmp_path / "out" / "lr.png"
    result = CliRunner().invoke(main, ["compare", str(sweep), "-o", str(output), "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 4 and f"wrote {output}" in result.stderr
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in output.parent.iterdir()] == ["lr.png"]  # no temporary file left
    pending = [row for row in compare([str(sweep)], None) if row.state == PENDING]
    with pytest.raises(CompareError, match="nothing to draw"):
        draw(pending, tmp_path / "none.png")


def test_each_row_is_in_the_state_jobgen_status_shows(tmp_path, spec_json, monkeypatch):
    """A run whose only task crashed (a failure that need not repeat: no failed marker) is
    failed for jobgen status, and compare called it submitted; a run whose task Slurm runs is
    running. Compare asks Slurm once, as the listing of runs does, and says what it says."""
    from jobgen.cli import status as cli_status
    from jobgen.runs.rundir import RunDir
    from jobgen.slurm import client as slurm

    def submitted(name: str, job_id: int, losses: dict[int, float]) -> RunDir:
        spec = json.loads(spec_json)
        spec["run"]["job"]["name"] = name  # Slurm knows a run's jobs by its name
        run = RunDir(fake_run(tmp_path / name, json.dumps(spec), losses))
        run.logs.mkdir()
        run.record_job({"job_id": job_id, "array": 1})
        return run

    crashed = submitted("crashed", 17, {})
    record = {"job_id": 17, "array_job_id": 17, "array_task": "1", "restart": 0, "job_start": 1000.0}
    crashed.task_record(17, 0).write_text(json.dumps({**record, "end": 1010.0, "exit_code": 1, "slurm_exit": 1}))
    running = submitted("running", 18, {10: 2.0})
    stopped = submitted("stopped", 19, {10: 2.5})
    stopped.switches.mkdir()
    stopped.set_switch("kill")
    finished = submitted("finished", 20, {10: 1.5})
    finished.done_marker.write_text("{}")
    entry = slurm.QueueEntry(18, 18, "1", "RUNNING", "None", "0:10", "2:00", "node1", "running", 1764219600.0)
    monkeypatch.setattr(slurm, "queue", lambda ids: [entry] if 18 in ids else [])
    monkeypatch.setattr(slurm, "config", lambda: {"MinJobAge": "300"})
    monkeypatch.setattr(slurm, "ended_jobs", lambda ids, accounting: [])
    runs = [crashed, running, stopped, finished]
    rows = {row.name: row.state for row in compare([str(run.path) for run in runs], None)}
    assert rows == {"crashed": "failed", "running": "running", "stopped": "stopped", "finished": "finished"}
    listing = cli_status._statuses(runs, dict.fromkeys(runs), None, details=False)  # what jobgen status lists
    assert {status.name: status.state for status in listing} == rows
