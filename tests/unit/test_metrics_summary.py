"""metrics.jsonl's summary (jobgen/runs/metrics_summary.py, kept by jobgen/runs/summary_cache.py)
against a full read of the file, on random histories.

A history here is what a week of a real run leaves: tasks that resume from an older checkpoint
and log steps again, requeues under the same job id, evaluations (NaN losses among them), world
sizes that change, a program's own metrics, lines cut by a crash and followed by the next task's
append, hand-damaged lines, blank lines. The file grows in random pieces, a piece may end in the
middle of a line, and between two reads the kept summary may be cut short, edited, replaced by
another version's, or the file itself replaced or started again. After every piece the summary
:func:`summarize` returns must equal the one a full read builds (:func:`full_scan`), and what
status, goodput, the watchdogs, plot and compare take from it must equal what the readers took
from the whole list of records before the summary existed (the reference functions below).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest

from jobgen.runs.jsonl_records import is_eval_line, read_metrics, training_lines
from jobgen.runs.metrics_summary import MAX_BUCKETS, PLOTTED, plotted_value, summarize_text
from jobgen.runs.summary_cache import full_scan, summarize, summary_path

T0 = 1_780_000_000.0


# ---------------------------------------------------------------- random histories


def _record(rng: random.Random, job: str, restart: int, step: int, at: float, world: int) -> dict[str, Any]:
    record: dict[str, Any] = {"time": round(at, 3), "job_id": job, "restart": restart, "step": step}
    record["loss"] = rng.choice([round(rng.uniform(0.5, 4), 4), round(rng.uniform(0.5, 4), 4), float("nan")])
    if rng.random() < 0.8:
        record["lr"] = rng.choice([1e-4, 3e-4, 2e-5])
    if rng.random() < 0.5:
        record["tokens_per_s"] = round(rng.uniform(100, 900), 1)
    else:
        record["step_tokens"] = rng.choice([512, 1024])
    record["step_seconds"] = rng.choice([round(rng.uniform(0.5, 3), 3), None]) if rng.random() < 0.9 else None
    if record["step_seconds"] is None and rng.random() < 0.5:
        del record["step_seconds"]
    if rng.random() < 0.3:
        record["host_used_percent"] = round(rng.uniform(10, 99), 1)
    record["world_size"] = world
    if rng.random() < 0.1:
        record["user/accuracy\u2028"] = rng.random()  # a program's own metric, with a line separator in its name
    return record


def _evaluation(rng: random.Random, job: str, restart: int, step: int, at: float) -> dict[str, Any]:
    loss = rng.choice([round(rng.uniform(0.5, 4), 4)] * 5 + [float("nan")])
    return {
        "time": round(at, 3),
        "job_id": job,
        "restart": restart,
        "step": step,
        "event": "eval",
        "eval_loss": loss,
        "eval_ppl": None if math.isnan(loss) else round(math.exp(loss), 3),
    }


DAMAGE = [
    b"this is no JSON",
    b"[1, 2, 3]",
    b'{"step": 3}',  # no time
    b'{"time": 1780000000, "step": "seven"}',
    b'{"time": 1e400, "step": 1}',
    b'{"time": 1780000000, "step": 1, "loss": "low"}',
    b"\xff\xfe not UTF-8 \x80",
    b"   ",
    b"",
]


def history(rng: random.Random, size: int) -> tuple[bytes, list[dict[str, Any]]]:
    """The bytes of a metrics.jsonl, and the tasks.jsonl records that go with it."""
    out: list[bytes] = []
    tasks: list[dict[str, Any]] = []
    at, reached, job, restart, launch = T0, 0, 100, 0, 0
    while sum(map(len, out)) < size * 120:
        kind = rng.choice(["next", "next", "next", "requeued", "relaunched"])
        if kind == "relaunched" and tasks:  # the batch script started the program again in the task
            launch += 1
        else:  # the next task, or the same job requeued (a restart)
            job += kind == "next"
            restart = sum(
                1 for t in tasks if t["job_id"] == str(job) and t["event"] == "first_step" and not t.get("launch")
            )
            launch = 0
        stamp = {"launch": launch} if launch else {}  # as MetricsWriter writes it
        start = max(0, reached - rng.randint(0, 7))  # resumed from an older checkpoint
        world = rng.choice([1, 2, 4])
        tasks.append(
            {"time": at, "event": "first_step", "job_id": str(job), "restart": restart, "start_step": start,
             "job_start": at - 5, "world_size": world, **stamp}
        )  # fmt: skip
        for step in range(start + 1, start + rng.randint(1, 40)):
            at += rng.uniform(0.5, 3)
            line = json.dumps({**_record(rng, str(job), restart, step, at, world), **stamp}).encode()
            roll = rng.random()
            if roll < 0.04:
                out.append(line[: rng.randint(1, len(line) - 1)])  # cut by a crash: the next append follows it
                break
            out.append(line + b"\n")
            if roll < 0.12:
                out.append(rng.choice(DAMAGE) + b"\n")
            if roll > 0.85:
                out.append(json.dumps({**_evaluation(rng, str(job), restart, step, at), **stamp}).encode() + b"\n")
            reached = max(reached, step)
        if rng.random() < 0.6:
            tasks.append(
                {"time": at + 1, "event": "exit", "job_id": str(job), "restart": restart, "start_step": start,
                 "end_step": reached, "exit_code": 0, "job_start": at - 30, "step_seconds_total": 12.0,
                 "save_seconds": [1.5], **stamp}
            )  # fmt: skip
    if rng.random() < 0.3:
        out.append(rng.choice(DAMAGE))  # the file ends in the middle of a line, or in a bad one
    return b"".join(out), tasks


# ---------------------------------------------------------------- the readers before the summary


def reference(path: Path) -> dict[str, Any]:
    """What status, goodput, the watchdogs, plot and compare took from the whole list of records."""
    lines = read_metrics(path)
    steps = training_lines(lines)
    evals = [x for x in lines if is_eval_line(x) and x.get("eval_loss") is not None]

    def task_of(line: dict[str, Any]) -> tuple[str, int, int]:  # one launch of one attempt of one job
        return str(line.get("job_id")), int(line.get("restart") or 0), int(line.get("launch") or 0)

    by_task: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for line in lines:
        by_task.setdefault(task_of(line), []).append(line)
    killed = {}
    for key, task in by_task.items():
        seconds = [float(x["step_seconds"]) for x in task if x.get("step_seconds") is not None]
        killed[key] = (
            max(int(x["step"]) for x in task),
            max(float(x["time"]) for x in task),
            float(task[-1]["time"]),
            max(seconds) if seconds else None,
            sum(seconds) / len(seconds) if seconds else None,
        )
    memory = {}
    for job in {key[0] for key in by_task}:
        mine = [x for x in steps if str(x.get("job_id")) == job]
        if mine:
            memory[job] = (mine[-1].get("host_used_percent"), "host_used_percent" in mine[-1])
    series = {}
    for key in PLOTTED:
        rows = [x for x in (evals if key == "eval_loss" else steps) if plotted_value(x, key) is not None]
        parts: list[Any] = []
        for x in rows:
            task = task_of(x)
            if not parts or parts[-1][0] != task:
                parts.append((task, [], [], []))
            parts[-1][1].append(x["step"])
            parts[-1][2].append(x["time"])
            parts[-1][3].append(plotted_value(x, key))
        series[key] = parts
    return {
        "warning": lines.warning(),
        "records": len(lines),
        "last_training": steps[-1] if steps else None,
        "eta": [float(x["step_seconds"]) for x in steps[-20:] if x.get("step_seconds")],
        "recent": [[x["step"], x["time"]] for x in lines[-50:]],
        "eval_last": evals[-1]["step"] if evals else None,
        "eval_lowest": min(evals, key=lambda x: x["eval_loss"])["step"] if evals else None,
        "has_loss": any(x.get("loss") is not None for x in lines),
        "killed": killed,
        "memory": memory,
        "series": series,
        "curves": {key: _curve(series[key]) for key in ("loss", "eval_loss")},
        "final_loss": _curve(series["loss"])[-1] if series["loss"] else None,
    }


def _curve(parts: list[Any]) -> list[tuple[int, float]]:
    points: list[tuple[int, float]] = []
    for _, steps, _, values in parts:
        for step, value in zip(steps, values):
            while points and points[-1][0] >= step:
                points.pop()
            points.append((step, value))
    return points


def answers(summary) -> dict[str, Any]:
    """The same, from the summary."""
    return {
        "warning": summary.warning(),
        "records": summary.records,
        "last_training": summary.last_training,
        "eta": summary.eta_step_seconds(),
        "recent": list(summary.recent),
        "eval_last": summary.eval_last["step"] if summary.eval_last else None,
        "eval_lowest": summary.eval_lowest["step"] if summary.eval_lowest else None,
        "has_loss": summary.has_loss,
        "killed": {
            key: (t.max_step, t.max_time, t.last_time, t.seconds_max, t.mean_step_seconds)
            for key, t in summary.tasks.items()
        },
        "memory": {
            job: summary.last_training_line_of_job(job)
            for job in {key[0] for key in summary.tasks}
            if summary.last_training_line_of_job(job) is not None
        },
        "series": {key: summary.segments(key) for key in PLOTTED},
        "curves": {key: summary.curve(key) for key in ("loss", "eval_loss")},
        "final_loss": tuple(summary.last_loss) if summary.last_loss else None,
    }


def whole(summary) -> dict[str, Any]:
    """Everything a summary keeps: its state and its series."""
    return {**summary.to_json(), "series": summary.series_json()}


def same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN (a diverged loss is logged as NaN)."""
    return json.dumps(_plain(a), sort_keys=True) == json.dumps(_plain(b), sort_keys=True)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- between two reads


def damage_the_summary(rng: random.Random, path: Path) -> str:
    kept = summary_path(path)
    if not kept.exists():
        return "none kept"
    content = kept.read_bytes()
    how = rng.choice(["cut", "edited", "garbage", "other version", "other file", "nothing", "nothing"])
    if how == "cut":
        kept.write_bytes(content[: rng.randint(0, len(content) - 1)])
    elif how == "edited":  # still JSON, its aggregates changed: the digest at its start no longer matches
        kept.write_bytes(content.replace(b'"records":', b'"records":1', 1))
    elif how == "garbage":
        kept.write_bytes(rng.randbytes(rng.randint(0, 200)))
    elif how == "other version":
        _, _, body = content.partition(b"\n")
        state, _, series = body.partition(b"\n")
        data = json.loads(state)
        data["version"] = 999
        body = json.dumps(data).encode() + b"\n" + series
        kept.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    elif how == "other file":  # the same content under a new inode: a copy, or a restore from backup
        copy = path.with_name("copy")
        copy.write_bytes(path.read_bytes())
        os.replace(copy, path)
    return how


@pytest.mark.parametrize("seed", range(60))
def test_the_summary_read_piece_by_piece_equals_a_full_read(tmp_path: Path, seed: int):
    rng = random.Random(seed)
    data, _ = history(rng, rng.choice([40, 150, 400]))
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"")
    cuts = sorted({rng.randint(0, len(data)) for _ in range(rng.randint(1, 8))} | {len(data)})
    written = 0
    for cut in cuts:
        with open(path, "ab") as fh:
            fh.write(data[written:cut])
        written = cut
        how = damage_the_summary(rng, path) if rng.random() < 0.4 else "nothing"
        summary = summarize(path)
        scanned = full_scan(path)
        assert same(whole(summary), whole(scanned)), (seed, cut, how)
        assert same(answers(summary), reference(path)), (seed, cut, how)
    # The file written anew in place (same inode): a teammate's copy of another run's history
    # over it, longer or shorter than what the summary reached.
    other, _ = history(random.Random(seed + 1000), rng.choice([20, 150, 600]))
    with open(path, "r+b") as fh:
        fh.truncate(0)
        fh.write(other)
    assert same(whole(summarize(path)), whole(full_scan(path))), seed
    assert same(answers(summarize(path)), reference(path))


def test_a_long_history_is_decimated_and_keeps_every_spike(tmp_path: Path):
    """Over MAX_BUCKETS steps a series is decimated: each task's highest and lowest value, its
    first and its last point are still drawn, and a divergence's single NaN-free spike too."""
    rng = random.Random(7)
    lines, spike_step = [], 7777
    for job, (start, end) in enumerate([(0, 9000), (8500, 20000)]):
        for step in range(start + 1, end + 1):
            loss = 10.0 if step == spike_step else 2.0 + rng.random() * 0.1
            record = {"time": T0 + step, "job_id": str(job), "restart": 0, "step": step, "loss": loss, "lr": 1e-4}
            lines.append(json.dumps(record))
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines[:-3000]) + "\n")
    summarize(path)  # kept decimated, then read back and continued: the same as one read
    with open(path, "a") as fh:
        fh.write("\n".join(lines[-3000:]) + "\n")
    summary = summarize(path)
    assert same(whole(summary), whole(full_scan(path)))
    assert len(summary.series["loss"].buckets) <= MAX_BUCKETS
    parts = summary.segments("loss")
    assert [task for task, *_ in parts] == [("0", 0, 0), ("1", 0, 0)]  # a line never joins two jobs
    assert max(v for _, _, _, values in parts for v in values) == 10.0  # the spike shows
    drawn = sum(len(steps) for _, steps, _, _ in parts)
    assert drawn <= 4 * MAX_BUCKETS < len(lines)
    assert parts[0][1][0] == 1 and parts[0][1][-1] == 9000 and parts[1][1][-1] == 20000
    curve = summary.curve("loss")
    assert curve[-1] == (20000, json.loads(lines[-1])["loss"]) and all(
        a[0] < b[0] for a, b in itertools.pairwise(curve)
    )
    assert max(s for s, _ in curve if s < 8500) <= 8500  # the second task replaced the first one's later steps


def test_only_the_new_lines_are_read_once_a_summary_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"time": T0 + i, "step": i, "loss": 1.0}) + "\n" for i in range(1, 2001)))
    summarize(path)
    with open(path, "a") as fh:
        fh.write(json.dumps({"time": T0 + 3000, "step": 2001, "loss": 0.5}) + "\n")
    folded = []
    from jobgen.runs import metrics_summary

    original = metrics_summary.MetricsSummary.add_line
    monkeypatch.setattr(
        metrics_summary.MetricsSummary, "add_line", lambda self, raw: (folded.append(raw), original(self, raw))
    )
    summary = summarize(path)
    assert len(folded) == 1 and summary.last_training["step"] == 2001 and summary.records == 2001


def test_a_summary_that_cannot_be_written_beside_the_file_goes_to_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"time": T0, "step": 1, "loss": 1.0}) + "\n")
    summary_path(path).mkdir()  # no file can be written at its name (as a read-only run directory for a teammate)
    assert summarize(path).records == 1
    cached = list((tmp_path / "cache" / "jobgen" / "metrics-summaries").iterdir())
    assert len(cached) == 1
    with open(path, "a") as fh:
        fh.write(json.dumps({"time": T0 + 1, "step": 2, "loss": 0.5}) + "\n")
    assert summarize(path).records == 2 and same(whole(summarize(path)), whole(full_scan(path)))


def test_a_summary_that_is_a_link_or_fifo_is_not_read(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"time": T0, "step": 1, "loss": 1.0}) + "\n")
    summarize(path)
    kept = summary_path(path)
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(kept, elsewhere)
    kept.symlink_to(elsewhere)
    with open(path, "a") as fh:
        fh.write(json.dumps({"time": T0 + 1, "step": 2, "loss": 3.0}) + "\n")
    assert same(whole(summarize(path)), whole(full_scan(path)))
    assert not kept.is_symlink()  # replaced by a file of its own, the link's target untouched
    os.mkfifo(tmp_path / "fifo")
    os.replace(tmp_path / "fifo", kept)
    assert summarize(path).records == 2  # and it did not wait on the FIFO


def test_a_step_tokens_no_float_can_hold_is_no_throughput(tmp_path: Path):
    """``step_tokens`` (a program's own field, which the records' check does not know) of 400
    digits: every read-side command reads this line, and the division by step_seconds
    overflowed in each of them."""
    huge = json.dumps({"time": T0, "step": 1, "loss": 1.0, "step_tokens": 10**400, "step_seconds": 1.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text(huge + "\n")
    summary = summarize(path)
    assert summary.records == 1 and not summary.segments("tokens_per_s") and summary.last_loss == [1, 1.0]


def test_summarize_text_of_an_empty_file_has_no_records(tmp_path: Path):
    assert summarize_text(tmp_path / "metrics.jsonl", b"").records == 0
    assert summarize(tmp_path / "absent.jsonl").records == 0


def test_the_writer_keeps_the_summary_up_to_date_every_so_often(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The trainer's and a program's writer (jobgen.runtime.records.MetricsWriter) refreshes the
    summary itself every SUMMARY_EVERY_SECONDS, so a run nobody looked at for a week answers
    status at once; never in between (each step appends one line, nothing more)."""
    from jobgen.runtime import records

    writer = records.MetricsWriter(tmp_path, enabled=True)
    for step in range(1, 6):
        writer.log_step({"step": step, "loss": 1.0 / step})
    assert not summary_path(tmp_path / "metrics.jsonl").exists()
    monkeypatch.setattr(records, "SUMMARY_EVERY_SECONDS", 0.0)
    writer.log_step({"step": 6, "loss": 0.1})
    writer._summarizing.join(timeout=60)
    kept = summarize(tmp_path / "metrics.jsonl", keep=False)
    assert kept.records == 6 and same(whole(kept), whole(full_scan(tmp_path / "metrics.jsonl")))
    assert summary_path(tmp_path / "metrics.jsonl").exists()
