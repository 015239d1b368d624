"""Memory-lean training: optimizer in backward, per-parameter clipping, activation offloading,
chunked loss. Spec rules first (no torch), then unit tests of each piece on the CPU, then the
trainer under torchrun: an interrupted and resumed run equals an uninterrupted one."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest

from helpers import (
    DATA,
    TRAINER_SETTINGS,
    checkpoints,
    llama,
    losses,
    read_jsonl,
    run_spec,
    stopped_by_kill_switch,
    summary,
    torchrun,
)
from helpers import write_spec as write_text_spec
from jobgen.base.exit_codes import ExitCode
from jobgen.spec.loader import SpecError, load_run

# ---------------------------------------------------------------- spec rules

BASE = """
    site = "local"
    [job]
    name = "lean"
    time = "2h"
    {job}
    [model]
    path = "model"
    {model}
    [data]
    path = "data.jsonl"
    [train]
    {train}
"""


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    return tmp_path


def _spec(workdir: Path, *, job: str = "", model: str = "", train: str = "") -> Path:
    return write_text_spec(workdir, BASE.format(job=job, model=model, train=train))


def _issues(path: Path) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        load_run(path)
    return {i.key: i.message for i in info.value.issues}


ONE_PROCESS = "nodes = 1\n    procs_per_node = 1"


def test_optimizer_in_backward_refuses_grad_accum(workdir):
    found = _issues(
        _spec(workdir, job=ONE_PROCESS, train="optimizer_in_backward = true\n    grad_clip = 0\n    grad_accum = 4")
    )
    message = found["train"]
    assert "train.optimizer_in_backward" in message and "train.grad_accum = 1 (it is 4)" in message, found


def test_optimizer_in_backward_refuses_global_clipping_and_says_what_to_set(workdir):
    found = _issues(_spec(workdir, job=ONE_PROCESS, train="optimizer_in_backward = true"))  # grad_clip 1.0 default
    message = found["train"]
    assert "train.grad_clip" in message and "train.grad_clip_mode = 'global'" in message, found
    assert "set train.grad_clip = 0 or train.grad_clip_mode = 'per_parameter'" in message


@pytest.mark.parametrize(
    "job, says",
    [
        ("nodes = 1\n    procs_per_node = 2", "job.procs_per_node = 1 (it is 2)"),
        ("nodes = 2\n    procs_per_node = 1", "job.nodes = 1 (it is 2)"),
        ("", "job.procs_per_node = 1 (it is unset"),  # the site decides: may be every GPU of the node
    ],
)
def test_optimizer_in_backward_with_ddp_needs_one_process(workdir, job, says):
    found = _issues(_spec(workdir, job=job, train="optimizer_in_backward = true\n    grad_clip = 0"))
    message = found[""]
    assert "train.optimizer_in_backward" in message and "train.parallelism = 'ddp'" in message, found
    assert says in message and "parallelism = 'fsdp'" in message


def test_optimizer_in_backward_accepted_combinations(workdir):
    spec = load_run(_spec(workdir, job=ONE_PROCESS, train="optimizer_in_backward = true\n    grad_clip = 0"))
    assert spec.run.train.optimizer_in_backward and spec.run.train.grad_clip_mode == "global"
    fsdp = load_run(
        _spec(
            workdir,
            job="nodes = 2\n    procs_per_node = 2",
            train='optimizer_in_backward = true\n    parallelism = "fsdp"\n    grad_clip_mode = "per_parameter"\n'
            '    optimizer = "adafactor"',
        )
    )
    assert fsdp.world_size == 4 and fsdp.run.train.grad_clip == 1.0


def test_activation_offloading_needs_gradient_checkpointing(workdir):
    found = _issues(_spec(workdir, model="activation_offloading = true"))
    assert "model.activation_offloading" in found["model"] and "model.gradient_checkpointing = true" in found["model"]
    ok = load_run(_spec(workdir, model="activation_offloading = true\n    gradient_checkpointing = true"))
    assert ok.run.model.activation_offloading


def test_loss_chunk_tokens_is_a_count(workdir):
    assert (
        "greater than or equal to 0"
        in _issues(_spec(workdir, train="loss_chunk_tokens = -1"))["train.loss_chunk_tokens"]
    )
    assert load_run(_spec(workdir, train="loss_chunk_tokens = 1024")).run.train.loss_chunk_tokens == 1024
    assert load_run(_spec(workdir)).run.train.loss_chunk_tokens == 0  # no chunking unless asked
    assert load_run(_spec(workdir)).run.train.target_logits_only  # the output layer at target positions only


def test_grad_clip_mode_is_checked(workdir):
    assert "train.grad_clip_mode" in _issues(_spec(workdir, train='grad_clip_mode = "layerwise"'))


# ---------------------------------------------------------------- the pieces, on the CPU


def _torch():
    """torch, imported by the tests that need it: the spec tests above run without it."""
    return pytest.importorskip("torch")


@pytest.mark.torch
@pytest.mark.parametrize(
    ("chunk", "targets_only"), [(1, False), (5, False), (16, False), (1000, False), (0, True), (5, True), (1000, True)]
)
def test_chunked_loss_equals_full_loss_values_and_gradients(chunk, targets_only):
    torch = _torch()
    from trainer.data.packing import IGNORE_INDEX, token_loss_sum
    from trainer.memory.chunked_loss import chunked_linear_cross_entropy

    gen = torch.Generator().manual_seed(chunk)
    batch, seq, dim, vocab = 3, 17, 8, 50
    hidden = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.5).requires_grad_()
    bias = torch.randn(vocab, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :9] = IGNORE_INDEX  # a prompt
    labels[2, 11:] = IGNORE_INDEX  # padding: whole chunks without a target
    labels[:, 0] = IGNORE_INDEX

    full, _count = token_loss_sum(torch.nn.functional.linear(hidden, weight, bias), labels)
    grads_full = torch.autograd.grad(full, [hidden, weight, bias])
    chunked = chunked_linear_cross_entropy(hidden, weight, bias, labels, chunk, targets_only=targets_only)
    grads_chunked = torch.autograd.grad(chunked, [hidden, weight, bias])
    assert chunked.dtype == torch.float32 and chunked.shape == ()
    assert float(chunked.detach()) == pytest.approx(float(full.detach()), rel=1e-5)
    for a, b in zip(grads_chunked, grads_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.torch
@pytest.mark.parametrize(("chunk", "targets_only"), [(4, False), (4, True), (0, True)])
def test_chunked_loss_without_targets_is_zero_and_still_gives_gradients(chunk, targets_only):
    torch = _torch()
    from trainer.data.packing import IGNORE_INDEX
    from trainer.memory.chunked_loss import chunked_linear_cross_entropy

    hidden = torch.randn(2, 6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    labels = torch.full((2, 6), IGNORE_INDEX)
    loss = chunked_linear_cross_entropy(hidden, weight, None, labels, chunk, targets_only=targets_only)
    loss.backward()  # connected to the graph: DDP needs a gradient for every parameter
    assert float(loss.detach()) == 0.0 and weight.grad is not None and float(weight.grad.abs().sum()) == 0.0


def _tiny_lm(tie: bool = False, **config_overrides):
    _torch().manual_seed(0)
    dims = dict(vocab=97, hidden=32, inter=64, layers=2, heads=4, kv=2, tie=tie)
    return llama(**dims, max_position_embeddings=128, use_cache=False, **config_overrides)


def _batch(torch, vocab=97, batch=2, seq=24):
    from trainer.data.packing import IGNORE_INDEX

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[:, :7] = IGNORE_INDEX
    labels[1, 20:] = IGNORE_INDEX
    return ids, labels


@pytest.mark.torch
@pytest.mark.parametrize(("chunk", "targets_only"), [(5, False), (0, True), (5, True)])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_output_layer_inside_the_forward_matches_logits_loss(tie, chunk, targets_only):
    torch = _torch()
    from trainer.data.packing import token_loss_sum
    from trainer.memory.chunked_loss import ChunkedLossHead, install_chunked_loss

    reference = _tiny_lm(tie)
    model = copy.deepcopy(reference)
    keys = list(model.state_dict())
    ids, labels = _batch(torch)

    full, _ = token_loss_sum(reference(input_ids=ids, use_cache=False).logits.float(), labels)
    full.backward()
    loss = install_chunked_loss(model, chunk, targets_only=targets_only)
    assert isinstance(model.lm_head, ChunkedLossHead) and list(model.state_dict()) == keys  # checkpoints unchanged
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie  # ties kept
    with loss.targets(labels):
        output = model(input_ids=ids, use_cache=False).logits
    assert output.shape == (1, 1, 1)
    summed = loss.loss_sum(output)
    summed.backward()
    assert float(summed) == pytest.approx(float(full), rel=1e-5)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Outside targets() the layer is a plain linear layer again (generation, export).
    assert model(input_ids=ids, use_cache=False).logits.shape == (2, 24, 97)


@pytest.mark.torch
def test_chunked_loss_refuses_models_it_cannot_stand_in_for():
    torch = _torch()
    from trainer.memory.chunked_loss import LossHeadError, install_chunked_loss

    with pytest.raises(LossHeadError, match=r"logit_scale = 2\.0.*loss_chunk_tokens = 0"):
        model = _tiny_lm()
        model.config.logit_scale = 2.0
        install_chunked_loss(model, 8)

    class Scaled(torch.nn.Linear):
        pass

    model = _tiny_lm()
    model.lm_head.__class__ = Scaled
    with pytest.raises(LossHeadError, match=r"not a plain torch\.nn\.Linear"):
        install_chunked_loss(model, 8)

    # A model that post-processes its logits without saying so in its config: found on the first step.
    model = _tiny_lm()
    loss = install_chunked_loss(model, 8)
    forward = model.forward

    def capped(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = torch.tanh(out.logits / 30.0) * 30.0
        return out

    model.forward = capped
    ids, labels = _batch(torch)
    with loss.targets(labels):
        output = model(input_ids=ids, use_cache=False).logits
    with pytest.raises(LossHeadError, match="changes its output layer's result"):
        loss.loss_sum(output)


@pytest.mark.torch
def test_offload_hooks_give_identical_gradients_and_never_move_parameters():
    torch = _torch()
    from trainer.memory.activation_offload import ActivationOffloader, CopyTransfer, offload_activations

    model = _tiny_lm()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, labels = _batch(torch)
    from trainer.data.packing import token_loss_sum

    def grads(context):
        model.zero_grad(set_to_none=True)
        with context:
            loss, _ = token_loss_sum(model(input_ids=ids, use_cache=False).logits, labels)
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads(offload_activations(None))
    transfer = CopyTransfer(torch.device("cpu"))
    offloader = ActivationOffloader(transfer, min_bytes=0)
    packed_params = []
    pack = offloader.pack
    offloader.pack = lambda t: (packed_params.append(t) if isinstance(t, torch.nn.Parameter) else None, pack(t))[1]
    offloaded = grads(offload_activations(offloader))
    assert transfer.moved > 0 and transfer.fetched >= transfer.moved  # each block input went out and came back
    for name, grad in reference.items():
        assert torch.equal(grad, offloaded[name]), name
    # Parameters (and their views, e.g. weight.t()) were seen by the hook but not copied.
    assert packed_params and transfer.moved < 20
    assert not offloader._live and not offloader._prefetched  # nothing kept after the context


@pytest.mark.torch
def test_offload_skips_small_tensors_and_is_a_logged_no_op_on_cpu(caplog):
    torch = _torch()
    from trainer.memory import activation_offload as offload

    transfer = offload.CopyTransfer(torch.device("cpu"))
    offloader = offload.ActivationOffloader(transfer, min_bytes=1 << 20)
    x = torch.randn(8, 8, requires_grad=True)
    with offloader.hooks():
        (x.exp() * 2).sum().backward()
    assert transfer.moved == 0
    caplog.set_level(logging.INFO, logger="trainer.memory.activation_offload")
    offload._logged_noop = False
    assert offload.make_offloader(torch.device("cpu"), True) is None
    assert offload.make_offloader(torch.device("cpu"), True) is None
    assert [r.message for r in caplog.records].count(
        "activation offloading: no-op on cpu (nothing to move to host memory)"
    ) == 1
    assert offload.make_offloader(torch.device("cpu"), False) is None


def _train_spec(**overrides):
    from jobgen.spec.tables.run import TrainSpec

    return TrainSpec(**{"lr": 1e-2, "warmup_steps": 1, "max_steps": 4, "weight_decay": 0.1, **overrides})


@pytest.mark.torch
@pytest.mark.parametrize("optimizer, clip_mode, clip", [("adamw", "global", 0.0), ("adafactor", "per_parameter", 0.05)])
def test_optimizer_in_backward_steps_like_the_plain_optimizer(optimizer, clip_mode, clip):
    torch = _torch()
    from trainer.optim import OptimizerInBackward, build_optimizer, build_scheduler, clip_per_parameter

    torch.manual_seed(0)
    plain_model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    lean_model = copy.deepcopy(plain_model)
    plain_spec = _train_spec(optimizer=optimizer, grad_clip=clip, grad_clip_mode=clip_mode)
    lean_spec = _train_spec(optimizer=optimizer, grad_clip=clip, grad_clip_mode=clip_mode, optimizer_in_backward=True)
    plain = build_optimizer(list(plain_model.parameters()), plain_spec)
    lean = build_optimizer(list(lean_model.parameters()), lean_spec)
    assert isinstance(lean, OptimizerInBackward) and len(lean.optimizers) == 4
    plain_sched, lean_sched = build_scheduler(plain, plain_spec), build_scheduler(lean, lean_spec)
    for step in range(4):
        x = torch.randn(5, 6)
        plain_model(x).pow(2).sum().backward()
        params = list(plain_model.parameters())
        norm = clip_per_parameter(params, clip) if clip else torch.nn.utils.clip_grad_norm_(params, float("inf"))
        plain.step()
        plain.zero_grad()
        plain_sched.step()
        lean_model(x).pow(2).sum().backward()
        assert all(p.grad is None for p in lean_model.parameters())  # freed in the hooks
        lean.step()
        assert lean.grad_norm() == pytest.approx(float(norm), rel=1e-5)
        lean_sched.step()
        assert lean_sched.get_last_lr() == plain_sched.get_last_lr()
        for a, b in zip(lean_model.parameters(), plain_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"step {step}")
    assert lean.grad_norm() != lean.grad_norm()  # NaN when no hook ran: never a misleading number


# ---------------------------------------------------------------- the trainer under torchrun


def _make_run(
    directory: Path, tiny_model: Path, *, procs: int, model: dict | None = None, data: dict | None = None, **train
) -> Path:
    """helpers.make_run with ``job.procs_per_node`` set (optimizer_in_backward with DDP needs 1)."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize

    spec_file = run_spec(
        directory,
        "lean",
        filename="lean.toml",
        job={"time": "1h", "runs_root": "runs", "nodes": 1, "procs_per_node": procs},
        model={"path": tiny_model, **(model or {})},
        data={"path": DATA, "max_length": 256, **(data or {})},
        train={**TRAINER_SETTINGS, "max_steps": 8, **train},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path


def _interrupted_and_resumed_equals_uninterrupted(
    tmp_path: Path, tiny_model: Path, procs: int, **settings
) -> tuple[Path, Path]:
    """An uninterrupted run, and one stopped by the kill switch after step 2 or later then
    resumed: the same loss at every step. Returns both run directories."""
    reference = _make_run(tmp_path / "a", tiny_model, procs=procs, **settings)
    proc = torchrun(reference, nproc=procs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 9))

    run = _make_run(tmp_path / "b", tiny_model, procs=procs, **settings)
    stopped, out = stopped_by_kill_switch(run, 2, nproc=procs)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and 2 <= k < 8, out
    assert checkpoints(run) == [f"step-{k:08d}"]
    resumed_proc = torchrun(run, nproc=procs)
    assert resumed_proc.returncode == 0, resumed_proc.stdout + resumed_proc.stderr
    assert summary(run)["start_step"] == k
    resumed = losses(run)
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(expected[step], abs=1e-5), (step, resumed[step], expected[step])
    return reference, run


@pytest.mark.torch
@pytest.mark.full  # CI's budget: the fsdp test below resumes optimizer in backward exactly in CI
def test_optimizer_in_backward_one_process_adafactor_resumes_exactly(tmp_path, tiny_model):
    _, run = _interrupted_and_resumed_equals_uninterrupted(
        tmp_path,
        tiny_model,
        procs=1,
        optimizer_in_backward=True,
        optimizer="adafactor",
        grad_accum=1,
        grad_clip_mode="per_parameter",
        model={"gradient_checkpointing": True, "activation_offloading": True},
    )
    records = read_jsonl(run / "metrics.jsonl")
    assert all(r["grad_norm"] > 0 for r in records), records  # summed in the hooks, not NaN


@pytest.mark.torch
def test_optimizer_in_backward_under_fsdp_with_chunked_loss_resumes_exactly(tmp_path, tiny_model):
    _, run = _interrupted_and_resumed_equals_uninterrupted(
        tmp_path,
        tiny_model,
        procs=2,
        parallelism="fsdp",
        optimizer_in_backward=True,
        grad_accum=1,
        grad_clip=0,
        loss_chunk_tokens=64,
    )
    records = read_jsonl(run / "metrics.jsonl")
    assert all(r["grad_norm"] > 0 for r in records), records
    assert losses(run)[8] < losses(run)[1]


@pytest.mark.torch
# In 'full' only (CI's budget): the fsdp test resumes the chunked loss exactly; units check it equals the full loss.
@pytest.mark.full
def test_chunked_loss_under_ddp_resumes_exactly_and_matches_the_full_loss(tmp_path, tiny_model):
    reference, _ = _interrupted_and_resumed_equals_uninterrupted(tmp_path, tiny_model, procs=2, loss_chunk_tokens=32)
    # The first step starts from the same weights as a run with the full-logits loss.
    full = _make_run(tmp_path / "full", tiny_model, procs=2, max_steps=1)
    assert torchrun(full).returncode == 0
    assert losses(reference)[1] == pytest.approx(losses(full)[1], rel=1e-5)


@pytest.mark.torch
@pytest.mark.full  # CI: the chunked-loss equivalence tests above cover the same loss path
def test_target_positions_only_trains_like_every_positions_logits(tmp_path, tiny_model):
    """The default output layer (target positions only) against every position's logits, 2
    DDP ranks with packing and gradient accumulation: the same loss and gradient norm at
    every step."""
    settings = {"max_steps": 4, "grad_accum": 2}
    runs = {}
    for only in (True, False):
        run = _make_run(
            tmp_path / str(only), tiny_model, procs=2, data={"packing": True}, target_logits_only=only, **settings
        )
        proc = torchrun(run, nproc=2)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ("the loss inside it, at target positions only, all at once" in proc.stdout) is only, proc.stdout
        runs[only] = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in runs[True]] == [1, 2, 3, 4]
    for fast, plain in zip(runs[True], runs[False]):
        assert fast["loss"] == pytest.approx(plain["loss"], rel=1e-5), (fast, plain)
        assert fast["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4), (fast, plain)
