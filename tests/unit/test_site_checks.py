"""The doctor's site checks: what a site profile asks of the nodes, judged from each node's facts
(trainer.site_checks), read on the node (trainer.site_facts) and printed by ``jobgen doctor``
(jobgen.launch.doctor.site_table). The command output below is captured text: this machine's
own where it says so, hand-written lines for the eth0/ib0 cases."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import REPO, VENV_BIN, run_spec
from jobgen.base.exit_codes import ExitCode
from jobgen.launch.doctor import report, site_table
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import load_run
from trainer import site_facts
from trainer.site_checks import (
    GIB,
    Check,
    Iface,
    NodeFacts,
    Probe,
    ProcRoute,
    Route,
    SiteFactError,
    SiteNeeds,
    SitePlan,
    hca_names,
    judge,
    judge_environment,
    judge_ifname,
    judge_shared,
    judge_snapshot_dir,
    judge_transport,
    merge,
    parse_addrs,
    parse_proc_route,
    parse_route_get,
    port_state,
    route_by_table,
    site_needs,
)

# This machine (`ip -o route get 127.0.0.1`, `ip -o route get 192.0.2.2`: its own eth0 address).
ROUTE_LOOPBACK = "local 127.0.0.1 dev lo src 127.0.0.1 uid 0 \\    cache <local> \n"
ROUTE_OWN_ADDRESS = "local 192.0.2.2 dev lo src 192.0.2.2 uid 0 \\    cache <local> \n"
# This machine (`ip -o -4 addr`), while the dev cluster's bridge was up.
ADDRS = (
    "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
    "4: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever preferred_lft forever\n"
    "121: jgbr0    inet 10.213.47.1/24 scope global jgbr0\\       valid_lft forever preferred_lft forever\n"
)
# This machine's /proc/net/route (tabs and the kernel's trailing blanks as it prints them).
PROC_ROUTE = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT       \n"
    "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0           \n"
    "jgbr0\t002FD50A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0          \n"
    "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0           \n"
)
# Hand-written: a compute node reaching the head over the IPoIB interface, through a gateway on eth0,
# and a veth in a container.
ROUTE_IB0 = "10.10.0.1 dev ib0 src 10.10.0.7 uid 1000 \\    cache \n"
ROUTE_VIA = "10.20.0.1 via 192.168.1.1 dev eth0 src 192.168.1.23 uid 1000 \\    cache \n"
ADDRS_NODE = (
    "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
    "2: eth0    inet 192.168.1.23/24 brd 192.168.1.255 scope global eth0\\       valid_lft forever\n"
    "5: ib0    inet 10.10.0.7/16 brd 10.10.255.255 scope global ib0\\       valid_lft forever\n"
    "9: eth1@if12    inet 172.17.0.3/16 scope global eth1\\       valid_lft forever\n"
)
NODE_IFACES = [Iface("lo", "127.0.0.1", 8), Iface("eth0", "192.168.1.23", 24), Iface("ib0", "10.10.0.7", 16)]

NEEDS = SiteNeeds(
    ifname="ib0",
    transport="ib",
    ib_hca=None,
    snapshot_dir="/dev/shm",
    shared=(("paths.runs_root", "/shared/runs/doc"),),
    imports=(("train", "torch"), ("train", "transformers"), ("lora", "peft")),
)


def node(name: str = "n2", **facts) -> NodeFacts:
    """A healthy compute node's facts: reaches the head 10.10.0.1 over ib0, one ACTIVE HCA, a
    24 GiB /dev/shm, sees the head's file, has every module."""
    base = {
        "rendezvous": "head",
        "rendezvous_addr": "10.10.0.1",
        "route": Route("unicast", "ib0", "10.10.0.7"),
        "interfaces": list(NODE_IFACES),
        "links": ["lo", "eth0", "ib0"],
        "infiniband": [("mlx5_0", ["ACTIVE"])],
        "shm_is_dir": True,
        "shm_size": 24 * GIB,
        "shm_free": 23 * GIB,
        "seen": {"paths.runs_root": "seen"},
        "prefix": "/opt/envs/llm",
    }
    return NodeFacts(node=name, **{**base, **facts})


# --------------------------------------------------------------------------- reading text


def test_route_get_of_this_machine_and_of_a_compute_node():
    assert parse_route_get(ROUTE_LOOPBACK) == Route("local", "lo", "127.0.0.1")
    assert parse_route_get(ROUTE_OWN_ADDRESS) == Route("local", "lo", "192.0.2.2")
    assert parse_route_get(ROUTE_IB0) == Route("unicast", "ib0", "10.10.0.7")
    assert parse_route_get(ROUTE_VIA) == Route("unicast", "eth0", "192.168.1.23")
    with pytest.raises(SiteFactError, match="no interface"):
        parse_route_get("unreachable 10.0.0.1 \\    cache \n")


def test_addresses_of_this_machine_and_of_a_compute_node():
    assert parse_addrs(ADDRS) == [
        Iface("lo", "127.0.0.1", 8),
        Iface("eth0", "192.0.2.2", 24),
        Iface("jgbr0", "10.213.47.1", 24),
    ]
    # A veth's peer suffix is not part of the name NCCL and Gloo are given.
    assert parse_addrs(ADDRS_NODE)[1:] == [*NODE_IFACES[1:], Iface("eth1", "172.17.0.3", 16)]
    assert parse_addrs("") == [] and parse_addrs("garbage\n") == []


def test_proc_net_route_by_longest_prefix():
    routes = parse_proc_route(PROC_ROUTE)
    assert routes == [
        ProcRoute("eth0", "0.0.0.0", "0.0.0.0"),
        ProcRoute("jgbr0", "10.213.47.0", "255.255.255.0"),
        ProcRoute("eth0", "192.0.2.0", "255.255.255.0"),
    ]
    ifaces = parse_addrs(ADDRS)
    assert route_by_table("10.213.47.9", routes, ifaces) == Route("unicast", "jgbr0", None)
    assert route_by_table("8.8.8.8", routes, ifaces) == Route("unicast", "eth0", None)  # the default route
    assert route_by_table("192.0.2.2", routes, ifaces) == Route("local", "eth0", "192.0.2.2")  # this node's own
    assert route_by_table("127.0.1.1", routes, ifaces) == Route("local", "lo", "127.0.1.1")
    with pytest.raises(SiteFactError, match="no route"):
        route_by_table("10.9.9.9", routes[1:], ifaces)
    with pytest.raises(SiteFactError, match="unreadable"):
        parse_proc_route(PROC_ROUTE.splitlines()[0] + "\neth0\tzz\t0\t0001\t0\t0\t0\t00\t0\t0\t0\n")


def test_infiniband_port_states_and_hca_lists():
    assert port_state("4: ACTIVE\n") == "ACTIVE" and port_state("1: DOWN") == "DOWN" and port_state("") == "unknown"
    assert hca_names("mlx5_0,mlx5_1") == (False, ["mlx5_0", "mlx5_1"])
    assert hca_names("=mlx5_0:1,mlx5_3:1") == (True, ["mlx5_0", "mlx5_3"])
    assert hca_names("^mlx5_2") is None


# --------------------------------------------------------------------------- judging


def test_ifname_unset_names_the_interface_that_routes_to_the_head():
    check = judge_ifname(replace(NEEDS, ifname=None), node(), [])
    assert check == Check(
        "network.ifname",
        "n2",
        False,
        "not set; the rendezvous host 10.10.0.1 is reached over ib0",
        'network.ifname = "ib0"',
    )


def test_ifname_that_routes_to_the_head_is_ok():
    check = judge_ifname(NEEDS, node(), [])
    assert check.ok and check.found == "ib0 has an IPv4 address; the rendezvous host 10.10.0.1 is reached over ib0"


def test_ifname_missing_or_without_an_address_is_named_with_the_nodes_interfaces():
    missing = judge_ifname(replace(NEEDS, ifname="eth9"), node(), [])
    assert not missing.ok and missing.fix == 'network.ifname = "ib0"'
    assert missing.found.startswith("eth9 is no interface of this node (IPv4: eth0 192.168.1.23, ib0 10.10.0.7)")
    bare = judge_ifname(replace(NEEDS, ifname="eth2"), node(links=["lo", "eth0", "eth2", "ib0"]), [])
    assert not bare.ok and bare.found.startswith("eth2 has no IPv4 address")


def test_the_head_node_reaches_itself_over_the_interface_holding_the_address():
    head = node("n1", rendezvous_addr="10.10.0.7", route=parse_route_get("local 10.10.0.7 dev lo src 10.10.0.7"))
    check = judge_ifname(NEEDS, head, [])
    assert check.ok and check.found.endswith("the rendezvous host 10.10.0.7 is reached over ib0")


def test_a_head_named_by_a_loopback_address_is_found_from_the_other_nodes():
    """MASTER_ADDR is the head's hostname, which /etc/hosts maps to 127.0.1.1 there: its
    interface is the one in the network the other nodes' routes come from."""
    unset = replace(NEEDS, ifname=None)
    head = node("n1", rendezvous_addr="127.0.1.1", route=Route("local", "lo", "127.0.1.1"))
    peer = node("n2", route=Route("unicast", "ib0", "10.10.3.4"))
    check = judge_ifname(unset, head, [peer])
    assert check.fix == 'network.ifname = "ib0"'
    assert check.found == "not set; the other nodes reach this node (the rendezvous host) over ib0"
    alone = judge_ifname(unset, head, [])
    assert alone.found == "not set; the rendezvous host is this node, by a loopback address (127.0.1.1)"
    assert alone.fix == "network.ifname: one of eth0 192.168.1.23, ib0 10.10.0.7 (the nodes' network)"


def test_an_unresolvable_rendezvous_host_is_said():
    facts = node(rendezvous="head", rendezvous_addr=None, route=None, errors={"rendezvous": "gaierror: no name"})
    check = judge_ifname(replace(NEEDS, ifname=None), facts, [])
    assert not check.ok and "head has no IPv4 address here (gaierror: no name)" in check.found


def test_transport_against_the_infiniband_devices():
    socket_site = replace(NEEDS, transport="socket")
    assert judge_transport(NEEDS, node()) == Check("network.transport", "n2", True, "ib over mlx5_0 (ACTIVE)")
    none = judge_transport(NEEDS, node(infiniband=[]))
    assert none == Check(
        "network.transport", "n2", False, "ib, but no InfiniBand devices", 'network.transport = "socket"'
    )
    down = judge_transport(NEEDS, node(infiniband=[("mlx5_0", ["DOWN"])]))
    assert not down.ok and down.found == "ib, but no port is ACTIVE: mlx5_0 (DOWN)"
    unused = judge_transport(socket_site, node(infiniband=[("mlx5_0", ["ACTIVE"]), ("mlx5_1", ["ACTIVE"])]))
    assert unused.ok and unused.found == (
        'InfiniBand devices mlx5_0 mlx5_1 found: transport = "ib" (and ib_hca) would use them'
    )
    assert judge_transport(socket_site, node(infiniband=[])).found == "socket; InfiniBand: none"


def test_ib_hca_names_only_devices_the_node_has():
    wrong = judge_transport(replace(NEEDS, ib_hca="=mlx5_9:1"), node())
    assert not wrong.ok and wrong.fix == 'network.ib_hca = "mlx5_0"' and "mlx5_9" in wrong.found
    assert judge_transport(replace(NEEDS, ib_hca="mlx5"), node()).ok  # a prefix
    assert judge_transport(replace(NEEDS, ib_hca="^mlx5_9"), node()).ok  # an exclusion


def test_snapshot_dir_needs_a_directory_of_a_gib():
    assert judge_snapshot_dir(NEEDS, node()) == Check(
        "paths.snapshot_dir", "n2", True, "/dev/shm: 24 GiB (23 GiB free)"
    )
    small = judge_snapshot_dir(NEEDS, node(shm_size=64 * 2**20, shm_free=64 * 2**20))
    assert not small.ok and small.found == "/dev/shm: 0.1 GiB (0.1 GiB free)" and "paths.snapshot_dir" in str(small.fix)
    assert not judge_snapshot_dir(NEEDS, node(shm_is_dir=False)).ok


def test_a_shared_directory_is_one_filesystem_only_where_every_node_reads_the_token():
    probe = Probe("paths.runs_root", "/shared/runs/doc", ".jobgen-doctor-1", "t")
    assert judge_shared(probe, node()).ok
    fix = "paths.runs_root must be one filesystem every node sees (a node-local directory is not shared)"
    for seen, words in [
        ("missing", "the file the head node wrote there is not there"),
        ("no directory", "no such directory on this node"),
        ("other", "a file of that name holds another token than the head node wrote"),
    ]:
        check = judge_shared(probe, node(seen={"paths.runs_root": seen}))
        assert check == Check("paths.runs_root", "n2", False, f"/shared/runs/doc: {words}", fix)
    skipped = Probe("paths.hf_home", "/shared/hf", skipped="does not exist on the head node yet: not checked")
    assert judge_shared(skipped, node()).ok
    unwritable = judge_shared(Probe("paths.hf_home", "/shared/hf", problem="cannot write"), node())
    assert not unwritable.ok and unwritable.fix == "paths.hf_home: a directory you may write, on every node"


def test_environment_names_the_extra_for_each_missing_module():
    assert judge_environment(NEEDS, node()).found == "/opt/envs/llm has torch, transformers, peft"
    check = judge_environment(NEEDS, node(missing=["transformers", "peft"]))
    assert not check.ok and check.found == "/opt/envs/llm lacks transformers, peft"
    assert check.fix == (
        "pip install 'jobgen[train]' into /opt/envs/llm on the node; "
        "pip install 'jobgen[lora]' into /opt/envs/llm on the node"
    )


def test_judge_and_merge_put_nodes_with_one_result_on_one_line():
    plan = SitePlan(NEEDS, (Probe("paths.runs_root", "/shared/runs/doc", ".jobgen-doctor-1", "t"),))
    everyone = [node("n1"), node("n2"), node("n3", seen={"paths.runs_root": "missing"}, missing=["peft"])]
    merged = merge(judge(plan, everyone))
    assert [(m["check"], m["nodes"], m["ok"]) for m in merged] == [
        ("network.ifname", ["n1", "n2", "n3"], True),
        ("network.transport", ["n1", "n2", "n3"], True),
        ("paths.snapshot_dir", ["n1", "n2", "n3"], True),
        ("paths.runs_root", ["n1", "n2"], True),
        ("paths.runs_root", ["n3"], False),
        ("environment", ["n1", "n2"], True),
        ("environment", ["n3"], False),
    ]
    json.dumps(merged)  # doctor.json holds it as it is
    broken = merge(judge(plan, [node("n1", errors={"site checks": "RuntimeError: boom"})]))
    assert broken == [
        {
            "check": "site checks",
            "nodes": ["n1"],
            "ok": False,
            "found": "RuntimeError: boom",
            "fix": "see the doctor's log",
        }
    ]
    assert judge(SitePlan(skipped="no spec.json"), everyone) == []


def test_site_needs_from_a_resolved_spec(tmp_path: Path):
    (tmp_path / "hf").mkdir()
    site = {"profile": "local", "paths": {"hf_home": str(tmp_path / "hf"), "data_cache": str(tmp_path / "cache")}}
    spec = load_run(
        run_spec(
            tmp_path, "doc", site=site, job={"program": "doctor", "time": "5m", "exit_grace": "1m", "runs_root": "runs"}
        )
    )
    needs = site_needs(spec, spec.run_dir)
    assert (needs.ifname, needs.transport, needs.snapshot_dir) == ("eth0", "socket", "/dev/shm")
    assert needs.shared == (
        ("job.runs_root", str(spec.run_dir)),
        ("paths.runs_root", spec.site.paths.runs_root),  # the site's own, elsewhere: checked as well
        ("paths.data_cache", str(tmp_path / "cache")),
        ("paths.hf_home", str(tmp_path / "hf")),
    )
    # What a training run on the site imports, though the doctor itself needs only torch.
    assert needs.imports == tuple(
        ("train", m) for m in ("torch", "transformers", "datasets", "tokenizers", "safetensors")
    )


# --------------------------------------------------------------------------- on this machine


def test_probe_files_are_seen_refused_behind_links_and_removed(tmp_path: Path):
    probe, held = site_facts.place_probe("paths.runs_root", str(tmp_path))
    assert probe.name and probe.token and held is not None
    assert site_facts.read_probe(probe) == "seen"
    assert site_facts.read_probe(probe._replace(token="another")) == "other"
    site_facts.remove_probes([held])
    assert list(tmp_path.iterdir()) == []
    assert site_facts.read_probe(probe._replace(directory=str(tmp_path / "nowhere"))) == "no directory"
    # A link planted at the name is neither followed nor read.
    (tmp_path / "target").write_text(str(probe.token))
    (tmp_path / str(probe.name)).symlink_to(tmp_path / "target")
    assert site_facts.read_probe(probe) == "link"
    skipped, none = site_facts.place_probe("paths.hf_home", str(tmp_path / "absent"))
    assert none is None and skipped.skipped and skipped.name is None


def test_plan_without_spec_json_skips_the_site_checks(tmp_path: Path):
    plan, held = site_facts.plan_site_checks(tmp_path)
    assert plan.needs is None and held == [] and "no spec.json" in str(plan.skipped)


@pytest.mark.parametrize("with_ip", [True, False])
def test_this_machine_reads_its_own_facts(monkeypatch, tmp_path: Path, with_ip: bool):
    """With `ip`, and without it (/proc/net/route and ioctl): this machine reaches itself."""
    if with_ip and subprocess.run(["which", "ip"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no ip command here")
    if not with_ip:
        monkeypatch.setattr(site_facts, "run_ip", lambda *args: None)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    needs = SiteNeeds("lo", "socket", None, str(tmp_path), (), (("train", "json"), ("train", "no_such_module_x")))
    facts = site_facts.read_node(SitePlan(needs), "here")
    assert facts.errors == {}, facts.errors
    assert facts.route == Route("local", "lo", "127.0.0.1") and "lo" in facts.links
    assert any(i.name == "lo" and i.addr == "127.0.0.1" for i in facts.interfaces)
    assert facts.shm_is_dir and facts.shm_size > 0 and facts.missing == ["no_such_module_x"]


# --------------------------------------------------------------------------- jobgen doctor's report


SITE_CHECKS = [
    {
        "check": "network.ifname",
        "nodes": ["n1", "n2"],
        "ok": False,
        "found": "not set; via eth0",
        "fix": 'network.ifname = "eth0"',
    },
    {"check": "paths.runs_root", "nodes": ["n1"], "ok": True, "found": "/runs/doc: seen", "fix": None},
    {
        "check": "paths.runs_root",
        "nodes": ["n2"],
        "ok": False,
        "found": "/runs/doc: gone",
        "fix": "paths.runs_root must be",
    },
]


def test_site_table_merges_nodes_and_says_all_of_them():
    lines = site_table({"nodes": ["n1", "n2"], "site_checks": SITE_CHECKS})
    assert lines == [
        "site check       node(s)      result  found              fix",
        "-" * len("site check       node(s)      result  found              fix"),
        'network.ifname   all 2 nodes  FAIL    not set; via eth0  network.ifname = "eth0"',
        "paths.runs_root  n1           ok      /runs/doc: seen    -",
        "paths.runs_root  n2           FAIL    /runs/doc: gone    paths.runs_root must be",
    ]
    assert site_table({"ok": True, "table": []}) == []
    assert site_table({"site_checks": [], "site_checks_skipped": "no spec.json"}) == [
        "site checks skipped: no spec.json"
    ]


def test_report_prints_the_site_checks_after_the_table_and_fails_on_one(tmp_path: Path, capsys):
    run = RunDir(tmp_path / "doc")
    run.path.mkdir()
    table = ["node ...", "RESULT: FAILED: site checks failed: network.ifname (all 4 ranks OK on 2 node(s))"]
    verdict = {"ok": False, "table": table, "nodes": ["n1", "n2"], "site_checks": SITE_CHECKS}
    (run.path / "doctor.json").write_text(json.dumps(verdict))
    assert report(run, 7) == int(ExitCode.DOCTOR_FAILED)
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["jobgen doctor:", *table] and out[3].startswith("site check") and len(out) == 8
    # A failed site check fails the exit status even where "ok" says otherwise.
    (run.path / "doctor.json").write_text(json.dumps({**verdict, "ok": True}))
    assert report(run, 7) == int(ExitCode.DOCTOR_FAILED)


@pytest.mark.torch
def test_summarise_fails_the_verdict_on_a_site_check():
    pytest.importorskip("torch")
    from trainer.doctor import summarise

    rank = {"node": "n1", "device": "cpu", "torch": "2.x", "nccl": None, "python": "3.x", "errors": {}, "checks": {}}
    reports = [{**rank, "rank": 0}, {**rank, "rank": 1}]
    lines, verdict = summarise(reports, 2, SITE_CHECKS)
    assert not verdict["ok"] and verdict["site_checks"] == SITE_CHECKS
    assert (
        lines[-1] == "RESULT: FAILED: site checks failed: network.ifname, paths.runs_root (all 2 ranks OK on 1 node(s))"
    )
    lines, verdict = summarise(reports, 2, [c for c in SITE_CHECKS if c["ok"]])
    assert verdict["ok"] and lines[-1] == "RESULT: all 2 ranks OK on 1 node(s)"
    lines, verdict = summarise(reports[:1], 2, SITE_CHECKS)
    assert (
        lines[-1]
        == "RESULT: FAILED (1/2 ranks reported; bad nodes: none; site checks failed: network.ifname, paths.runs_root)"
    )


@pytest.mark.torch
def test_the_doctor_program_checks_the_site_on_two_ranks(tmp_path: Path):
    """torchrun --standalone, 2 processes on gloo: doctor.json holds the site checks of the
    run's site, and the files written to check the shared directories are gone."""
    pytest.importorskip("torch")
    spec = load_run(
        run_spec(
            tmp_path,
            "doc",
            site={"profile": "local", "network": {"ifname": "lo"}, "paths": {"runs_root": str(tmp_path / "site-runs")}},
            job={"program": "doctor", "time": "5m", "exit_grace": "1m", "runs_root": "runs", "procs_per_node": 2},
        )
    )
    spec.run_dir.mkdir(parents=True)
    (tmp_path / "site-runs").mkdir()
    (spec.run_dir / "spec.json").write_text(json.dumps(spec.to_json()))
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "trainer.doctor"]
    cmd += ["--run-dir", str(spec.run_dir), "--expected-world-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    verdict = json.loads((spec.run_dir / "doctor.json").read_text())
    checks = {c["check"]: c for c in verdict["site_checks"]}
    names = ["network.ifname", "network.transport", "paths.snapshot_dir", "job.runs_root", "paths.runs_root"]
    assert list(checks) == [*names, "environment"]
    assert all(c["ok"] for c in checks.values()), proc.stdout + proc.stderr
    assert verdict["ok"] and proc.returncode == 0, proc.stdout + proc.stderr
    assert checks["job.runs_root"]["found"] == f"{spec.run_dir}: the head node's file is seen"
    assert sorted(p.name for p in spec.run_dir.iterdir()) == ["doctor.json", "spec.json"]
    assert "site check" in proc.stdout
