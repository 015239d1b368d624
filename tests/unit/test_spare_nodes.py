"""Spare nodes (issue 35, job.spare_nodes): which specs may hold them, what the batch script
asks Slurm for and relaunches after, and how a relaunch on other nodes reads in status. The
node loss itself runs on the dev cluster (tests/cluster/test_slurm_in_job_restarts.py)."""

from __future__ import annotations

import json

import pytest

from helpers import DATA, run_spec, script_supervisor
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.render import render
from jobgen.report.status_format import task_lines
from jobgen.report.task_table import build_tasks, read_task_records
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import SpecError, load_run
from run_dirs import batch_end_record

GPU_SITE = {"profile": "local", "slurm": {"gpus_per_node": 4}}  # relaunches twice by default
T0 = 1_800_000_000.0


def spec_with(tmp_path, model, site=GPU_SITE, **job):
    base = {"nodes": 2, "time": "1h", "runs_root": str(tmp_path / "runs"), **job}
    return run_spec(tmp_path, "r", site=site, job=base, model={"path": str(model)}, data={"path": str(DATA)})


@pytest.mark.parametrize(
    ("site", "job", "message"),
    [
        (GPU_SITE, {"min_nodes": 1}, r"job\.spare_nodes = 1 with job\.min_nodes = 1 below job\.nodes = 2"),
        (GPU_SITE, {"procs_per_node": [2, 1]}, r"job\.spare_nodes = 1 with job\.procs_per_node = \[2, 1\]"),
        (GPU_SITE, {"device_memory": ["24GB", "80GB"]}, r"job\.spare_nodes = 1 with job\.device_memory"),
        (GPU_SITE, {"in_job_restarts": 0}, r"job\.spare_nodes = 1: a spare is used by a relaunch"),
        ("local", {}, r"job\.spare_nodes: 1 spare node\(s\) are used by a relaunch inside the task"),
        (GPU_SITE, {"program": "doctor"}, r"job\.spare_nodes = 1: program 'doctor' is not relaunched"),
    ],
)
def test_spares_are_refused_where_no_relaunch_could_use_one_or_the_world_could_change(
    tmp_path, tiny_model, site, job, message
):
    with pytest.raises(SpecError, match=message):
        load_run(spec_with(tmp_path, tiny_model, site, spare_nodes=1, **job))


def test_a_task_asks_for_its_nodes_and_the_spares_and_keeps_them_when_one_fails(tmp_path, tiny_model):
    script = render(load_run(spec_with(tmp_path, tiny_model, spare_nodes=1)))
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script
    assert "TASK_WORLD_SIZE=8\n" in script  # 2 nodes x 4, not 3 x 4
    # 2 to 3 nodes: a pending task asks for fewer spares once a quarantine leaves fewer nodes.
    assert "SLURM_JOB_NUM_NODES < 2 || SLURM_JOB_NUM_NODES > 3" in script and "EXPECTED_NODES" not in script
    # A node failure is relaunched (while spares last); each launch picks its nodes first.
    settings = script_supervisor(script)
    assert settings["relaunch_codes"] == [ExitCode.CRASHED, ExitCode.NODE_FAILURE, ExitCode.HUNG]
    # The supervisor picks each launch's nodes (jobgen.runs.quarantine.launch_nodes) before it starts.
    assert (settings["nodes"], settings["spare_nodes"]) == (2, 1)
    assert '--nodes=2 --ntasks=2 --nodelist="$JOBGEN_LAUNCH_NODES"' in script

    plain = render(load_run(spec_with(tmp_path, tiny_model)))
    assert "#SBATCH --nodes=2\n" in plain and "--no-kill" not in plain and "LAUNCH_NODES" not in plain
    assert script_supervisor(plain)["relaunch_codes"] == [ExitCode.CRASHED, ExitCode.HUNG]


def test_a_relaunch_on_a_spare_shows_its_nodes(tmp_path):
    run = RunDir(tmp_path / "demo")
    (run.path / "logs").mkdir(parents=True)
    run.record_job({"job_id": 40, "array": 1})
    batch_end_record(run, 41, 1, 0, 0, "finished", array=40, start=T0, end=T0 + 300)
    record = json.loads(run.task_record("41", 0).read_text())
    relaunch = {
        "launch": 1,
        "time": T0 + 60,
        "after_exit": int(ExitCode.NODE_FAILURE),
        "reason": "node failure: node2 quarantined (Slurm marked it DOWN+NOT_RESPONDING)",
        "nodes": "node1,node3",
    }
    run.task_record("41", 0).write_text(json.dumps({**record, "restarts": [relaunch]}))
    (row,) = build_tasks(run, "demo", [], [], [], read_task_records(run), 3600)
    (again,) = row.relaunches
    assert again.nodes == "node1,node3"
    shown = task_lines([row])[-1]
    assert (
        "after exit 20 (node failure: node2 quarantined (Slurm marked it DOWN+NOT_RESPONDING)) on node1,node3" in shown
    )
    # A record's nodes that are no text (an edited file) are left out, not shown as garbage.
    run.task_record("41", 0).write_text(json.dumps({**record, "restarts": [{**relaunch, "nodes": ["x"]}]}))
    (row,) = build_tasks(run, "demo", [], [], [], read_task_records(run), 3600)
    assert row.relaunches[0].nodes is None and " on " not in task_lines([row])[-1]
