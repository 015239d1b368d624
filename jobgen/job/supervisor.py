"""The job's supervisor: the batch host's process that owns an array task from the program's first
launch to the task's end. The rendered batch script sets up the environment and the launch line,
then hands over to it as its last line::

    exec python -m jobgen.job --settings "$JOBGEN_SUPERVISOR"

so that Slurm's lead-time signal (``--signal=B:...``) and its SIGTERM reach it. It launches the
program, watches for hangs, catches the signals (a flag each, read at the loop's turn), reads how
each launch ended, relaunches where a relaunch may get past the failure, writes the task's
record, the run's markers and the job's comment, frees the snapshots, and cancels the array's
pending tasks once the run is finished or failed. Every decision is a function of
:mod:`jobgen.job.decisions`; every effect goes through :mod:`jobgen.job.effects`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from jobgen.base.exit_codes import ExitCode
from jobgen.job import decisions as rules
from jobgen.job import records
from jobgen.job.effects import LocalEffects, SlurmEffects, keep_stacks
from jobgen.job.hang_watch import HangWatch, hang_words, is_hung
from jobgen.job.node_watch import NodeWatch
from jobgen.job.settings import SupervisorSettings, Task
from jobgen.runs.heartbeat import DIR_ENV, SECONDS_ENV
from jobgen.runs.quarantine import QuarantineError, TooFewNodes
from jobgen.runs.rundir import RunDir, switch_is_set
from jobgen.slurm.client import SlurmError, hostnames

# How often the loop turns while a launch runs: signals and the launch's end are seen this fast.
TICK_SECONDS = 0.5
# After its step is killed, srun may still wait for a node that no longer answers (it waits for
# every node's word until Slurm declares the node down): this long at most, then srun is killed.
LOST_KILL_WAIT_SECONDS = 5
HUNG_KILL_WAIT_SECONDS = 30
# Errors of an effect the supervisor says in a line and goes on from (the task still ends cleanly).
EFFECT_ERRORS = (OSError, SlurmError, QuarantineError, subprocess.SubprocessError, ValueError)


def log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} jobgen: {message}", flush=True)


class Supervisor:
    """One task: launches, the signals it catches, how it ends."""

    def __init__(self, settings: SupervisorSettings, task: Task, effects: LocalEffects, env: dict[str, str]):
        self.settings, self.task, self.effects, self.env = settings, task, effects, env
        self.run = RunDir(Path(settings.run_dir))
        self.history = rules.LaunchHistory()
        self.signals: list[int] = []
        self.caught: str | None = None  # the first signal, with its lead ("USR1 118"): read at a launch's end
        self.stop_caught: str | None = None  # the first signal's name: no relaunch after it
        self.forwarded: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.nodes = [task.nodelist] if not effects.on_slurm else self._hostnames(task.nodelist)

    # ------------------------------------------------------------------ the task

    def supervise(self) -> int:
        for signum in {signal.Signals[f"SIG{self.settings.lead_signal}"], signal.SIGTERM}:
            signal.signal(signum, self._caught)
        if self.settings.spare_nodes and not self._choose_nodes():
            message = f"fewer than {self.settings.nodes} of the allocation's nodes are usable (above)"
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} jobgen: ERROR: {message}", file=sys.stderr, flush=True)
            return self.finish(ExitCode.LAUNCH_ERROR, f"launch error: {message}")
        end = self._launch()
        while self.settings.in_job_restarts:
            self._handle_signals()
            why = rules.relaunch_refusal(self._relaunch_facts(end))
            if why is not None:
                if end.status != 0:
                    log(f"not relaunching the program: {why}")
                break
            if not self._prepare_relaunch(end):
                break
            end = self._launch()
        return self.finish(end.status, end.words)

    def _relaunch_facts(self, end: rules.LaunchEnd) -> rules.RelaunchFacts:
        return rules.RelaunchFacts(
            status=end.status,
            launches=self.history.launches,
            in_job_restarts=self.settings.in_job_restarts,
            relaunch_codes=frozenset(self.settings.relaunch_codes),
            stop_caught=self.stop_caught,
            failed_marker=os.path.lexists(self.run.failed_marker),
            done_marker=os.path.lexists(self.run.done_marker),
            kill_or_abort=switch_is_set(self.run.switch("kill")) or switch_is_set(self.run.switch("abort")),
            seconds_left=self._seconds_left(),
            exit_grace=self.settings.exit_grace,
        )

    def _prepare_relaunch(self, end: rules.LaunchEnd) -> bool:
        restarted = int(time.time())  # the relaunch's cost counts from here to its first step
        if self.settings.spare_nodes and not self._choose_nodes():
            usable = f"fewer than {self.settings.nodes} of the allocation's nodes are usable (above)"
            log(f"not relaunching the program: {usable}")
            return False
        if self.settings.command_plan and not self._write_command_plan():
            log("not relaunching the program: could not write its plan (above)")
            return False
        self.history.launches += 1
        launch = self.history.launches
        log(
            f"relaunching the program inside this task (relaunch {launch} of at most {self.settings.in_job_restarts}): "
            f"it ended with status {end.status}" + (f": {end.words}" if end.words else "")
        )
        entry = {"launch": launch, "time": restarted, "after_exit": end.status, "reason": end.described}
        if self.settings.spare_nodes:
            entry["nodes"] = ",".join(self.nodes)
        self.history.restarts.append(entry)
        self.env.update(JOBGEN_LAUNCH=str(launch), JOBGEN_LAUNCH_START=str(restarted))
        records.clear_exit_record(self.run, self.task)
        self._record(None, None, "")
        return True

    # ------------------------------------------------------------------ one launch

    def _launch(self) -> rules.LaunchEnd:
        launch = self.history.launches
        self.env["JOBGEN_LAUNCH_NODES"] = ",".join(self.nodes) if self.settings.spare_nodes else self.task.nodelist
        watch, nodes = self._hang_watch(launch), self._node_watch(launch)
        started = time.time()
        self.proc = proc = self.effects.start_launch(self.env)
        hang, lost, kill_by = None, "", None
        while True:
            self._handle_signals()
            try:
                returncode = proc.wait(timeout=TICK_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if nodes is not None and not (hang or lost):
                lost = self._look_for_lost_node(nodes, proc, launch, now)
                # From the step's kill, not from the look: quarantining the node took its own seconds.
                kill_by = time.monotonic() + LOST_KILL_WAIT_SECONDS if lost else None
            # While the node watch judges a rank's end, the silence is not a hang (decisions.hang_waits_for_node_watch).
            judging = nodes is not None and nodes.judging(now)
            if watch is not None and not (hang or lost or judging) and watch.due(now):
                hang = self._look_for_hang(watch, proc, launch)
                kill_by = now + HUNG_KILL_WAIT_SECONDS if hang else None
            if kill_by is not None and now >= kill_by:
                # srun waits for a node that will never answer: the step's ranks are dead already.
                log("the launch did not end after its step was killed: killing srun")
                proc.kill()
                kill_by = None
        self._handle_signals()
        self.proc = None
        status = returncode if returncode >= 0 else 128 - returncode  # as bash reports a signal
        return self._launch_ended(status, hang, launch, started, lost)

    def _node_watch(self, launch: int) -> NodeWatch | None:
        """With spares to relaunch on (job.spare_nodes, on Slurm): the launch's other nodes, watched for
        a loss. Without spares Slurm's own way is kept: it finds the node after SlurmdTimeout, ends
        the job NODE_FAIL and requeues it onto healthy nodes, which an early end would forgo."""
        if not (self.effects.on_slurm and self.settings.spare_nodes and self.settings.in_job_restarts):
            return None
        others = [node for node in self.nodes if node != self.env.get("SLURMD_NODENAME")]
        if not others:
            return None
        ended = lambda: bool(self.run.rank_ends(self.task.job_id, self.task.restart, launch))  # noqa: E731
        return NodeWatch(others, ended, self.effects.slurmd_addresses, self.effects.node_answers)

    def _look_for_lost_node(self, watch: NodeWatch, proc: subprocess.Popen[bytes], launch: int, now: float) -> str:
        """The words for the nodes found lost at this look (quarantined, the launch killed), or ""."""
        found = self._effect(lambda: watch.look(now), "could not check the launch's nodes") or {}
        if not found:
            return ""
        for node, why in found.items():
            log(f"node {node} is {why}: ending this launch")
        blamed = self._effect(lambda: self.effects.quarantine_lost(found), "could not quarantine the lost node")
        problem = self._effect(
            lambda: self.effects.kill_launch(proc, launch, node_lost=True), "could not kill the launch"
        )
        if problem:
            log(problem)
        return blamed or "; ".join(f"{node} {why}" for node, why in found.items())

    def _launch_ended(
        self, status: int, hang: rules.Hang | None, launch: int, started: float, lost: str = ""
    ) -> rules.LaunchEnd:
        if not self.settings.lifecycle:
            log(f"program exited with status {status}")
            return rules.LaunchEnd(status)
        record = records.read_exit_record(self.run, self.task)
        facts = rules.LaunchFacts(
            launcher_status=status,
            record=record,
            command_plan=self.settings.command_plan,
            forward_signal=self.settings.forward_signal,
            forwarded=self.forwarded,
            caught=self.caught,
            seconds_left=self._seconds_left() if self.settings.command_plan and not record else None,
            hang=hang,
            last_hang_step=self.history.last_hang_step,
            ranks_started=status not in rules.UNRUNNABLE or self._ranks_started(started),
        )
        end = rules.launch_end(facts)
        if end.finished:
            self._effect(lambda: records.mark_done(self.run, end.words), "could not mark the run finished")
            log(f"{end.words}: the run is finished ({self.run.done_marker})")
        if end.hung:
            self.history.last_hang_step = end.hang_step
        log(f"program exited with status {end.status}" + (f": {end.words}" if end.words else ""))
        if lost:
            end = rules.blamed(end, lost)  # the node at fault is known: the one the watch found lost
        elif rules.checks_nodes(end.status, self.effects.on_slurm):
            found = self._effect(
                lambda: self.effects.nodes_at_fault(launch, self.nodes),
                "could not check this task's nodes for a node failure",
            )
            end = rules.blamed(end, found or "")
        if (
            self.settings.command_plan
            and end.status != ExitCode.NODE_FAILURE
            and rules.own_crash(end, record is not None)
        ):
            end = self._own_crash(end, launch, started)
        if end.failed is not None:
            self._mark_failed(end.status, end.failed)
        return end

    def _ranks_started(self, started: float) -> bool:
        """Whether a rank of the launch that began at ``started`` wrote its log (unreadable: yes,
        so that a launch is never stopped for good on a guess)."""
        nodes = self.nodes if self.effects.on_slurm else ["local"]
        found = self._effect(
            lambda: records.ranks_started(self.run, self.task, nodes, started), "could not read the rank logs"
        )
        return found is not False

    def _own_crash(self, end: rules.LaunchEnd, launch: int, started: float) -> rules.LaunchEnd:
        """Your own program crashed with no reason of its own: the same crash as the launch or the
        task before it stops the run instead of burning the array."""
        nodes = self.nodes if self.effects.on_slurm else ["local"]
        signature = rules.CrashSignature(
            end.status, rules.error_line(records.error_tail(self.run, self.task, nodes, started))
        )
        attempt = rules.Attempt(self.task.job_id, self.task.array_job_id, self.task.restart, launch)
        repeated = rules.crash_repeats(records.read_crash(self.run), signature, attempt)
        self._effect(lambda: records.write_crash(self.run, self.task, launch, signature), "could not record the crash")
        if not repeated:
            return end
        words = f"crashed twice the same way ({signature.describe()})"
        return replace(end, words=words, failed=rules.Failure(words, rules.REPEATED_CRASH_FIX))

    def _hang_watch(self, launch: int) -> HangWatch | None:
        timeout, every = self.settings.hang_timeout, self.settings.heartbeat_every
        if not timeout or not every:
            return None
        watch = HangWatch(self.run.heartbeats(self.task.job_id, self.task.restart, launch), timeout, every)
        if not watch.prepare():
            log(f"could not create {watch.directory}: no hang watch for this launch")
            return None
        # Each launch's ranks beat in their own directory: nothing of an earlier launch is judged.
        self.env[DIR_ENV], self.env[SECONDS_ENV] = str(watch.directory), str(every)
        return watch

    def _look_for_hang(self, watch: HangWatch, proc: subprocess.Popen[bytes], launch: int) -> rules.Hang | None:
        quiet, step = watch.look()
        if not is_hung(quiet, watch.timeout):
            return None
        stacks = self.run.hang_stacks(time.strftime("%Y%m%dT%H%M%S"), self.task.job_id)
        at = step if step is not None else "unknown"
        log(
            f"no rank has taken a step for {int(quiet or 0)} s (train.hang_timeout = {watch.timeout} s, last step "
            f"{at}): taking every rank's stacks into {stacks}, then ending this launch"
        )
        text = self._effect(lambda: self.effects.take_stacks(self.nodes), "taking the stacks failed")
        self._effect(
            lambda: keep_stacks(stacks, text or "(no stacks: see the batch log)\n"),
            f"could not keep the stacks as {stacks}",
        )
        problem = self._effect(lambda: self.effects.kill_launch(proc, launch), "could not kill the launch")
        if problem:
            log(problem)
        return rules.Hang(step, hang_words(step, watch.timeout, stacks))

    # ------------------------------------------------------------------ signals

    def _caught(self, signum: int, frame: object) -> None:
        self.signals.append(signum)  # acted on at the loop's next turn

    def _handle_signals(self) -> None:
        while self.signals:
            self._request_stop(signal.Signals(self.signals.pop(0)).name.removeprefix("SIG"))

    def _request_stop(self, name: str) -> None:
        """Leave a stop request the program polls at every step, naming this attempt (a requeued
        job keeps its id, so no later attempt can act on it). torchrun would die of the signal
        without telling its workers; on SIGTERM it gives them TORCH_ELASTIC_SHUTDOWN_TIMEOUT to save."""
        lead = self._seconds_left()
        before = f" {lead} s before the time limit" if lead is not None else ""
        self.caught = self.caught or (f"{name} {lead}" if lead is not None else name)
        self.stop_caught = self.stop_caught or name
        log(f"received SIG{name}{before}: asking the program to save and exit")
        stop = self.run.stop_request(self.task.job_id, self.task.restart)
        self._effect(
            lambda: records.write_stop_request(stop, name),
            f"could not leave the stop request {stop}: the program saves only at its deadline",
        )
        limit = f" {lead} s before the limit" if lead is not None else ""
        if name != "TERM":
            self.effects.set_comment(
                f"time limit ({name}{limit}): asked the program to stop; this stays if Slurm kills it at the limit"
            )
        forward = self.settings.forward_signal
        if forward and name != "TERM" and not self.forwarded:
            # Your program reads no stop request: it gets its signal, as torchrun passes it to the workers.
            self.forwarded = f"{name}{limit}"
            own = "it saves nothing for jobgen: it resumes from its own last checkpoint"
            log(f"forwarding SIG{forward} to the program ({own})")
            self._effect(lambda: self.effects.forward(forward, self.proc), f"could not forward SIG{forward}")

    # ------------------------------------------------------------------ the end

    def finish(self, code: int, words: str = "") -> int:
        code = int(code)
        words = words or rules.exit_words(code)
        exit_code = rules.slurm_exit(code)
        if code != 0 and exit_code == 0:
            log(f"exit {code} is a planned stop: exiting 0, so Slurm records COMPLETED")
        self._record(code, exit_code, words)
        self._end_the_array()  # first: its comment for the pending tasks names the whole array
        self.effects.set_comment(f"{words} (exit {code})")
        snapshots = self.env.get("JOBGEN_SNAPSHOT_DIR")
        if snapshots:
            problem = self._effect(
                lambda: self.effects.clear_snapshots(snapshots), "could not delete the memory snapshots"
            )
            if problem:
                log(problem)
        return exit_code

    def _end_the_array(self) -> None:
        """A finished or failed run has nothing for its pending tasks to do but take nodes from the queue."""
        why = rules.array_end_reason(
            done=os.path.lexists(self.run.done_marker),
            failed=os.path.lexists(self.run.failed_marker),
            in_sweep=bool(self.env.get("JOBGEN_SWEEP_DIR")),
            task=self.task.slurm_name,
        )
        if why is None:
            return
        cancelled = self._effect(lambda: self.effects.cancel_pending(why), "could not cancel the array's pending tasks")
        if cancelled:
            log(f"cancelled the array's pending task(s) {', '.join(cancelled)}: {why}")

    def _record(self, code: int | None, exit_code: int | None, words: str) -> None:
        restarts = self.history.restarts if self.settings.in_job_restarts else None
        path = self.run.task_record(self.task.job_id or "none", self.task.restart)
        self._effect(
            lambda: records.write_task_record(self.run, self.task, time.time(), code, exit_code, words, restarts),
            f"could not write {path}",
        )

    def _mark_failed(self, code: int, failure: rules.Failure) -> None:
        marked = self._effect(
            lambda: self.run.mark_failed(code, failure.reason, failure.fix, self.task.job_id, self.task.restart),
            f"could not mark the run failed ({self.run.failed_marker}): later tasks start it again",
        )
        if marked:
            log(f"the run is stopped: {failure.reason} ({marked})")

    # ------------------------------------------------------------------ helpers

    def _choose_nodes(self) -> bool:
        """job.spare_nodes: the nodes the next launch trains on, and its rendezvous on the first."""
        try:
            self.nodes = self.effects.launch_nodes(self.settings.nodes)
        except TooFewNodes as exc:
            print(f"jobgen: {exc}", file=sys.stderr, flush=True)
            return False
        except EFFECT_ERRORS as exc:
            print(f"jobgen: could not choose the launch's nodes: {exc}", file=sys.stderr, flush=True)
            return False
        log(f"this launch trains on {','.join(self.nodes)}")
        head = self.nodes[0]
        address = self._effect(lambda: self.effects.head_address(head), "could not ask the head node its address")
        if not address:
            print(
                f"jobgen: head node {head} has no IPv4 address on interface '{self.settings.rendezvous.ifname}'",
                file=sys.stderr,
            )
            return False
        spread = self.settings.rendezvous.port_spread
        job = int(self.task.job_id) if self.task.job_id.isdecimal() else 0
        port = self.settings.rendezvous.port + (job % spread if spread else 0)
        self.env.update(JOBGEN_HEAD_NODE=head, JOBGEN_RDZV_ENDPOINT=f"{address}:{port}")
        log(f"rendezvous at {address}:{port} (head node {head})")
        return True

    def _write_command_plan(self) -> bool:
        """Again before a relaunch: it resumes from the newest checkpoint (jobgen.launch.command_plan,
        in its own process: the room that renders the script sits above this one)."""
        args = ["--run-dir", str(self.run.path), "--job", self.task.job_id, "--restart", str(self.task.restart)]
        command = [sys.executable, "-m", "jobgen.launch.command_plan", *args, "--task", self.task.array_task or "0"]
        return (
            self._effect(
                lambda: subprocess.run(command, env=self.env, check=False).returncode, "could not write the plan"
            )
            == 0
        )

    def _seconds_left(self) -> int | None:
        return self._effect(self.effects.seconds_to_limit, "could not ask Slurm the job's end")

    def _hostnames(self, nodelist: str) -> list[str]:
        try:
            return hostnames(nodelist) or [nodelist]
        except SlurmError:
            return [nodelist]

    @staticmethod
    def _effect(action, failed: str):
        """An effect whose failure is one line in the batch log, never the end of the task."""
        try:
            return action()
        except EFFECT_ERRORS as exc:
            log(f"{failed}: {exc}")
            return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobgen.job", description=__doc__.split("\n")[0])
    parser.add_argument("--settings", required=True, help="the task's settings, JSON (SupervisorSettings)")
    args = parser.parse_args(argv)
    try:
        settings = SupervisorSettings.model_validate_json(args.settings)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the settings"
        print(f"jobgen: ERROR: the batch script's supervisor settings: {where}: {first['msg']}", file=sys.stderr)
        return int(ExitCode.LAUNCH_ERROR)
    task = Task.from_env()
    run = RunDir(Path(settings.run_dir))
    effects = (SlurmEffects if task.on_slurm else LocalEffects)(settings, task, run)
    return Supervisor(settings, task, effects, dict(os.environ)).supervise()
