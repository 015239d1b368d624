"""HSDP (``train.parallelism = "hsdp"``): FSDP2 on a 2-D mesh ``(replicate, shard)``. Four gloo
processes on this machine with ``shard_size = 2`` make a 2 x 2 mesh: two copies of the model,
each sharded over two ranks, as two nodes of two GPUs would.

- It trains as FSDP does on the same run (losses and gradient norms equal within float
  tolerance: only the order of the sums differs).
- A stop by the kill switch and a resume give exactly the losses of an uninterrupted run.
- Sharded loading fills each rank's shards with ``from_pretrained``'s weights.
- The grad norm that OptimizerInBackward sums in its hooks, and global clipping's norm, equal
  FSDP's: the replicas hold the same shards, so the sum runs over the shard dimension only.
- ``jobgen export`` of its checkpoint loads and equals the FSDP run's export.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import (
    DATA,
    REPO,
    TRAINER_SETTINGS,
    VENV_BIN,
    checkpoint_tensors,
    checkpoints,
    losses,
    read_jsonl,
    run_spec,
    stopped_by_kill_switch,
    summary,
    torchrun,
    torchrun_many,
)
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch

PROCS = 4
STEPS = 10


def make_run(directory: Path, tiny_model: Path, parallelism: str, **train: object) -> Path:
    """A run directory of 4 processes on one node (the trainer's settings of tests/helpers,
    float32 weights so that exports compare at full precision)."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    spec_file = run_spec(
        directory,
        parallelism,
        site={"profile": "local", "slurm": {"cpus_per_node": PROCS}},
        filename=f"{parallelism}.toml",
        job={"time": "1h", "runs_root": "runs", "procs_per_node": PROCS},
        model={"path": tiny_model, "dtype": "float32"},
        data={"path": DATA, "max_length": 256},
        train={**TRAINER_SETTINGS, "max_steps": STEPS, "parallelism": parallelism, **train},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path


def hsdp_run(directory: Path, tiny_model: Path) -> Path:
    return make_run(directory, tiny_model, "hsdp", shard_size=2)


def trained(run: Path) -> subprocess.CompletedProcess[str]:
    proc = torchrun(run, nproc=PROCS, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model) -> tuple[Path, Path, str]:
    """An uninterrupted HSDP run, the same run under FSDP (sharded over all 4 ranks), and their
    output: one torchrun trains both (tests/run_many.py)."""
    runs = (
        hsdp_run(tmp_path_factory.mktemp("hsdp"), tiny_model),
        make_run(tmp_path_factory.mktemp("fsdp"), tiny_model, "fsdp"),
    )
    proc = torchrun_many(list(runs), nproc=PROCS, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return *runs, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def hsdp(uninterrupted) -> tuple[Path, str]:
    """The uninterrupted HSDP run and the output."""
    return uninterrupted[0], uninterrupted[2]


@pytest.fixture(scope="module")
def fsdp(uninterrupted) -> Path:
    return uninterrupted[1]


def test_hsdp_trains_like_fsdp(hsdp, fsdp):
    run, out = hsdp
    assert "hsdp: 2 replica(s) of the model, each sharded over 2 rank(s)" in out, out[-3000:]
    info = summary(run)
    assert info["exit_code"] == 0 and info["world_size"] == PROCS and info["end_step"] == STEPS
    assert info["parallelism"] == "hsdp"
    curve, reference = losses(run), losses(fsdp)
    assert sorted(curve) == list(range(1, STEPS + 1))
    for step in curve:
        assert curve[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-5), (step, curve, reference)
    assert sum(curve[s] for s in (8, 9, 10)) < 0.9 * sum(curve[s] for s in (1, 2, 3)), curve
    norms = {r["step"]: r["grad_norm"] for r in read_jsonl(run / "metrics.jsonl")}
    expected = {r["step"]: r["grad_norm"] for r in read_jsonl(fsdp / "metrics.jsonl")}
    for step in norms:  # global clipping's norm: summed over the shard dimension, not the world
        assert norms[step] == pytest.approx(expected[step], rel=1e-3), (step, norms, expected)


def test_hsdp_resume_after_kill_switch_is_exact(tmp_path, tiny_model, hsdp):
    expected = losses(hsdp[0])
    run = hsdp_run(tmp_path, tiny_model)
    stopped, out = stopped_by_kill_switch(run, 2, nproc=PROCS)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and 2 <= k < STEPS, out[-3000:]
    assert checkpoints(run) == [f"step-{k:08d}"]

    trained(run)
    resumed = losses(run)
    assert summary(run)["start_step"] == k
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], abs=1e-5), (step, resumed[step], expected[step])


def test_hsdp_export_loads_and_equals_the_fsdp_export(tmp_path, hsdp, fsdp):
    import torch
    from transformers import AutoModelForCausalLM

    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints.export import export

    exported = {}
    for name, run in (("hsdp", hsdp[0]), ("fsdp", fsdp)):
        source = export(RunDir(run).load_spec(), run, tmp_path / name, report=lambda line: None)
        assert source.name == f"step-{STEPS:08d}"
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert model.dtype == torch.float32
        exported[name] = model.state_dict()
        checkpoint = checkpoint_tensors(source)
        assert set(checkpoint) <= set(exported[name])
        for key, tensor in checkpoint.items():  # one copy of every tensor, however many replicas wrote it
            assert torch.equal(exported[name][key], tensor), (name, key)
    assert set(exported["hsdp"]) == set(exported["fsdp"])
    for key, tensor in exported["hsdp"].items():
        torch.testing.assert_close(tensor, exported["fsdp"][key], rtol=1e-4, atol=1e-5, msg=key)


# ---------------------------------------------------------------- one process group, 4 ranks

CHECK = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from jobgen.spec.tables.run import TrainSpec
    from jobgen.spec.tables.model import ModelSpec
    from trainer.distributed import exit_now, init_distributed
    from trainer.model.build import trainable_parameters
    from trainer.parallel.build import build_model
    from trainer.optim import build_optimizer
    from trainer.parallel.strategies import strategy

    path, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    env = init_distributed(120, None)
    spec = ModelSpec(path=path, dtype="float32")
    report = {}

    def full(tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    if mode == "load":
        model = build_model(spec, TrainSpec(parallelism="hsdp", shard_size=2), env)
        weight = model.get_input_embeddings().weight
        report["mesh"] = [list(weight.device_mesh.shape), list(weight.device_mesh.mesh_dim_names)]
        report["placements"] = [type(p).__name__ for p in weight.placements]
        report["rows"] = [weight.shape[0], weight.to_local().shape[0]]
        from transformers import AutoModelForCausalLM
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref.config.use_cache = False
        expected = {**ref.state_dict(), **dict(ref.named_buffers())}
        report["mismatched"] = [
            name for name, t in [*model.state_dict().items(), *model.named_buffers()]
            if not torch.equal(full(t), expected[name])
        ]
        tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = model(input_ids=tokens).logits - ref(input_ids=tokens).logits
        report["logits_max_diff"] = float(diff.abs().max())
    else:  # the gradient norms of one backward on each rank's own batch
        tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(env.rank))
        for name, keys in (("fsdp", {}), ("hsdp", {"shard_size": 2})):
            lean = TrainSpec(parallelism=name, optimizer_in_backward=True, grad_clip=0.0, **keys)
            model = build_model(spec, lean, env)
            params = trainable_parameters(model)
            optimizer = build_optimizer(params, lean, strategy(name).norm_group(params))
            model(input_ids=tokens, labels=tokens).loss.backward()
            report[f"{name}_in_backward"] = optimizer.grad_norm()
            model = build_model(spec, TrainSpec(parallelism=name, **keys), env)
            model(input_ids=tokens, labels=tokens).loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), 1e-3)
            report[f"{name}_clip"] = float(full(norm))
            report[f"{name}_clipped"] = float(full(torch.nn.utils.get_total_norm(
                [p.grad for p in trainable_parameters(model)])))
    json.dump(report, open(f"{out}.{env.rank}", "w"))
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization for gloo's threads to abort in
    """
)


def run_check(tmp_path: Path, model: Path, mode: str) -> list[dict]:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={PROCS}", str(script), str(model), mode]
    proc = subprocess.run([*cmd, str(out)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(PROCS)]


# In the full suite: every HSDP run here loads through the same sharded load (build_sharded).
@pytest.mark.full
def test_hsdp_sharded_load_equals_from_pretrained(tmp_path, tiny_model):
    for rank, report in enumerate(run_check(tmp_path, tiny_model, "load")):
        assert report["mismatched"] == [] and report["logits_max_diff"] == 0.0, report
        assert report["mesh"] == [[2, 2], ["replicate", "shard"]], report
        assert report["placements"] == ["Replicate", "Shard"], report
        rows, local = report["rows"]
        assert local == -(-rows // 2), (rank, report)  # half the vocabulary: sharded over 2 ranks, not 4


def test_hsdp_gradient_norms_equal_fsdp(tmp_path, tiny_model):
    reports = run_check(tmp_path, tiny_model, "norms")
    for report in reports:
        fsdp = report["fsdp_clip"]
        assert fsdp > 0
        # Optimizer in backward: summed in the hooks, then over the shard group (over the
        # world, each shard would count twice: sqrt(2) x the norm).
        assert report["fsdp_in_backward"] == pytest.approx(fsdp, rel=1e-5), report
        assert report["hsdp_in_backward"] == pytest.approx(fsdp, rel=1e-5), report
        # Global clipping: the norm before clipping, and the gradients clipped to max_norm.
        assert report["hsdp_clip"] == pytest.approx(fsdp, rel=1e-5), report
        assert report["hsdp_clipped"] == pytest.approx(1e-3, rel=1e-3), report
    assert len({r["hsdp_in_backward"] for r in reports}) == 1  # the same figure on every rank
