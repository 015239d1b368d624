"""The job's supervisor decides as the rows of jobgen.job.decision_table say (issue 47): every
reason the batch script gave in bash has a row, and each row fails when its rule is removed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers import REPO
from jobgen.base.exit_codes import ExitCode
from jobgen.job import decisions as d
from jobgen.job.decision_table import END_CASES, RELAUNCH_CASES, markdown


@pytest.mark.parametrize("case", RELAUNCH_CASES, ids=lambda c: c.given)
def test_relaunch_row(case):
    assert d.relaunch_refusal(case.facts) == case.reason


@pytest.mark.parametrize("case", [c for c in RELAUNCH_CASES if c.rule], ids=lambda c: c.given)
def test_a_relaunch_row_fails_without_its_rule(case):
    without = tuple(rule for rule in d.RELAUNCH_RULES if rule.name != case.rule)
    assert len(without) == len(d.RELAUNCH_RULES) - 1, f"no rule named {case.rule!r}"
    assert d.relaunch_refusal(case.facts, without) != case.reason


def test_every_relaunch_rule_has_a_row():
    assert {rule.name for rule in d.RELAUNCH_RULES} == {c.rule for c in RELAUNCH_CASES if c.rule}


def test_the_first_rule_that_holds_is_the_reason():
    facts = RELAUNCH_CASES[0].facts
    both = replace(facts, launches=2, done_marker=True)
    assert d.relaunch_refusal(both) == "it was relaunched 2 time(s), job.in_job_restarts = 2"


@pytest.mark.parametrize("case", END_CASES, ids=lambda c: c.given)
def test_launch_end_row(case):
    end = d.launch_end(case.facts)
    assert (end.status, end.words) == (case.status, case.words)
    assert end.finished == (case.action == "done marker")
    assert (end.failed is not None) == (case.action == "failed marker")


def test_a_record_that_is_no_number_leaves_the_launchers_status():
    assert d.parse_exit_record("12\ntime limit (USR1 90 s before the limit)\n") == d.ExitRecord(
        12, "time limit (USR1 90 s before the limit)"
    )
    assert d.parse_exit_record("1") == d.ExitRecord(1, "")
    assert d.parse_exit_record("") is None and d.parse_exit_record("x\nwords") is None


def test_planned_stops_exit_0_and_every_other_status_itself():
    for code in ExitCode:
        assert d.slurm_exit(code) == (0 if code.planned else int(code))
    assert d.slurm_exit(137) == 137
    assert "left no exit record" in d.exit_words(137)


def test_nodes_are_examined_after_a_failure_but_not_after_a_hang_or_a_planned_stop():
    assert d.checks_nodes(1, on_slurm=True) and d.checks_nodes(137, on_slurm=True)
    assert not d.checks_nodes(int(ExitCode.HUNG), on_slurm=True)
    assert not d.checks_nodes(int(ExitCode.DEADLINE), on_slurm=True)
    assert not d.checks_nodes(1, on_slurm=False)
    end = d.blamed(d.LaunchEnd(1, "crashed"), "node2 quarantined (no rank answered)")
    assert (end.status, end.words) == (20, "node failure: node2 quarantined (no rank answered)")
    assert d.blamed(d.LaunchEnd(1, "crashed"), "") == d.LaunchEnd(1, "crashed")


# ------------------------------------------------------------------ your own program's crashes

ATTEMPT = d.Attempt(job_id="101", array_job_id="100", restart=0, launch=0)
SIGNATURE = d.CrashSignature(1, "RuntimeError: optimizer state does not match")


def history(job_id="100", array="100", restart=0, launch=0, signature=SIGNATURE):
    return d.CrashHistory(signature, job_id, array, restart, launch)


@pytest.mark.parametrize(
    "previous, attempt, repeats",
    [
        (None, ATTEMPT, False),  # the first crash
        (history(job_id="100"), ATTEMPT, True),  # the previous task of the array crashed so
        (history(job_id="100", signature=d.CrashSignature(1, "KeyError: 'x'")), ATTEMPT, False),  # another crash
        (history(job_id="100", signature=d.CrashSignature(2, SIGNATURE.line)), ATTEMPT, False),  # another status
        (history(job_id="90", array="90"), ATTEMPT, False),  # another submission of the run
        (history(job_id="101", launch=0), replace(ATTEMPT, launch=1), True),  # the launch before, in this task
        (history(job_id="101", restart=0), replace(ATTEMPT, restart=1), False),  # a requeue starts afresh
        (history(job_id="101", array=None), replace(ATTEMPT, array_job_id=None), False),  # the same launch again
    ],
)
def test_a_crash_repeats_only_after_the_launch_or_task_before(previous, attempt, repeats):
    assert d.crash_repeats(previous, SIGNATURE, attempt) is repeats


def test_the_error_line_is_the_last_exception_with_its_addresses_masked():
    lines = [
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "RuntimeError: tensor at 0x7f3a2b does not match (pid 4242)",
        "",
        "[rank0]: torchrun: worker failed",
    ]
    assert d.error_line(lines) == "RuntimeError: tensor at … does not match (…)"
    assert d.error_line(["just a line", ""]) == "just a line"
    assert d.error_line([]) == ""


def test_only_a_crash_with_no_reason_of_its_own_is_compared():
    assert d.own_crash(d.LaunchEnd(1), record_left=False)
    assert not d.own_crash(d.LaunchEnd(1), record_left=True)  # jobgen.runtime keeps its own history
    assert not d.own_crash(d.LaunchEnd(143, d.KILLED_BY_TERM_WORDS), record_left=False)
    assert not d.own_crash(d.LaunchEnd(0, d.FINISHED_WORDS, finished=True), record_left=False)
    assert not d.own_crash(d.LaunchEnd(24, "hung", hung=True), record_left=False)


def test_the_decisions_page_is_the_generated_one():
    assert (REPO / "docs" / "supervisor.md").read_text() == markdown(), (
        "run: python -m jobgen.job.decision_table --write docs/supervisor.md"
    )


# ------------------------------------------------------------------ a lost node


def test_a_node_is_lost_after_missed_checks_in_a_row_and_one_answer_clears_it():
    misses = d.node_misses({}, {"n2": False, "n3": True})
    assert misses == {"n2": 1, "n3": 0} and d.lost_nodes(misses) == []
    misses = d.node_misses(misses, {"n2": False, "n3": False})
    assert d.lost_nodes(misses) == ["n2"]
    assert d.node_misses({"n2": 1}, {"n2": True}) == {"n2": 0}
    assert not d.suspect_lost_node(None) and not d.suspect_lost_node(d.LOST_NODE_GRACE_SECONDS - 1)
    assert d.suspect_lost_node(d.LOST_NODE_GRACE_SECONDS)


def test_the_node_watch_asks_nothing_until_a_rank_ended_and_the_launch_went_on():
    from jobgen.job.node_watch import NodeWatch

    ended, asked = [False], []
    watch = NodeWatch(
        ["n2", "n3"],
        lambda: ended[0],
        lambda nodes: {node: (f"10.0.0.{node[-1]}", 6818) for node in nodes},
        lambda address: asked.append(address) or address[0] != "10.0.0.2",
        every=1,
        next_look=0,
    )
    assert watch.look(0) == {} and watch.look(1) == {} and asked == []  # training: slurmd is left alone
    ended[0] = True
    assert watch.look(2) == {} and asked == []  # a rank ended: the launch gets its grace to end
    assert watch.look(2 + d.LOST_NODE_GRACE_SECONDS) == {} and len(asked) == 2  # n2's first miss
    found = watch.look(3 + d.LOST_NODE_GRACE_SECONDS)
    assert list(found) == ["n2"] and found["n2"].startswith("lost: its slurmd at 10.0.0.2:6818 did not answer")


def test_the_hang_watch_waits_while_the_node_watch_judges_a_rank_that_ended():
    """Found by the hour soak (tests/soak/test_soak_hour.py): a node killed under a launch with the
    hang watch on was taken for a hang 10 s after the last step (the surviving rank had ended, so
    no rank beat), its stacks asked of the dead node for 34 s and no node quarantined, before the
    node watch's second check."""
    from jobgen.job.node_watch import NodeWatch

    assert not d.hang_waits_for_node_watch(None)  # no rank ended: a silence is a hang
    assert d.hang_waits_for_node_watch(0) and d.hang_waits_for_node_watch(d.NODE_JUDGING_SECONDS - 0.5)
    assert not d.hang_waits_for_node_watch(d.NODE_JUDGING_SECONDS)  # the nodes answered: judged again
    # The watch's own checks end before it stops judging.
    assert d.LOST_NODE_GRACE_SECONDS + d.NODE_MISSES_TO_LOSE * d.NODE_CHECK_SECONDS < d.NODE_JUDGING_SECONDS

    ended = [False]
    watch = NodeWatch(["n2"], lambda: ended[0], lambda nodes: {}, lambda address: True, every=1, next_look=0)
    assert watch.look(0) == {} and not watch.judging(0)
    ended[0] = True
    watch.look(1)
    assert watch.judging(1) and watch.judging(d.NODE_JUDGING_SECONDS) and not watch.judging(1 + d.NODE_JUDGING_SECONDS)


@pytest.mark.parametrize(
    "done, failed, in_sweep, reason",
    [
        (True, False, False, "the run finished in task 7_1"),
        (False, True, False, "the run stopped in task 7_1: a failure every task would repeat (jobgen status)"),
        (True, True, False, "the run finished in task 7_1"),
        (False, False, False, None),  # a time limit, a kill switch: the next task goes on (or leaves)
        (True, False, True, None),  # one point of a sweep: the array's other points go on
    ],
)
def test_the_array_is_ended_once_the_run_is_finished_or_failed(done, failed, in_sweep, reason):
    assert d.array_end_reason(done=done, failed=failed, in_sweep=in_sweep, task="7_1") == reason
