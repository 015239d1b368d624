"""The parallelism table (jobgen/model/parallelism.py) read alike by the spec, the plan and the
trainer (issue 31): the settings a parallelism refuses listed once and refused by both the
spec and ``jobgen plan``, whose suggestions the spec then loads; the mesh
(jobgen/model/mesh.py) as the one layout the spec, the plan and the trainer read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import torch

from fake_models import fake_model
from helpers import DATA, run_spec
from jobgen.model.mesh import Mesh, mesh_of
from jobgen.model.parallelism import STRATEGIES, Refusal
from jobgen.plan.inputs import PipelineInputs, PlanInputs
from jobgen.plan.memory_plan import plan_run
from jobgen.spec.loader import SpecError, load_run
from jobgen.spec.tables.run import RunSpec
from jobgen.spec.tables.train import TrainSpec
from trainer.distributed import DistEnv
from trainer.parallel.strategies import STRATEGIES as TRAINER_STRATEGIES
from trainer.parallel.strategies import hsdp_shape

# A setting turned on in run.toml for each key the table may name (SEVERAL_PROCESSES: job.nodes = 2).
TURN_ON = {
    "train.cpu_offload": {"train": {"cpu_offload": True}},
    "train.optimizer_in_backward": {"train": {"optimizer_in_backward": True, "grad_clip": 0}},
    "train.loss_chunk_tokens": {"train": {"loss_chunk_tokens": 64}},
    "train.grad_clip_mode = 'per_parameter'": {"train": {"grad_clip_mode": "per_parameter"}},
    "[eval]": {"eval": {"path": "/e"}},
    "model.lora": {"model": {"lora": {}}},
    "model.activation_offloading": {"model": {"activation_offloading": True, "gradient_checkpointing": True}},
    "more than one process": {"job": {"nodes": 2}},
}


def _run(parallelism: str, *switches: str) -> dict:
    run = {
        "job": {"name": "x", "time": "1h", "procs_per_node": 1},
        "model": {"path": "/m"},
        "data": {"path": "/d"},
        "train": {"parallelism": parallelism},
    }
    for key in switches:
        for table, keys in TURN_ON[key].items():
            run[table] = {**run.get(table, {}), **keys}
    return run


@pytest.mark.parametrize(("name", "refusal"), [(name, r) for name, entry in STRATEGIES.items() for r in entry.refuses])
def test_the_spec_refuses_what_the_entry_lists_and_nothing_else(name: str, refusal: Refusal):
    """Each refusal of the table is the spec's, in the table's words; its settings one short are fine."""
    with pytest.raises(ValueError) as refused:
        RunSpec.model_validate(_run(name, *refusal.keys))
    assert refusal.text(nodes=2, procs_per_node="1") in str(refused.value)
    for left_out in refusal.keys:
        RunSpec.model_validate(_run(name, *(k for k in refusal.keys if k != left_out)))


@pytest.mark.parametrize("key", sorted(TURN_ON))
def test_the_plan_refuses_what_the_spec_refuses(key: str):
    """The plan's inputs name the same settings as the spec (jobgen plan never suggests a
    pipeline that the spec refuses: 19cea76 fixed one such drift by hand)."""
    run = RunSpec.model_validate(_run("fsdp", key))
    inputs = PlanInputs(
        parallelism="fsdp",
        world_size=2 if key == "more than one process" else 1,
        cpu_offload=run.train.cpu_offload,
        optimizer_in_backward=run.train.optimizer_in_backward,
        loss_chunk_tokens=run.train.loss_chunk_tokens,
        per_parameter_clip=run.train.grad_clip_mode == "per_parameter",
        lora_r=run.model.lora.r if run.model.lora else None,
        activation_offloading=run.model.activation_offloading,
    )
    held = frozenset({"[eval]"}) if run.eval else frozenset()
    assert inputs.turned_on() | held == run.turned_on() - ({"more than one process"} - inputs.turned_on())


def test_every_trainer_strategy_is_jobgen_s_entry():
    assert TRAINER_STRATEGIES.keys() == STRATEGIES.keys()
    assert all(TRAINER_STRATEGIES[name].plan is STRATEGIES[name] for name in STRATEGIES)


# --------------------------------------------------------------------------- the mesh


def test_the_mesh_of_each_parallelism():
    assert mesh_of("ddp", 8, 4) == Mesh(replicate=8)
    assert mesh_of("fsdp", 8, 4) == Mesh(shard=8)
    assert mesh_of("hsdp", 8, 4) == Mesh(replicate=2, shard=4)
    assert mesh_of("hsdp", 8, [4, 2, 2], shard_size=2) == Mesh(replicate=4, shard=2)
    assert mesh_of("fsdp", 8, 4, context_parallel=2) == Mesh(shard=8, cp=2)
    assert mesh_of("pipeline", 8, 4, pipeline_size=2, data_parallel="fsdp") == Mesh(pp=2, shard=4)
    assert mesh_of("pipeline", 8, 4, pipeline_size=2, data_parallel="ddp") == Mesh(pp=2, replicate=4)
    assert mesh_of("pipeline", 4, 4, data_parallel="fsdp") == Mesh(pp=4)  # one pipeline over the world


def test_the_mesh_numbers_ranks_as_the_trainer_groups_them():
    """Rows: a context group's consecutive ranks read one row, a pipeline's positions too;
    positions outermost; hsdp's (replicate, shard) the trainer's device mesh."""
    cp = mesh_of("ddp", 8, 8, context_parallel=4)
    assert [cp.data_shard(r) for r in range(8)] == [(0, 2)] * 4 + [(1, 2)] * 4
    assert cp.ranks_per_replica == 4 and cp.world == 8
    pipe = mesh_of("pipeline", 8, 4, pipeline_size=2, data_parallel="fsdp")
    assert [pipe.position(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert [pipe.data_shard(r)[0] for r in range(8)] == [0, 1, 2, 3] * 2 and pipe.data_replicas == 4
    env = DistEnv(0, 8, 0, torch.device("cpu"), "gloo", local_world_size=4)
    assert hsdp_shape(env, None) == (2, 4) and hsdp_shape(env, 2) == (4, 2)


@pytest.mark.parametrize(
    "train",
    [
        {"parallelism": "ddp", "context_parallel": 2},
        {"parallelism": "hsdp", "context_parallel": 4},
        {"parallelism": "pipeline", "pipeline": {"size": 2}},
        {"parallelism": "pipeline", "pipeline": {"size": 4, "data_parallel": "ddp"}},
    ],
)
def test_the_spec_s_degrees_are_the_mesh_s(train: dict):
    spec = TrainSpec.model_validate({"micro_batch_size": 4, **train})
    mesh = spec.mesh(8, 2)
    assert mesh.world == 8
    assert spec.ranks_per_replica(8) == mesh.ranks_per_replica
    assert spec.data_parallel_size(8) == mesh.data_replicas
    assert spec.gradient_ranks(8) == mesh.dp


def test_the_plan_lays_out_a_pipeline_by_the_mesh():
    inputs = PlanInputs(parallelism="pipeline", world_size=8, pipeline=PipelineInputs(size=2, data_parallel="ddp"))
    assert inputs.mesh == Mesh(pp=2, replicate=4) and inputs.shard == 1
    assert PlanInputs(parallelism="hsdp", world_size=8, nodes=2).shard == 4


# --------------------------------------------------------------------------- what jobgen plan suggests


def _apply(run: dict, change: str) -> dict:
    """run.toml's tables with one suggestion applied: ``key = value`` pairs, "(without X)"
    removing X, combined suggestions joined by "; "."""
    for pair in re.split(r", |; ", change):
        pair, _, without = pair.partition(" (without ")
        if without:
            key = without.rstrip(")").strip("[]").split(".")
            run.get(key[0], {}).pop(key[-1], None)
        key, _, value = pair.partition(" = ")
        *tables, name = key.split(".")
        table = run
        for part in tables:
            table = table.setdefault(part, {})
        table[name] = tomllib.loads(f"v = {value}")["v"]
    return run


def _plan_and_tables(tmp_path: Path, name: str, job: dict, train: dict, memory: str):
    """The plan of the fake 374M model on the local site (Ethernet) with ``memory`` per rank:
    on GPUs ("4GiB on GPUs"), or on CPUs (a figure alone)."""
    model = fake_model(tmp_path / "model")
    tables = {
        "job": {"time": "1h", "runs_root": str(tmp_path / "runs"), **job},
        "model": {"path": str(model)},
        "data": {"path": DATA, "max_length": 512},
        "train": {"micro_batch_size": 2, **train},
    }
    memory, _, gpus = memory.partition(" on ")
    slurm = {"device_memory": memory, "cpus_per_node": 8, "gpus_per_node": 4 if gpus else 0}
    site = {"profile": "local", "slurm": slurm}
    plan = plan_run(load_run(run_spec(tmp_path / name, name, site=site, **tables)))
    return plan, site, tables


@pytest.mark.parametrize(
    ("job", "train", "memory"),
    [
        # A context-parallel run was offered a pipeline, which the spec refuses with it.
        ({"procs_per_node": 2}, {"parallelism": "ddp", "context_parallel": 2}, "4GiB"),
        ({"procs_per_node": 2, "nodes": 2}, {"parallelism": "ddp", "context_parallel": 2}, "4GiB on GPUs"),
        ({"procs_per_node": 2}, {"parallelism": "fsdp", "context_parallel": 2}, "4GiB"),
        # DDP on two processes was offered optimizer_in_backward, which it runs on one only.
        ({"procs_per_node": 2}, {"parallelism": "ddp", "micro_batch_size": 1, "grad_clip": 0}, "7900MiB"),
        # One process clipping by the global norm (the default), or with a global batch, was offered
        # optimizer_in_backward, which the spec refuses with either.
        ({"procs_per_node": 1}, {"parallelism": "ddp", "micro_batch_size": 1}, "7900MiB"),
        (
            {"procs_per_node": 1},
            {"parallelism": "ddp", "micro_batch_size": 1, "grad_clip": 0, "global_batch_size": 1},
            "7900MiB",
        ),
        ({"procs_per_node": 2, "nodes": 2}, {"parallelism": "hsdp"}, "4GiB on GPUs"),
        (
            {"procs_per_node": 4},
            {"parallelism": "pipeline", "pipeline": {"schedule": "gpipe", "size": 2}},
            "4GiB on GPUs",
        ),
    ],
)
def test_every_suggestion_is_a_spec_that_loads(tmp_path: Path, job: dict, train: dict, memory: str):
    plan, site, tables = _plan_and_tables(tmp_path, "run", job, train, memory)
    offered = [s.change for s in plan.suggestions + plan.network_suggestions]
    assert offered, plan.format()
    for index, change in enumerate(offered):
        changed = _apply({name: dict(keys) for name, keys in tables.items()}, change)
        try:
            load_run(run_spec(tmp_path / f"s{index}", "run", site=site, **changed))
        except SpecError as exc:
            pytest.fail(f"jobgen plan suggests {change!r}, which the spec refuses: {exc}")


def test_more_nodes_keep_a_context_parallel_run_s_batch(tmp_path: Path):
    """A context-parallel group reads one row: the global batch is micro-batch x grad_accum x
    world / context_parallel (it was counted over the world)."""
    job, train = {"procs_per_node": 2}, {"parallelism": "ddp", "context_parallel": 2, "grad_accum": 2}
    plan, _, _ = _plan_and_tables(tmp_path, "run", job, train, "4GiB")
    nodes = next(s for s in plan.suggestions if s.change.startswith("job.nodes"))
    assert "the same global batch (4)" in nodes.cost and "train.grad_accum = 1" in nodes.change
