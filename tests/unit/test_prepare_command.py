"""``jobgen data prepare --nodes N``'s job, as data (the CPU job's srun options and each node's
command), and what it refuses before Slurm is asked: a container site (the step would run the
host's Python), a time limit that is none."""

from __future__ import annotations

import sys

from helpers import DATA, jobgen, run_spec
from jobgen.spec.loader import load_run
from trainer.prepare_data import node_step


def spec_file(tmp_path, **site):
    return run_spec(
        tmp_path,
        "mix",
        site={"profile": "local", **site},
        job={"time": "1h"},
        model={"path": str(tmp_path)},
        data={"path": str(DATA)},
    )


def test_a_cpu_job_of_n_nodes_one_task_each_with_the_sites_cpus_and_nothing_else(tmp_path):
    path = spec_file(
        tmp_path,
        slurm={"cpus_per_node": 48, "partition": "cpu", "account": "ml", "qos": "low"},
        network={"ifname": "ib0", "env": {"NCCL_IB_GID_INDEX": "3"}},
        env={"HF_HUB_OFFLINE": "1"},
        paths={"hf_home": "/shared/hf"},
    )
    options, command, env = node_step(load_run(path), str(path), 4, 2 * 3600 + 60, 16)
    assert options == [
        "--job-name=mix-data",
        "--nodes=4",
        "--ntasks-per-node=1",
        "--cpus-per-task=48",
        "--time=02:01:00",
        "--kill-on-bad-exit=1",
        "--partition=cpu",
        "--account=ml",
        "--qos=low",
    ]
    assert not any("gpu" in option for option in options)  # a CPU job: no GPU asked for
    assert command == [sys.executable, "-m", "trainer.prepare_data", str(path.resolve()), "--procs", "16"]
    # What a batch script would export: the site's [env], HF_HOME, Gloo on the site's interface.
    wanted = {"HF_HUB_OFFLINE": "1", "NCCL_IB_GID_INDEX": "3", "HF_HOME": "/shared/hf", "GLOO_SOCKET_IFNAME": "ib0"}
    assert {name: env.get(name) for name in wanted} == wanted, env


def test_what_the_nodes_cannot_do_is_refused_before_slurm_is_asked(tmp_path):
    path = spec_file(tmp_path)
    bad_time = jobgen("data", "prepare", str(path), "--nodes", "2", "--time", "soon")
    assert bad_time.returncode == 2 and "--time 'soon'" in bad_time.stderr, bad_time.stderr
    container = spec_file(
        tmp_path, python={"kind": "container", "container_runtime": "podman", "container_image": "localhost/x:1"}
    )
    refused = jobgen("data", "prepare", str(container), "--nodes", "2")
    assert refused.returncode == 2 and "runs jobs in a container" in refused.stderr, refused.stderr
