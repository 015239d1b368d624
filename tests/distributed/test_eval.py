"""Held-out evaluation in the trainer, under torchrun on gloo: it leaves the training as it
was, resumes exactly, gives the same loss at every world size, keeps the best checkpoint,
is abandoned for a stop, and names ``eval.path`` when the file is unusable. The runs that
tests only start from are trained by one torchrun for all of them (:func:`trained`,
tests/run_many.py).

Early stopping on the dev cluster (2 nodes, COMPLETED with the reason as the comment) is
in tests/cluster/test_slurm_eval.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers import (
    DATA,
    checkpoints,
    cut_short_and_extend,
    eval_losses,
    jobgen,
    losses,
    make_run,
    read_jsonl,
    stopped_by_kill_switch,
    summary,
    torchrun,
    torchrun_many,
    wait_for,
)
from jobgen.base.exit_codes import ExitCode
from jobgen.base.visible import visible

pytestmark = pytest.mark.torch


def _eval_file(directory: Path, rows: int, repeat: int = 1) -> Path:
    """The first ``rows`` rows of the example data (``repeat`` times over) as a validation file."""
    lines = DATA.read_text().splitlines()[:rows] * repeat
    path = directory / f"valid-{rows}x{repeat}.jsonl"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


SETTINGS = {"parallelism": "fsdp", "max_steps": 10, "data": {"packing": True}, "keep_checkpoints": 1}


def _with_eval(directory: Path) -> dict:
    return {"path": str(_eval_file(directory, 48)), "every_steps": 2, "micro_batch_size": 3}


def _samples_run(directory: Path, tiny_model: Path) -> Path:
    prompts_file = directory / "prompts.jsonl"
    directory.mkdir(parents=True, exist_ok=True)
    prompts_file.write_text(json.dumps({"prompt": "Give me a | pipe and\na newline."}) + "\n")
    return make_run(
        directory,
        tiny_model,
        parallelism="fsdp",
        max_steps=4,
        lr=1e-6,  # near the random start, the model answers with tokens, not the end of turn at once
        model={"dtype": "float32"},  # the export below is then the very weights that answered
        report_to=["tensorboard"],
        eval={
            "split": 0.05,
            "every_steps": 2,
            "prompts": ["Name three colors.", "What is 2+2?"],
            "prompts_file": str(prompts_file),
            "max_new_tokens": 8,
        },
    )


def _ranks_run(directory: Path, tiny_model: Path, ranks: int) -> Path:
    # One global batch of 8 rows per step on every world size, so the weights evaluated agree
    # too; padded rows (no packing) make the batches' padding differ as little as it can.
    return make_run(
        directory / f"w{ranks}",
        tiny_model,
        max_steps=2,
        micro_batch_size=2,
        grad_accum=4 // ranks,
        eval={"split": 0.1, "every_steps": 2},
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model):
    """Runs of 2 ranks trained to their end in one torchrun, each for the test named after it."""
    root = tmp_path_factory.mktemp("trained")
    runs = {
        "plain": make_run(root / "plain", tiny_model, **SETTINGS),
        "evaluated": make_run(root / "eval", tiny_model, eval=_with_eval(root), **SETTINGS),
        "two ranks": _ranks_run(root, tiny_model, 2),
        "samples": _samples_run(root / "samples", tiny_model),
        "broken best": make_run(
            root / "best", tiny_model, max_steps=6, keep_checkpoints=2, eval={"split": 0.1, "every_steps": 2}
        ),
    }
    _ok(torchrun_many(list(runs.values())))
    return runs


def test_evaluation_leaves_training_unchanged_keeps_the_best_and_resumes_exactly(trained, tmp_path, tiny_model):
    plain, evaluated = trained["plain"], trained["evaluated"]

    # The same training, step by step, with or without evaluations (and the saves of new bests).
    assert losses(evaluated) == pytest.approx(losses(plain), abs=1e-6)
    evals = [r for r in read_jsonl(evaluated / "metrics.jsonl") if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6, 8, 10]  # at_end falls on step 10, evaluated once
    for record in evals:  # the whole validation set every time
        assert record["eval_tokens"] > 0 and record["eval_all_tokens"] > record["eval_tokens"]
        assert record["eval_ppl"] == pytest.approx(2.718281828 ** record["eval_loss"], rel=1e-6)
        assert (record["eval_tokens"], record["eval_batches"]) == (evals[0]["eval_tokens"], evals[0]["eval_batches"])
    curve = eval_losses(evaluated)
    best_step = min(curve, key=curve.get)
    best = json.loads((evaluated / "checkpoints" / "best.json").read_text())
    assert best["step"] == best_step and best["checkpoint"] == f"step-{best_step:08d}"
    assert best["eval_loss"] == pytest.approx(curve[best_step])
    # keep_checkpoints = 1: the newest plus the best.
    assert checkpoints(evaluated) == sorted({f"step-{best_step:08d}", "step-00000010"})
    assert summary(evaluated)["eval_seconds"] and summary(evaluated)["eval_round_seconds_max"] > 0

    # Stopped by the kill switch and resumed: the same training and evaluation losses.
    resumed = make_run(tmp_path / "resumed", tiny_model, eval=_with_eval(tmp_path), **SETTINGS)
    stopped, out = stopped_by_kill_switch(resumed, 3)
    assert stopped["exit_code"] == ExitCode.KILL_SWITCH, out
    stopped_at = stopped["end_step"]
    assert 3 <= stopped_at < 10
    _ok(torchrun(resumed))
    assert summary(resumed)["start_step"] == stopped_at
    assert losses(resumed) == pytest.approx(losses(evaluated), abs=1e-6)
    assert eval_losses(resumed) == pytest.approx(curve, abs=1e-6)
    assert json.loads((resumed / "checkpoints" / "best.json").read_text())["step"] == best_step


def test_eval_loss_is_the_same_on_one_two_and_four_ranks(trained, tmp_path, tiny_model):
    results = {}
    for ranks in (1, 2, 4):
        if ranks == 2:
            run = trained["two ranks"]
        else:
            run = _ranks_run(tmp_path, tiny_model, ranks)
            _ok(torchrun(run, nproc=ranks))
        (record,) = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "eval"]
        results[ranks] = record
    assert {r["eval_tokens"] for r in results.values()} == {results[1]["eval_tokens"]}
    assert {r["eval_batches"] for r in results.values()} == {20}  # 40 held-out rows in batches of 2
    for ranks in (2, 4):
        assert results[ranks]["eval_loss"] == pytest.approx(results[1]["eval_loss"], abs=2e-5), results


def test_a_stop_during_an_evaluation_abandons_it_and_saves(tmp_path, tiny_model):
    # A validation set much larger than a step (3,200 rows: seconds of evaluation), evaluated
    # after every step: the kill switch, set a second after step 2 is logged, lands in the
    # evaluation of step 2. Not at once: the step boundary that starts the evaluation reads
    # the switch too, right after the line is written, and a busy machine can let the switch
    # win that race (seen in CI: the run then stops before evaluating, as it should).
    valid = _eval_file(tmp_path, 400, repeat=8)
    run = make_run(tmp_path / "run", tiny_model, max_steps=50, eval={"path": str(valid), "every_steps": 1})
    proc = torchrun(run, background=True)
    wait_for(lambda: 2 in losses(run), 240, "step 2", interval=0.02, process=proc)
    time.sleep(1.0)
    (run / "switches" / "kill").touch()
    out, _ = proc.communicate(timeout=240)
    assert summary(run)["exit_code"] == ExitCode.KILL_SWITCH, out
    assert "evaluation abandoned for a stop request" in out
    assert summary(run)["end_step"] == 2
    assert sorted(eval_losses(run)) == [1]  # step 2's evaluation was never recorded
    assert "step-00000002" in checkpoints(run)
    assert not (run / "done").exists()


def test_an_unusable_validation_file_is_named_at_the_trainers_start(tmp_path, tiny_model):
    # A chat file where [data] says alpaca: validate cannot see columns, the trainer's first seconds do.
    chat = Path(DATA).with_name("chat.jsonl")
    run = make_run(tmp_path, tiny_model, eval={"path": str(chat), "every_steps": 2})
    started = time.monotonic()
    proc = torchrun(run)
    out = proc.stdout + proc.stderr
    assert f"exit {int(ExitCode.DATA_ERROR)}" in out, out[-3000:]
    assert "eval.path (read as [data] format 'alpaca')" in out and "needs column(s)" in out
    assert checkpoints(run) == [] and not (run / "metrics.jsonl").exists()
    assert json.loads((run / "failed").read_text())["exit_code"] == ExitCode.DATA_ERROR
    assert time.monotonic() - started < 120


def test_samples_answer_the_prompts_as_generate_would_and_reach_jobgen_samples(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained["samples"]
    lines = read_jsonl(run / "samples.jsonl")
    prompts = ["Name three colors.", "What is 2+2?", "Give me a | pipe and\na newline."]
    assert [(x["step"], x["prompt"]) for x in lines] == [(s, p) for s in (2, 4) for p in prompts]
    assert all(0 <= x["tokens"] <= 8 for x in lines)
    assert any(x["tokens"] for x in lines if x["step"] == 2), lines  # something to compare below

    # The answers at step 2 are greedy generate()'s from the exported step-2 weights.
    target = tmp_path / "export"
    proc = jobgen("export", str(run), "--to", str(target), "--step", "2")
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    for line in (x for x in lines if x["step"] == 2):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": line["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert line["completion"] == expected, (line, expected)

    shown = jobgen("samples", str(run))
    assert shown.returncode == 0, shown.stderr
    for number, prompt in enumerate(prompts, start=1):  # shown as one line: its newline escaped
        assert f"prompt {number}: {visible(prompt)}" in shown.stdout
    assert shown.stdout.count("step 2 |") == 3 and shown.stdout.count("step 4 |") == 3
    missing = jobgen("samples", str(run), "--step", "3")
    assert missing.returncode == 1 and "no samples at step 3 (steps with samples: [2, 4])" in missing.stderr

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4]
    texts = events.Tensors("samples/text_summary")
    assert [e.step for e in texts] == [2, 4]
    assert "pipe and<br>a newline" in texts[-1].tensor_proto.string_val[0].decode()


def test_a_broken_best_checkpoint_is_set_aside_and_the_best_named_again(trained):
    run = trained["broken best"]
    curve = eval_losses(run)
    assert curve[6] < curve[4] < curve[2], curve  # every evaluation a new best: step 6 is the best
    best = run / "checkpoints" / "best.json"
    assert json.loads(best.read_text())["checkpoint"] == "step-00000006"
    assert checkpoints(run) == ["step-00000004", "step-00000006"]

    # The best (and newest) checkpoint is cut short; the run is asked for two more steps.
    cut_short_and_extend(run, "step-00000006", max_steps=8)
    proc = torchrun(run)
    out = proc.stdout + proc.stderr
    _ok(proc)
    assert "step-00000006 is unusable; falling back to the previous one" in out
    assert "best checkpoint: step-00000004" in out  # named again from the history, before training on
    assert any(p.name.startswith("broken-step-00000006-") for p in (run / "checkpoints").iterdir())
    evals = eval_losses(run)  # steps 6 and 8 evaluated again by the resumed job
    final = json.loads(best.read_text())
    assert final["step"] == min(evals, key=evals.get) and (run / "checkpoints" / final["checkpoint"]).is_dir()
