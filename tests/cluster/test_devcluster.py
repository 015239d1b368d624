"""The dev cluster against real daemons: munged, MariaDB, slurmdbd, slurmctld and two slurmd.

Run alone with::

    sudo .venv/bin/python -m pytest tests/cluster/test_devcluster.py -v

Each class brings up one cluster of its own (loopback, then netns) and takes it
down at the end, beside any other dev cluster of the machine (the session clusters of
the other tests, a developer's): another instance (jobgen.devcluster.instances), with
node names, ports, bridge and /etc/hosts block of its own, reached through SLURM_CONF.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jobgen.devcluster as devcluster
from helpers import slurm_series_under_test, wait_for
from jobgen.devcluster import procs
from jobgen.devcluster.instances import Instance

pytestmark = [
    pytest.mark.slurm,
    # These start dev clusters of this machine's Slurm beside the session's and talk to them with
    # the tests' clients; a run on another series (JOBGEN_TEST_SLURM=24.11) has that series'
    # clients first on PATH, which cannot reach a 22.05 controller. The built series' own `up`
    # is what that run's `cluster` fixture does.
    pytest.mark.skipif(
        slurm_series_under_test() != devcluster.SYSTEM_SERIES,
        reason=f"tests the dev cluster on this machine's Slurm ({devcluster.SYSTEM_SERIES})",
    ),
]

# The slurm.conf of the class's own cluster, which every Slurm command here talks to.
_CONF: dict[str, str] = {}


def _run(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **_CONF}
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


class Cluster:
    """The cluster of one test class, started by this module."""

    def __init__(self, info: devcluster.ClusterInfo, up_seconds: float) -> None:
        self.info, self.up_seconds = info, up_seconds

    @property
    def state_dir(self) -> str:
        return self.info.state_dir

    def node(self, k: int) -> str:
        """The name of its k-th node (1-based): node1 for the machine's first cluster."""
        return self.info.nodes[k - 1]


def _cluster(tmp_path_factory: pytest.TempPathFactory, netns: bool):
    if os.geteuid() != 0:
        pytest.skip("the dev cluster needs root")
    state_dir = tmp_path_factory.mktemp("netns-cluster" if netns else "lo-cluster")
    started = time.monotonic()
    info = devcluster.up(nodes=2, cpus_per_node=2, netns=netns, state_dir=state_dir)
    cluster = Cluster(info, up_seconds=time.monotonic() - started)
    _CONF["SLURM_CONF"] = info.slurm_conf
    try:
        yield cluster
    finally:
        _CONF.clear()
        devcluster.down(state_dir=state_dir)


def _wait_job(job_id: str, timeout: float = 90) -> dict[str, str]:
    """Poll `scontrol show job` until the job is finished (sacct's side: test_accounting.py)."""

    def finished() -> dict[str, str] | None:
        out = _run("scontrol", "show", "job", "-o", job_id).stdout
        fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        return fields if fields.get("JobState") in ended else None

    return wait_for(finished, timeout, f"job {job_id} to finish")


def _kill_and_wait(pids: list[int]) -> None:
    """SIGKILL and wait until they are gone: a signal is delivered asynchronously. One that is
    gone already (a daemon that died on its own on a loaded machine) is as good as killed."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(procs.is_alive(p) for p in pids), 10, f"{pids} to be gone", interval=0.05)


def _sleepers() -> list[int]:
    """The live `sleep 613` processes of the job that test_down leaves running."""
    out = _run("pgrep", "-x", "-f", "sleep 613", check=False).stdout
    return [int(p) for p in out.split() if procs.is_alive(int(p))]


def _idle_states() -> dict[str, str]:  # of the class's cluster
    out = _run("sinfo", "-h", "-N", "-o", "%N %t").stdout
    return dict(line.split() for line in out.splitlines())


def _sbatch_two_nodes(tmp_path: Path) -> list[str]:
    """Nodes a 2-node batch job's `srun` ran on (sorted; two distinct ones expected)."""
    out = tmp_path / "job.out"
    job_id = (
        _run(
            "sbatch",
            "--parsable",
            "-N2",
            "--ntasks-per-node=1",
            "-t",
            "2",
            "-o",
            str(out),
            "--wrap",
            'srun bash -c "echo NODE=\\$SLURMD_NODENAME"',
        )
        .stdout.strip()
        .split(";")[0]
    )
    fields = _wait_job(job_id)
    assert fields["JobState"] == "COMPLETED", fields
    return sorted(line.split("=", 1)[1] for line in out.read_text().splitlines() if line.startswith("NODE="))


# --- loopback mode ---------------------------------------------------------------


@pytest.fixture(scope="class")
def mode_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The cluster of the test class's mode (its NETNS), for the tests of that class."""
    yield from _cluster(tmp_path_factory, netns=request.cls.NETNS)


class TestLoopback:
    NETNS = False

    def test_up_shows_idle_nodes(self, mode_cluster: Cluster) -> None:
        info = mode_cluster.info
        first = 100 * info.instance
        assert info.nodes == [f"node{first + 1}", f"node{first + 2}"]
        assert info.nic == "lo" and not info.netns
        assert set(info.node_addrs.values()) == {"127.0.0.1"}
        assert {"debug", "short"} <= set(info.partitions)
        assert Path(info.slurm_conf).is_file()
        if info.instance == 0:  # the machine's first cluster owns the system's slurm.conf
            assert os.path.realpath("/etc/slurm/slurm.conf") == os.path.realpath(info.slurm_conf)
        assert _idle_states() == dict.fromkeys(info.nodes, "idle")
        print(f"\nup (loopback, instance {info.instance}) took {mode_cluster.up_seconds:.1f}s")

    def test_status_readable_from_another_process(self, mode_cluster: Cluster) -> None:
        code = (
            "import json, dataclasses, jobgen.devcluster as d;"
            f"print(json.dumps(d.status({mode_cluster.state_dir!r}).to_dict()))"
        )
        out = _run(sys.executable, "-c", code).stdout
        data = json.loads(out)
        assert data["nodes"] == mode_cluster.info.nodes
        assert data["state_dir"] == mode_cluster.state_dir
        assert set(data["node_states"]) == set(mode_cluster.info.nodes)
        cli = _run(sys.executable, "-m", "jobgen.devcluster.cli", "status", "--state-dir", mode_cluster.state_dir)
        assert all(node in cli.stdout for node in mode_cluster.info.nodes), cli.stdout

    def test_two_node_batch_job_runs_on_both_nodes(self, mode_cluster: Cluster, tmp_path: Path) -> None:
        ran_on = _sbatch_two_nodes(tmp_path)
        assert len(set(ran_on)) == 2 and set(ran_on) <= set(mode_cluster.info.nodes)

    def test_short_partition_rejects_long_time(self, mode_cluster: Cluster) -> None:
        # The preflight tests rely on `short` having a small MaxTime.
        ok = _run("sbatch", "--test-only", "-p", "short", "-t", "4", "--wrap", "true", check=False)
        assert ok.returncode == 0, ok.stderr
        bad = _run("sbatch", "--test-only", "-p", "short", "-t", "10", "--wrap", "true", check=False)
        assert bad.returncode != 0
        assert "time limit" in (bad.stdout + bad.stderr).lower()

    def test_second_up_is_a_noop(self, mode_cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
        before = devcluster.status(mode_cluster.state_dir)
        capsys.readouterr()
        again = devcluster.up(nodes=2, cpus_per_node=2, netns=False, state_dir=mode_cluster.state_dir)
        assert "nothing to do" in capsys.readouterr().err  # found every daemon alive: started, waited for nothing
        assert before is not None and again.daemons == before.daemons
        with pytest.raises(devcluster.ClusterError, match="down"):
            devcluster.up(nodes=3, cpus_per_node=2, netns=False, state_dir=mode_cluster.state_dir)

    def test_up_restarts_a_dead_slurmd(self, mode_cluster: Cluster) -> None:
        before = devcluster.status(mode_cluster.state_dir)
        assert before is not None
        second, first = f"slurmd:{mode_cluster.node(2)}", f"slurmd:{mode_cluster.node(1)}"
        old = before.daemons[second]
        _kill_and_wait([old])
        info = devcluster.up(nodes=2, cpus_per_node=2, netns=False, state_dir=mode_cluster.state_dir)
        new = info.daemons[second]
        assert new != old and procs.is_alive(new)
        assert info.daemons[first] == before.daemons[first]

    def test_up_restarts_dead_accounting_daemons(self, mode_cluster: Cluster) -> None:
        """MariaDB and slurmdbd killed: `up` starts both again (MariaDB first, on its data),
        and sacct answers again."""
        before = devcluster.status(mode_cluster.state_dir)
        assert before is not None
        old = {name: before.daemons[name] for name in ("mariadb", "slurmdbd")}
        _kill_and_wait(list(old.values()))
        info = devcluster.up(nodes=2, cpus_per_node=2, netns=False, state_dir=mode_cluster.state_dir)
        for name, pid in old.items():
            assert info.daemons[name] != pid and procs.is_alive(info.daemons[name])
        assert info.daemons["slurmctld"] == before.daemons["slurmctld"]
        listed = _run("sacctmgr", "--noheader", "--parsable2", "list", "cluster", "format=cluster").stdout
        assert listed.split() == ["jobgen"]

    def test_stale_record_is_cleaned_by_up(self, mode_cluster: Cluster) -> None:
        # As after a reboot or `kill -9` of everything: the pid files stay behind
        # (MariaDB's in its own directory, which only its user may write).
        root = Path(mode_cluster.state_dir)
        pidfiles = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.pid"))
        assert pidfiles == [
            "mariadb/mariadbd.pid",
            "run/slurmctld.pid",
            f"run/slurmd.{mode_cluster.node(1)}.pid",
            f"run/slurmd.{mode_cluster.node(2)}.pid",
            "run/slurmdbd.pid",
        ]
        pids = [procs.read_pidfile(root / p) for p in pidfiles]
        _kill_and_wait(pids)
        info = devcluster.up(nodes=2, cpus_per_node=2, netns=False, state_dir=mode_cluster.state_dir)
        assert not set(info.daemons.values()) & set(pids)
        assert _idle_states() == dict.fromkeys(mode_cluster.info.nodes, "idle")


# --- netns mode ----------------------------------------------------------------


class TestNetns:
    NETNS = True

    def test_each_node_has_its_own_eth0(self, mode_cluster: Cluster) -> None:
        info = mode_cluster.info
        assert info.nic == "eth0" and info.netns
        out = _run(
            "srun",
            "-N2",
            "--ntasks-per-node=1",
            "-t",
            "1",
            "bash",
            "-c",
            "echo $SLURMD_NODENAME $(ip -4 -o addr show eth0 | awk '{print $4}')",
        ).stdout
        seen = dict(line.split() for line in out.splitlines())
        assert len(seen) == 2
        assert seen == {n: f"{info.node_addrs[n]}/24" for n in seen}
        assert len(set(info.node_addrs.values())) == len(info.nodes)
        hosts = Path("/etc/hosts").read_text()
        for node, addr in info.node_addrs.items():
            assert f"{addr}\t{node}" in hosts
        print(f"\nup (netns, instance {info.instance}) took {mode_cluster.up_seconds:.1f}s")

    def test_tcp_from_node2_to_node1(self, mode_cluster: Cluster) -> None:
        node1, node2 = mode_cluster.node(1), mode_cluster.node(2)
        addr1 = mode_cluster.info.node_addrs[node1]
        listener = subprocess.Popen(
            [
                "srun",
                "-N1",
                "-w",
                node1,
                "-t",
                "1",
                sys.executable,
                "-c",
                "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                f"s.bind(({addr1!r}, 29517)); s.listen(); c, a = s.accept();"
                "print('FROM', a[0], c.recv(16).decode(), flush=True)",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **_CONF},
        )
        try:
            client = _run(
                "srun",
                "-N1",
                "-w",
                node2,
                "-t",
                "1",
                sys.executable,
                "-c",
                # Until the listener's step runs (its srun may wait for the node a moment).
                "import socket, time\n"
                "deadline = time.monotonic() + 90\n"
                "while True:\n"
                "    try:\n"
                f"        s = socket.create_connection(({node1!r}, 29517), timeout=2); break\n"
                "    except OSError:\n"
                "        if time.monotonic() > deadline: raise\n"
                "        time.sleep(0.2)\n"
                "s.sendall(b'hello'); print('SRC', s.getsockname()[0])\n",
                timeout=150,
            )
            out, err = listener.communicate(timeout=150)
        finally:
            if listener.poll() is None:
                listener.kill()
        addr2 = mode_cluster.info.node_addrs[node2]
        assert f"SRC {addr2}" in client.stdout
        assert f"FROM {addr2} hello" in out, err

    def test_two_node_batch_job(self, mode_cluster: Cluster, tmp_path: Path) -> None:
        ran_on = _sbatch_two_nodes(tmp_path)
        assert len(set(ran_on)) == 2 and set(ran_on) <= set(mode_cluster.info.nodes)

    def test_down_removes_everything(self, mode_cluster: Cluster) -> None:
        info = mode_cluster.info
        # A job left running (and ignoring SIGTERM) must not survive `down`.
        _run("sbatch", "-N2", "-o", "/dev/null", "--wrap", "srun bash -c 'trap \"\" TERM; sleep 613'")
        wait_for(lambda: len(_sleepers()) >= 2, 30, "the job's steps to start", interval=0.2)
        assert len(_sleepers()) == 2, "the job's steps did not start"
        started = time.monotonic()
        assert devcluster.down(state_dir=info.state_dir) is True
        print(f"\ndown (netns, with a running job) took {time.monotonic() - started:.1f}s")

        assert devcluster.status(info.state_dir) is None
        # Whole names: another cluster's node101 contains this cluster's node1 as text.
        namespaces = {line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()}
        assert not namespaces & set(info.netns_names.values()), namespaces
        links = _run("ip", "-o", "link").stdout
        instance = Instance(info.instance)
        veths = [f": jgv{n.removeprefix('node')}@" for n in info.nodes]  # "7: jgv1@if6: <...>"
        assert f": {instance.bridge}:" not in links and not any(v in links for v in veths), links
        assert f"# BEGIN {instance.hosts_marker}\n" not in Path("/etc/hosts").read_text()
        assert os.path.realpath("/etc/slurm/slurm.conf") != os.path.realpath(info.slurm_conf)
        assert not Path(info.state_dir).exists()
        # No daemon of this cluster is left (another cluster's, the session's, may run).
        assert not _run("pgrep", "-f", info.state_dir, check=False).stdout.strip()
        assert not _sleepers()
        # A second down (the fixture's) is harmless.
        assert devcluster.down(state_dir=info.state_dir) is False
