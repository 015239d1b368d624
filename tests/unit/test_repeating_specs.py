"""Specs that validated and then crashed every rank of every array task (issue 30, item 10) are
refused by `jobgen validate`, each naming its key: a seed torch cannot take, pipeline stages of
no blocks or of more blocks than the model has, LoRA targets that adapt none of the model's
layers (read from its safetensors headers, without torch), a collective timeout no timedelta
holds. And the repeat rule's records: a crash repeats only when the previous task of the same
submission crashed with the same signature."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fake_models import fake_model
from helpers import DATA, run_spec, spec_issues
from jobgen.runs.rundir import RunDir
from jobgen.runtime.records import CrashSignature, attempt_ended, attempt_started
from jobgen.spec.loader import load_run
from jobgen.spec.tables.train import MAX_SEED

SMALL = dict(hidden=64, layers=4, inter=128, heads=4, kv=4, vocab=256)


def spec(tmp_path: Path, *, model: dict[str, Any] | None = None, train: dict[str, Any] | None = None, **job) -> Path:
    return run_spec(
        tmp_path,
        "t",
        job={"time": "1h", "procs_per_node": 2, **job},
        model={"path": "org/m", **(model or {})},
        data={"path": str(DATA)},
        train=train or {},
    )


@pytest.mark.parametrize(
    "train, key, words",
    [
        ({"seed": 18014398509481985}, "train.seed", f"less than or equal to {MAX_SEED}"),
        ({"seed": MAX_SEED + 1}, "train.seed", "less than or equal to"),
        ({"seed": -1}, "train.seed", "greater than or equal to 0"),
        ({"collective_timeout": "9999999999d"}, "train.collective_timeout", "outside 1s to 30d"),
        ({"collective_timeout": "0s"}, "train.collective_timeout", "outside 1s to 30d"),
        (
            {"parallelism": "pipeline", "pipeline": {"layers_per_stage": [-1, 3]}},
            "train.pipeline.layers_per_stage[0]",
            "greater than or equal to 1",
        ),
        (
            {"parallelism": "pipeline", "pipeline": {"layers_per_stage": [2, 0]}},
            "train.pipeline.layers_per_stage[1]",
            "greater than or equal to 1",
        ),
    ],
)
def test_a_value_that_crashes_every_rank_is_refused_with_its_key(tmp_path: Path, train, key, words):
    found = spec_issues(spec(tmp_path, train=train))
    assert key in found and words in found[key], found


@pytest.mark.parametrize("lora, key", [({"target_modules": []}, "model.lora.target_modules")])
def test_an_empty_lora_target_list_is_refused(tmp_path: Path, lora, key):
    found = spec_issues(spec(tmp_path, model={"lora": lora}))
    assert "adapts nothing" in found.get(key, ""), found


@pytest.mark.torch
def test_the_largest_seed_seeds_every_rank_of_the_largest_world():
    torch = pytest.importorskip("torch")
    largest_rank = 4096 * 256 - 1  # job.nodes and procs_per_node at their bounds
    torch.manual_seed(MAX_SEED)
    torch.manual_seed(MAX_SEED * 1000 + largest_rank)  # trainer.loop's per-rank stream


# ---------------------------------------------------------------- against the model's files


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    return fake_model(tmp_path / "model", **SMALL)


@pytest.mark.parametrize(
    "targets, key, words",
    [
        (["q_proj", "qproj"], "model.lora.target_modules[1]", "'qproj' matches no layer of the model"),
        (["input_layernorm"], "model.lora.target_modules[0]", "which LoRA cannot adapt"),
        ([".*q_proj"], "model.lora.target_modules[0]", "matches no layer"),  # a list entry is a name, not a regex
        (r"model\.layers\.\d+\.attn\.q_proj", "model.lora.target_modules", "matches no layer"),
    ],
)
def test_lora_targets_that_adapt_nothing_in_a_local_model_are_refused(tmp_path, model_dir, targets, key, words):
    found = spec_issues(spec(tmp_path, model={"path": str(model_dir), "lora": {"target_modules": targets}}))
    assert key in found and words in found[key], found
    assert "q_proj" in found[key] and "down_proj" in found[key]  # the names the model has


@pytest.mark.parametrize(
    "targets",
    [
        ["q_proj", "v_proj"],
        ["self_attn.o_proj", "mlp.down_proj"],
        ["model.layers.0.self_attn.q_proj"],
        "all-linear",
        "ALL-LINEAR",
        r".*\.(q|v)_proj",
        ["lm_head"],
    ],
)
def test_lora_targets_by_peft_rules_are_accepted(tmp_path, model_dir, targets):
    loaded = load_run(spec(tmp_path, model={"path": str(model_dir), "lora": {"target_modules": targets}}))
    assert loaded.run.model.lora.target_modules == targets


def test_validate_says_what_lora_adapts_by_default(tmp_path, model_dir):
    """Issue 32: unset target_modules adapts every linear layer of the blocks, whatever the
    architecture calls them; validate names them (here Llama's seven projections, 4 blocks)."""
    from helpers import jobgen

    shown = jobgen("validate", str(spec(tmp_path, model={"path": str(model_dir), "lora": {}}))).stdout
    assert "model.lora adapts down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (28 layers)" in shown, shown
    chosen = spec(tmp_path / "chosen", model={"path": str(model_dir), "lora": {"target_modules": ["q_proj"]}})
    assert "model.lora adapts q_proj (4 layers)" in jobgen("validate", str(chosen)).stdout


@pytest.mark.parametrize(
    "pipeline, world, key, words",
    [
        ({"layers_per_stage": [1, 2]}, {}, "train.pipeline.layers_per_stage", "sums to 3; the model has 4"),
        ({"layers_per_stage": [2, 2, 2]}, {"procs_per_node": 3}, "train.pipeline.layers_per_stage", "sums to 6"),
        ({}, {"nodes": 3, "procs_per_node": 2}, "train.pipeline.stages", "more than the model's 4 decoder blocks"),
    ],
)
def test_a_pipeline_split_the_models_blocks_cannot_fill_is_refused(tmp_path, model_dir, pipeline, world, key, words):
    train = {"parallelism": "pipeline", "micro_batch_size": 8, "pipeline": pipeline}
    found = spec_issues(spec(tmp_path, model={"path": str(model_dir)}, train=train, **world))
    assert key in found and words in found[key], found


def test_a_split_that_fits_the_model_validates(tmp_path, model_dir):
    train = {"parallelism": "pipeline", "micro_batch_size": 4, "pipeline": {"layers_per_stage": [1, 3]}}
    load_run(spec(tmp_path, model={"path": str(model_dir)}, train=train))


# ---------------------------------------------------------------- the repeat rule's records


def crash(kind: type[BaseException], step: int | None) -> CrashSignature:
    try:
        raise kind("x")
    except kind as exc:
        return CrashSignature.of(exc, step)


def run_dir(tmp_path: Path) -> RunDir:
    (tmp_path / "logs").mkdir()
    return RunDir(tmp_path)


def test_the_same_crash_in_the_next_task_repeats(tmp_path: Path):
    run, boom = run_dir(tmp_path), crash(ValueError, 7)
    attempt_started(run, "11", 0, "10")
    assert attempt_ended(run, "11", 0, "10", boom) is None  # the first time
    attempt_started(run, "12", 0, "10")
    assert attempt_ended(run, "12", 0, "10", crash(ValueError, 7)) == boom
    assert boom.describe().startswith("at step 7 (ValueError at test_repeating_specs.py:")


@pytest.mark.parametrize(
    "between",
    [
        "another step",
        "another kind",
        "a clean end",
        "a killed task",
        "a requeue of the same job",
        "a resubmission",
        "an unreadable record",
    ],
)
def test_anything_between_two_crashes_or_any_difference_is_no_repeat(tmp_path: Path, between: str):
    run, boom = run_dir(tmp_path), crash(ValueError, 7)
    attempt_started(run, "11", 0, "10")
    attempt_ended(run, "11", 0, "10", boom)
    job, restart, array, again = "12", 0, "10", boom
    if between == "another step":
        again = crash(ValueError, 8)
    elif between == "another kind":
        again = crash(KeyError, 7)
    elif between == "a clean end":
        attempt_started(run, "12", 0, "10")
        attempt_ended(run, "12", 0, "10", None)
        job = "13"
    elif between == "a killed task":
        attempt_started(run, "12", 0, "10")  # and never ended
        job = "13"
    elif between == "a requeue of the same job":
        job, restart = "11", 1
    elif between == "a resubmission":
        array = "20"
    else:
        (tmp_path / "logs" / "attempt.json").write_text(json.dumps({"job_id": "11", "ended": True, "crash": [1]}))
    attempt_started(run, job, restart, array)
    assert attempt_ended(run, job, restart, array, again) is None


def test_an_end_without_its_start_repeats_nothing(tmp_path: Path):
    run, boom = run_dir(tmp_path), crash(ValueError, 7)
    attempt_started(run, "11", 0, "10")
    attempt_ended(run, "11", 0, "10", boom)
    assert attempt_ended(run, "12", 0, "10", boom) is None  # 12 never recorded its start


@pytest.mark.torch
@pytest.mark.parametrize(
    "targets",
    [["q_proj", "v_proj"], ["self_attn.o_proj"], ["lm_head"], "all-linear", r".*\.mlp\.(up|down)_proj", None],
)
def test_jobgen_names_the_layers_peft_adapts(tiny_model: Path, targets):
    """The validate check and the trainer agree: the modules jobgen.model.lora_targets works out from the
    safetensors headers are the ones peft adapts in the loaded model (trainer.model.prep)."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from jobgen.model.files import read_model
    from jobgen.model.lora_targets import adapted, weight_modules
    from jobgen.spec.tables.model import ModelSpec
    from trainer.model.prep import add_lora

    info = read_model(tiny_model)
    expected = adapted(targets, weight_modules(info.tensors))
    model = add_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        ModelSpec(path=str(tiny_model), lora={"target_modules": targets}),
    )
    assert sorted(model.targeted_module_names) == expected and expected
