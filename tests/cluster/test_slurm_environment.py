"""The job's Python environment on the dev cluster's nodes, where one exists only on some of
them: a venv in the node-local directory of the first node only (``<state>/node-local``, each
node its own, jobgen.devcluster.nodelocal). The login node (this machine) does not see it:
validate warns and submit queues the run; the head node has it, so the batch script goes on;
the start probe finds it missing on the second node, names the node and the file, and the task
ends FAILED with the node quarantined for the run: not torchrun's "command not found"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import doctor_spec, jobgen, node, submit, wait_for
from helpers import status as run_status

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_an_environment_only_the_head_node_has_fails_the_probe_naming_the_other(cluster, tmp_path: Path):
    if not cluster.node_local:
        pytest.skip("this dev cluster has no node-local directories (needs root and unshare)")
    venv = Path(cluster.node_local) / f"venv-{tmp_path.name}"
    on_head = Path(cluster.node_local_dirs[node(1)]) / venv.name
    (on_head / "bin").mkdir(parents=True)
    # An environment on the first node alone: it activates this test environment.
    (on_head / "bin" / "activate").write_text(f"source {Path(sys.prefix) / 'bin' / 'activate'}\n")
    try:
        site = {"profile": "local", "python": {"kind": "venv", "venv": str(venv)}}
        spec = doctor_spec(tmp_path, "envdoc", site=site, nodes=2, nodelist=[f"{node(1)},{node(2)}"])
        checked = jobgen("validate", str(spec), check=True)
        assert f"{venv}/bin/python is not on this machine" in checked.stderr
        submit(spec)
        run = tmp_path / "runs" / "envdoc"

        def ended() -> dict | None:
            tasks = run_status(run)["tasks"]
            return tasks[0] if tasks and tasks[0]["state"] not in ("PENDING", "RUNNING") else None

        task = wait_for(ended, 180, "the doctor's task to end")
        assert task["state"] == "FAILED", task
        why = f"{node(2)}=the job's Python environment is missing: {venv}/bin/activate"
        assert why in jobgen("logs", str(run), "--all", check=True).stdout
        shown = jobgen("status", str(run), check=True).stdout
        assert node(2) in shown and "quarantine" in shown, shown
    finally:
        for path in sorted(on_head.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        on_head.rmdir()
