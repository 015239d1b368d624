"""trainer.data.packing: best-fit packing, collation, and packed == unpacked loss on the tiny model."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

from jobgen.base.paths import EXAMPLES_DIR  # noqa: E402
from jobgen.spec.tables.data import DataSpec  # noqa: E402
from trainer.data.build import tokenize_dataset  # noqa: E402
from trainer.data.examples import Examples  # noqa: E402
from trainer.data.packing import (  # noqa: E402
    build_rows,
    collate,
    count_targets,
    fetch_rows,
    fill_ratio,
    model_inputs,
    pack,
    token_loss_sum,
)
from trainer.data.source import load_raw  # noqa: E402

PAD = 3


def ex(ids, labels=None):
    return {"input_ids": list(ids), "labels": list(labels if labels is not None else ids)}


# --------------------------------------------------------------------------- pack


def test_pack_is_best_fit_decreasing():
    # 5 and 4 open two rows; the first 3 fills the 5-row exactly (tightest fit), the
    # second goes with the 4; 2 fits nowhere (room 1) and opens a row; 1 fills the 4-row.
    assert pack([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]


def test_pack_is_complete_bounded_and_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(500)]
    rows = pack(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    assert rows == pack(list(lengths), 64)
    lower_bound = -(-sum(lengths) // 64)
    assert len(rows) <= lower_bound * 1.05 + 1, (len(rows), lower_bound)  # best fit is near optimal here
    assert fill_ratio(build_rows(lengths, 64, packing=True).tokens(lengths), 64) > 0.9


def test_pack_rejects_examples_longer_than_a_row():
    with pytest.raises(ValueError, match="example 1 has 9 tokens"):
        pack([3, 9], 8)


def test_rows_without_packing_are_single_examples():
    assert build_rows([5, 4, 3], 8, packing=False).as_lists() == [[0], [1], [2]]
    assert build_rows([5, 4, 3], 8, packing=True).as_lists() == [[0, 2], [1]]


# --------------------------------------------------------------------------- collate


def test_unpacked_collate_pads_to_the_longest_in_the_batch():
    batch = collate(
        [[ex([10, 11, 12])], [ex([20, 21, 22, 23, 24], [-100, -100, 22, 23, 24])]], pad_token_id=PAD, packing=False
    )
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].tolist() == [[10, 11, 12, PAD, PAD], [20, 21, 22, 23, 24]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 11, 12, -100, -100], [-100, -100, 22, 23, 24]]
    assert all(t.dtype == torch.long for t in batch.values())
    assert count_targets(batch["labels"]).item() == 5


def test_unpacked_collate_takes_one_example_per_row():
    with pytest.raises(ValueError, match="one example"):
        collate([[ex([1, 2]), ex([3, 4])]], pad_token_id=PAD, packing=False)


def test_packed_collate_restarts_positions_and_never_targets_an_example_start():
    rows = [[ex([10, 11, 12]), ex([20, 21])], [ex([30, 31, 32, 33])]]
    batch = collate(rows, pad_token_id=PAD, packing=True)
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no attention_mask, on purpose
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, 21], [30, 31, 32, 33, PAD]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    # 20 would be "predicted" from 12, another example: not a target even though its label said so.
    assert batch["labels"].tolist() == [[-100, 11, 12, -100, 21], [-100, 31, 32, 33, -100]]
    assert set(model_inputs(batch)) == {"input_ids", "position_ids", "use_cache"}
    assert model_inputs(batch)["use_cache"] is False


def test_token_loss_sum_is_shifted_cross_entropy_over_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    labels = torch.tensor([[-100, 1, 2, -100], [-100, -100, 5, 6]])
    total, count = token_loss_sum(logits, labels)
    expected = [
        torch.nn.functional.cross_entropy(logits[b, t - 1 : t], labels[b, t : t + 1])
        for b in range(2)
        for t in range(1, 4)
        if labels[b, t] != -100
    ]
    assert count.item() == 4
    assert torch.allclose(total, torch.stack(expected).sum())


# --------------------------------------------------------------------------- equivalence on the tiny model


@pytest.fixture(scope="module")
def examples(tiny_model):
    """A dozen tokenized chat examples of different lengths, and the tokenizer's pad id."""

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    path = EXAMPLES_DIR / "data" / "chat.jsonl"
    spec = DataSpec(path=str(path), format="chat", max_length=128, packing=True)
    ds, _ = tokenize_dataset(load_raw(spec.path).select(range(12)), spec, tokenizer, source=spec.path)
    tokenized = Examples(ds.data.table)  # as the ranks read a cache entry
    assert len(set(tokenized.column("length"))) > 3
    return tokenized, tokenizer.pad_token_id


def load_model(path, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    return model.eval()


def mean_loss(model, batch, **overrides) -> float:
    inputs = {**model_inputs(batch), **overrides}
    inputs = {k: v for k, v in inputs.items() if v is not None}
    with torch.no_grad():
        total, count = token_loss_sum(model(**inputs).logits, batch["labels"])
    return (total / count).item()


def one_by_one(model, ds, pad) -> float:
    total = count = 0
    with torch.no_grad():
        for i in range(len(ds)):
            (example,) = fetch_rows(ds, [[i]], [0])
            batch = collate([example], pad_token_id=pad, packing=False)
            s, c = token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"])
            total, count = total + s, count + c
    return (total / count).item()


# flex_attention is what model.attention = "auto" picks for packed rows on GPUs; on CPU it
# runs through inductor's C++ template (compiled on first use), whose softmax sums in another
# order: 2e-5 apart here, still 50x closer than attending across examples (> 1e-3 below).
@pytest.mark.parametrize(
    "attn",
    # flex's first compile costs about a minute in a fresh CI (no inductor cache): full suite.
    ["sdpa", "eager", pytest.param("flex_attention", marks=pytest.mark.full)],
)
def test_packed_loss_equals_examples_run_one_by_one(tiny_model, examples, attn):
    ds, pad = examples
    model = load_model(tiny_model, attn)
    rows = build_rows(ds.column("length"), 128, packing=True)
    assert len(rows) < len(ds) and any(len(r) > 1 for r in rows)
    packed = collate(fetch_rows(ds, rows, range(len(rows))), pad_token_id=pad, packing=True)
    assert packed["input_ids"].shape[1] <= 128
    assert (packed["input_ids"] == pad).any(), "the test should cover a padded packed row"

    reference = one_by_one(model, ds, pad)
    tolerance = 1e-4 if attn == "flex_attention" else 1e-5
    assert mean_loss(model, packed) == pytest.approx(reference, abs=tolerance)

    # Unpacked, padded to the longest: the same loss too.
    padded = collate(fetch_rows(ds, [[i] for i in range(len(ds))], range(len(ds))), pad_token_id=pad, packing=False)
    assert padded["input_ids"].shape[1] == max(ds.column("length"))
    assert mean_loss(model, padded) == pytest.approx(reference, abs=tolerance)

    # The same rows without per-example boundaries attend across examples: the loss changes,
    # so the equality above is not an accident of this model or data.
    contiguous = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"]))
    assert abs(mean_loss(model, contiguous) - reference) > 1e-3
    # transformers traps: any 2D attention_mask, or a KV cache (use_cache defaults to True),
    # switches its packed-sequence detection off.
    ones = torch.ones_like(packed["input_ids"])
    assert abs(mean_loss(model, packed, attention_mask=ones) - reference) > 1e-3
    assert abs(mean_loss(model, packed, use_cache=None) - reference) > 1e-3


def test_flex_attention_for_packed_rows_on_gpus_and_compiled_blocks_on_gpus_by_default(tiny_model):
    from jobgen.spec.tables.model import ModelSpec
    from jobgen.spec.tables.run import TrainSpec
    from trainer.model.build import attention_implementation, compiles_blocks

    auto, cuda, cpu = ModelSpec(path=str(tiny_model)), torch.device("cuda", 0), torch.device("cpu")
    assert attention_implementation(auto, cuda, packing=True) == "flex_attention"
    assert attention_implementation(auto, cuda, packing=False) == "sdpa"  # padded rows: sdpa's flash kernel
    assert attention_implementation(auto, cpu, packing=True) == "sdpa"
    assert attention_implementation(ModelSpec(path="m", attention="eager"), cuda, packing=True) == "eager"
    assert compiles_blocks(TrainSpec(), cuda) and not compiles_blocks(TrainSpec(), cpu)
    assert compiles_blocks(TrainSpec(compile=True), cpu) and not compiles_blocks(TrainSpec(compile=False), cuda)


@pytest.mark.full  # inductor compiles the block on CPU: ~15 s
def test_compiled_decoder_blocks_give_the_packed_loss_and_gradients_of_eager(tiny_model, examples):
    from trainer.model.build import compile_decoder_blocks

    ds, pad = examples
    packed = collate(
        fetch_rows(ds, build_rows(ds.column("length"), 128, packing=True), range(3)), pad_token_id=pad, packing=True
    )

    def loss_and_grad(model):
        model.train()
        total, count = token_loss_sum(model(**model_inputs(packed)).logits, packed["labels"])
        (total / count).backward()
        return (total / count).item(), model.get_input_embeddings().weight.grad.clone()

    eager_loss, eager_grad = loss_and_grad(load_model(tiny_model, "sdpa"))
    compiled = compile_decoder_blocks(load_model(tiny_model, "sdpa"))
    from trainer.model.build import decoder_layers

    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled))
    compiled_loss, compiled_grad = loss_and_grad(compiled)
    assert compiled_loss == pytest.approx(eager_loss, abs=1e-5)
    assert torch.allclose(compiled_grad, eager_grad, atol=1e-5)


def test_rows_are_arrays_that_pack_as_the_lists_did():
    """The packed rows of 20,000 examples held as two arrays, row for row what the list-of-lists
    best fit gave (a checkpoint's sampler position indexes these rows: their order may not
    change), and their tokens per row."""
    import bisect

    import numpy as np

    def lists(lengths, max_length):  # the previous implementation, kept here as the reference
        order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
        rows, room = [], []
        for i in order:
            n = int(lengths[i])
            k = bisect.bisect_left(room, (n, -1))
            if k == len(room):
                rows.append([i])
                left, row = max_length - n, len(rows) - 1
            else:
                left, row = room.pop(k)
                rows[row].append(i)
                left -= n
            if left > 0:
                bisect.insort(room, (left, row))
        return [sorted(r) for r in rows]

    lengths = np.random.RandomState(3).randint(1, 200, size=20_000)
    rows = build_rows(lengths, 256, packing=True)
    assert rows.as_lists() == lists(lengths.tolist(), 256)
    assert rows.members.dtype == np.int64 and rows.members.nbytes == 8 * 20_000
    assert rows.tokens(lengths).tolist() == [int(lengths[r].sum()) for r in rows.as_lists()]
    single = build_rows(lengths, 256, packing=False)
    assert len(single) == 20_000 and single.members is None and single[7] == [7]
    assert single.tokens(lengths).tolist() == lengths.tolist()
    with pytest.raises(IndexError):
        single[20_000]
