"""The model families users fine-tune under every parallelism jobgen offers (issues 32 and 50): tiny
random models of 19 families (tests/model_families.py) x {DDP, FSDP, LoRA with its default
targets, a pipeline of 2 stages, each MoE layer's experts over 2 ranks} on 2 gloo processes, 3
steps each, and each family's export.

Every cell either trains with the losses of one process training the same global batch (DDP
and LoRA to float rounding, FSDP, the pipeline and expert parallel within float tolerance), or is refused by
``jobgen validate`` (the spec's loading) with its reason. Each family's trained checkpoint
(FSDP's where FSDP trains it, DDP's otherwise) exports to a directory that
``from_pretrained`` loads, equal to the checkpoint tensor for tensor, its files holding the
tensors the base model's do (per-expert tensors of a mixture of experts included).

All the 2-process runs train in one torchrun, the 1-process references in another
(tests/run_many.py): a torch start-up per run would cost more than the runs. The table in
docs/model-families.md is written from these results (``pytest --update-golden``) and checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import REPO, checkpoint_tensors, losses, make_run, summary, torchrun_many
from jobgen.spec.loader import SpecError
from model_families import FAMILIES, make_family_model

pytestmark = pytest.mark.torch

STEPS = 3
BATCH = {"max_steps": STEPS, "micro_batch_size": 2, "global_batch_size": 4, "warmup_steps": 1}
# mode -> (what the spec says, the 1-process reference it is compared with)
MODES: dict[str, tuple[dict[str, object], str]] = {
    "ddp": ({"parallelism": "ddp"}, "full"),
    "fsdp": ({"parallelism": "fsdp"}, "full"),
    # No dropout: its masks are drawn per rank, so 2 ranks and 1 process would drop different inputs.
    "lora": ({"parallelism": "ddp", "model": {"lora": {"dropout": 0.0}}}, "lora"),
    "pipeline": ({"parallelism": "pipeline", "pipeline": {"schedule": "1f1b", "microbatches": 2}}, "full"),
    # Each MoE layer's experts split over the 2 ranks (trainer/parallel/expert_parallel.py).
    "ep": ({"parallelism": "fsdp", "expert_parallel": 2, "procs": 2}, "full"),
}
REFERENCES: dict[str, dict[str, object]] = {"full": {"parallelism": "ddp"}, "lora": MODES["lora"][0]}
# Losses of 2 ranks against 1: DDP sums the same gradients in another order; FSDP reduces
# shards; a pipeline's stages send activations between ranks.
TOLERANCE = {"ddp": 1e-5, "lora": 1e-5, "fsdp": 1e-4, "pipeline": 1e-4, "ep": 1e-4}
TABLE = REPO / "docs" / "model-families.md"
# family -> what its export showed, filled by the export test (run before the table's, in this file's order)
EXPORTED: dict[str, str] = {}


@dataclass
class Matrix:
    runs: dict[tuple[str, str], Path] = field(default_factory=dict)  # (family, mode) -> run directory
    refused: dict[tuple[str, str], str] = field(default_factory=dict)  # (family, mode) -> validate's reason
    references: dict[tuple[str, str], Path] = field(default_factory=dict)  # (family, full|lora) -> 1 process
    models: dict[str, Path] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)  # nproc -> torchrun's output


def _make(directory: Path, model: Path, name: str, keys: dict[str, object]) -> Path:
    keys = dict(keys)
    return make_run(directory, model, name, model=keys.pop("model", None), **BATCH, **keys)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    found = Matrix()
    root = tmp_path_factory.mktemp("matrix")
    for family in FAMILIES:
        model = found.models[family] = make_family_model(root / "models" / family, family)
        for mode, (keys, _) in MODES.items():
            try:
                found.runs[family, mode] = _make(root / family / mode, model, f"{family}-{mode}", keys)
            except SpecError as exc:  # refused by validate: the reason is the cell
                found.refused[family, mode] = "; ".join(issue.message for issue in exc.issues)
        for kind, keys in REFERENCES.items():
            found.references[family, kind] = _make(root / family / f"one-{kind}", model, f"{family}-one-{kind}", keys)
    for nproc, runs in ((2, list(found.runs.values())), (1, list(found.references.values()))):
        proc = torchrun_many(runs, nproc=nproc)
        found.outputs[nproc] = proc.stdout + proc.stderr
        assert proc.returncode == 0, found.outputs[nproc][-6000:]
    return found


CELLS = [(family, mode) for family in FAMILIES for mode in MODES]


@pytest.mark.parametrize(("family", "mode"), CELLS, ids=[f"{f}-{m}" for f, m in CELLS])
def test_each_cell_trains_as_one_process_does_or_is_refused_by_validate(matrix: Matrix, family: str, mode: str):
    if (family, mode) in matrix.refused:
        reason = matrix.refused[family, mode]
        assert "train.parallelism" in reason or "pipeline" in reason or "experts" in reason, reason
        assert str(matrix.models[family]) in reason  # names the model it cannot train
        return
    run = matrix.runs[family, mode]
    ended = summary(run)
    assert (ended["exit_code"], ended["end_step"]) == (0, STEPS), ended
    reference = losses(matrix.references[family, MODES[mode][1]])
    got = losses(run)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=TOLERANCE[mode]), (step, got, reference)


def test_what_validate_refuses_is_what_the_table_of_parallelisms_says(matrix: Matrix):
    """The refusals are the architecture's, not accidents: a pipeline of every family but the
    hybrid Mamba one (tied embeddings summed across the first and last stage, Gemma's
    soft-capping, GPT-2's absolute positions, MoE blocks); expert parallelism of every mixture
    of experts; DDP, FSDP (the mixtures of experts' per-expert checkpoints merged as they load)
    and LoRA train every family."""
    dense = {family for family in FAMILIES if not _experts(matrix.models[family])}
    refused = [("granite-4-h", "pipeline")] + [(family, "ep") for family in dense]
    assert sorted(matrix.refused) == sorted(refused)
    assert "the model has no routed experts to place on ranks" in matrix.refused["llama", "ep"]
    assert "Mamba scans" in matrix.refused["granite-4-h", "pipeline"]
    assert "train it with train.parallelism = 'ddp' or 'fsdp' or 'hsdp'" in matrix.refused["granite-4-h", "pipeline"]


def _experts(model: Path) -> int:
    from jobgen.model.files import read_model

    return read_model(model).traits.experts


def test_attention_auto_is_eager_where_the_class_has_no_sdpa(matrix: Matrix):
    assert "attention: eager (Gemma2ForCausalLM does not support SDPA)" in matrix.outputs[2]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_exports_a_model_that_loads_equal_to_the_checkpoint(matrix: Matrix, family: str, tmp_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints.export import export

    run = matrix.runs.get((family, "fsdp")) or matrix.runs[family, "ddp"]
    source = export(RunDir(run).load_spec(), run, tmp_path / "exported", report=lambda line: None).name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    trained = checkpoint_tensors(run / "checkpoints" / source)
    exported = model.state_dict()
    assert model.dtype == torch.float32  # model.export_dtype 'base': the float32 the model's config names
    tied = {"lm_head.weight"} if model.config.get_text_config().tie_word_embeddings else set()
    assert set(exported) - tied == set(trained) - tied, family
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), (family, name)
    # Written in the base model's layout, as save_pretrained writes it (Mixtral's experts one
    # tensor each, GPT-NeoX's embed_out), whatever names the checkpoint holds them under.
    assert _tensor_names(tmp_path / "exported") == _tensor_names(matrix.models[family]), family
    EXPORTED[family] = "loads, equals the checkpoint, the base model's layout"


@pytest.mark.parametrize("family", ["gemma2", "gpt2"])
def test_a_tied_model_trained_in_a_pipeline_exports_one_weight_for_both(matrix: Matrix, family: str, tmp_path: Path):
    """The first and the last stage each held a copy of the tied embedding (summed gradients);
    both copies are in the checkpoint, equal, and the export writes the weight once."""
    import torch
    from transformers import AutoModelForCausalLM

    from jobgen.runs.rundir import RunDir
    from trainer.checkpoints.export import export

    run = matrix.runs[family, "pipeline"]
    source = export(RunDir(run).load_spec(), run, tmp_path / "exported", report=lambda line: None).name
    trained = checkpoint_tensors(run / "checkpoints" / source)
    embedding = next(name for name in trained if name.endswith(("embed_tokens.weight", "wte.weight")))
    assert torch.equal(trained["lm_head.weight"], trained[embedding])  # the two copies stayed one weight
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert torch.equal(model.state_dict()[embedding], trained[embedding])
    assert _tensor_names(tmp_path / "exported") == _tensor_names(matrix.models[family])


def _tensor_names(directory: Path) -> set[str]:
    from jobgen.model.files import read_model

    return {tensor.name for tensor in read_model(directory).tensors}


# ---------------------------------------------------------------- the table in docs/

MODE_TITLES = {
    "ddp": "DDP",
    "fsdp": "FSDP",
    "lora": "LoRA (default targets)",
    "pipeline": "pipeline, 2 stages",
    "ep": "expert parallel 2",
}


def render_table(matrix: Matrix) -> str:
    """docs/model-families.md from the matrix's results: each cell "trains" (losses of one process)
    or "refused (n)", n the reason below; the LoRA cell names what the default adapts."""
    reasons: list[str] = []
    rows = []
    for family, (model_type, _) in FAMILIES.items():
        cells = []
        for mode in MODES:
            if (family, mode) in matrix.refused:
                # One reason for every family it applies to: the path and the type are the row's.
                reason = matrix.refused[family, mode].replace(str(matrix.models[family]) + ": ", "")
                reason = re.sub(r"\s+", " ", reason.replace(f"'{model_type}'", "'<model_type>'"))
                if reason not in reasons:
                    reasons.append(reason)
                cells.append(f"refused ({reasons.index(reason) + 1})")
            elif mode == "lora":
                cells.append(f"trains: {_adapted(matrix.runs[family, mode])}")
            else:
                cells.append("trains")
        cells.append(EXPORTED.get(family, "not checked (its test failed or did not run)"))
        rows.append(f"| {family} | `{model_type}` | " + " | ".join(cells) + " |")
    header = ["family", "model_type", *MODE_TITLES.values(), "export"]
    lines = [
        "# Model families x parallelisms",
        "",
        "<!-- Written by tests/distributed/test_family_matrix.py from its results (pytest --update-golden);",
        "     the test fails when this file is not what the runs showed. -->",
        "",
        f"Tiny random models of each family (tests/model_families.py), {STEPS} steps on 2 gloo processes. "
        '"trains": the losses equal those of one process training the same global batch (FSDP, expert parallel and the '
        'pipeline within float tolerance); "refused": `jobgen validate` refuses the spec, for the reason '
        "below, before anything is queued (the trainer refuses it too, should a hub id skip the check). "
        "Export: `jobgen export` of the FSDP checkpoint, loaded with `AutoModelForCausalLM.from_pretrained`, "
        "equal to the checkpoint tensor for tensor, its files holding the tensors the base model's hold.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *rows,
        "",
        *(f"{n}. {reason}" for n, reason in enumerate(reasons, 1)),
        "",
    ]
    return "\n".join(lines)


def _adapted(run: Path) -> str:
    """What validate says LoRA's default adapts in this run's model (the trainer adapts the same:
    tests/distributed/test_model_families.py)."""
    from jobgen.runs.rundir import RunDir
    from jobgen.spec.named_files import lora_adapted

    return lora_adapted(RunDir(run).load_spec().run) or ""


def test_the_table_in_docs_is_what_the_matrix_showed(matrix: Matrix, update_golden: bool):
    table = render_table(matrix)
    if update_golden:
        TABLE.write_text(table)
    assert TABLE.exists() and TABLE.read_text() == table, (
        "docs/model-families.md differs from the matrix's results: "
        "pytest tests/distributed/test_family_matrix.py --update-golden"
    )
