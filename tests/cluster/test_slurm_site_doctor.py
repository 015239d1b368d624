"""``jobgen doctor`` checking a site profile on the dev cluster's nodes (each its own host, and
each with a node-local directory, ``<state>/node-local``): the profile ``jobgen site init`` wrote
passes every site check; one whose runs root and data cache are node-local directories (there on
every node, but each node's own) fails those checks on the other node, naming the profile keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import doctor_spec, jobgen, node, submit, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def test_the_profile_site_init_wrote_passes_the_doctors_site_checks(cluster, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    runs = tmp_path / "runs"
    jobgen("site", "init", "devdoc", "--runs-root", str(runs), "--ifname", "eth0", "--no-gpu-compute", check=True)
    proc = jobgen("doctor", "--site", "devdoc", "--nodes", "2", "--procs-per-node", "1", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "site check" in proc.stdout
    (verdict,) = [json.loads(p.read_text()) for p in runs.glob("*/doctor.json")]
    checks = {c["check"]: c for c in verdict["site_checks"]}
    assert {"network.ifname", "network.transport", "paths.snapshot_dir", "paths.runs_root", "environment"} <= set(
        checks
    ), checks
    assert all(c["ok"] for c in verdict["site_checks"]), verdict["site_checks"]
    assert checks["network.ifname"]["nodes"] == "all" or len(checks["network.ifname"]["nodes"]) == 2, checks


def test_node_local_runs_root_and_cache_fail_naming_the_keys(cluster, tmp_path: Path):
    if not cluster.node_local:
        pytest.skip("this dev cluster has no node-local directories (needs root and unshare)")
    local = Path(cluster.node_local)
    mine = f"doctor-{tmp_path.name}"
    for directory in cluster.node_local_dirs.values():  # there on every node, each node's own
        for sub in ("runs", "cache"):
            (Path(directory) / mine / sub).mkdir(parents=True)
    profile = tmp_path / "nodelocal.toml"
    profile.write_text(
        'name = "nodelocal"\n[slurm]\npartition = "debug"\ncpus_per_node = 2\n'
        '[network]\nifname = "eth0"\n'
        f'[paths]\nruns_root = "{local / mine / "runs"}"\ndata_cache = "{local / mine / "cache"}"\n'
    )
    # The doctor's own run lives in a shared directory: a run under the site's runs root could
    # not even write its batch log on the head node.
    spec = doctor_spec(tmp_path, "nldoc", site=str(profile), nodes=2, runs_root=str(tmp_path / "runs"))
    spec.write_text(spec.read_text().replace("[job]", f'[job]\nnodelist = ["{node(1)},{node(2)}"]'))
    submit(spec)
    result = tmp_path / "runs" / "nldoc" / "doctor.json"
    verdict = json.loads(wait_for(lambda: result.exists() and result.read_text(), 240, "the doctor's verdict"))
    assert not verdict["ok"], verdict
    failed = {(c["check"], tuple(c["nodes"])): c for c in verdict["site_checks"] if not c["ok"]}
    for key in ("paths.runs_root", "paths.data_cache"):
        check = failed[(key, (node(2),))]
        assert "must be one filesystem every node sees" in check["fix"] and key in check["fix"], check
    assert all(c["ok"] for c in verdict["site_checks"] if c["check"] in ("job.runs_root", "environment"))
