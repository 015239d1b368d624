"""Context parallelism (trainer/parallel/context_parallel.py) on gloo processes of this machine, against
one unsharded forward and backward of the same rows (the model's own sdpa attention and the
trainer's loss, :func:`trainer.data.packing.token_loss_sum`):

- CP=2 on 2 ranks, CP=4 on 4 ranks, and CP=2 x 2 data-parallel replicas, each under FSDP2
  ``fully_shard`` over the whole world with the trainer's scaling (world size / global target
  count): on packed rows (several documents per row, lengths not multiples of 2N) and on
  right-padded unpacked rows, the summed loss, the target count and every parameter's gradient
  equal the unsharded model's within TOLERANCE; a Llama with GQA, and on 2 ranks a Mistral with
  a sliding window shorter than the documents and the Llama's packed rows with activation
  checkpointing (attention runs again in backward);
- the negative control: with the document mask off (attention across packed documents) the
  packed loss differs, so the comparison can fail;
- the flex_attention path on 2 ranks, forward only (torch 2.13's flex_attention has no backward
  on CPU; its backward is bench/gpu_context_parallel_check.py's): the Llama's and the Mistral's
  packed and unpacked rows give the unsharded sdpa model's loss, the negative control differs;
  its block mask is the SDPA path's dense mask (element by element, and block by block), for
  every rank of CP=1, 2 and 4 and with a sliding window; on CPU it refuses backward by name;
- the host-staged all-gather (gloo with CUDA tensors) equals torch's op, forward and backward;
- refusals: attention outside ``active()``, a batch that is not the active layout's, a model
  that is not a transformers model, a kernel other than sdpa and flex_attention; and which
  kernel ``install`` picks (asked for, else the model's own).
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
DIFFERENT = 100 * TOLERANCE  # the negative control differs by at least this much per token (measured 2e-3)

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from trainer.parallel.context_parallel import ContextParallel, _HostGather, _gather
    from trainer.data.packing import collate, model_inputs, token_loss_sum
    from trainer.distributed import exit_now

    models, out, replicas = sys.argv[1].split(","), sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
    flex = sys.argv[4] == "flex"  # also the flex_attention path, forward only
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()

    def rows(seed, packing):
        # Per replica 3 rows; packed: 2-3 documents of odd lengths, the first third of each
        # document's labels ignored (a prompt); unpacked: one document, right-padded.
        g = torch.Generator().manual_seed(seed)
        def example(n):
            ids = torch.randint(0, 128, (n,), generator=g).tolist()
            return {"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]}
        if packing:
            shapes = [[7, 11, 5], [13, 9], [3, 17, 2], [19, 6], [5, 5, 5, 5], [21]]
        else:
            shapes = [[23], [15], [9], [25], [4], [18]]
        return collate([[example(n) for n in s] for s in shapes[: 3 * dp]], pad_token_id=0, packing=packing)

    def share(batch):
        return {k: v[dp_rank * 3: (dp_rank + 1) * 3] for k, v in batch.items()}

    def reference(model_dir, batch):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        summed, count = token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"])
        (summed / count).backward()
        return float(summed), int(count), {n: p.grad for n, p in model.named_parameters()}

    def sharded(model_dir, batch, documents=True, checkpointing=False):
        model = cp.install(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
        if checkpointing:  # as trainer.model.build does: attention runs again in backward, inside active()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        local = cp.shard(share(batch))
        local.layout.documents = documents
        with cp.active(local):
            summed, count = cp.loss_sum(model(**local.model_inputs()).logits, local.labels)
            totals = torch.stack([summed.detach(), count.to(summed.dtype)])
            dist.all_reduce(totals)  # every rank's share: the whole global batch
            (summed * world / totals[1]).backward()  # the trainer's scale
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        return float(totals[0]), int(totals[1]), grads

    def flex_forward(model_dir, batch, documents=True):
        # No backward: flex_attention has none on CPU.
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cp.install(model, attention="flex_attention")
        local = cp.shard(share(batch))
        local.layout.documents = documents
        with torch.no_grad(), cp.active(local):
            summed, count = cp.loss_sum(model(**local.model_inputs()).logits, local.labels)
        totals = torch.stack([summed, count.to(summed.dtype)])
        dist.all_reduce(totals)
        return float(totals[0]), int(totals[1])

    report = {}
    for dp in replicas:  # the data-parallel replicas; world // dp context-parallel ranks each
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
        dp_rank, cp = mesh["dp"].get_local_rank(), ContextParallel(mesh["cp"].get_group())
        for model_dir, packing in [(m, p) for m in models for p in (True, False)]:
            batch = rows(1 if packing else 2, packing)
            ref_loss, ref_count, ref_grads = reference(model_dir, batch)
            checkpointing = world == 2 and packing and model_dir == models[0]
            loss, count, grads = sharded(model_dir, batch, checkpointing=checkpointing)
            name = f"{model_dir.rsplit('/', 1)[-1]}-{'packed' if packing else 'unpacked'}-dp{dp}"
            name += "-checkpointed" if checkpointing else ""
            report[name] = {
                "loss": abs(loss - ref_loss) / ref_count,
                "loss_sum": abs(loss - ref_loss),
                "count": [count, ref_count],
                "grad": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
                "params": sorted(grads) == sorted(ref_grads),
            }
            if packing:
                loss, _, _ = sharded(model_dir, batch, documents=False)
                report[name]["no_documents"] = abs(loss - ref_loss) / ref_count
            if flex:
                loss, count = flex_forward(model_dir, batch)
                flex_name = name.replace("-checkpointed", "") + "-flex"
                report[flex_name] = {"loss": abs(loss - ref_loss) / ref_count, "loss_sum": abs(loss - ref_loss),
                                     "count": [count, ref_count]}
                if packing:
                    loss, _ = flex_forward(model_dir, batch, documents=False)
                    report[flex_name]["no_documents"] = abs(loss - ref_loss) / ref_count

    # The host-staged gather against torch's op, forward and backward.
    group = mesh["cp"].get_group()
    k, v = (torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(rank + i), requires_grad=True)
            for i in range(2))
    weight = torch.randn(2, 2, 3 * group.size(), 4, generator=torch.Generator().manual_seed(9))
    K, V = _gather(k, v, group)
    ((K * weight).sum() + (V * weight).sum()).backward()
    op = [K.detach(), V.detach(), k.grad.clone(), v.grad.clone()]
    k.grad = v.grad = None
    K, V = _HostGather.apply(k, group), _HostGather.apply(v, group)
    ((K * weight).sum() + (V * weight).sum()).backward()
    staged = [K.detach(), V.detach(), k.grad, v.grad]
    report["host_gather"] = max(float((a - b).abs().max()) for a, b in zip(op, staged))
    json.dump(report, open(f"{out}.{rank}", "w"))
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization for gloo's threads to abort in
    """
)


def save_model(directory: Path, kind: str) -> str:
    """A random tiny decoder with GQA (4 query heads, 2 key/value heads) saved as safetensors:
    a Llama, or a Mistral whose sliding window (6) is shorter than most documents."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    shape = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "use_cache": False,
    }
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=6))
    model.save_pretrained(directory / kind, safe_serialization=True)
    return str(directory / kind)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cp-models")
    return {kind: save_model(root, kind) for kind in ("llama", "mistral")}


def launch(tmp_path: Path, models: list[str], procs: int, replicas: str, flex: bool = False) -> list[dict]:
    """The worker on ``procs`` gloo processes (``flex``: the flex path's forward too); every rank's report."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={procs}", str(script)]
    proc = subprocess.run(
        [*cmd, ",".join(models), str(out), replicas, "flex" if flex else "-"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(procs)]


def check(reports: list[dict], cases: list[str]) -> dict[str, float]:
    """Every case within TOLERANCE on every rank; the negative control off by more than DIFFERENT.
    Returns the worst figures (printed for the log)."""
    worst = {"loss": 0.0, "loss_sum": 0.0, "grad": 0.0, "host_gather": 0.0, "no_documents": float("inf")}
    for report in reports:
        assert set(report) == {*cases, "host_gather"}, sorted(report)
        worst["host_gather"] = max(worst["host_gather"], report["host_gather"])
        for case in cases:
            got = report[case]
            assert got["count"][0] == got["count"][1], (case, got["count"])
            worst["loss"] = max(worst["loss"], got["loss"])
            worst["loss_sum"] = max(worst["loss_sum"], got["loss_sum"])
            if not case.endswith("-flex"):  # forward only
                assert got["params"], case
                worst["grad"] = max(worst["grad"], got["grad"])
            if "no_documents" in got:
                worst["no_documents"] = min(worst["no_documents"], got["no_documents"])
    print(json.dumps(worst))
    assert worst["loss"] < TOLERANCE and worst["grad"] < TOLERANCE and worst["host_gather"] == 0.0, worst
    assert worst["no_documents"] > DIFFERENT, worst  # the test can fail: documents matter here
    return worst


def test_two_ranks_equal_the_unsharded_model(tmp_path, tiny_models):
    """SDPA path forward and backward; flex path forward."""
    reports = launch(tmp_path, [tiny_models["llama"], tiny_models["mistral"]], 2, "1", flex=True)
    sdpa = ["llama-packed-dp1-checkpointed", "llama-unpacked-dp1", "mistral-packed-dp1", "mistral-unpacked-dp1"]
    flex = [f"{m}-{p}-dp1-flex" for m in ("llama", "mistral") for p in ("packed", "unpacked")]
    check(reports, [*sdpa, *flex])


def test_four_ranks_equal_the_unsharded_model(tmp_path, tiny_models):
    """CP=4, then CP=2 x 2 replicas, in one launch (the processes' start-up is most of the time)."""
    reports = launch(tmp_path, [tiny_models["llama"]], 4, "1,2")
    check(reports, [f"llama-{p}-dp{dp}" for dp in (1, 2) for p in ("packed", "unpacked")])


def test_refusals(tiny_models):
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from trainer.data.packing import collate
    from trainer.parallel.context_parallel import ATTENTION, FLEX_ATTENTION, ContextParallel, ContextParallelError

    cp = ContextParallel(None)
    model = cp.install(AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32))
    batch = collate([[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]], pad_token_id=0, packing=True)
    local = cp.shard(batch)
    with pytest.raises(ContextParallelError, match=r"train\.context_parallel.*outside"):
        model(**local.model_inputs())
    unsharded = collate([[{"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]}]], pad_token_id=0, packing=True)
    with cp.active(local), pytest.raises(ContextParallelError, match="the batch the one shard"):
        model(input_ids=unsharded["input_ids"], position_ids=unsharded["position_ids"], use_cache=False)
    with pytest.raises(ContextParallelError, match=r"train\.context_parallel"):
        cp.install(nn.Linear(2, 2))
    with pytest.raises(ContextParallelError, match=r"train\.context_parallel.*not 'eager'"):
        ContextParallel(None, attention="eager")
    # The kernel: asked for, else the model's own (its flex_attention: the flex path; sdpa: SDPA).
    assert model.config._attn_implementation == ATTENTION
    own = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], attn_implementation="flex_attention")
    assert cp.install(own).config._attn_implementation == FLEX_ATTENTION
    assert cp.install(own, "sdpa").config._attn_implementation == ATTENTION
    # flex_attention has no backward on CPU (torch 2.13): refused by name, torch's reason kept.
    flex = cp.install(AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32), "flex_attention")
    with cp.active(local), pytest.raises(ContextParallelError, match=r"train\.context_parallel.*backward on CPU"):
        flex(**local.model_inputs())
    # One rank runs the same code unsharded: rows padded to a multiple of 16, labels shifted.
    assert local.input_ids.shape == (1, 16) and local.labels.tolist() == [[2, 3] + [-100] * 14]


def test_flex_block_mask_is_the_dense_mask():
    """The flex path's mask_mod, element by element, and its BlockMask, block by block, against
    the SDPA path's dense mask (itself proven against the model above): every rank of CP=1, 2
    and 4 (layouts made without processes), packed rows padded at the end, with and without a
    sliding window, rows long enough for several 128-token blocks per rank."""
    import torch
    import torch.nn.functional as F

    from trainer.data.packing import collate
    from trainer.parallel.context_parallel import ContextParallel

    g = torch.Generator().manual_seed(0)

    def example(n):
        ids = torch.randint(0, 128, (n,), generator=g).tolist()
        return {"input_ids": ids, "labels": ids}

    batch = collate([[example(509), example(341), example(146)], [example(984)]], pad_token_id=0, packing=True)
    cpu = torch.device("cpu")
    for size in (1, 2, 4):
        for rank in range(size):
            cp = ContextParallel(None)
            cp.size, cp.rank = size, rank  # rank `rank` of `size`: the layout needs no group
            layout = cp.shard(batch).layout
            for window in (None, 100):
                dense = torch.isfinite(layout.mask(cpu, torch.float32, window))[:, 0]
                rows, queries, keys = dense.shape
                b, q, k = torch.arange(rows)[:, None, None], torch.arange(queries)[:, None], torch.arange(keys)
                assert torch.equal(layout.mask_mod(cpu, window)(b, 0, q, k), dense), (size, rank, window)
                blocks = layout.block_mask(cpu, window)
                assert blocks.shape == (rows, 1, queries, keys)
                padded = F.pad(dense, (0, -keys % 128, 0, -queries % 128))
                per_block = padded.unflatten(2, (-1, 128)).unflatten(1, (-1, 128)).any(4).any(2)
                assert torch.equal(blocks.to_dense()[:, 0].bool(), per_block), (size, rank, window)
