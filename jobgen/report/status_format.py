"""``jobgen status`` as text: one run's view with its tasks, and the one-line-per-run listing.

Pure functions of :class:`jobgen.report.status.RunStatus`; the JSON form is ``RunStatus.to_json``.
Every text that comes from a file or from Slurm (names, reasons, notes, warnings) is shown
through jobgen.base.visible: a control character in it is printed as an escape, never acted on.
"""

from __future__ import annotations

import time

from jobgen.base.durations import format_human
from jobgen.base.visible import visible
from jobgen.report.status import RunStatus
from jobgen.report.task_table import Relaunch, TaskStatus
from jobgen.slurm import client as slurm
from jobgen.spec.tables.run import layout_text


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else format_human(max(0, int(seconds)))


def _clock(epoch: float | None, form: str = "%m-%d %H:%M") -> str:
    try:
        return time.strftime(form, time.localtime(epoch)) if epoch else ""
    except (OverflowError, OSError, ValueError):  # no date: the readers keep times in range; say so if not
        return "?"


def step_text(status: RunStatus) -> str:
    """The run's step as both views show it: ``400/1000`` with a known total, ``400`` for a
    program that reports steps but no total (your own program), ``-`` before any step."""
    step = "-" if status.step is None else str(status.step)
    return f"{step}/{status.max_steps}" if status.max_steps else step


def _why(task: TaskStatus) -> str:
    """Why the task waits, or how it ended, in words."""
    if task.state in slurm.JOB_PENDING:
        return visible(task.reason or "")
    if task.state in slurm.JOB_ACTIVE:
        return ""
    words = visible(task.exit_reason or task.reason or "")
    if task.jobgen_exit is not None:
        words = f"exit {task.jobgen_exit}: {words}" if words else f"exit {task.jobgen_exit}"
    return words


def task_lines(tasks: list[TaskStatus]) -> list[str]:
    header = (
        f"{'task':<12} {'state':<10} {'nodes':<14} {'started':<11}  {'elapsed/limit':>15}  "
        f"{'steps':<11} {'redone':>6} {'1st step':>8} {'ranks/batch':>11}  why"
    )
    lines = [header]
    for t in tasks:
        name = visible(t.slurm_id) + (f" #{t.restart}" if t.restart else "")
        nodes = visible(t.nodes or "") if t.state not in slurm.JOB_PENDING else ""
        limit = _age(t.time_limit_seconds) if t.time_limit_seconds else "-"
        elapsed = f"{_age(t.elapsed_seconds) if t.elapsed_seconds is not None else '-'}/{limit}"
        steps = f"{t.start_step}->{'' if t.end_step is None else t.end_step}" if t.start_step is not None else ""
        redone = "" if t.recomputed_steps is None or t.start_step is None else str(t.recomputed_steps)
        first = f"{t.seconds_to_first_step:.0f}s" if t.seconds_to_first_step is not None else ""
        shape = f"{t.world_size}/{t.global_batch}" if t.world_size and t.global_batch else ""
        lines.append(
            f"{name:<12} {visible(t.state):<10} {nodes:<14} {_clock(t.start_time):<11}  {elapsed:>15}  "
            f"{steps:<11} {redone:>6} {first:>8} {shape:>11}  {_why(t)}".rstrip()
        )
        lines += [_relaunch_line(r) for r in t.relaunches]
    return lines


def _relaunch_line(r: Relaunch) -> str:
    """A relaunch inside the task above it: when, after what, and what it cost."""
    after = f"exit {r.after_exit}" if r.after_exit is not None else "a failure"
    line = f"  relaunch {r.launch} {_clock(r.time)} after {after}"
    line += f" ({visible(r.reason)})" if r.reason else ""
    line += f" on {visible(r.nodes)}" if r.nodes else ""
    if r.start_step is not None:
        line += f": resumed at step {r.start_step}"
        line += f", {r.recomputed_steps} redone" if r.recomputed_steps is not None else ""
        if r.seconds_to_first_step is not None:
            line += f", first step {r.seconds_to_first_step:.0f}s after the relaunch"
    return line


def format_status(status: RunStatus) -> str:
    """One run: its state and progress, then a line per task (``ARRAYID_TASK``, ``#N`` for a
    requeued job's later attempts), notes and warnings."""
    lines = [
        f"run      {visible(status.name)}  ({status.program})",
        f"dir      {visible(status.run_dir)}",
        f"state    {status.state}",
    ]
    if status.node_procs:
        world = f" = world size {sum(status.node_procs)}"
        lines.append(f"nodes    {layout_text(tuple(status.node_procs))}{world}")
    if status.max_steps is not None:
        progress = f"step     {step_text(status)}"
        if status.loss is not None:
            progress += f"   loss {status.loss:.4f}"
        if status.tokens_per_s is not None:
            progress += f"   {status.tokens_per_s:,.0f} tokens/s"
        if status.eta_seconds is not None and status.state in ("running", "pending"):
            progress += f"   ETA {_age(status.eta_seconds)} of training"
        lines.append(progress)
    elif status.step is not None:  # your own program: the steps it reported, no total known
        lines.append(f"step     {status.step}" + (f"   loss {status.loss:.4f}" if status.loss is not None else ""))
    if status.source_tokens:
        total = max(sum(status.source_tokens.values()), 1)
        shares = ", ".join(f"{visible(name)} {n / total:.1%}" for name, n in status.source_tokens.items())
        lines.append(f"data     {shares} of {total:,} tokens drawn")
    if status.eval_last is not None:
        line = f"eval     loss {status.eval_last['eval_loss']:.4f} at step {status.eval_last['step']}"
        if status.eval_best is not None:
            best = status.eval_best
            line += f"   best {best['eval_loss']:.4f} at step {best['step']}"
            line += f" ({visible(best['checkpoint'])})" if best.get("checkpoint") else ""
        lines.append(line)
    if status.last_checkpoint:
        lines.append(f"saved    {visible(status.last_checkpoint)}, {_age(status.last_checkpoint_age_seconds)} ago")
    if status.goodput is not None:
        lines.append(f"goodput  {status.goodput:.1%} (time in steps that were kept / time the jobs held)")
    if status.switches:
        lines.append(f"switches {', '.join(visible(name) for name in status.switches)}")
    for entry in status.quarantined:
        stamp = _clock(entry["since"], "%Y-%m-%d %H:%M")
        node, job, reason = (visible(entry[key]) for key in ("node", "job", "reason"))
        lines.append(f"quarantined {node} since {stamp} (job {job}): {reason}")
    if status.tasks:
        lines.append("")
        lines.extend(task_lines(status.tasks))
    lines.extend(f"note     {visible(n)}" for n in status.notes)
    lines.extend(f"WARNING  {visible(w)}" for w in status.warnings)
    return "\n".join(lines)


def format_listing(statuses: list[RunStatus]) -> str:
    """Every run on one line: name, state, step/total, loss, tokens/s, ETA, goodput, the
    newest checkpoint's age, and its warnings (the first, and how many more)."""
    rows = [("RUN", "STATE", "STEP", "LOSS", "TOKENS/S", "ETA", "GOODPUT", "SAVED", "ALERTS")]
    for s in statuses:
        alerts = "-"
        if s.warnings:
            # The run's own files by their names in it: what a truncated column still shows.
            warning = visible(s.warnings[0].replace(f"{s.run_dir}/", ""))
            first = warning if len(warning) <= 60 else warning[:57] + "..."
            alerts = first + (f" (+{len(s.warnings) - 1})" if len(s.warnings) > 1 else "")
        rows.append(
            (
                visible(s.name),
                s.state,
                step_text(s),
                f"{s.loss:.4f}" if s.loss is not None else "-",
                f"{s.tokens_per_s:,.0f}" if s.tokens_per_s is not None else "-",
                _age(s.eta_seconds) if s.eta_seconds is not None and s.state in ("running", "pending") else "-",
                f"{s.goodput:.0%}" if s.goodput is not None else "-",
                f"{_age(s.last_checkpoint_age_seconds)} ago" if s.last_checkpoint else "-",
                alerts,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    # A run that cannot be read says why in full: the file and the error.
    unreadable = [s for s in statuses if s.state == "unreadable" and s.warnings]
    lines += [f"{visible(s.name)}: {visible(s.warnings[0])}" for s in unreadable]
    return "\n".join(lines)
