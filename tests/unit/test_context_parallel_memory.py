"""`jobgen plan` with train.context_parallel = N (jobgen/plan/context_parallel.py): one rank's
share of each row, plus the whole row's gathered keys and values and, with SDPA, its mask."""

from __future__ import annotations

import pytest

from fake_models import fake_model
from jobgen.model.files import ModelInfo, read_model
from jobgen.plan.context_parallel import share_of_row
from jobgen.plan.inputs import PlanInputs
from jobgen.plan.pipeline import estimate_run

LENGTH = 32768


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelInfo:
    return read_model(fake_model(tmp_path_factory.mktemp("cp") / "m"))


def inputs(ranks: int, **keys) -> PlanInputs:
    settings = {"device": "cuda", "world_size": 8, "parallelism": "fsdp", "micro_batch_size": 1, **keys}
    return PlanInputs(seq_len=share_of_row(LENGTH, ranks), context_parallel=ranks, **settings)


def test_a_share_of_a_row_is_padded_for_two_chunks_per_rank():
    assert share_of_row(32768, 4) == 8192 and share_of_row(1000, 3) == 334 and share_of_row(7, 1) == 8


def test_splitting_the_row_cuts_activations_and_adds_the_gathered_keys_and_values(model):
    one = estimate_run(model, inputs(1, attn_implementation="flex_attention"))
    four = estimate_run(model, inputs(4, attn_implementation="flex_attention"))
    assert four.components["activations"] < one.components["activations"] / 3.5
    assert four.components["logits"] < one.components["logits"] / 3.5
    assert "context_parallel_kv" in four.components and "context_parallel_kv" not in one.components
    assert four.phases["steady"] < one.phases["steady"]
    assert any("context_parallel = 4" in note for note in four.notes)


def test_sdpa_adds_the_share_by_row_mask_flex_does_not(model):
    flex = estimate_run(model, inputs(2, attn_implementation="flex_attention")).components["context_parallel_kv"]
    sdpa = estimate_run(model, inputs(2)).components["context_parallel_kv"]
    assert sdpa - flex == 1 * (LENGTH // 2) * LENGTH * 2  # rows x share x row length, bf16
