"""``jobgen plot RUN``: one figure of a run's progress that a person reads at a glance.

Three rows, loss, learning rate and tokens/s, each against the step (left) and against
wall time (right). A dotted line marks where each task resumed (its first step, at the
step it resumed from and at the time it took it); grey spans on the time axis are the
time the run had no job running: queued before its first task, and between one task's end
and the next one's start.

Data: ``metrics.jsonl`` (the logged steps; for a Hugging Face Trainer run without jobgen's
callback, which writes none, the newest checkpoint's ``trainer_state.json`` history through
:mod:`jobgen.program.trainer_records`), ``tasks.jsonl`` (each task's first step),
``logs/task.*.json`` (each task's start and end, from the batch script) and ``jobs.json``
(when the run was submitted). matplotlib is an optional extra (``pip install
'jobgen[plot]'``), imported only here; :func:`missing_matplotlib` says so plainly.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobgen.base.visible import visible
from jobgen.program.trainer_records import trainer_history
from jobgen.report.task_table import read_task_records
from jobgen.runs.jsonl_records import TaskKey, read_tasks, task_key
from jobgen.runs.metrics_summary import PLOTTED, MetricsSummary
from jobgen.runs.rundir import RunDir
from jobgen.runs.summary_cache import summarize


class PlotError(RuntimeError):
    """Nothing to plot, or matplotlib is missing; the message says what to do."""


@dataclass
class Series:
    """One metric's points as the summary keeps them (decimated per step bucket, with each
    bucket's first, lowest, highest and last point: jobgen.runs.metrics_summary), one part per
    job in turn: a line never joins two jobs."""

    parts: list[tuple[list[int], list[float], list[float]]]  # (steps, times, values) of each job

    def segments(self) -> list[tuple[list[int], list[float], list[float]]]:
        """The points of each job in turn (steps, times, values)."""
        return self.parts

    @property
    def steps(self) -> list[int]:
        return [step for steps, _, _ in self.parts for step in steps]

    @property
    def times(self) -> list[float]:
        return [at for _, times, _ in self.parts for at in times]

    @property
    def values(self) -> list[float]:
        return [value for _, _, values in self.parts for value in values]


@dataclass
class PlotData:
    name: str
    metrics: dict[str, Series]  # loss, lr, tokens_per_s, eval_loss (drawn on the loss panel)
    resumes: list[tuple[int, float]]  # (step resumed from, time of that task's first step)
    waits: list[tuple[float, float]]  # (start, end) of spans with no job running


def _iso(value: str) -> float | None:
    try:
        return dt.datetime.fromisoformat(value).timestamp()
    except (TypeError, ValueError):
        return None


def _warn(message: str) -> None:
    print(f"jobgen plot: warning: {visible(message)}", file=sys.stderr)  # it quotes a file


def run_metrics(run: RunDir) -> MetricsSummary:
    """The run's metrics.jsonl, summarised (jobgen.runs.summary_cache); for a Trainer run
    without jobgen's callback, which logs no loss, with the Trainer's own history folded in
    (the newest checkpoint's ``trainer_state.json``)."""
    metrics = summarize(run.metrics)
    if not metrics.has_loss:
        history = trainer_history(run.checkpoints)
        if history:
            metrics = copy.deepcopy(metrics)
            for record in history:
                metrics.add_record(record)
    return metrics


def read_plot_data(run: RunDir, warn: Callable[[str], None] = _warn) -> PlotData:
    """What the plot shows. Lines of metrics.jsonl and tasks.jsonl that are no records are
    left out, and ``warn`` is told once per file how many. Reads the summary of metrics.jsonl,
    never its whole history: a week's run plots as fast as an hour's."""
    lines = read_metrics_warned(run, warn)
    tasks = read_tasks(run.task_lines)
    if tasks.warning():
        warn(tasks.warning())
    if not lines.records:
        raise PlotError(
            f"{run.metrics}: no logged steps yet, nothing to plot (nor a Trainer's history: "
            "no checkpoint with a readable trainer_state.json)"
        )
    metrics = {key: Series([(s, t, v) for _, s, t, v in lines.segments(key)]) for key in PLOTTED}
    firsts = [r for r in tasks if r.get("event") == "first_step"]
    resumes = [(int(r["start_step"]), float(r["time"])) for r in firsts if r.get("start_step")]
    return PlotData(run.path.name, metrics, sorted(resumes), _waits(run, lines, tasks))


def read_metrics_warned(run: RunDir, warn: Callable[[str], None]) -> MetricsSummary:
    """:func:`run_metrics`, with ``warn`` told of the lines of metrics.jsonl that are no records."""
    metrics = run_metrics(run)
    if metrics.warning():
        warn(metrics.warning())
    return metrics


# What an empty panel says: a program that does not log a value is no run without progress.
EMPTY_PANEL = {
    "loss": "no loss logged",
    "lr": "no learning rate logged",
    "tokens_per_s": "throughput unknown: the program logs no tokens_per_s (or step_tokens and step_seconds)",
}


def empty_panels(data: PlotData) -> dict[str, str]:
    """The panels with nothing to draw, and what each says instead."""
    return {key: words for key, words in EMPTY_PANEL.items() if not data.metrics[key].steps}


def _waits(run: RunDir, lines: MetricsSummary, tasks: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Spans with no job of the run running: submission to the first start, and each gap
    between one job's end and the next one's start. A job's end is the batch script's
    record of it, else the trainer's exit record, else its last logged step (killed)."""
    ends: dict[TaskKey, tuple[float, float]] = {}
    for record in read_task_records(run).values():
        if record.get("job_start") and record.get("end"):
            key = task_key(record)
            ends[key] = (float(record["job_start"]), float(record["end"]))
    last_line = {key: task.last_time for key, task in lines.tasks.items()}
    for record in tasks:
        key = task_key(record)
        if key in ends or not record.get("job_start"):
            continue
        start = float(record["job_start"])
        end = (
            float(record["time"])
            if record.get("event") == "exit"
            else max(float(record["time"]), last_line.get(key, 0))
        )
        ends[key] = (start, max(end, ends.get(key, (start, start))[1]))
    spans = sorted(ends.values())
    submitted = [t for t in (_iso(j.get("submitted_at", "")) for j in run.jobs()) if t is not None]
    waits = []
    if spans and submitted and min(submitted) < spans[0][0]:
        waits.append((min(submitted), spans[0][0]))
    covered = spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        if start > covered:
            waits.append((covered, start))
        covered = max(covered, end)
    return waits


def missing_matplotlib() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "jobgen plot needs matplotlib, an optional extra: pip install 'jobgen[plot]' (or pip install matplotlib)"
    return None


LABELS = {"loss": "loss", "lr": "learning rate", "tokens_per_s": "tokens/s"}


def draw(data: PlotData, output: Path) -> Path:
    """Write the figure to ``output`` (PNG, or what its suffix names), through a temporary
    file and a rename: a reader never sees half a picture."""
    problem = missing_matplotlib()
    if problem:
        raise PlotError(problem)
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(13, 9), sharex="col")
    empty = empty_panels(data)
    for row, key in enumerate(("loss", "lr", "tokens_per_s")):
        _draw_row(data, key, *axes[row])
        for ax in axes[row] if key in empty else ():
            ax.text(0.5, 0.5, empty[key], transform=ax.transAxes, ha="center", va="center", color="0.4", wrap=True)
    axes[2][0].set_xlabel("step")
    axes[2][1].set_xlabel("wall time")
    locator = mdates.AutoDateLocator()
    axes[2][1].xaxis.set_major_locator(locator)
    axes[2][1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    fig.suptitle(
        f"{data.name}: {_summary(data)}; {len(data.resumes)} resume(s) (dotted), time without a running job shaded",
        fontsize=11,
    )
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}{output.suffix}")
    try:
        fig.savefig(tmp, dpi=110)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, output)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return output


def _dates(seconds: list[float]) -> list[float]:
    """Times (seconds since 1970) as matplotlib's dates, in this machine's local time as
    ``datetime.fromtimestamp`` gives it."""
    from matplotlib.dates import date2num

    return list(date2num([dt.datetime.fromtimestamp(t) for t in seconds]))


def _joined(series: Series) -> tuple[list[float], list[float], list[float]]:
    """(steps, times as dates, values) of every job's points, a NaN between two jobs: one line
    per panel, broken where a job ends, however many jobs a week of time limits made (an
    artist per job made a plot of 500 jobs take seconds)."""
    steps: list[float] = []
    times: list[float] = []
    values: list[float] = []
    for part_steps, part_times, part_values in series.segments():
        if steps:
            steps.append(math.nan)
            times.append(math.nan)
            values.append(math.nan)
        steps.extend(part_steps)
        times.extend(_dates(part_times))
        values.extend(part_values)
    return steps, times, values


def _draw_row(data: PlotData, key: str, by_step, by_time) -> None:
    """One metric's row: against the step (``by_step``) and against wall time (``by_time``),
    with the resumes marked and the time without a running job shaded."""
    steps, times, values = _joined(data.metrics[key])
    by_step.plot(steps, values, lw=1.2, color="C0")
    by_time.plot(times, values, lw=1.2, color="C0")
    by_time.xaxis_date()
    if key == "loss" and data.metrics["eval_loss"].steps:
        # Each job's evaluations as points joined by a line, like its training loss.
        steps, times, values = _joined(data.metrics["eval_loss"])
        by_step.plot(steps, values, "o-", ms=4, lw=1, color="C1", label="eval loss")
        by_time.plot(times, values, "o-", ms=4, lw=1, color="C1")
        by_step.plot([], [], lw=1.2, color="C0", label="training loss")
        by_step.legend(loc="upper right", fontsize=8)
    by_step.set_ylabel(LABELS[key])
    for ax in (by_step, by_time):
        ax.ticklabel_format(axis="y", useOffset=False, style="sci" if key == "lr" else "plain", scilimits=(-3, 4))
    if data.resumes:  # one collection per axis, not a line per resume
        by_step.vlines([s for s, _ in data.resumes], 0, 1, transform=by_step.get_xaxis_transform(), **RESUME)
        at = _dates([t for _, t in data.resumes])
        by_time.vlines(at, 0, 1, transform=by_time.get_xaxis_transform(), **RESUME)
    if data.waits:
        starts, ends = _dates([start for start, _ in data.waits]), _dates([end for _, end in data.waits])
        spans = [(a, b - a) for a, b in zip(starts, ends, strict=True)]
        by_time.broken_barh(spans, (0, 1), transform=by_time.get_xaxis_transform(), color="0.85", lw=0, zorder=0)
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)


RESUME = {"color": "C3", "linestyles": ":", "lw": 1}


def _summary(data: PlotData) -> str:
    """The title's account of where the run stands: its last step and loss, and its evaluations."""
    last = data.metrics["loss"]
    summary = f"step {last.steps[-1]}, loss {last.values[-1]:.4f}" if last.steps else "no loss logged"
    evals = data.metrics["eval_loss"]
    if evals.steps:
        best = min(range(len(evals.values)), key=evals.values.__getitem__)
        summary += f", eval loss {evals.values[-1]:.4f} (best {evals.values[best]:.4f} at step {evals.steps[best]})"
    return summary
