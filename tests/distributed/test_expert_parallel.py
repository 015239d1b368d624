"""Expert parallelism (issue 50, ``train.expert_parallel``): each MoE layer's experts split over
2 ranks, FSDP over the 2 ranks holding the same experts, on 4 gloo processes; the tokens go to
their experts' ranks and back by all-to-all (trainer/parallel/expert_parallel.py).

- Mixtral, DeepSeek-V3 (shared experts, a dense first layer, MLA) and gpt-oss (expert biases,
  its own gating) train with the losses of one process training the same global batch, and so
  does Mixtral with each row split over 2 ranks too (seed 004's cp 2 x ep 2 on 4 ranks);
- a run stopped under ep 2 resumes under ep 1 (the same 4 ranks), and back under ep 2, and logs
  the uninterrupted run's losses: the checkpoint holds every expert whole;
- validate refuses what cannot be split, naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import REPO, local_run, losses, read_jsonl, stopped_by_kill_switch, summary, torchrun, torchrun_many
from jobgen.spec.loader import SpecError
from model_families import make_family_model

pytestmark = pytest.mark.torch

PROCS = 4
STEPS = 6
FAMILIES = ("mixtral", "deepseek-v3", "gpt-oss")
BATCH = {"max_steps": STEPS, "micro_batch_size": 2, "global_batch_size": 8, "warmup_steps": 1, "save_every_steps": 3}


def make_run(directory: Path, model: Path, name: str, procs: int, **train: object) -> Path:
    """A run of ``procs`` processes on one node, float32 weights."""
    return local_run(directory, model, procs, name, data={"max_length": 256}, **{**BATCH, **train})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (its ep 2 x fsdp 2 run, its 1-process reference), trained."""
    root = tmp_path_factory.mktemp("ep")
    runs = {}
    for family in FAMILIES:
        model = make_family_model(root / "models" / family, family)
        split = make_run(root / family / "ep", model, f"{family}-ep", PROCS, parallelism="fsdp", expert_parallel=2)
        one = make_run(root / family / "one", model, f"{family}-one", 1, parallelism="ddp")
        runs[family] = (split, one)
    # seed 004's cp x ep: each row split over 2 ranks, each layer's experts over 2, 2 data replicas.
    mixtral = runs["mixtral"][1]
    model = Path(json.loads((mixtral / "spec.json").read_text())["run"]["model"]["path"])
    split_rows = make_run(
        root / "cp-ep", model, "cp-ep", PROCS, parallelism="fsdp", expert_parallel=2, context_parallel=2
    )
    runs["mixtral-cp2"] = (split_rows, mixtral)
    # The router's auxiliary loss, as Mixtral's config asks for it: under ep 2 and under FSDP alone.
    aux_model = _with_router_aux(model, root / "mixtral-aux")
    for name, ep in (("aux-ep", 2), ("aux-fsdp", 1)):
        runs[name] = (make_run(root / name, aux_model, name, PROCS, parallelism="fsdp", expert_parallel=ep), mixtral)
    for nproc, index in ((PROCS, 0), (1, 1)):
        proc = torchrun_many(list(dict.fromkeys(pair[index] for pair in runs.values())), nproc=nproc)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return runs


def _with_router_aux(model: Path, target: Path) -> Path:
    """``model`` with its config asking for the router's load-balancing loss."""
    import shutil

    shutil.copytree(model, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(
        json.dumps({**config, "output_router_logits": True, "router_aux_loss_coef": 0.5})
    )
    return target


def test_the_routers_auxiliary_loss_is_the_models_own_and_expert_parallel_keeps_it(trained):
    """The trainer's micro-batch loss is what MixtralForCausalLM returns with labels (mean
    cross-entropy + router_aux_loss_coef x aux_loss); expert parallelism leaves the routers on
    every rank's own tokens, so ep 2 logs FSDP's losses; and the term is there (the losses
    differ from the same model without it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jobgen.spec.tables.train import TrainSpec
    from trainer.distributed import DistEnv
    from trainer.parallel.step_parts import StepParts
    from trainer.parallel.step_runner import forward_loss_sum

    split, whole = trained["aux-ep"][0], trained["aux-fsdp"][0]
    with_aux, without = losses(whole), losses(trained["mixtral"][0])
    for step, loss in with_aux.items():
        assert losses(split)[step] == pytest.approx(loss, rel=1e-5), step
    assert all(abs(with_aux[s] - without[s]) > 1e-4 for s in with_aux), (with_aux, without)

    model_dir = Path(json.loads((whole / "spec.json").read_text())["run"]["model"]["path"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt, not scored
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    parts = StepParts(model, env, TrainSpec(max_steps=1), 0, None, None, None)
    with torch.no_grad():
        ours = forward_loss_sum(parts, {"input_ids": ids}, labels) / (labels[:, 1:] != -100).sum()
        theirs = model(input_ids=ids, labels=labels)
    assert theirs.aux_loss is not None and float(theirs.aux_loss) > 0
    assert float(ours) == pytest.approx(float(theirs.loss), rel=1e-6)


@pytest.mark.parametrize("family", [*FAMILIES, "mixtral-cp2"])
def test_expert_parallel_2_by_fsdp_2_trains_as_one_process_does(trained, family: str):
    split, one = trained[family]
    assert summary(split)["end_step"] == STEPS
    expected, got = losses(one), losses(split)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), (step, got, expected)
    # Each step's line says the routed load: the busiest rank's rows against the mean (dropless).
    lines = [r for r in read_jsonl(split / "metrics.jsonl") if "loss" in r]
    assert all(r["expert_rows_max"] >= r["expert_rows_mean"] > 0 for r in lines), lines
    assert all(r["expert_load_imbalance"] >= 1.0 for r in lines), lines
    assert not any("expert_rows_max" in r for r in read_jsonl(one / "metrics.jsonl"))


def _set_expert_parallel(run: Path, degree: int) -> None:
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["train"]["expert_parallel"] = degree
    (run / "spec.json").write_text(json.dumps(spec))


def test_a_run_moves_from_ep_2_to_ep_1_and_back_with_the_same_losses(trained, tmp_path: Path):
    """Stopped by the kill switch under ep 2, resumed under ep 1 and stopped again, finished
    under ep 2: each resume from the checkpoint the other degree wrote, every loss the
    uninterrupted 1-process run's. Steps paced (tests/paced), so that a stop lands mid-run."""
    _, one = trained["mixtral"]
    model = Path(json.loads((one / "spec.json").read_text())["run"]["model"]["path"])
    run = make_run(tmp_path, model, "resume", PROCS, parallelism="fsdp", expert_parallel=2)
    paced = {"PYTHONPATH": f"{REPO / 'tests' / 'paced'}:{REPO}", "PACED_STEP_SECONDS": "0.5"}
    first, out = stopped_by_kill_switch(run, 1, nproc=PROCS, env=paced)
    assert first["end_step"] < STEPS - 1, out[-3000:]
    _set_expert_parallel(run, 1)
    second, out = stopped_by_kill_switch(run, first["end_step"] + 1, nproc=PROCS, env=paced)
    assert first["end_step"] < second["end_step"] < STEPS and second["start_step"] == first["end_step"], out[-3000:]
    _set_expert_parallel(run, 2)
    proc = torchrun(run, nproc=PROCS, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    last = summary(run)
    assert last["end_step"] == STEPS and last["start_step"] == second["end_step"], (first, second, last)
    expected, got = losses(one), losses(run)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), (step, got, expected)
    _exports_the_hub_layout(run, model, tmp_path / "exported")


def _exports_the_hub_layout(run: Path, model: Path, target: Path) -> None:
    """The checkpoint an expert-parallel run wrote exports as every other does: the base model's
    files' names (per-expert tensors), loading equal to the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import checkpoint_tensors
    from jobgen.model.files import read_model
    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints.export import export

    source = export(RunDir(run).load_spec(), run, target, report=lambda line: None).name
    names = {tensor.name for tensor in read_model(target).tensors}
    assert names == {tensor.name for tensor in read_model(model).tensors}
    loaded = AutoModelForCausalLM.from_pretrained(target).state_dict()
    for name, tensor in checkpoint_tensors(run / "checkpoints" / source).items():
        assert torch.equal(loaded[name], tensor), name


def test_validate_refuses_an_expert_split_the_model_or_the_world_cannot_take(trained, tmp_path: Path):
    _, one = trained["mixtral"]
    mixtral = Path(json.loads((one / "spec.json").read_text())["run"]["model"]["path"])  # 4 experts a layer
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "three", mixtral, "three", 3, parallelism="fsdp", expert_parallel=3, global_batch_size=6)
    assert refused.value.issues[0].key == "train.expert_parallel"
    assert "3 does not divide the 4 experts of each of the model's MoE layers" in refused.value.issues[0].message
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "world", mixtral, "world", 3, parallelism="fsdp", expert_parallel=2, global_batch_size=6)
    assert "must divide the world size 3" in str(refused.value)
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "ddp", mixtral, "ddp", PROCS, parallelism="ddp", expert_parallel=2)
    assert "needs train.parallelism = 'fsdp'" in str(refused.value)
    llama = make_family_model(tmp_path / "llama", "llama")
    with pytest.raises(SpecError) as refused:
        make_run(tmp_path / "dense", llama, "dense", PROCS, parallelism="fsdp", expert_parallel=2)
    assert "has no routed experts to place on ranks" in str(refused.value)
