"""``jobgen serve`` on the dev cluster, driven with the official ``openai`` client.

A run trained here for two steps (a checkpoint each, ``best.json`` naming the first) is served
as a Slurm job of the run's site profile: ``transformers serve`` on a node's own eth0 address,
its address in ``RUN/serve.json`` once it answers. Chat completions (through the model's chat
template) and completions, streamed and not, equal greedy generation from the exported model;
a wrong model name or a malformed body gets the server's 4xx and the server keeps answering;
``jobgen chat`` keeps the conversation from piped stdin; ``--stop`` ends the job at once, its
address goes and no process of it is left. In the full suite a served job also meets its
2-minute time limit (TIMEOUT) and cleans up the same way. A copy of the run served with
``[serve] api_key_env`` answers only with the key, which sbatch passed from the submitting
shell and nothing wrote. Every request has a timeout; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

import helpers
from helpers import DATA, TRAINER_SETTINGS, VENV_BIN, jobgen, run_spec, torchrun, wait_until_gone
from jobgen.slurm import client as slurm

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

NAME = "chat-sft"
REQUEST_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def served_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """Two steps of training with a learning rate too small to change the random model (whose
    greedy replies are never empty), a checkpoint per step, and best.json naming step 1."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    directory = tmp_path_factory.mktemp("serve")
    spec_file = run_spec(
        directory,
        NAME,
        filename=f"{NAME}.toml",
        job={"time": "1h", "runs_root": "runs"},
        model={"path": tiny_model, "dtype": "float32"},
        data={"path": DATA, "max_length": 256},
        train={**TRAINER_SETTINGS, "max_steps": 2, "save_every_steps": 1, "lr": 1e-9, "warmup_steps": 0},
        serve={"time": "2m", "ready_timeout": "2m"},
    )
    spec = load_run(spec_file)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    proc = torchrun(run.path, nproc=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in run.checkpoints.glob("step-*")) == ["step-00000001", "step-00000002"]
    run.best_checkpoint.write_text(json.dumps({"step": 1, "checkpoint": "step-00000001", "eval_loss": 1.25}))
    return run.path


@pytest.fixture(autouse=True)
def _cancel_serve_jobs():
    # conftest's _cancel_leftover_jobs scancels these names after the test: a failed test
    # leaves no server holding a node.
    helpers.SUBMITTED_NAMES.append(f"{NAME}-serve")


def greedy(model_dir: str, *, messages: list[dict] | None = None, prompt: str | None = None, tokens: int):
    """What the served model must answer: greedy generation from the exported directory, through
    its chat template for ``messages``; the text and the prompt's length in tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if messages is not None:
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, length:], skip_special_tokens=True), length


def streamed_as(streamed: str, full: str) -> bool:
    """A streamed reply is the full decode, except that transformers' streamer holds back an
    incomplete UTF-8 sequence at the very end (the random model's byte tokens), which the full
    decode shows as U+FFFD."""
    return streamed in (full, full.rstrip("\ufffd"))


def left_behind(address: dict) -> list[dict]:
    """Processes of a serve job still alive: the supervisor (its command line names the model
    directory) and the server (its own port)."""
    import psutil

    marks = (address["model_dir"], f"--port {address['port']}")
    return [
        p.info
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(mark in " ".join(p.info["cmdline"] or []) for mark in marks)
    ]


def serve_and_wait(run: Path, *args: str) -> dict:
    proc = jobgen("serve", str(run), *args, "--wait", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run / "serve.json").read_text())


def test_openai_clients_get_the_models_answers_and_stop_ends_the_job(served_run: Path, cluster):
    import httpx
    import openai

    started = time.monotonic()
    address = serve_and_wait(served_run, "--best")
    ready = time.monotonic() - started
    job_id = int(address["job_id"])
    assert address["host"] == cluster.node_addrs[address["node"]], (address, cluster.node_addrs)  # its eth0
    assert (address["model"], address["checkpoint"], address["engine"]) == (NAME, "step-00000001", "transformers")
    assert address["model_dir"] == str(served_run / "served" / "step-00000001")

    client = openai.OpenAI(base_url=address["url"], api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=1)
    assert [m.id for m in client.models.list().data] == [NAME]

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected, prompt_tokens = greedy(address["model_dir"], messages=messages, tokens=8)
    assert expected.strip(), "the random model's greedy reply should not be empty"
    chat = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
    reply = client.chat.completions.create(**chat)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == prompt_tokens  # the chat template was applied
    stream = client.chat.completions.create(**chat, stream=True)
    assert streamed_as("".join(c.choices[0].delta.content or "" for c in stream if c.choices), expected)

    expected_text, _ = greedy(address["model_dir"], prompt="Once upon a time", tokens=8)
    completion = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    assert client.completions.create(**completion).choices[0].text == expected_text
    stream = client.completions.create(**completion, stream=True)
    assert streamed_as("".join(c.choices[0].text or "" for c in stream if c.choices), expected_text)

    # Refused with a 4xx, and the server goes on.
    with pytest.raises(openai.BadRequestError) as wrong_model:
        client.chat.completions.create(**{**chat, "model": "no-such-model"})
    assert wrong_model.value.status_code == 400
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(**chat, extra_body={"no_such_field": 1})
    raw = httpx.post(
        f"{address['url']}/chat/completions",
        content=b'{"model": "chat-sft", "messages": [',
        headers={"Content-Type": "application/json"},
        timeout=REQUEST_TIMEOUT,
    )
    assert raw.status_code == 422, raw.text
    assert client.chat.completions.create(**chat).choices[0].message.content == expected

    # jobgen chat from a pipe: each line a turn, the conversation kept, /reset starts over.
    proc = subprocess.run(
        [str(VENV_BIN / "jobgen"), "chat", str(served_run), "--max-tokens", "6", "--temperature", "0"],
        input="Hello\nAnd then?\n/reset\nHello\n",
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    first, second, reset, again = proc.stdout.split("\n")[:4]
    hello = [{"role": "user", "content": "Hello"}]
    assert first == again and streamed_as(first, greedy(address["model_dir"], messages=hello, tokens=6)[0])
    # The second turn went with the first one's question and answer (as streamed: what chat kept).
    history = [*hello, {"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    assert streamed_as(second, greedy(address["model_dir"], messages=history, tokens=6)[0])
    assert reset == "(conversation reset)"

    status = json.loads(jobgen("serve", str(served_run), "--status", "--json", check=True).stdout)
    assert (status["state"], status["job_id"], status["url"]) == ("up", str(job_id), address["url"])
    assert (status["slurm_state"], status["node"]) == ("RUNNING", address["node"])
    second_server = jobgen("serve", str(served_run))
    assert second_server.returncode == 2 and f"already served by job {job_id}" in second_server.stderr

    stopped = jobgen("serve", str(served_run), "--stop", check=True, timeout=120)
    assert f"stopped serve job {job_id}" in stopped.stdout and not left_behind(address)
    print(f"serve job {job_id}: answered {ready:.1f}s after `jobgen serve`")


# In the full suite: the job's SIGTERM at its limit is the one `--stop` sends (scancel), which
# the default run proves; this one waits the limit out (2 minutes, Slurm checks once a minute).
@pytest.mark.full
def test_the_time_limit_ends_the_serve_job_and_removes_its_address(served_run: Path, cluster):
    started = time.monotonic()
    address = serve_and_wait(served_run, "--best")
    job_id = int(address["job_id"])
    wait_until_gone([job_id], timeout=240)
    ended = time.monotonic() - started
    (record,) = slurm.show_job(job_id)
    assert record["JobState"] == "TIMEOUT", record
    assert not (served_run / "serve.json").exists()
    log = (served_run / "logs" / "serve" / f"{job_id}.out").read_text()
    assert "received SIGTERM: stopping the server" in log and "removed" in log, log[-3000:]
    assert not left_behind(address)
    after = jobgen("serve", str(served_run), "--status")
    assert after.returncode == 1 and "ended" in after.stdout
    print(f"serve job {job_id}: gone after {ended:.0f}s")


def test_stop_ends_the_serve_job_and_removes_its_address(served_run: Path, cluster):
    address = serve_and_wait(served_run, "--step", "2")
    job_id = int(address["job_id"])
    assert address["checkpoint"] == "step-00000002"
    assert sorted(p.name for p in (served_run / "served").iterdir()) == ["step-00000001", "step-00000002"]
    started = time.monotonic()
    stopped = jobgen("serve", str(served_run), "--stop", check=True, timeout=120)
    assert f"stopped serve job {job_id}" in stopped.stdout
    assert time.monotonic() - started < 60
    assert not slurm.queue([job_id])
    assert not (served_run / "serve.json").exists()
    assert not left_behind(address)
    (record,) = slurm.show_job(job_id)
    assert record["JobState"] == "CANCELLED", record
    chat = jobgen("chat", str(served_run))
    assert chat.returncode == 1 and "no server answers" in chat.stderr


def test_a_copy_served_with_an_api_key_answers_only_with_it(served_run: Path, cluster, tmp_path: Path):
    """A copy of the run (serve.json and logs go into the copy, not the original) with
    [serve] api_key_env: sbatch passes the key from this shell to the job, which is the only
    place that has it; the openai client gets 401 without it and answers with it."""
    import shutil
    import urllib.error
    import urllib.request

    import openai

    copy = Path(shutil.copytree(served_run, tmp_path / "copy"))
    spec = json.loads((copy / "spec.json").read_text())
    spec["run"]["serve"]["api_key_env"] = "SERVE_API_KEY"
    (copy / "spec.json").write_text(json.dumps(spec))
    key = secrets.token_hex(16)
    env = {"SERVE_API_KEY": key}
    proc = jobgen("serve", str(copy), "--best", "--wait", env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    address = json.loads((copy / "serve.json").read_text())
    assert address["api_key_env"] == "SERVE_API_KEY" and not (served_run / "serve.json").exists()
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{address['url']}/models", timeout=REQUEST_TIMEOUT)
        assert refused.value.code == 401
        wrong = openai.OpenAI(base_url=address["url"], api_key="wrong", max_retries=0, timeout=REQUEST_TIMEOUT)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        client = openai.OpenAI(base_url=address["url"], api_key=key, timeout=REQUEST_TIMEOUT, max_retries=1)
        assert [m.id for m in client.models.list().data] == [NAME]
        chat = subprocess.run(
            [str(VENV_BIN / "jobgen"), "chat", str(copy), "--max-tokens", "4"],
            input="Hello\n",
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, **env},
            check=False,
        )
        assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
    finally:
        stopped = jobgen("serve", str(copy), "--stop", timeout=120)
    assert stopped.returncode == 0 and "stopped serve job" in stopped.stdout, stopped.stdout + stopped.stderr
    written = [p for p in copy.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not written, written
