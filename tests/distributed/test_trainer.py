"""The trainer under torchrun: 2 processes on gloo (CPU), the tiny model, the example data.

Each test builds a run directory the way ``jobgen submit`` does and launches
``torchrun --standalone --nproc-per-node=2 -m trainer``: the same entry point the
rendered script runs on every node. The runs that several tests only start from (a finished
run to look at, a reference curve, a run to damage and resume) are trained by one torchrun
for all of them (:func:`trained`, tests/run_many.py: the trainer's own ``train()`` for each).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from helpers import (
    checkpoints,
    cut_short_and_extend,
    jobgen,
    last_step,
    losses,
    make_run,
    python_checks,
    read_jsonl,
    status,
    stopped_by_kill_switch,
    summary,
    torchrun,
    torchrun_many,
    wait_for,
    wait_for_step,
)
from jobgen.base.exit_codes import ExitCode

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model):
    """Runs trained to their end in one torchrun, each for the test named after it."""
    root = tmp_path_factory.mktemp("trained")
    runs = {
        "fsdp": make_run(root / "fsdp", tiny_model, parallelism="fsdp", max_steps=25, data={"packing": True}),
        "reference": make_run(root / "reference", tiny_model, parallelism="fsdp", max_steps=14),
        "finished": make_run(root / "finished", tiny_model, max_steps=3),
        "truncated": make_run(root / "truncated", tiny_model, max_steps=6, save_every_steps=2, keep_checkpoints=3),
        "async": make_run(
            root / "async",
            tiny_model,
            max_steps=40,
            optimizer="adafactor",
            async_save=True,
            save_every="1s",
            keep_checkpoints=50,
        ),
        "export": make_run(root / "export", tiny_model, max_steps=4),
    }
    proc = torchrun_many(list(runs.values()))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return runs


def reduced_loss_to_the_end(run, packing: bool) -> None:
    curve = losses(run)
    assert sorted(curve) == list(range(1, 26))
    first, last = sum(curve[s] for s in (1, 2, 3)) / 3, sum(curve[s] for s in (23, 24, 25)) / 3
    assert last < first * 0.8, curve
    info = summary(run)
    assert info["exit_code"] == 0 and info["world_size"] == 2 and info["end_step"] == 25
    assert info["exit_reason"] == "reached step 25 of 25: finished", info
    assert len(info["tokens_per_s_per_rank"]) == 2 and all(t > 0 for t in info["tokens_per_s_per_rank"])
    assert json.loads((run / "done").read_text())["step"] == 25
    assert checkpoints(run) == ["step-00000025"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000025"
    record = read_jsonl(run / "metrics.jsonl")[-1]
    for key in ("loss", "lr", "grad_norm", "tokens", "target_tokens", "tokens_per_s", "rss_mib", "job_id"):
        assert key in record, key
    assert info["data_stats"]["packing"] is packing
    if packing:  # several examples per row: fewer rows than examples
        assert info["data_stats"]["rows"] < info["data_stats"]["kept"]


def test_two_process_run_reduces_loss(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, parallelism="ddp", max_steps=25, data={"packing": False})
    proc = torchrun(run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reduced_loss_to_the_end(run, packing=False)
    assert "exit 0: reached step 25 of 25: finished" in proc.stdout + proc.stderr
    assert "seed 7" in proc.stdout + proc.stderr


def test_fsdp_with_packing_reduces_loss(trained):
    reduced_loss_to_the_end(trained["fsdp"], packing=True)


# DDP's resume is also exercised by the quick soak in CI; its own run here is in the full suite.
@pytest.mark.parametrize("parallelism", [pytest.param("ddp", marks=pytest.mark.full), "fsdp"])
def test_resume_after_kill_switch_is_exact(tmp_path, tiny_model, parallelism, request):
    if parallelism == "fsdp":  # the uninterrupted run's curve
        expected = losses(request.getfixturevalue("trained")["reference"])
    else:
        reference = make_run(tmp_path / "a", tiny_model, parallelism=parallelism, max_steps=14)
        assert torchrun(reference).returncode == 0
        expected = losses(reference)

    run = make_run(tmp_path / "b", tiny_model, parallelism=parallelism, max_steps=14)
    stopped, out = stopped_by_kill_switch(run, 2)
    k = stopped["end_step"]
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH and 2 <= k < 14, out
    assert checkpoints(run) == [f"step-{k:08d}"]
    assert "kill switch" in out

    proc2 = torchrun(run)
    assert proc2.returncode == 0, proc2.stdout + proc2.stderr
    resumed = losses(run)
    assert summary(run)["start_step"] == k
    # Same seed, same curve: before the stop too.
    for step in range(1, k + 1):
        assert resumed[step] == pytest.approx(expected[step], abs=1e-5), (step, resumed[step], expected[step])
    for step in range(k + 1, 15):
        assert resumed[step] == pytest.approx(expected[step], abs=1e-5), (step, resumed[step], expected[step])


def test_kill_switch_at_start_exits_before_loading(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model)
    (run / "switches" / "kill").touch()
    proc = torchrun(run)
    out = proc.stdout + proc.stderr
    assert "kill switch present at start: not starting" in out
    assert f"exit {int(ExitCode.NOT_STARTED)}" in out
    # Before loading anything: the trainer logs "starting at step 0" once model and data are loaded.
    assert "starting at step" not in out, out
    assert checkpoints(run) == [] and not (run / "metrics.json").exists()
    assert (run / "switches" / "kill").exists()


def test_save_switch_saves_deletes_and_continues(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=30, keep_checkpoints=5)
    proc = torchrun(run, background=True)
    wait_for_step(run, proc, 2)
    (run / "switches" / "save").touch()
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    saved = checkpoints(run)
    assert len(saved) == 2 and saved[-1] == "step-00000030", saved
    assert not (run / "switches" / "save").exists()
    assert "save switch" in out and summary(run)["end_step"] == 30


def test_abort_switch_exits_without_saving(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=200)
    proc = torchrun(run, background=True)
    wait_for_step(run, proc, 2)
    (run / "switches" / "abort").touch()
    out, _ = proc.communicate(timeout=180)
    info = summary(run)
    assert info["exit_code"] == ExitCode.ABORTED and info["end_step"] < 200, out
    assert checkpoints(run) == [] and (run / "switches" / "abort").exists()
    assert not (run / "done").exists()


@pytest.mark.parametrize("how", ["signal", "request-file"])
def test_stop_request_saves_and_exits(tmp_path, tiny_model, how):
    run = make_run(tmp_path, tiny_model, max_steps=300)
    proc = torchrun(run, background=True, env={"SLURM_JOB_ID": "4242"})
    wait_for_step(run, proc, 2)
    if how == "signal":
        # Slurm's preemption and `scancel --signal` reach every process of the step; here
        # only the workers (torchrun's children): torchrun itself dies of SIGUSR1.
        subprocess.run(["pkill", "-USR1", "-P", str(proc.pid)], check=True)
    else:
        # What the batch shell's trap writes (job 4242, attempt 0) on Slurm's lead-time signal.
        (run / "switches" / "stop.4242.0").write_text("USR1\n")
    out, _ = proc.communicate(timeout=180)
    info = summary(run)
    assert info["exit_code"] == ExitCode.SIGNALLED, out
    assert checkpoints(run) == [f"step-{info['end_step']:08d}"]
    assert not (run / "switches" / "stop.4242.0").exists()
    # The reason names what happened: the signal that reached the program, or the time limit
    # whose lead-time signal the batch shell caught. The batch script reads both lines.
    words = "SIGUSR1 (scancel --signal)" if how == "signal" else "time limit (USR1 300 s before the limit)"
    assert info["exit_reason"] == f"{words}: saving and exiting"
    exit_file = (run / "logs" / "exit-code.4242.0").read_text().splitlines()
    assert exit_file == [str(int(ExitCode.SIGNALLED)), info["exit_reason"]]


def test_deadline_saves_and_exits(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=500)
    # job.time is 1h with exit_grace 5m: a job ending in 5m + 8s must stop about 8s in.
    end = int(time.time()) + 300 + 8
    proc = torchrun(run, env={"JOBGEN_JOB_END_TIME": str(end)})
    info = summary(run)
    assert info["exit_code"] == ExitCode.DEADLINE, proc.stdout + proc.stderr
    assert checkpoints(run) == [f"step-{info['end_step']:08d}"] and info["end_step"] < 500
    assert "deadline" in proc.stdout + proc.stderr


def test_without_graceful_stop_the_deadline_stop_requests_and_signals_end_the_job_unsaved(tmp_path, tiny_model):
    """job.graceful_stop = false, what bench/goodput.py compares against: the trainer trains past
    its deadline and ignores the batch shell's stop request; a signal kills it without a save."""
    run = make_run(tmp_path, tiny_model, max_steps=100_000, save_every_steps=0)
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["job"]["graceful_stop"] = False
    (run / "spec.json").write_text(json.dumps(spec))
    deadline = time.time() + 2  # job.time 1h, exit_grace 5m: the job "ends" 5m + 2s from now
    env = {"SLURM_JOB_ID": "4243", "JOBGEN_JOB_END_TIME": str(int(deadline + 300))}
    proc = torchrun(run, background=True, env=env)
    wait_for_step(run, proc, 2)
    (run / "switches" / "stop.4243.0").touch()  # what the batch shell's trap would write
    wait_for(lambda: time.time() > deadline + 2, 30, "the deadline to pass")
    passed = last_step(run)
    wait_for_step(run, proc, passed + 3)  # still training: past the deadline, with a stop request
    subprocess.run(["pkill", "-USR1", "-P", str(proc.pid)], check=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert checkpoints(run) == [] and "graceful_stop = false" in out, out


def test_memory_guard_saves_and_exits(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=50, max_host_memory_percent=0.5)
    proc = torchrun(run)
    info = summary(run)
    assert info["exit_code"] == ExitCode.MEMORY_GUARD and info["end_step"] == 1, proc.stdout + proc.stderr
    assert checkpoints(run) == ["step-00000001"]
    assert "memory guard" in proc.stdout + proc.stderr


def test_finished_run_exits_at_once(trained):
    run = trained["finished"]
    again = torchrun(run)
    assert again.returncode == 0 and "run already finished" in again.stdout + again.stderr
    assert summary(run)["end_step"] == 3


def test_truncated_newest_checkpoint_falls_back(trained):
    run = trained["truncated"]
    assert checkpoints(run) == ["step-00000002", "step-00000004", "step-00000006"]
    cut_short_and_extend(run, "step-00000006", max_steps=8)
    proc = torchrun(run)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "step-00000006 is unusable; falling back to the previous one" in out
    assert summary(run)["start_step"] == 4 and summary(run)["end_step"] == 8


def test_world_size_mismatch_is_refused(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model)
    proc = torchrun(run, expected=4)
    assert "world size is 2, the spec asks for 4" in proc.stdout + proc.stderr
    assert not (run / "metrics.json").exists()


@pytest.mark.full  # CI: tests/distributed/test_export_streaming.py checks merged LoRA exports against peft
def test_lora_with_gradient_checkpointing_under_ddp_then_merged_export(tmp_path, tiny_model):
    pytest.importorskip("peft")
    run = make_run(
        tmp_path,
        tiny_model,
        max_steps=4,
        model={"gradient_checkpointing": True, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
    )
    proc = torchrun(run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mark a variable ready only once" not in proc.stdout + proc.stderr
    assert summary(run)["end_step"] == 4
    # Only the adapters are trained, so only they are checkpointed: a small checkpoint.
    ckpt_bytes = sum(p.stat().st_size for p in (run / "checkpoints" / "step-00000004").glob("*.distcp"))
    model_bytes = (tiny_model / "model.safetensors").stat().st_size
    assert ckpt_bytes < model_bytes / 4, (ckpt_bytes, model_bytes)
    # ... and a LoRA run resumes from such a checkpoint.
    (run / "done").unlink()
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["train"]["max_steps"] = 6
    (run / "spec.json").write_text(json.dumps(spec))
    resumed = torchrun(run)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert summary(run)["start_step"] == 4 and summary(run)["end_step"] == 6
    out = tmp_path / "merged"
    jobgen("export", str(run), "--to", str(out), "--merge-lora", "--checkpoint", "step-00000004", check=True)
    code = f"""
import torch
from transformers import AutoModelForCausalLM
merged = AutoModelForCausalLM.from_pretrained({str(out)!r})
base = AutoModelForCausalLM.from_pretrained({str(tiny_model)!r})
assert not any("lora" in k for k in merged.state_dict()), "adapters were not merged"
q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
diff = (merged.state_dict()[q].float() - base.state_dict()[q]).abs().max()
same = (merged.state_dict()[k].float() - base.state_dict()[k]).abs().max()
assert diff > 1e-4 and same < 1e-2, (float(diff), float(same))
"""
    python_checks(code)


def test_async_saves_and_time_interval_with_adafactor(trained):
    run = trained["async"]
    saved = checkpoints(run)
    assert saved[-1] == "step-00000040" and len(saved) >= 2, saved  # saves by wall time, then the final one
    assert not list((run / "checkpoints").glob(".tmp-*"))
    info = summary(run)
    assert len(info["save_blocking_seconds"]) == len(info["save_seconds"]) == len(saved)
    curve = losses(run)
    assert curve[40] < curve[1]


def test_export_loads_and_generates(trained, tmp_path, tiny_model):
    run = trained["export"]
    out = tmp_path / "exported"
    jobgen("export", str(run), "--to", str(out), check=True)
    code = f"""
import torch, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
import torch.distributed.checkpoint as dcp
tok = AutoTokenizer.from_pretrained({str(out)!r})
model = AutoModelForCausalLM.from_pretrained({str(out)!r})
ids = tok("Add 2 and 3.", return_tensors="pt").input_ids
gen = model.generate(ids, max_new_tokens=5, do_sample=False)
assert gen.shape[1] > ids.shape[1]
base = AutoModelForCausalLM.from_pretrained({str(tiny_model)!r})
state = {{"model": {{k: torch.empty_like(v) for k, v in base.state_dict().items()}}}}
dcp.load(state, checkpoint_id={str(run / "checkpoints" / "step-00000004")!r})
trained = state["model"]["model.layers.0.self_attn.q_proj.weight"]
exported = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
# model.export_dtype 'base' (the tiny model's float32, though model.dtype says bfloat16): the checkpoint's weights.
assert model.dtype == torch.float32 and torch.equal(trained, exported), "exported weights differ from the checkpoint"
assert not torch.allclose(base.state_dict()["model.layers.0.self_attn.q_proj.weight"], trained)
"""
    python_checks(code)


def test_status_warns_when_exit_grace_is_shorter_than_a_save_and_a_step(tmp_path, tiny_model):
    run = make_run(tmp_path, tiny_model, max_steps=3, save_every_steps=1, keep_checkpoints=5)
    spec = json.loads((run / "spec.json").read_text())
    spec["run"]["job"]["exit_grace"] = "5s"  # as if submitted with exit_grace = "5s"
    (run / "spec.json").write_text(json.dumps(spec))
    # As the batch script exports it: the allocation began 5 s before torchrun was started.
    assert torchrun(run, env={"SLURM_JOB_ID": "777", "JOBGEN_JOB_START": str(time.time() - 5)}).returncode == 0
    (record,) = [r for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "first_step"]
    phases = record["startup_seconds"]
    assert set(phases) == {"launch", "imports", "rendezvous", "data", "model", "resume", "first_step"}, phases
    assert phases["launch"] >= 5 and abs(sum(phases.values()) - record["seconds_to_first_step"]) < 0.05, record
    view = status(run)
    assert any("exit_grace is 5s" in w and "slowest save took" in w for w in view["warnings"]), view
    (only,) = [t for t in view["tasks"] if t["start_step"] is not None]
    assert only["start_step"] == 0 and only["end_step"] == 3 and only["recomputed_steps"] == 0
    assert only["seconds_to_first_step"] > 0 and view["goodput"] is not None
