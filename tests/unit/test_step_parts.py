"""trainer.parallel.step_parts: a step runner needs nothing of the Trainer but its StepParts. Built by hand
here, with no Trainer, no data pipeline and no process group, the data-parallel runner (through
the strategies' table, as the Trainer builds it) runs a step whose loss and gradients are those
of the plain model, clips as train.grad_clip_mode says, and its loss path is the evaluator's."""

from __future__ import annotations

import functools

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jobgen.spec.tables.train import TrainSpec  # noqa: E402
from trainer.data.packing import collate, model_inputs, token_loss_sum  # noqa: E402
from trainer.distributed import DistEnv  # noqa: E402
from trainer.parallel.step_parts import StepParts  # noqa: E402

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def tiny(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def micro_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)

    def example(n: int) -> dict[str, list[int]]:
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        return {"input_ids": ids, "labels": ids}

    batches = [collate([[example(n)] for n in lengths], pad_token_id=0, packing=False) for lengths in ([7, 5], [6, 9])]
    for batch in batches:  # as trainer.data.batches.DataPipeline.next_batch adds it
        batch["num_tokens"] = torch.tensor(int(batch["attention_mask"].sum()))
    return batches


def parts_of(model: torch.nn.Module, train: TrainSpec) -> StepParts:
    return StepParts(model=model, env=CPU, train=train, pad_token_id=0, context=None, loss_head=None, offloader=None)


def reference_gradients(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], scale: float):
    """The plain model's summed loss and scaled gradients over the micro-batches."""
    total = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        inputs = model_inputs({k: v for k, v in batch.items() if k != "num_tokens"})
        summed, _ = token_loss_sum(model(**inputs).logits.float(), batch["labels"])
        (summed * scale).backward()
        total += summed.detach().double()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def test_the_data_parallel_runner_steps_from_its_parts_alone(tiny_model):
    from trainer.parallel.step_runner import DataParallelSteps
    from trainer.parallel.strategies import strategy

    model = tiny(tiny_model)
    batches = micro_batches(model.config.vocab_size)
    scale = 1.0 / 17
    expected_loss, expected_grads = reference_gradients(model, batches, scale)

    runner = strategy("ddp").runner(parts_of(model, TrainSpec(parallelism="ddp", grad_clip=0.0)))
    assert isinstance(runner, DataParallelSteps)
    loss = runner.forward_backward(batches, scale)

    assert loss.dtype == torch.float64 and torch.allclose(loss, expected_loss)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected_grads[name], atol=1e-7), name
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected_grads.values()])).item()
    assert runner.clip(float("inf")) == pytest.approx(norm, rel=1e-5)


def test_the_runner_clips_as_the_parts_train_settings_say(tiny_model):
    from trainer.parallel.strategies import strategy

    model = tiny(tiny_model)
    batches = micro_batches(model.config.vocab_size)
    per_parameter = TrainSpec(parallelism="ddp", grad_clip=1e-4, grad_clip_mode="per_parameter")
    runner = strategy("ddp").runner(parts_of(model, per_parameter))
    runner.forward_backward(batches, 1.0)
    before = [p.grad.norm().item() for p in model.parameters() if p.grad is not None]
    # max_norm is the global clip's (none here); per_parameter clips each gradient to grad_clip.
    runner.clip(float("inf"))
    after = [p.grad.norm().item() for p in model.parameters() if p.grad is not None]
    assert max(before) > 1e-3 and max(after) <= 1e-4 * (1 + 1e-3)


def test_the_evaluators_loss_path_is_the_runners(tiny_model):
    from trainer.data.batches import model_inputs_on
    from trainer.parallel.step_runner import forward_loss_sum

    model = tiny(tiny_model)
    batch = micro_batches(model.config.vocab_size)[0]
    # What trainer.evaluation.in_training.build_run_evaluation hands its Evaluator.
    loss_sum = functools.partial(forward_loss_sum, parts_of(model, TrainSpec()))
    with torch.no_grad():
        got = loss_sum(model_inputs_on(batch, CPU.device), batch["labels"])
        inputs = model_inputs({k: v for k, v in batch.items() if k != "num_tokens"})
        expected, _ = token_loss_sum(model(**inputs).logits.float(), batch["labels"])
    assert torch.allclose(got, expected)
