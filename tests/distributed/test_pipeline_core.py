"""Pipeline parallelism's core (trainer/parallel/pipeline.py) on gloo processes of this machine, against
one unpipelined forward and backward of the same global batch:

- every schedule torch 2.13 ships, on 2 pipeline ranks and (a selection) on 4: the loss and
  every parameter's gradient equal the unpipelined model's within 1e-5, the loss normalised
  over the target tokens of the whole batch (rows with different numbers of -100 labels,
  so a mean of per-micro-batch means would differ); the global gradient norm and the
  clipped gradients equal ``clip_grad_norm_``'s; a second step with another sequence length
  is right too (the schedules fix their shapes at the first step);
- 2 stages x 2 data-parallel replicas with fsdp and with ddp (replicate): the same, and a
  checkpoint of model and optimizer saved with DCP, loaded into a fresh build, gives the
  same parameters after one more step, bit for bit; the checkpoint loads into an
  unpipelined model, every tensor equal;
- a model with tied embeddings, or not Llama-style, is refused with PipelineError.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, VENV_BIN

pytestmark = pytest.mark.torch

TOLERANCE = 1e-5
LAYERS = 8  # 4 ranks x 2 stages each for the V schedules

WORKER = textwrap.dedent(
    """
    import json, sys, time
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from jobgen.model.pipeline_split import SCHEDULES, stage_indices, stage_layers
    from trainer.distributed import exit_now, init_distributed
    from trainer.data.packing import IGNORE_INDEX, count_targets, token_loss_sum
    from trainer.parallel.pipeline import PipelineStep, build_stages, checkpoint_options, grad_norm_and_clip

    model_dir, out, dp, kind, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    names = sys.argv[6].split(",")
    env = init_distributed(120, None)
    pp = env.world_size // dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank, pp_group = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    ROWS, MAX_NORM = 8, 0.05  # rows per replica; a max norm the gradients exceed
    MICROBATCHES = 4 if pp == 2 else 8  # V schedules: at least 2 x pp

    def batch(rows, seq, seed):
        # Two documents packed per row (positions restart), uneven numbers of -100 per row.
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 128, (rows, seq), generator=g)
        pos = torch.arange(seq).repeat(rows, 1)
        labels = ids.clone()
        for r in range(rows):
            cut = int(torch.randint(2, seq - 2, (1,), generator=g))
            pos[r, cut:] = torch.arange(seq - cut)
            labels[r, cut] = IGNORE_INDEX
            labels[r, : r % (seq // 2)] = IGNORE_INDEX  # r targets fewer: uneven micro-batches
        return ids, pos, labels

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    REFERENCE = {}

    def reference(seq):
        # The unpipelined model on the whole global batch: loss, grads, norm, clipped grads.
        if seq not in REFERENCE:
            ids, pos, labels = batch(ROWS * dp, seq, seq)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            summed, count = token_loss_sum(model(input_ids=ids, position_ids=pos, use_cache=False).logits, labels)
            (summed / count).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
            REFERENCE[seq] = float(summed / count), grads, norm, clipped
        return REFERENCE[seq]

    def build(name):
        per = SCHEDULES[name].stages_per_rank or 2
        stages = per * pp
        mine = stage_indices(name, pp_rank, pp, stages)
        return build_stages(model_dir, None, env, stage_layers(8, stages), mine, torch.float32, pp_group,
                            mesh["dp"], kind)

    def run_step(step, seq):
        # One replica's share of the global batch; the loss over the whole global batch.
        ids, pos, labels = batch(ROWS * dp, seq, seq)
        share = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        targets = int(count_targets(labels))
        summed = step(ids[share], pos[share], labels[share], scale=dp / targets)
        total = summed.clone()
        dist.all_reduce(total)  # only the last stage's ranks hold a part
        return float(total) / targets

    def compare(module, step, seq):
        loss = run_step(step, seq)
        ref_loss, grads, ref_norm, clipped = reference(seq)
        got = {n: full(p.grad).clone() for n, p in module.named_parameters()}
        norm = grad_norm_and_clip(module, MAX_NORM, pp_group)
        return {
            "loss": abs(loss - ref_loss),
            "grad": max(float((g - grads[n]).abs().max()) for n, g in got.items()),
            "norm": abs(norm - ref_norm) / ref_norm,
            "clipped": max(float((full(p.grad) - clipped[n]).abs().max()) for n, p in module.named_parameters()),
            "params": sorted(got),
        }

    report = {}
    for name in names:
        started = time.monotonic()
        module, stages = build(name)
        step = PipelineStep(name, stages, MICROBATCHES)
        report[name] = {}
        for seq in (16, 12):  # a second step with another sequence length
            report[name][str(seq)] = compare(module, step, seq)
            module.zero_grad(set_to_none=True)
        report[name]["seconds"] = time.monotonic() - started

    def train_step(module, step, optimizer, seq):
        run_step(step, seq)
        grad_norm_and_clip(module, MAX_NORM, pp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if ckpt != "-":
        name = names[0]
        module, stages = build(name)
        step = PipelineStep(name, stages, MICROBATCHES)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        train_step(module, step, optimizer, 16)
        options = checkpoint_options(module)
        model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
        saved = {k: full(v).clone() for k, v in model_sd.items()}
        torch.save(saved, f"{out}.saved.{env.rank}")
        train_step(module, step, optimizer, 12)
        continued = {n: full(p).clone() for n, p in module.named_parameters()}

        module, stages = build(name)
        step = PipelineStep(name, stages, MICROBATCHES)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
        train_step(module, step, optimizer, 12)
        resumed = {n: full(p) for n, p in module.named_parameters()}
        report["resume"] = {
            "max_diff": max(float((resumed[n] - continued[n]).abs().max()) for n in continued),
            "params": sorted(continued),
            "moved": max(float((continued[n] - saved[n]).abs().max()) for n in continued),
        }
    json.dump(report, open(f"{out}.{env.rank}", "w"))
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization for gloo's threads to abort in
    """
)


def make_model(directory: Path, *, tied: bool = False) -> Path:
    """A random tiny Llama (8 blocks, hidden 32) saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        use_cache=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("pp-model"))


def launch(tmp_path: Path, model: Path, procs: int, dp: int, kind: str, schedules: list[str], ckpt: str = "-"):
    """The worker on ``procs`` gloo processes; every rank's report."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={procs}", str(script)]
    args = [str(model), str(out), str(dp), kind, ckpt, ",".join(schedules)]
    proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(procs)]


def all_parameters(model: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def check_equivalence(reports: list[dict], schedules: list[str], model: Path) -> dict[str, dict[str, float]]:
    """Every schedule's figures (the largest over ranks and both steps) within TOLERANCE, and
    every parameter of the model compared on some rank. Returns the figures (for the log)."""
    figures = {}
    for name in schedules:
        worst = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "clipped": 0.0}
        compared: set[str] = set()
        for report in reports:
            for seq in ("16", "12"):
                step = report[name][seq]
                compared |= set(step["params"])
                worst = {k: max(v, step[k]) for k, v in worst.items()}
        assert compared == all_parameters(model), (name, all_parameters(model) - compared)
        assert all(v < TOLERANCE for v in worst.values()), (name, worst)
        figures[name] = worst
    print(json.dumps(figures, indent=1))
    return figures


ALL = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "interleaved-zero-bubble",
    "zbv-zero-bubble",
    "dualpipev",
]


def check_checkpoint(directory: Path, reports: list[dict], model: Path) -> None:
    """The resumed step equals the continued one bit for bit on every rank, and the checkpoint
    loads into one unpipelined model with every tensor equal to what the ranks saved."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    assert set().union(*(r["resume"]["params"] for r in reports)) == all_parameters(model)
    for report in reports:
        assert report["resume"]["max_diff"] == 0.0 and report["resume"]["moved"] > 0, report["resume"]
    saved = {}
    for rank in range(len(reports)):
        saved |= torch.load(directory / f"report.saved.{rank}")
    unpipelined = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    state = {"model": unpipelined.state_dict()}
    dcp.load(state, checkpoint_id=str(directory / "checkpoint"), no_dist=True)  # one process, no group
    assert set(saved) == set(state["model"])
    for key, tensor in state["model"].items():
        assert torch.equal(tensor, saved[key]), key


def test_every_schedule_on_two_ranks_equals_the_unpipelined_model(tmp_path, tiny_llama):
    reports = launch(tmp_path, tiny_llama, 2, 1, "fsdp", ALL, str(tmp_path / "checkpoint"))
    check_equivalence(reports, ALL, tiny_llama)
    check_checkpoint(tmp_path, reports, tiny_llama)  # of the first schedule, gpipe


def test_four_pipeline_ranks(tmp_path, tiny_llama):
    chosen = ["1f1b", "interleaved-1f1b", "dualpipev"]
    check_equivalence(launch(tmp_path, tiny_llama, 4, 1, "fsdp", chosen), chosen, tiny_llama)


# 2 pipeline ranks x 2 replicas; the checkpoint is the first schedule's.
@pytest.mark.parametrize(
    ("kind", "schedules"), [("fsdp", ["interleaved-1f1b", "1f1b"]), ("ddp", ["zbv-zero-bubble", "gpipe"])]
)
def test_pipeline_times_data_parallel_and_checkpoint(tmp_path, tiny_llama, kind, schedules):
    reports = launch(tmp_path, tiny_llama, 4, 2, kind, schedules, str(tmp_path / "checkpoint"))
    check_equivalence(reports, schedules, tiny_llama)
    check_checkpoint(tmp_path, reports, tiny_llama)


def test_tied_embeddings_split_and_other_architectures_are_refused(tmp_path):
    """Tied embeddings were refused; the last stage now holds a copy of the embedding, read
    from its tensor (trainer.parallel.pipeline_steps.TiedCopies keeps the copies equal). A model
    type the stages do not reproduce is refused before any collective, and one that lacks a
    piece is refused naming it."""
    import torch
    from transformers import CohereConfig, CohereForCausalLM, LlamaConfig, LlamaForCausalLM

    from trainer.distributed import DistEnv
    from trainer.model.errors import ModelError
    from trainer.parallel.pipeline import PipelineError, StageModule, build_stages

    with torch.device("meta"):
        tied_model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True))
    first = StageModule(tied_model, [range(0, 1), range(1, 2)], [0])
    last = StageModule(tied_model, [range(0, 1), range(1, 2)], [1])
    assert first.tied and last.tied and first.weight_aliases() == {}
    assert last.weight_aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "model.embed_tokens.weight" in dict(first.named_parameters())
    assert "lm_head.weight" in dict(last.named_parameters())
    both = StageModule(tied_model, [range(0, 1), range(1, 2)], [0, 1])  # a V placement's rank 0
    with pytest.raises(PipelineError, match="first and the last stage on one rank"):
        both.check_replicable()
    cohere = make_model(tmp_path / "cohere", tied=False)
    config = json.loads((cohere / "config.json").read_text())
    (cohere / "config.json").write_text(json.dumps({**config, "model_type": "cohere", "architectures": None}))
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    with pytest.raises(PipelineError, match="not 'cohere'"):  # before any collective
        build_stages(str(cohere), None, env, [range(0, 4), range(4, 8)], [0], torch.float32, None, None)
    with torch.device("meta"):
        cohere_model = CohereForCausalLM(CohereConfig(num_hidden_layers=2))
        bare = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False))
    with pytest.raises(PipelineError, match="cohere"):
        StageModule(cohere_model, [range(0, 1), range(1, 2)], [0])
    del bare.model.norm
    with pytest.raises(ModelError, match="lacks norm"):
        StageModule(bare, [range(0, 1), range(1, 2)], [0])
