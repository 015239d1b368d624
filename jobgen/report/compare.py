"""``jobgen compare SWEEP|RUN...``: runs side by side, to choose the best of a sweep.

A reference is a sweep (its directory, which holds ``sweep.json``, or its name under the runs
root: each point's run directory is ``<sweep dir>/points/<point name>``), ``SWEEP/POINT``, or
one run (its directory, or its name under the runs root).
For each run: the state ``jobgen status`` shows of it (:func:`run_states`), its last step of
``max_steps``, its final training loss and its best eval loss (``checkpoints/best.json``, else
the lowest logged; :func:`jobgen.report.status.eval_progress`). The rows are sorted best first: by
best eval loss, then runs without one by final training loss, then runs with neither.

Slurm is asked once for every run, as the listing of runs asks it (comparing a sweep of 50
points costs one ``squeue``, not 50); out of reach, each state is what the run directory
records, as ``jobgen status`` then says. The text table and the JSON
are :mod:`jobgen.cli.compare`'s; :func:`draw` overlays the curves (matplotlib, the optional
``[plot]`` extra, imported only there, as :mod:`jobgen.report.plot` does).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobgen.base.atomic import write_bytes_atomic
from jobgen.base.safe_read import DamagedFile, read_best
from jobgen.base.visible import visible
from jobgen.report.plot import read_metrics_warned
from jobgen.report.status import eval_progress, queue_for, remembered_for, run_status, unreadable
from jobgen.runs.rundir import RunDir, RunDirError, find_run
from jobgen.runs.sweep_files import SWEEP_INDEX
from jobgen.runs.sweep_runs import SweepError, find_point, find_sweep, read_sweep, sweep_of
from jobgen.slurm import client as slurm

# A row's state is jobgen status's (running, pending, finished, failed, stopped, unknown), and:
PENDING = "pending"  # a sweep point never submitted: no run directory yet
UNREADABLE = "unreadable"  # its records cannot be read (jobgen.report.status.unreadable says why)


class CompareError(RuntimeError):
    """Nothing to compare, or no figure can be drawn; the message says why. ``code`` is the
    exit status the command ends with."""

    code = 1


class BadReference(CompareError):
    """A reference that is neither a sweep nor a run, or a sweep.json that cannot be read."""

    code = 2


@dataclass(frozen=True)
class Target:
    """One run to compare: a plain run, or a sweep point (whose directory may not exist yet)."""

    name: str
    path: Path
    sweep: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    """What the table shows of one run; the curves are for :func:`draw` only."""

    name: str
    run_dir: str
    sweep: str | None
    state: str
    overrides: dict[str, Any]
    step: int | None = None
    max_steps: int | None = None
    final_loss: float | None = None
    best_eval_loss: float | None = None
    best_eval_step: int | None = None
    train_curve: list[tuple[int, float]] = field(default_factory=list, repr=False)
    eval_curve: list[tuple[int, float]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in JSON_FIELDS}


JSON_FIELDS = (
    "name",
    "run_dir",
    "sweep",
    "state",
    "overrides",
    "step",
    "max_steps",
    "final_loss",
    "best_eval_loss",
    "best_eval_step",
)


def _warn(message: str) -> None:
    print(f"jobgen compare: warning: {visible(message)}", file=sys.stderr)


# ---------------------------------------------------------------- references


def resolve(refs: list[str], runs_root: Path | None) -> list[Target]:
    """The runs the references name, in order, each once. A directory with sweep.json (given as
    a path or as a name under ``runs_root``) is its points; anything else must be a run.
    Raises BadReference naming the first reference that is neither."""
    targets: list[Target] = []
    for ref in refs:
        sweep = find_sweep(ref, runs_root)
        if sweep is not None:
            targets.extend(sweep_points(sweep))
            continue
        try:
            run = find_run(ref, runs_root)
        except RunDirError as exc:
            point = _find_point(ref, runs_root)  # SWEEP/POINT: with its overrides
            if point is None:
                words = f"'{ref}' is neither a sweep (a directory with {SWEEP_INDEX}) nor a run: {exc}"
                raise BadReference(words) from None
            directory = sweep_of(point)
            if directory is not None:
                targets.extend(t for t in sweep_points(directory) if t.path == point.path)
            continue
        targets.append(Target(run.path.name, run.path))
    # A run named twice (by name and by path, or alone and in its sweep) is one row.
    first: dict[Path, Target] = {}
    for target in targets:
        first.setdefault(target.path.resolve(), target)
    unique = list(first.values())
    if len({t.sweep for t in unique if t.sweep}) > 1:
        # Two sweeps of the same grid name their points alike: say whose each one is.
        unique = [Target(f"{t.sweep}/{t.name}", t.path, t.sweep, t.overrides) if t.sweep else t for t in unique]
    return unique


def _find_point(ref: str, runs_root: Path | None) -> RunDir | None:
    try:
        return find_point(ref, runs_root)
    except SweepError as exc:
        raise BadReference(str(exc)) from None


def sweep_points(directory: Path) -> list[Target]:
    """The points ``directory/sweep.json`` lists, each at its run directory in ``directory``
    (jobgen.runs.sweep_files); BadReference naming the file when it cannot be read."""
    try:
        index = read_sweep(directory)
    except SweepError as exc:  # a hand edit or a cut write: the file named, never a traceback
        raise BadReference(str(exc)) from None
    return [Target(p.name, index.point_dir(p.name), index.name, dict(p.overrides)) for p in index.points]


# ---------------------------------------------------------------- reading


def read_row(target: Target, warn: Callable[[str], None] = _warn, state: str = "unknown", curves: bool = False) -> Row:
    """One run's row, in ``state`` (:func:`run_states`): empty values and state ``pending``
    for a point with no run directory. ``curves``: also the loss curves :func:`draw` draws
    (the table needs only the newest values, which the summary holds without its series)."""
    run = RunDir(target.path)
    row = Row(target.name, str(target.path), target.sweep, PENDING, dict(target.overrides))
    if not run.exists():
        return row
    row.state = state
    # An unreadable spec.json was named once already, by run_states.
    row.max_steps = _max_steps(run, warn if state != UNREADABLE else lambda message: None)
    # The summary of metrics.jsonl (a Trainer run without jobgen's callback: its checkpoint's
    # history, as plot reads it), never the whole history.
    lines = read_metrics_warned(run, warn)
    row.step = lines.last_training["step"] if lines.last_training else None
    row.final_loss = lines.last_loss[1] if lines.last_loss else None  # the last logged
    if curves:
        row.train_curve = lines.curve("loss")
        row.eval_curve = lines.curve("eval_loss")
    _, best = eval_progress(lines, _best(run, warn))
    if best is not None:
        row.best_eval_loss, row.best_eval_step = best["eval_loss"], best["step"]
    return row


def _best(run: RunDir, warn: Callable[[str], None]) -> dict[str, Any] | None:
    """best.json; a damaged one is a warning, and the lowest eval loss logged stands in."""
    try:
        return read_best(run.best_checkpoint)
    except DamagedFile as exc:
        warn(f"{exc}: the best eval loss shown is the lowest logged")
        return None


def _max_steps(run: RunDir, warn: Callable[[str], None]) -> int | None:
    try:
        spec = run.load_spec()
    except (DamagedFile, FileNotFoundError) as exc:  # jobgen.base.safe_read.read_spec names the file and key
        warn(f"{exc}: max_steps unknown")
        return None
    # As jobgen status: only the bundled trainer has a known total.
    return spec.run.train.max_steps if spec.run.job.kind.trains else None


def run_states(runs: list[RunDir], warn: Callable[[str], None] = _warn) -> dict[Path, str]:
    """The state ``jobgen status`` shows of each run that has a directory: its run_status,
    from one ``squeue`` (and one look at Slurm's configuration) for all of them, as the
    listing of runs asks; a run whose records cannot be read is ``unreadable``, with a
    warning naming the file. A run's tasks' records decide as they do there: a task that
    failed makes the run failed even without a failure marker."""
    present = [run for run in runs if run.exists()]
    problems = {run.path: unreadable(run) for run in present}
    readable = [run for run in present if not problems[run.path]]
    queue: list[slurm.QueueEntry] | Exception
    conf: dict[str, str] | Exception | None = None
    remembered: list[slurm.JobRecord] | None = None
    try:
        queue = queue_for(readable)
        conf = slurm.config() if any(r.jobs() for r in readable) else None
        remembered = remembered_for(readable, queue, conf) if len(readable) > 1 else None
    except slurm.SlurmUnavailable as exc:
        queue = exc  # each run's state from its directory, as jobgen status says then
        why = ((exc.stderr or str(exc)).strip().splitlines() or ["no answer"])[-1]
        warn(f"Slurm not reachable ({why}): states from the run directories")
    states = {}
    for path, problem in problems.items():
        if problem:
            warn(problem)
            states[path] = UNREADABLE
    for run in readable:
        states[run.path] = run_status(
            run, queue=queue, details=False, ended=True, conf=conf, remembered=remembered
        ).state
    return states


def sort_key(row: Row) -> tuple[int, float]:
    """Best eval loss first; then runs without one by final training loss; then the rest."""
    if row.best_eval_loss is not None:
        return 0, row.best_eval_loss
    if row.final_loss is not None:
        return 1, row.final_loss
    return 2, 0.0


def compare(
    refs: list[str], runs_root: Path | None, warn: Callable[[str], None] = _warn, curves: bool = False
) -> list[Row]:
    """The rows of every run the references name, best first (sorting is stable: ties and
    runs with no loss keep the order they were named in); ``curves`` for :func:`draw`. Raises
    CompareError."""
    targets = resolve(refs, runs_root)
    if not targets:
        raise CompareError(f"no runs to compare: {', '.join(refs)} list(s) no points")
    states = run_states([RunDir(t.path) for t in targets], warn)
    return sorted((read_row(t, warn, states.get(t.path, PENDING), curves) for t in targets), key=sort_key)


def override_keys(rows: list[Row]) -> list[str]:
    """Every override key of the rows, in the order first seen: one column each."""
    return list(dict.fromkeys(key for row in rows for key in row.overrides))


def value_text(value: Any) -> str:
    """An override's value as a person writes it: 0.0003, 16, bf16, [q_proj, v_proj]."""
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else json.dumps(value)


# ---------------------------------------------------------------- drawing


def label(row: Row, short: dict[str, str]) -> str:
    """A line's legend: its overrides (``lr=0.0003, r=16``), or its name without any."""
    if not row.overrides:
        return row.name
    return ", ".join(f"{short.get(key, key)}={value_text(value)}" for key, value in row.overrides.items())


def short_names(keys: list[str]) -> dict[str, str]:
    """Each dotted key's last part (``train.lr`` -> ``lr``), unless two keys share it."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: tail if last.count(tail) == 1 else key for key, tail in zip(keys, last)}


def draw(rows: list[Row], output: Path) -> Path:
    """Training loss and eval loss against the step, one line per run in the table's order,
    written to ``output`` (PNG, or what its suffix names) atomically: a reader never sees half
    a picture. Raises CompareError without matplotlib or without any logged loss."""
    from jobgen.report.plot import missing_matplotlib

    problem = missing_matplotlib()
    if problem:
        raise CompareError(problem.replace("jobgen plot", "jobgen compare -o"))
    drawn = [row for row in rows if row.train_curve or row.eval_curve]
    if not drawn:
        raise CompareError("no run has a logged loss yet: nothing to draw")
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.pyplot as plt

    fig, (by_train, by_eval) = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    short = short_names(override_keys(drawn))
    for i, row in enumerate(drawn):
        color = f"C{i % 10}"
        if row.train_curve:
            by_train.plot(*zip(*row.train_curve), lw=1.2, color=color, label=label(row, short))
        if row.eval_curve:
            by_eval.plot(*zip(*row.eval_curve), "o-", ms=3, lw=1, color=color)
    for ax, title in ((by_train, "training loss"), (by_eval, "eval loss")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if not any(row.eval_curve for row in drawn):
        by_eval.text(0.5, 0.5, "no evaluations logged", transform=by_eval.transAxes, ha="center", color="0.4")
    by_train.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{len(drawn)} run(s), best first: {drawn[0].name}", fontsize=11)
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=output.suffix.lstrip(".") or "png", dpi=110)
    except ValueError as exc:  # an unknown suffix: matplotlib names the formats it has
        raise CompareError(f"{output}: {exc}") from None
    finally:
        plt.close(fig)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(output, buffer.getvalue())
    return output
