"""``metrics.jsonl`` summarised, so that reading a run costs the same after a week as after a minute.

A week of training logs 300,000 lines (100 MB and more); every read-side command (status,
``--watch``, the watchdog checks every few minutes, plot, compare) needs only the newest
records and a few aggregates of the rest. :class:`MetricsSummary` is those, folded line by line:

- the lines counted and the first that is no record (:meth:`MetricsSummary.warning`, as
  :func:`jobgen.runs.goodput.read_records` says it);
- the newest training line, the step times of the last :data:`ETA_WINDOW` of them, the (step,
  time) of the last :data:`RECENT` records, the newest and the lowest evaluation;
- per task (job id, restart), what the goodput reports need of a task that left no exit record
  (:class:`TaskMetrics`);
- each plotted metric decimated per step bucket (:class:`Decimated`): every bucket keeps its
  first, lowest, highest and last point, so a spike or a divergence still shows however many
  steps a pixel column holds.

:mod:`jobgen.runs.summary_cache` keeps it beside the file and folds in only the lines appended
since it was written. :meth:`MetricsSummary.add_line` reads a line exactly as
:func:`jobgen.runs.goodput.read_records` does, so a summary folded in several sittings equals
one folded at once, and both equal what a full read of the file says. A kept summary is
input like the file: anyone who can write the run directory can write one whose digest
matches, so every value is checked as a line's are (:meth:`MetricsSummary.from_json`).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jobgen.base.safe_read import LINES_FILE, DamagedFile, is_int, is_number, is_time, open_regular
from jobgen.runs.jsonl_records import METRICS_FIELDS, TaskKey, is_eval_line, record_problem, task_key

VERSION = 4  # 4: a task is (job id, restart, launch)
# Training lines whose median step time gives status's ETA.
ETA_WINDOW = 20
# Records whose (step, time) give the disk watchdog's step rate.
RECENT = 50
# Buckets a decimated series keeps at most: more than the pixel columns of a plot's panel.
MAX_BUCKETS = 512
# The metrics a plot or a comparison draws: training lines' loss, learning rate and
# throughput, evaluations' loss.
PLOTTED = ("loss", "lr", "tokens_per_s", "eval_loss")


class DamagedSummary(ValueError):
    """A summary that is not what :meth:`MetricsSummary.to_json` writes: rebuilt, never used."""


def plotted_value(record: dict[str, Any], key: str) -> float | None:
    """A record's value of ``key``; tokens/s from ``step_tokens`` and ``step_seconds`` where a
    program logs those instead. ``step_tokens`` is no field the records are checked for, so
    it is checked here as every number is (an integer of 400 digits overflows the division)."""
    value = record.get(key)
    if value is None and key == "tokens_per_s":
        tokens, seconds = record.get("step_tokens"), record.get("step_seconds")
        if is_number(tokens) and is_number(seconds) and seconds > 0:
            return tokens / seconds
    return float(value) if is_number(value) else None


def _maybe(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _shaped(value: Any, *checks: Callable[[Any], bool]) -> bool:
    """A list of one item per check, each passing its own: a point, a [step, time] pair..."""
    return isinstance(value, list) and len(value) == len(checks) and all(ok(v) for ok, v in zip(checks, value))


def _count(value: Any) -> bool:  # also a line's number
    return is_int(value) and value >= 0


class TaskMetrics:
    """What one task's lines say, for a task that left no exit record (killed outright)."""

    __slots__ = (
        "last_time",
        "last_train",
        "lines",
        "max_step",
        "max_time",
        "seconds_count",
        "seconds_max",
        "seconds_sum",
    )

    def __init__(self) -> None:
        self.lines = 0
        self.max_step = 0
        self.max_time = 0.0
        self.last_time = 0.0  # of its last line, in file order (the plot's end of a killed task)
        self.seconds_count = 0
        self.seconds_sum = 0.0
        self.seconds_max: float | None = None
        # (line number, host_used_percent or None, whether the line had that key) of its last training line
        self.last_train: list[Any] | None = None

    def add(self, record: dict[str, Any], number: int) -> None:
        step, at = int(record["step"]), float(record["time"])
        first = not self.lines
        self.lines += 1
        self.max_step = step if first else max(self.max_step, step)
        self.max_time = at if first else max(self.max_time, at)
        self.last_time = at
        seconds = record.get("step_seconds")
        if seconds is not None:
            seconds = float(seconds)
            self.seconds_count += 1
            self.seconds_sum += seconds
            self.seconds_max = seconds if self.seconds_max is None else max(self.seconds_max, seconds)
        if not is_eval_line(record):
            self.last_train = [number, record.get("host_used_percent"), "host_used_percent" in record]

    @property
    def mean_step_seconds(self) -> float | None:
        return self.seconds_sum / self.seconds_count if self.seconds_count else None

    def to_json(self) -> list[Any]:
        return [getattr(self, name) for name in self.__slots__]

    @classmethod
    def from_json(cls, data: Any) -> TaskMetrics:
        _check(isinstance(data, list) and len(data) == len(cls.__slots__), "a task's metrics")
        out = cls()
        for name, value in zip(cls.__slots__, data):
            setattr(out, name, value)
        _check(is_int(out.max_step) and is_time(out.max_time) and is_time(out.last_time), "a task's steps and times")
        _check(is_int(out.lines) and out.lines > 0, "a task's line count")
        _check(_count(out.seconds_count) and is_number(out.seconds_sum), "a task's step seconds")
        _check(_maybe(is_number)(out.seconds_max), "a task's slowest step")
        _check(_maybe(lambda t: _shaped(t, _count, _maybe(is_number), _BOOL))(out.last_train), "a line")
        return out


class Decimated:
    """One metric's points, bucketed by step: a bucket holds the steps ``[index * width,
    (index + 1) * width)`` of one task and keeps its first, lowest, highest and last point
    (line number, step, time, value). When there are more than :data:`MAX_BUCKETS`, the width
    doubles and neighbouring buckets of the same task merge. While the width is 1 and a task
    logs each step once, every point is kept as logged."""

    def __init__(self) -> None:
        self.width = 1
        # [task index, bucket index, first, lowest, highest, last]; a point is [number, step, time, value]
        self.buckets: list[list[Any]] = []

    def add(self, task: int, point: list[Any]) -> None:
        index = point[1] // self.width
        last = self.buckets[-1] if self.buckets else None
        if last is not None and last[0] == task and last[1] == index:
            _merge_point(last, point)
        else:
            self.buckets.append([task, index, point, point, point, point])
            if len(self.buckets) > MAX_BUCKETS:
                self._coarsen()

    def _coarsen(self) -> None:
        while len(self.buckets) > MAX_BUCKETS * 3 // 4 and self.width < 1 << 62:
            self.width *= 2
            merged: list[list[Any]] = []
            for task, index, first, low, high, last in self.buckets:
                index //= 2
                if merged and merged[-1][0] == task and merged[-1][1] == index:
                    into = merged[-1]
                    into[3] = low if low[3] < into[3][3] else into[3]
                    into[4] = high if high[3] > into[4][3] else into[4]
                    into[5] = last
                else:
                    merged.append([task, index, first, low, high, last])
            if len(merged) == len(self.buckets):  # one bucket per task: nothing merges any more
                self.buckets = merged
                return
            self.buckets = merged

    def points(self) -> Iterator[tuple[int, list[Any]]]:
        """(task index, point) in the order they were logged, each bucket's kept points once."""
        for task, _, *kept in self.buckets:
            seen = set()
            for point in sorted(kept, key=lambda p: p[0]):
                if point[0] not in seen:
                    seen.add(point[0])
                    yield task, point

    def to_json(self) -> dict[str, Any]:
        """Each bucket as [task, index, its distinct points in order, where the lowest and the
        highest are among them]: one point, not four, where a bucket holds one step."""
        buckets = []
        for task, index, first, low, high, last in self.buckets:
            points = sorted({id(p): p for p in (first, low, high, last)}.values(), key=lambda p: p[0])
            buckets.append([task, index, points, points.index(low), points.index(high)])
        return {"width": self.width, "buckets": buckets}

    @classmethod
    def from_json(cls, data: Any, tasks: int) -> Decimated:
        _check(isinstance(data, dict) and is_int(data.get("width")), "a series")
        out = cls()
        out.width = data["width"]
        buckets = data.get("buckets")
        _check(isinstance(buckets, list) and 1 <= out.width <= 1 << 62, "a series' buckets")
        for bucket in buckets:
            _check(isinstance(bucket, list) and len(bucket) == 5, "a bucket")
            task, index, points, low, high = bucket
            _check(is_int(task) and 0 <= task < tasks and is_int(index), "a bucket's task")
            _check(isinstance(points, list) and 0 < len(points) <= 4, "a bucket's points")
            _check(all(_shaped(p, _count, is_int, is_time, is_number) for p in points), "a point")
            _check(is_int(low) and is_int(high) and 0 <= low < len(points) > high >= 0, "a bucket")
            out.buckets.append([task, index, points[0], points[low], points[high], points[-1]])
        return out


def _merge_point(bucket: list[Any], point: list[Any]) -> None:
    if point[3] < bucket[3][3]:
        bucket[3] = point
    if point[3] > bucket[4][3]:
        bucket[4] = point
    bucket[5] = point


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise DamagedSummary(f"not {what}")


_BOOL, _STR = (lambda v: isinstance(v, bool)), (lambda v: isinstance(v, str))
_EVAL = {"step": is_int, "eval_loss": is_number, "eval_ppl": _maybe(is_number)}  # as _add_eval keeps one
_EVALUATION = _maybe(lambda v: isinstance(v, dict) and v.keys() == _EVAL.keys() and all(_EVAL[k](v[k]) for k in v))
# Each value of a kept summary's state, checked as what it came from was (a line's fields as
# record_problem checks them: an integer jobgen can compute with, a time a date can be made of).
_STATE: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(("lines", "skipped", "records"), _count),
    "first_problem": _STR,
    "has_loss": _BOOL,
    "pending": _maybe(lambda v: _shaped(v, _count, _STR)),
    "last_training": _maybe(lambda v: isinstance(v, dict) and record_problem(v, METRICS_FIELDS) is None),
    "last_loss": _maybe(lambda v: _shaped(v, is_int, is_number)),
    "eta_seconds": lambda v: isinstance(v, list) and len(v) <= ETA_WINDOW and all(map(_maybe(is_number), v)),
    "recent": lambda v: isinstance(v, list) and len(v) <= RECENT and all(_shaped(r, is_int, is_time) for r in v),
    **dict.fromkeys(("eval_last", "eval_lowest"), _EVALUATION),
}


class MetricsSummary:
    """What the read-side commands need of ``metrics.jsonl``, folded one complete line at a
    time (:meth:`add_line`); the attributes are the answers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0  # complete lines folded, blank ones included (a skipped line's number)
        self.skipped = 0
        self.first_problem = ""
        # A line that is no JSON counts as skipped only once a line follows it: the last one is
        # a write cut by a crash (as read_records reads it). [number, problem] until then.
        self.pending: list[Any] | None = None
        self.unreadable: str | None = None  # why the file as a whole could not be read
        self.records = 0
        self.has_loss = False
        self.last_training: dict[str, Any] | None = None
        self.last_loss: list[Any] | None = None  # [step, loss] of the newest training line with a loss
        # step_seconds of the last ETA_WINDOW training lines (None: not logged)
        self.eta_seconds: deque[Any] = deque(maxlen=ETA_WINDOW)
        self.recent: deque[list[Any]] = deque(maxlen=RECENT)  # [step, time] of the last RECENT records
        self.eval_last: dict[str, Any] | None = None  # {step, eval_loss, eval_ppl}
        self.eval_lowest: dict[str, Any] | None = None
        self.tasks: dict[TaskKey, TaskMetrics] = {}  # in the order they first logged
        self.task_index: dict[TaskKey, int] = {}  # each task's place in that order (the series name it so)
        # Each plotted metric, decimated; read from the kept summary only when asked for (a
        # plot, a comparison, or lines to fold in): status and the listings never parse it.
        self._series: dict[str, Decimated] | None = {key: Decimated() for key in PLOTTED}
        self._series_text: bytes | None = None
        self._kept: tuple[int, list[TaskKey]] = (0, [])  # the lines and tasks the kept state covers

    @property
    def series(self) -> dict[str, Decimated]:
        if self._series is None:
            self._series = self._read_series()
        return self._series

    def _read_series(self) -> dict[str, Decimated]:
        """The series of the kept summary as :meth:`series_json` wrote it; else (its digest is
        no proof) those of the lines the kept state covers, folded again from the file, or none
        where the file no longer starts with them: never another file's points."""
        try:
            data = json.loads(self._series_text or b"")
            _check(isinstance(data, dict) and sorted(data) == sorted(PLOTTED), "the plotted series")
            return {key: Decimated.from_json(data[key], len(self._kept[1])) for key in PLOTTED}
        except (KeyError, TypeError, ValueError, RecursionError):  # DamagedSummary among them
            lines, tasks = self._kept
        fresh, rest = MetricsSummary(self.path), b""
        try:  # read as summary_cache reads it: only a regular file, LINES_FILE bytes at most
            with os.fdopen(open_regular(self.path), "rb") as fh:
                while fresh.lines < lines and fh.tell() < LINES_FILE and (chunk := fh.read(1 << 20)):
                    *complete, rest = (rest + chunk).split(b"\n")
                    for line in complete[: lines - fresh.lines]:
                        fresh.add_line(line)
        except (OSError, DamagedFile):
            pass
        same = fresh.lines == lines and list(fresh.tasks) == tasks
        return fresh.series if same else {key: Decimated() for key in PLOTTED}

    # ------------------------------------------------------------------ folding

    def add_line(self, raw: bytes) -> None:
        """Fold one line (without its newline), as read_records reads it."""
        self.lines += 1
        number = self.lines
        if self.pending is not None:
            self._skip(*self.pending)
            self.pending = None
        line = raw.decode(errors="replace")
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError; an int of 5000 digits
            if line.strip():
                self.pending = [number, f"not JSON ({getattr(exc, 'msg', 'nested too deep')})"]
            return
        problem = record_problem(record, METRICS_FIELDS)
        if problem is not None:
            self._skip(number, problem)
            return
        self._add_record(record, number)

    def _skip(self, number: int, problem: str) -> None:
        if not self.skipped:
            self.first_problem = f"line {number}: {problem}"
        self.skipped += 1

    def add_record(self, record: dict[str, Any]) -> None:
        """Fold a record already read and checked (a Trainer's history, a test's lines)."""
        self.lines += 1
        self._add_record(record, self.lines)

    def _add_record(self, record: dict[str, Any], number: int) -> None:
        self.records += 1
        key = task_key(record)
        task = self.tasks.get(key)
        if task is None:
            task = self.tasks[key] = TaskMetrics()
            self.task_index[key] = len(self.task_index)
        task.add(record, number)
        self.has_loss = self.has_loss or record.get("loss") is not None
        self.recent.append([record["step"], record["time"]])
        evaluation = is_eval_line(record)
        if evaluation:
            self._add_eval(record)
        else:
            self.last_training = record
            self.eta_seconds.append(record.get("step_seconds"))
        task_index = self.task_index[key]
        for name in PLOTTED:
            if (name == "eval_loss") != evaluation:
                continue
            value = plotted_value(record, name)
            if value is not None:
                self.series[name].add(task_index, [number, record["step"], record["time"], value])
                if name == "loss":
                    self.last_loss = [record["step"], value]

    def _add_eval(self, record: dict[str, Any]) -> None:
        if record.get("eval_loss") is None:
            return
        entry = {"step": record["step"], "eval_loss": record["eval_loss"], "eval_ppl": record.get("eval_ppl")}
        self.eval_last = entry
        # As min() picks: the first of the lowest (a NaN first stays, as it does there).
        if self.eval_lowest is None or entry["eval_loss"] < self.eval_lowest["eval_loss"]:
            self.eval_lowest = entry

    # ------------------------------------------------------------------ answers

    def warning(self) -> str | None:
        """One line naming the file and what was wrong; None when every line was a record."""
        if self.unreadable is not None:
            return f"{self.path}: {self.unreadable}: no metrics records read from it"
        if not self.skipped:
            return None
        return (
            f"{self.path}: skipped {self.skipped} line(s) that are not metrics records (first at {self.first_problem})"
        )

    def eta_step_seconds(self) -> list[float]:
        """The step times status's ETA is the median of."""
        return [float(s) for s in self.eta_seconds if s]

    def last_training_line_of_job(self, job_id: int | str) -> tuple[Any, bool] | None:
        """(host_used_percent, whether it was logged) of the job's newest training line, over
        every restart of the job; None when it logged none."""
        newest = None
        for (job, *_), task in self.tasks.items():
            if (
                job == str(job_id)
                and task.last_train is not None
                and (newest is None or task.last_train[0] > newest[0])
            ):
                newest = task.last_train
        return None if newest is None else (newest[1], newest[2])

    def segments(self, key: str) -> list[tuple[TaskKey, list[int], list[float], list[float]]]:
        """A plotted metric's kept points, one segment per task in turn: (task, steps, times, values)."""
        out: list[tuple[TaskKey, list[int], list[float], list[float]]] = []
        keys = list(self.tasks)
        previous = None
        for task, (_, step, at, value) in self.series[key].points():
            if task != previous:
                out.append((keys[task], [], [], []))
                previous = task
            out[-1][1].append(step)
            out[-1][2].append(at)
            out[-1][3].append(value)
        return out

    def curve(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of the points the run went on from, in step order: a task that resumed
        from an older checkpoint logs steps again, and its values replace those of the steps
        it redid and of any later ones the killed task had logged."""
        points: list[tuple[int, float]] = []
        for _, (_, step, _, value) in self.series[key].points():
            while points and points[-1][0] >= step:
                points.pop()
            points.append((step, value))
        return points

    # ------------------------------------------------------------------ the summary file

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "state": {
                "lines": self.lines,
                "skipped": self.skipped,
                "first_problem": self.first_problem,
                "pending": self.pending,
                "records": self.records,
                "has_loss": self.has_loss,
                "last_training": self.last_training,
                "last_loss": self.last_loss,
                "eta_seconds": list(self.eta_seconds),
                "recent": list(self.recent),
                "eval_last": self.eval_last,
                "eval_lowest": self.eval_lowest,
                "tasks": [[*key, task.to_json()] for key, task in self.tasks.items()],
            },
        }

    def series_json(self) -> dict[str, Any]:
        return {key: series.to_json() for key, series in self.series.items()}

    @classmethod
    def from_json(cls, path: Path, data: Any, series: bytes | None = None) -> MetricsSummary:
        """The summary ``data`` holds; DamagedSummary for anything :meth:`to_json` does not write,
        each value of the type and in the range it has there (_STATE, TaskMetrics's, Decimated's).
        ``series``: the text of :meth:`series_json`, parsed when first asked for."""
        try:
            _check(isinstance(data, dict) and data.get("version") == VERSION, f"a summary of version {VERSION}")
            state = data["state"]
            out = cls(path)
            for name, ok in _STATE.items():
                _check(ok(state[name]), f"a summary's {name}")
                if isinstance(getattr(out, name), deque):
                    getattr(out, name).extend(state[name])
                else:
                    setattr(out, name, state[name])
            _check(not (out.last_training and is_eval_line(out.last_training)), "a training line")
            _check(isinstance(state["tasks"], list), "a summary's tasks")
            for job, restart, launch, task in state["tasks"]:
                key = (job, restart, launch)
                _check(isinstance(job, str) and is_int(restart) and is_int(launch), "a task")
                _check(key not in out.tasks, "a task once")
                out.task_index[key] = len(out.task_index)
                out.tasks[key] = TaskMetrics.from_json(task)
            if series is not None:
                out._series, out._series_text = None, series
                out._kept = (out.lines, list(out.tasks))
        except (KeyError, TypeError, ValueError) as exc:
            raise DamagedSummary(str(exc)) from None
        return out


def summarize_text(path: Path, data: bytes) -> MetricsSummary:
    """The summary of ``data``, the content of a metrics file (``path`` names it in warnings)."""
    out = MetricsSummary(path)
    lines = data.split(b"\n")
    tail = lines.pop()
    for line in lines:
        out.add_line(line)
    if tail:
        out.add_line(tail)
    return out


def summarize_records(records: list[dict[str, Any]]) -> MetricsSummary:
    """The summary of records already read (a Trainer's history, a test's lines)."""
    out = MetricsSummary(Path("metrics.jsonl"))
    for record in records:
        out.add_record(record)
    return out
