"""Shared fixtures.

Slurm behaviour is tested on the real dev cluster (``jobgen cluster up --netns``),
started once per session by the ``cluster`` fixture when a test asks for it and
taken down again at the end if this session started it. Golden files are
regenerated only with ``pytest --update-golden``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from helpers import PACED, SHARED_DATA_CACHE_ENV, ClusterRun, cancel_submitted, slurm_series_under_test, train_spec
from unwind import pytest_configure  # noqa: F401 - SIGTERM unwinds the session (tests/unwind.py)

# The dev cluster's nodes and every torchrun share this machine's few cores, so their OpenMP
# threads must not spin while they wait: libgomp's default (active, 300,000 spins) counts only
# this process's threads against the cores and burns the CPU the other processes need. Three
# processes of 2 threads each on 2 cores doing the same matmuls: 192 CPU-s and 97 s without
# this, 21 CPU-s and 11 s with it. The thread counts, and so the numbers, stay as rendered;
# every process the tests start (sbatch exports it into the jobs) inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The folder says what a test needs: unit/ nothing but this checkout, distributed/ torchrun
# with several processes on gloo, cluster/ and soak/ the dev Slurm cluster. The `slurm`
# marker follows the folder, so `pytest -m "not slurm"` and `pytest tests/unit` agree.
KINDS = ("unit", "distributed", "cluster", "soak")
NEEDS_SLURM = ("cluster", "soak")
# The dev cluster's tests run in two parts, each on a worker with a dev cluster of its own: they
# wait mostly on Slurm's clocks (time limits are checked once a minute), so the parts overlap.
# Files named here go to part 2 (about half of the time, measured in CI: the summary line
# "time in tests per worker"); the rest to part 1.
CLUSTER_PART_2 = frozenset(
    {
        "test_slurm_lifecycle.py",
        "test_slurm_container.py",
        "test_slurm_own_script.py",
        "test_slurm_pipeline.py",
        "test_slurm_sweep.py",
        "test_slurm_world_size.py",
        "test_serve_slurm.py",
        "test_soak.py",
    }
)


def cluster_part(path: str) -> int:
    return 2 if Path(path).name in CLUSTER_PART_2 else 1


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """The test command runs three xdist workers (pyproject.toml's addopts): the tests that need
    the dev cluster are two units of work (:func:`cluster_part`), each run in order on one worker
    against that worker's own dev cluster (mostly waiting on Slurm's time limits), while the third
    runs unit/ and distributed/ module by module. Units start in collection order, so the two
    cluster units start at once.
    (xdist's own ``--dist loadgroup`` marks groups by rewriting node ids, which pytest 9.2 no
    longer lets it do: pytest-xdist issue #1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if any(f"tests/{kind}/" in path for kind in NEEDS_SLURM):
                return f"the dev cluster's tests, part {cluster_part(path)}"
            return path

    config.option.loadscopereorder = False  # collection order, not the largest unit first
    return SlurmTestsTogether(config, log)


# Seconds each xdist worker spent in tests (setup, call, teardown), summed on the controller:
# the suite's wall time is its busiest worker's, so CI prints where the time went.
_BUSY: dict[str, list[float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    if worker is not None:
        seconds, tests = _BUSY.get(worker, [0.0, 0])
        _BUSY[worker] = [seconds + report.duration, tests + (report.when == "call")]


def pytest_terminal_summary(terminalreporter) -> None:
    if _BUSY:
        parts = ", ".join(f"{w} {s:.0f} s ({int(n)} tests)" for w, (s, n) in sorted(_BUSY.items()))
        terminalreporter.write_line(f"time in tests per worker: {parts}")


def kind_of(item: pytest.Item) -> str:
    """The folder under tests/ that ``item`` lives in (KINDS)."""
    return Path(item.fspath).resolve().relative_to(Path(__file__).resolve().parent).parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        kind = kind_of(item)
        if kind not in KINDS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(KINDS)}}}/")
        if kind in NEEDS_SLURM:
            item.add_marker(pytest.mark.slurm)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current templates")


@pytest.fixture(scope="session")
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing in the test suite may reach a model or dataset hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def _own_state_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    # `jobgen watchdog install` notes its homes in the user's state directory: the tests'
    # homes go to one of their own, not the person's running them.
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))


@pytest.fixture(autouse=True)
def _shared_data_cache(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory) -> None:
    """The runs the distributed, cluster and soak tests write share one tokenized-data cache
    per worker (helpers.shared_cache): each test's first start no longer tokenizes the example
    data again. The unit tests of the cache keep one under each runs root."""
    if kind_of(request.node) != "unit":
        monkeypatch.setenv(SHARED_DATA_CACHE_ENV, str(tmp_path_factory.getbasetemp() / "data-cache"))


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs():
    """A failed scenario must not leave its job training: the next one needs the nodes
    (the jobs of the runs helpers.train_spec wrote during the test)."""
    yield
    cancel_submitted()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`jobgen make-tiny-model` once per session: random tiny Llama + local tokenizer."""
    pytest.importorskip("transformers")
    from jobgen.cli.tinymodel import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory):
    """``family_models(name)``: the tiny random model of a family of tests/model_families.py,
    made once per session."""
    pytest.importorskip("transformers")
    from model_families import make_family_model

    made: dict[str, Path] = {}

    def model(family: str) -> Path:
        if family not in made:
            made[family] = make_family_model(tmp_path_factory.mktemp(family), family)
        return made[family]

    return model


@pytest.fixture(scope="session")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 4 decoder blocks: a pipeline of 2 ranks can hold 2 stages each."""
    pytest.importorskip("transformers")
    from jobgen.cli.tinymodel import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("deep") / "model", layers=4)


# The dev cluster's fake GPUs, node by node (`jobgen cluster up --gpus 3,1,2`): unequal machines
# for the GPU-site tests (tests/cluster/test_slurm_gpus.py); CPU sites ask for none.
CLUSTER_GPUS = [3, 1, 2]


@pytest.fixture(scope="session")
def cluster():
    """The dev cluster in --netns mode with 3 nodes, one per pytest worker: the first worker's
    in the default state dir (reused if one is already up), another worker's in a state dir of
    its own, reached through SLURM_CONF (jobgen.devcluster.instances). Its node names are
    ``cluster.nodes`` (node1..3 for the first; node101..103 for the second), with 3, 1 and 2
    fake GPUs."""
    if shutil.which("slurmctld") is None and os.geteuid() != 0:
        pytest.skip("the dev cluster needs root to install and start Slurm")
    from jobgen import devcluster

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    slurm = slurm_series_under_test()
    own = "" if slurm == devcluster.SYSTEM_SERIES else f"-slurm{slurm}"  # never the other series' cluster
    state_dir = None if worker == "gw0" and not own else f"{devcluster.DEFAULT_STATE_DIR}-{worker}{own}"
    info = devcluster.status(state_dir)
    started = False
    gpus = [info.gpus.get(n, 0) for n in info.nodes] if info is not None else None
    shape = info is not None and info.netns and len(info.nodes) == 3 and info.cpus_per_node >= 4
    if info is not None and not (shape and gpus == CLUSTER_GPUS and info.slurm == slurm):
        # e.g. the 2-node cluster examples/quickstart.sh leaves running: replace it with the
        # shape these tests are written for.
        devcluster.down(state_dir)
        info = None
    if info is None:
        info = devcluster.up(nodes=3, cpus_per_node=4, netns=True, state_dir=state_dir, gpus=CLUSTER_GPUS, slurm=slurm)
        started = True
    if info.slurm_prefix:  # the clients of its own release: another's cannot reach its controller
        os.environ["PATH"] = os.pathsep.join([f"{info.slurm_prefix}/bin", os.environ["PATH"]])
    # This process and everything it starts (jobgen, sbatch, the jobs) talk to this cluster.
    os.environ["SLURM_CONF"] = info.slurm_conf
    os.environ[devcluster.STATE_DIR_ENV] = info.state_dir
    # tests/paced/sitecustomize.py paces the steps of the runs that train until something stops
    # them (helpers.PACED_STEP_SECONDS in their run.toml's [env]): the jobs get its folder on
    # PYTHONPATH (sbatch exports it; the batch script puts jobgen's checkout in front of it).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACED), os.environ.get("PYTHONPATH")]))
    yield info
    if started and not os.environ.get("JOBGEN_KEEP_CLUSTER"):
        devcluster.down(info.state_dir)


@pytest.fixture()
def cluster_run(cluster, tmp_path: Path, tiny_model: Path):
    """The set-up of a training run on the dev cluster, for the scenarios that submit one:
    ``spec, run = cluster_run("name", nodes=2, array=3, save_every_steps=5)`` writes the spec
    (helpers.train_spec's keywords: it trains until stopped unless max_steps says otherwise)
    under the test's directory and names its run directory; the run's jobs are cancelled
    after the test."""

    def make(name: str, *, runs_root: Path | None = None, **keys: object) -> ClusterRun:
        root = runs_root or tmp_path / "runs"
        return ClusterRun(train_spec(tmp_path, tiny_model, name, runs_root=root, **keys), root / name)

    return make
