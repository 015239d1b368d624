"""``train.cpu_offload`` is for GPUs. The loader refuses it for a site without GPUs; the
trainer has its own guard for a process that trains on the CPU anyway: a typed error (a
ModelError, so the run stops with a reason instead of retrying) that says what to change,
raised before anything is loaded. The offload itself needs a GPU: bench/gpu_offload_check.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from jobgen.spec.tables.model import ModelSpec  # noqa: E402
from jobgen.spec.tables.run import TrainSpec  # noqa: E402
from trainer.distributed import DistEnv  # noqa: E402
from trainer.model.errors import ModelError  # noqa: E402

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize("parallelism", ["fsdp", "hsdp"])
def test_the_trainer_refuses_cpu_offload_on_a_cpu_device_before_loading(tmp_path, parallelism):
    from trainer.parallel.build import build_model
    from trainer.parallel.strategies import CpuOffloadUnavailable

    train = TrainSpec(parallelism=parallelism, cpu_offload=True)
    # No model at this path: the refusal comes before anything is read.
    with pytest.raises(CpuOffloadUnavailable) as caught:
        build_model(ModelSpec(path=str(tmp_path / "absent")), train, CPU)
    message = str(caught.value)
    assert "train.cpu_offload = true needs a GPU" in message
    assert "this process trains on the cpu" in message
    assert "set train.cpu_offload = false or run on a GPU site" in message
    assert isinstance(caught.value, ModelError)  # __main__ turns it into an exit that stops the run


def test_without_offload_the_shards_live_on_the_device_and_with_it_on_the_host():
    from trainer.parallel.strategies import strategy

    gpu = DistEnv(0, 1, 0, torch.device("cuda", 0), "cpu:gloo,cuda:nccl")
    assert strategy("fsdp").param_device(TrainSpec(parallelism="fsdp"), gpu) == gpu.device
    offload = TrainSpec(parallelism="hsdp", cpu_offload=True)
    assert strategy("hsdp").param_device(offload, gpu) == torch.device("cpu")
    strategy("hsdp").check(offload, gpu)  # accepted where there is a GPU


def test_the_trainer_table_has_an_entry_for_every_parallelism_jobgen_knows():
    from jobgen.model.parallelism import STRATEGIES as PLANS
    from trainer.parallel.strategies import STRATEGIES

    assert STRATEGIES.keys() == PLANS.keys()
    assert [s.loads_sharded for s in STRATEGIES.values()] == [p.shards_parameters for p in PLANS.values()]


@pytest.mark.parametrize(
    ("world", "local", "shard_size", "shape"),
    [(4, 2, None, (2, 2)), (4, 4, 2, (2, 2)), (8, 8, None, (1, 8)), (2, 1, None, (2, 1))],
)
def test_hsdp_shape_comes_from_the_world_torchrun_formed(world, local, shard_size, shape):
    from trainer.parallel.strategies import hsdp_shape

    env = DistEnv(0, world, 0, torch.device("cpu"), "gloo", local_world_size=local)
    assert hsdp_shape(env, shard_size) == shape


def test_hsdp_refuses_a_shard_size_that_does_not_divide_this_world():
    from trainer.parallel.strategies import ParallelismError, strategy

    env = DistEnv(0, 6, 0, torch.device("cpu"), "gloo", local_world_size=6)
    with pytest.raises(ParallelismError, match=r"groups of 4 ranks.*must divide the world size 6"):
        strategy("hsdp").check(TrainSpec(parallelism="hsdp", shard_size=4), env)


def test_the_trainer_refuses_offload_before_it_reads_the_tokenizer_or_the_data(tmp_path, tiny_model, monkeypatch):
    # A GPU site's spec (validate accepts the offload there) in a process that trains on the CPU.
    import trainer.data.batches as batches
    import trainer.loop as loop
    from helpers import DATA, run_spec
    from jobgen.spec.loader import load_run
    from trainer.parallel.strategies import CpuOffloadUnavailable

    spec_file = run_spec(
        tmp_path,
        "offload",
        site="h100-ib",
        job={"nodes": 1, "procs_per_node": 8, "time": "1h", "runs_root": str(tmp_path / "runs")},
        model={"path": tiny_model},
        data={"path": DATA},
        train={"parallelism": "fsdp", "cpu_offload": True},
    )

    def read_too_early(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer or the data was read before the parallelism was checked")

    monkeypatch.setattr(batches, "load_tokenizer", read_too_early)
    monkeypatch.setattr(batches, "DataPipeline", read_too_early)
    with pytest.raises(CpuOffloadUnavailable):
        loop.Trainer(load_run(spec_file), tmp_path, CPU, monitor=None)
