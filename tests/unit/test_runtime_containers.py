"""The container runtimes (jobgen.spec.containers, jobgen.launch.container_step): the options the
rendered scripts give each runtime are options its documentation lists (the lists below, with the
documentation's version: kept here, not taken from the code under test), and podman's are options
of the podman on this machine; validate refuses what a runtime cannot honour, naming the key; every
step sees the job's directories at their paths, once, and podman's the variables the job sets."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import GOLDEN, doctor_spec, run_spec
from jobgen.base.paths import CHECKOUT
from jobgen.launch.container_step import container_step, job_directories
from jobgen.spec.containers import step_words
from jobgen.spec.loader import SpecError, load_run
from jobgen.spec.tables.site import PythonSettings

# pyxis v0.20.0 README, "Usage" (the [pyxis] section of `srun --help`).
PYXIS_0_20 = {
    "--container-image",
    "--container-mounts",
    "--container-workdir",
    "--container-name",
    "--container-save",
    "--container-mount-home",
    "--no-container-mount-home",
    "--container-remap-root",
    "--no-container-remap-root",
    "--container-entrypoint",
    "--no-container-entrypoint",
    "--container-entrypoint-log",
    "--container-writable",
    "--container-readonly",
    "--container-env",
}
# Apptainer 1.3 user guide, `apptainer exec --help` (the options jobgen or a site's profile may use).
APPTAINER_1_3_EXEC = {
    "--bind",
    "--pwd",
    "--nv",
    "--nvccli",
    "--rocm",
    "--writable-tmpfs",
    "--contain",
    "--containall",
    "--cleanenv",
    "--env",
    "--home",
    "--no-home",
    "--fakeroot",
    "--ipc",
    "--pid",
    "--userns",
}
# podman-run(1) of podman 4.3 (Debian bookworm's).
PODMAN_4_3_RUN = {
    "--rm",
    "--network",
    "--ipc",
    "--pid",
    "--uts",
    "--cap-add",
    "--security-opt",
    "--log-driver",
    "--env",
    "--volume",
    "--workdir",
    "--device",
    "--userns",
    "--ulimit",
    "--init",
    "--name",
    "--hooks-dir",
    "--group-add",
}
DOCUMENTED = {"pyxis": PYXIS_0_20, "apptainer": APPTAINER_1_3_EXEC, "podman": PODMAN_4_3_RUN}
GOLDEN_BY_RUNTIME = {
    "pyxis": "cloud-ethernet-train.sbatch",
    "apptainer": "apptainer-train.sbatch",
    "podman": "podman-train.sbatch",
}


def runtime_options(script: str, runtime: str) -> list[str]:
    """The options the script's SRUN_CONTAINER gives the runtime itself (its words up to the image)."""
    (block,) = re.findall(r"^SRUN_CONTAINER=\(\n(.*?)^\)", script, flags=re.S | re.M)
    words = [w.strip().strip("'") for w in block.splitlines()]
    if runtime == "apptainer":
        words = words[words.index("exec") + 1 : -1]
    elif runtime == "podman":
        words = words[words.index("podman-step") + 1 : -1]
    return words


@pytest.mark.parametrize("runtime", sorted(GOLDEN_BY_RUNTIME))
def test_every_option_of_the_golden_scripts_is_one_the_runtime_documents(runtime):
    options = runtime_options((GOLDEN / GOLDEN_BY_RUNTIME[runtime]).read_text(), runtime)
    assert options and all(o.startswith("--") for o in options), options
    unknown = sorted({o.split("=", 1)[0] for o in options} - DOCUMENTED[runtime])
    assert not unknown, f"{runtime} documents no {unknown}"


def test_every_podman_option_is_one_this_machines_podman_has():
    if shutil.which("podman") is None:
        pytest.skip("no podman here (the dev cluster's image fixture installs it)")
    help_text = subprocess.run(["podman", "run", "--help"], capture_output=True, text=True, check=True).stdout
    for option in {o.split("=", 1)[0] for o in runtime_options((GOLDEN / "podman-train.sbatch").read_text(), "podman")}:
        assert re.search(rf"(^|\s){re.escape(option)}[ =,]", help_text), option


@pytest.mark.parametrize(
    ("python", "words"),
    [
        ({"container_runtime": "podman", "container_image": "nvcr.io#nvidia/pytorch:24.05-py3"}, "pyxis's syntax"),
        ({"container_runtime": "podman", "container_image": "/images/jobgen.sif"}, "apptainer's"),
        ({"container_runtime": "apptainer", "container_image": "nvcr.io#nvidia/pytorch:24.05-py3"}, "pyxis's syntax"),
        ({"container_runtime": "pyxis", "container_image": "docker://nvcr.io/nvidia/pytorch:24.05-py3"}, "apptainer's"),
        (
            {"container_runtime": "apptainer", "container_image": "/i.sif", "container_mounts": ["/a:/b:z"]},
            "no mount flag",
        ),
        (
            {"container_runtime": "pyxis", "container_image": "a#b", "container_mounts": ["/a:/b:ro+q"]},
            "no mount flag 'q'",
        ),
        ({"container_runtime": "podman", "container_image": "x/y:1", "container_mounts": ["data:/data"]}, "absolute"),
        (
            {"container_runtime": "podman", "container_image": "x/y:1", "container_options": ["--container-writable"]},
            "pyxis's",
        ),
        (
            {"container_runtime": "pyxis", "container_image": "a#b", "container_options": ["--device=/dev/fuse"]},
            "not a pyxis",
        ),
        (
            {"container_runtime": "podman", "container_image": "x/y:1", "container_options": ["--env=A=$(id)"]},
            "cannot be used",
        ),
        # enroot reads a registry only before '#': this would be pulled from Docker Hub.
        ({"container_runtime": "pyxis", "container_image": "registry.example.org/team/jobgen:0.1.0"}, "before '#'"),
        ({"container_runtime": "pyxis", "container_image": "localhost:5000/jobgen:1"}, "before '#'"),
        # A relative .sif would be read from each step's working directory; a bare name is no image.
        ({"container_runtime": "apptainer", "container_image": "images/jobgen.sif"}, "absolute path"),
        ({"container_runtime": "apptainer", "container_image": "ubuntu:22.04"}, "absolute path"),
    ],
)
def test_validate_refuses_what_the_runtime_cannot_honour_naming_the_key(tmp_path, python, words):
    spec = doctor_spec(tmp_path, "c", site={"profile": "local", "python": {"kind": "container", **python}})
    with pytest.raises(SpecError) as caught:
        load_run(spec)
    (issue,) = caught.value.issues
    assert "python" in issue.key and words in issue.message, str(issue)
    key = (
        "container_options"
        if "container_options" in python
        else "container_mounts"
        if "container_mounts" in python
        else "container_image"
    )
    assert key in f"{issue.key} {issue.message}", str(issue)


def test_each_runtimes_own_image_and_mounts_are_accepted():
    for runtime, image, mount in [
        ("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3", "/fsx:/fsx:ro+rprivate"),
        ("apptainer", "/shared/images/jobgen.sif", "/fsx:/fsx:ro"),
        ("apptainer", "docker://registry.example.org/jobgen:1", "/fsx:/data"),
        ("podman", "registry.example.org/team/jobgen:0.1.0", "/fsx:/fsx:ro"),
        ("pyxis", "registry.example.org#team/jobgen:0.1.0", "/fsx:/fsx"),
        ("pyxis", "nvidia/pytorch:24.05-py3", "/fsx:/fsx"),  # Docker Hub's, as meant
        ("pyxis", "/shared/images/jobgen.sqsh", "/fsx:/fsx"),
        ("apptainer", "oras://registry.example.org/jobgen:1", "/fsx:/fsx"),
    ]:
        py = PythonSettings(
            kind="container", container_runtime=runtime, container_image=image, container_mounts=[mount]
        )
        assert py.container_runtime == runtime


def test_the_jobs_directories_are_mounted_once_each_at_their_paths(tmp_path):
    model, data = tmp_path / "models" / "tiny", tmp_path / "data"
    model.mkdir(parents=True)
    data.mkdir()
    (data / "train.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    spec = load_run(
        run_spec(
            tmp_path,
            "m",
            site={"profile": "local", "paths": {"hf_home": str(tmp_path / "hf"), "snapshot_dir": "/dev/shm"}},
            job={"runs_root": str(tmp_path / "runs"), "time": "10m"},
            model={"path": str(model)},
            data={"path": str(data / "train.jsonl")},
        )
    )
    dirs = job_directories(spec)
    assert {str(tmp_path / "runs"), str(tmp_path / "hf"), "/dev/shm", str(model), str(data)} <= set(dirs)
    py = PythonSettings(
        kind="container",
        container_runtime="podman",
        container_image="x/y:1",
        container_mounts=[f"{tmp_path}:{tmp_path}"],
    )
    step = container_step(py, dirs, ["MY_FLAG", "NCCL_IB_HCA"], gpus=False)
    # The site's mount of tmp_path covers the runs root, the model, the data and HF_HOME.
    assert [m for m in step.mounts if m.startswith(str(tmp_path))] == [f"{tmp_path}:{tmp_path}"]
    assert "/dev/shm:/dev/shm" in step.mounts and step.workdir == str(tmp_path / "runs")
    assert "MY_FLAG" in step.env and "NCCL_IB_HCA" not in step.env and "NCCL_*" in step.env


def test_a_read_only_site_mount_leaves_the_runs_root_under_it_writable():
    """The pyxis page's own example, /fsx read-only over a runs root in /fsx: the site's mount
    covered the runs root, so checkpoints and heartbeats met a read-only filesystem. Now the
    read-only mount goes first and the runs root (and HF_HOME) over it, writable."""
    py = PythonSettings(
        kind="container",
        container_runtime="pyxis",
        container_image="a#b",
        container_mounts=["/fsx:/fsx:ro+rprivate", "/scratch/x:/data"],
    )
    step = container_step(py, ["/fsx/jobgen-runs", "/fsx/hf", "/dev/shm"], [], gpus=False)
    mounts = [m for m in step.mounts if not m.startswith(f"{CHECKOUT}:")] if CHECKOUT else list(step.mounts)
    assert mounts == [
        "/fsx:/fsx:ro+rprivate",
        "/fsx/jobgen-runs:/fsx/jobgen-runs",
        "/fsx/hf:/fsx/hf",
        "/dev/shm:/dev/shm",
        "/scratch/x:/data",
    ]
    # A writable one still covers what lies under it: mounted once.
    rw = py.model_copy(update={"container_mounts": ["/fsx:/fsx"]})
    assert [m for m in container_step(rw, ["/fsx/jobgen-runs", "/dev/shm"], [], gpus=False).mounts if "fsx" in m] == [
        "/fsx:/fsx"
    ]


def test_a_container_site_without_hf_home_mounts_the_cache_validate_looked_in(tmp_path, monkeypatch):
    """podman's home is the image's: a hub model validate found in ~/.cache/huggingface would not
    be found by the trainer. The cache is named, exported as HF_HOME and mounted."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-cache"))
    python = {"kind": "container", "container_runtime": "podman", "container_image": "x/y:1"}
    spec = load_run(doctor_spec(tmp_path, "c", site={"profile": "local", "python": python}))
    assert spec.site.paths.hf_home == str(tmp_path / "hf-cache")
    assert str(tmp_path / "hf-cache") in job_directories(spec)
    assert spec.site.python.host_python  # the supervisor's Python, recorded at load


def test_the_mounts_order_does_not_depend_on_where_jobgen_was_cloned(monkeypatch):
    """CI clones into /check/work/main, this machine into /work/main: a render that sorted the
    mounts by path put the checkout before /dev/shm in one and after it in the other."""
    import jobgen.launch.container_step as container_step_module

    py = PythonSettings(kind="container", container_runtime="podman", container_image="x/y:1")
    shared = ["/shared/runs", "/shared/runs/cache", "/dev/shm"]
    orders = []
    for checkout in ("/a/jobgen", "/work/main", "/zz/jobgen"):
        monkeypatch.setattr(container_step_module, "CHECKOUT", Path(checkout))
        mounts = container_step(py, shared, [], gpus=False).mounts
        orders.append([m.replace(checkout, "@PROJECT@") for m in mounts])
    assert orders[0] == orders[1] == orders[2]
    assert orders[0] == ["/shared/runs:/shared/runs", "/dev/shm:/dev/shm", "@PROJECT@:@PROJECT@"]


def test_only_podman_is_given_the_variables_by_name():
    podman = PythonSettings(kind="container", container_runtime="podman", container_image="x/y:1")
    step = container_step(podman, ["/runs"], ["MY_FLAG"], gpus=True)
    words = step_words("podman", step)
    assert "--env=MY_FLAG" in words and "--env=SLURM*" in words and "--device=nvidia.com/gpu=all" in words
    assert words[:3] == ["bash", "-c", 'exec podman run --env=JOBGEN_TETHER_PID="$$" "$@"'] and words[-1] == "x/y:1"
    apptainer = PythonSettings(kind="container", container_runtime="apptainer", container_image="/i.sif")
    words = step_words("apptainer", container_step(apptainer, ["/runs"], ["MY_FLAG"], gpus=True))
    assert not any("MY_FLAG" in w or "SLURM" in w for w in words), words
    # pyxis passes the job's variables, but an image's own value of one wins unless it is named:
    # the names jobgen and the site set are, no family of podman's.
    pyxis = PythonSettings(kind="container", container_runtime="pyxis", container_image="a#b")
    words = step_words("pyxis", container_step(pyxis, ["/runs"], ["MY_FLAG", "NCCL_SOCKET_IFNAME"], gpus=True))
    (named,) = [w for w in words if w.startswith("--container-env=")]
    assert set(named.split("=", 1)[1].split(",")) >= {"MY_FLAG", "NCCL_SOCKET_IFNAME", "PYTHONNOUSERSITE"}, words
    assert not any("SLURM" in w or "*" in w for w in words), words
    assert "--nv" in step_words(
        "apptainer",
        container_step(
            PythonSettings(kind="container", container_runtime="apptainer", container_image="/i.sif"),
            ["/runs"],
            [],
            gpus=True,
        ),
    )


def test_the_golden_podman_script_starts_every_step_in_the_image():
    text = (GOLDEN / "podman-train.sbatch").read_text()
    launch = text[text.index("JOBGEN_SRUN_LAUNCH <<'LAUNCH'") :]
    assert "podman-step --rm --network=host --ipc=host --pid=host" in launch.splitlines()[3]
    assert '"container": [\n    "bash",' in text  # the supervisor's helper steps (stacks, address) too
    assert Path(GOLDEN / "specs" / "podman-train.toml").is_file()


def test_a_container_sites_shared_directories_are_made_at_submit(tmp_path):
    """podman refuses to mount a directory that is not there (exit 125, before the program): the
    data cache and HF_HOME the job would create are made when the run is submitted."""
    from jobgen.launch.container_step import mounted_directories_made

    site = {
        "profile": "local",
        "python": {"kind": "container", "container_runtime": "podman", "container_image": "x/y:1"},
        "paths": {"data_cache": str(tmp_path / "cache"), "hf_home": str(tmp_path / "hf")},
    }
    spec = load_run(doctor_spec(tmp_path, "d", site=site))
    assert mounted_directories_made(spec) is None
    assert (tmp_path / "hf").is_dir() and (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    (tmp_path / "blocked").write_text("a file where a directory should be\n")
    blocked = {**site, "paths": {"data_cache": str(tmp_path / "blocked" / "cache")}}
    key, problem = mounted_directories_made(load_run(doctor_spec(tmp_path, "e", site=blocked)))
    assert key == "site.paths.data_cache" and "could not be made" in problem
    venv = load_run(doctor_spec(tmp_path, "v", site={"profile": "local", "paths": {"hf_home": str(tmp_path / "h2")}}))
    assert mounted_directories_made(venv) is None and not (tmp_path / "h2").exists()  # no container: left to the job


def test_image_build_refuses_what_it_cannot_build_from(tmp_path):
    from jobgen.sites.image import ImageBuildError, build_image, jobgen_wheel

    (tmp_path / "other-1.0-py3-none-any.whl").write_text("")
    with pytest.raises(ImageBuildError, match="not a jobgen wheel"):
        jobgen_wheel(tmp_path, tmp_path / "other-1.0-py3-none-any.whl")
    with pytest.raises(ImageBuildError, match="no jobgen wheel"):
        build_image(base="x", tag="y", wheels=[tmp_path / "other-1.0-py3-none-any.whl"], tool="podman")
    # The wheels are checked before the machine is asked for a build tool: the same anywhere
    # (this failed on a machine without podman before).
    with pytest.raises(ImageBuildError, match="'nerdctl' not found"):
        build_image(base="x", tag="y", wheels=[tmp_path / "jobgen-1.0-py3-none-any.whl"], tool="nerdctl")


@pytest.mark.parametrize("container", [["bash", "-c", "exec podman run ..."], []], ids=["container", "host"])
def test_a_container_launch_is_handed_the_jobs_end_by_the_batch_host(tmp_path, monkeypatch, container):
    """An image holds no squeue, so rank 0 could not ask when the job ends (Slurm 22.05 sets no
    variable for it) and a container run had no deadline: the supervisor asks, on the batch host."""
    from jobgen.job import effects
    from jobgen.job.settings import RendezvousSettings, SupervisorSettings, Task
    from jobgen.runs.rundir import RunDir

    settings = SupervisorSettings(
        run_dir=str(tmp_path),
        lifecycle=True,
        command_plan=False,
        lead_signal="USR1",
        exit_grace=60,
        nodes=1,
        container=container,
        rendezvous=RendezvousSettings(port=29500),
    )
    task = Task("7", "7", "1", 0, "node1", 1, 0, True, "node1", "node1:29500")
    started = {}
    monkeypatch.setattr(effects.slurm, "end_time", lambda job_id: 1_900_000_000.5)
    monkeypatch.setattr(effects.subprocess, "Popen", lambda args, env: started.setdefault("env", env))
    effects.SlurmEffects(settings, task, RunDir(tmp_path)).start_launch({"JOBGEN_SRUN_LAUNCH": "true"})
    assert started["env"].get("JOBGEN_JOB_END_TIME") == ("1900000000" if container else None)
    started.clear()
    given = {"JOBGEN_SRUN_LAUNCH": "true", "SLURM_JOB_END_TIME": "1800000000"}  # Slurm 23.02+ says it itself
    effects.SlurmEffects(settings, task, RunDir(tmp_path)).start_launch(given)
    assert "JOBGEN_JOB_END_TIME" not in started["env"]
