"""`jobgen plan` and submit's memory check: the estimator (no torch), the CLI, the refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fake_models import expected_count, fake_model, plan_spec
from helpers import DATA, jobgen, run_spec
from jobgen.base.sizes import GIB, MIB, parse_size
from jobgen.model.files import read_model, read_safetensors_header
from jobgen.plan.estimate import estimate
from jobgen.plan.inputs import PlanInputs

# --------------------------------------------------------------------------- the estimator


def test_parse_size():
    assert parse_size("24GiB") == 24 * GIB
    assert parse_size("80G") == 80 * GIB
    assert parse_size("500MiB") == 500 * MIB
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("23.5GiB") == int(23.5 * GIB)
    with pytest.raises(ValueError):
        parse_size("lots")


def test_headers_give_exact_counts_single_and_sharded(tmp_path: Path):
    one = read_model(fake_model(tmp_path / "one"))
    assert one.param_count == expected_count() == 373_867_520
    sharded = read_model(fake_model(tmp_path / "three", shards=3))
    assert sharded.param_count == one.param_count
    assert sharded.num_layers == 24 and sharded.vocab_size == 32000
    assert one.root_numel == 2 * 32000 * 1024 + 1024
    header = read_safetensors_header(tmp_path / "one" / "model.safetensors")
    assert header["lm_head.weight"]["shape"] == [32000, 1024]


@pytest.mark.torch
def test_headers_match_the_real_tiny_model(tiny_model: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert read_model(tiny_model).param_count == sum(p.numel() for p in model.parameters())


def test_monotonic_sanity(tmp_path: Path):
    model = read_model(fake_model(tmp_path / "m"))
    base = PlanInputs(device="cpu", parallelism="fsdp", world_size=2, micro_batch_size=2, seq_len=1024)
    two, eight = estimate(model, base), estimate(model, replace(base, world_size=8))
    for part in ("parameters", "gradients", "optimizer_state"):
        assert eight.components[part] < two.components[part], part
    ckpt = estimate(model, replace(base, gradient_checkpointing=True))
    assert ckpt.components["activations"] < two.components["activations"]
    chunked = estimate(model, replace(base, loss_chunk_tokens=256))
    assert chunked.components["logits"] < two.components["logits"]
    oib = estimate(model, replace(base, world_size=1, parallelism="ddp", optimizer_in_backward=True))
    ddp = estimate(model, replace(base, world_size=1, parallelism="ddp"))
    assert oib.components["gradients"] < ddp.components["gradients"]
    assert oib.components["buffers"] < ddp.components["buffers"] / 100  # no DDP buckets on one rank
    ada = estimate(model, replace(base, optimizer="adafactor"))
    assert ada.components["optimizer_state"] < two.components["optimizer_state"] / 50
    lora = estimate(model, replace(base, lora_r=8, lora_targets=("q_proj", "v_proj")))
    assert lora.trainable_params == 24 * 2 * 8 * (1024 + 1024)
    assert lora.components["gradients"] < two.components["gradients"] / 100


def test_gpu_7b_bf16_fits_24gib_with_the_memory_savers(tmp_path: Path):
    """The Forgather recipe: 7B in full on one 24 GB GPU."""
    model = read_model(fake_model(tmp_path / "7b", dtype="BF16", hidden=4096, layers=32, inter=11008, heads=32, kv=32))
    assert 6.7e9 < model.param_count < 6.8e9
    lean = PlanInputs(
        device="cuda",
        dtype="bfloat16",
        micro_batch_size=1,
        seq_len=4096,
        optimizer="adafactor",
        optimizer_in_backward=True,
        gradient_checkpointing=True,
        activation_offloading=True,
        loss_chunk_tokens=1024,
    )
    peak = estimate(model, lean).peak
    assert 13 * GIB < peak < 23.5 * GIB - GIB
    assert estimate(model, replace(lean, optimizer="adamw", optimizer_in_backward=False)).peak > 40 * GIB


# --------------------------------------------------------------------------- CLI and submit


def test_plan_json_shape_and_no_torch_import(tmp_path: Path):
    spec = plan_spec(tmp_path, fake_model(tmp_path / "m"), device_memory="64GiB")
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from jobgen.cli.main import main\n"
        f"r = CliRunner().invoke(main, ['plan', {str(spec)!r}, '--json'])\n"
        "print(r.output)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'datasets')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    body, _, imported = out.rstrip().rpartition("\n")
    assert imported == "[]"
    data = json.loads(body)
    assert data["verdict"] == "fits" and data["fits"] is True
    assert set(data["components"]) == {
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "logits",
        "buffers",
        "overhead",
        "nccl_buffers",
    }
    assert data["components"]["nccl_buffers"] == 0 and data["headroom"] == {}  # gloo on a CPU site
    assert set(data["phases"]) == {"load", "first_step", "steady"}
    assert data["param_count"] == 373_867_520 and data["budget_bytes"] == 64 * GIB
    assert data["peak_bytes"] == max(data["phases"].values())


def test_plan_table_shows_measured_peaks(tmp_path: Path):
    spec = plan_spec(tmp_path, fake_model(tmp_path / "m"), device_memory="64GiB")
    run_dir = tmp_path / "runs" / "memplan"
    run_dir.mkdir(parents=True)
    peaks = {"load": {"host_rss_peak_mib": 2194.0}, "steady": {"host_rss_peak_mib": 8751.0}}
    (run_dir / "metrics.json").write_text(json.dumps({"memory_peaks": peaks}))
    proc = jobgen("plan", str(spec), check=True)
    assert "optimizer_state" in proc.stdout and "fits" in proc.stdout
    assert "measured 8.55 GiB" in proc.stdout, proc.stdout


def test_submit_refuses_a_run_that_does_not_fit(tmp_path: Path):
    spec = plan_spec(tmp_path, fake_model(tmp_path / "m"), device_memory="6GiB")
    proc = jobgen("submit", str(spec), "--dry-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not fit" in proc.stderr and "budget 6.00 GiB" in proc.stderr, proc.stderr
    assert "train.optimizer" in proc.stderr or "optimizer_in_backward" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs" / "memplan").exists()
    # jobgen plan says the same, with a non-zero exit.
    plan = jobgen("plan", str(spec))
    assert plan.returncode == 1 and "does not fit" in plan.stdout
    # The override lets it through to the cluster checks (which need Slurm: any refusal now
    # is not the memory plan's).
    forced = jobgen("submit", str(spec), "--dry-run", "--ignore-memory-plan")
    assert "--ignore-memory-plan submits anyway" not in forced.stderr
    assert forced.returncode != 2 or "does not fit" not in forced.stderr.split("problem(s)")[-1]
    assert "--ignore-memory-plan" in jobgen("submit", "--help").stdout


def test_submit_does_not_refuse_a_run_that_fits(tmp_path: Path):
    spec = plan_spec(tmp_path, fake_model(tmp_path / "m"), device_memory="64GiB")
    proc = jobgen("submit", str(spec), "--dry-run")
    assert "does not fit" not in proc.stderr + proc.stdout
    assert proc.returncode != 2 or "memory plan" not in proc.stderr, proc.stderr


def test_submit_warns_when_it_cannot_estimate(tmp_path: Path):
    from jobgen.launch.preflight import memory_findings
    from jobgen.spec.loader import load_run

    spec = load_run(plan_spec(tmp_path, Path("org/some-model"), device_memory="1GiB"))
    (finding,) = memory_findings(spec)
    assert finding.level == "warning" and "cannot estimate" in finding.message


def test_cpu_budget_from_slurm_mem(tmp_path: Path):
    from jobgen.plan.memory_plan import plan_run
    from jobgen.spec.loader import load_run

    spec_file = run_spec(
        tmp_path,
        "memmem",
        site={"profile": "local", "slurm": {"mem": "8G"}},
        job={"time": "1h", "runs_root": str(tmp_path / "runs"), "procs_per_node": 2},
        model={"path": fake_model(tmp_path / "m")},
        data={"path": DATA, "max_length": 512},
        train={"micro_batch_size": 1},
    )
    plan = plan_run(load_run(spec_file))
    assert plan.budget == 4 * GIB and plan.fits is False and plan.suggestions


def pipeline_spec(tmp_path: Path, model: Path, **pipeline) -> Path:
    """A pipeline over 2 nodes x 2 processes of the local site."""
    return run_spec(
        tmp_path,
        "memplan",
        site={"profile": "local", "slurm": {"device_memory": "64GiB"}},
        job={"time": "1h", "runs_root": str(tmp_path / "runs"), "nodes": 2, "procs_per_node": 2},
        model={"path": model},
        data={"path": DATA, "max_length": 512},
        train={"micro_batch_size": 4, "parallelism": "pipeline", "pipeline": pipeline},
    )


def test_plan_of_a_pipeline_lists_every_position(tmp_path: Path):
    spec = pipeline_spec(tmp_path, fake_model(tmp_path / "m"))
    text = jobgen("plan", str(spec), check=True).stdout
    assert "pipeline on 4 rank(s) (4 positions x 1 replica, 4 stages, schedule 1f1b, 4 pieces of 1 row a step)" in text
    # 24 blocks, the embedding's and the head's stages lighter (each about 2.5 blocks' parameters).
    for line in (
        "position 0, stage 0 (blocks 0-4, embedding): ",
        "position 1, stage 1 (blocks 5-11): ",
        "position 2, stage 2 (blocks 12-18): ",
        "position 3, stage 3 (blocks 19-23, norm + lm_head + loss): ",
    ):
        assert line in text, text
    assert text.count("<- the busiest") == 1 and "(4 of 4 pieces in flight)" in text
    data = json.loads(jobgen("plan", str(spec), "--json", check=True).stdout)
    positions = data["pipeline"]["per_position"]
    assert [p["blocks"] for p in positions] == [[[0, 4]], [[5, 11]], [[12, 18]], [[19, 23]]]
    assert data["peak_bytes"] == max(p["peak_bytes"] for p in positions)
    assert [p["pieces_in_flight"] for p in positions] == [4, 3, 2, 1]
    assert data["inputs"]["pipeline"]["schedule"] == "1f1b"


def test_plan_of_a_pipeline_that_cannot_be_split(tmp_path: Path):
    """More stages than blocks: the loader reads a local model's blocks and refuses it with the key
    (issue 30), before any plan; the plan's own word stays for a model only it can read."""
    spec = pipeline_spec(tmp_path, fake_model(tmp_path / "m", layers=2))
    proc = jobgen("plan", str(spec))
    assert proc.returncode == 2 and "train.pipeline.stages" in proc.stderr, proc.stdout + proc.stderr
    assert "more than the model's 2 decoder blocks" in proc.stderr


def test_memory_peaks_record_phases():
    pytest.importorskip("torch")
    from trainer.memory.peaks import MemoryPeaks, combine_ranks

    peaks = MemoryPeaks("cpu")
    peaks.end_phase("load")
    block = bytearray(64 * MIB)
    block[::4096] = b"x" * len(block[::4096])
    peaks.end_phase("first_step")
    peaks.end_phase("steady")
    out = peaks.as_dict()
    assert list(out)[:3] == ["load", "first_step", "steady"]
    assert out["first_step"]["host_rss_peak_mib"] >= 64
    both = combine_ranks([out, {**out, "steady": {"host_rss_peak_mib": 1e6}}])
    assert both["max_over_ranks"]["steady"]["host_rss_peak_mib"] == 1e6 and both["ranks"] == 2
    del block


@pytest.mark.parametrize(
    "damage",
    ["fifo", "link", "list", "peaks list", "max list", "infinite", "huge", "bool", "text"],
)
def test_measured_peaks_in_a_damaged_metrics_json_are_left_out(tmp_path: Path, damage: str):
    """`jobgen plan` shows a run's measured peaks beside the plan: a metrics.json that is not
    what the trainer writes is no measurement (it used to hang on a FIFO and crash on a list
    or on a figure too large for an int)."""
    import os

    from jobgen.plan.memory_plan import _measured_figure, read_measured

    path = tmp_path / "metrics.json"
    good = {"memory_peaks": {"steady": {"host_rss_peak_mib": 100.0}, "max_over_ranks": {"steady": {}}}}
    figure = {"infinite": "Infinity", "huge": "1e300", "bool": "true", "text": '"9"'}
    if damage == "fifo":
        os.mkfifo(path)
    elif damage == "link":
        (tmp_path / "real.json").write_text(json.dumps(good))
        path.symlink_to(tmp_path / "real.json")
    elif damage == "list":
        path.write_text("[1, 2]")
    elif damage == "peaks list":
        path.write_text('{"memory_peaks": [1]}')
    elif damage == "max list":
        path.write_text('{"memory_peaks": {"max_over_ranks": [1], "steady": {"host_rss_peak_mib": 7}}}')
    else:
        path.write_text('{"memory_peaks": {"steady": {"host_rss_peak_mib": ' + figure[damage] + "}}}")
    measured = read_measured(tmp_path)
    seen = _measured_figure(measured, "steady", "cpu")
    assert seen is None or (damage == "max list" and seen == 7 * 2**20), (measured, seen)
