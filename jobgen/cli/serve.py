"""``jobgen serve`` and ``jobgen chat``: the click commands; jobgen.cli.main registers them.

    jobgen serve RUN [--best | --step N] [--time 2h] [--wait]   # a Slurm job serving the run's checkpoint
    jobgen serve DIR [--site PROFILE]                           # a Hugging Face model directory as it is
    jobgen serve RUN --local                                    # the same script here, in the foreground
    jobgen serve RUN --status [--json] | --stop
    jobgen chat RUN [--system TEXT] [--max-tokens N] [--temperature T]

The export of a run's checkpoint is trainer code, handed in by jobgen.cli.main (the composition
root) as the ``export`` of :func:`serve_command`. This module imports only click at module
level: ``jobgen --help`` stays fast. The work is in jobgen.serve.submit, jobgen.serve.status and
jobgen.serve.chat.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, NoReturn

import click

if TYPE_CHECKING:
    from jobgen.serve.submit import Exporter, Target


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(code)


def _target(ref: str) -> Target:
    from jobgen.runs.rundir import default_runs_root
    from jobgen.serve.submit import ServeError, find_target

    try:
        return find_target(ref, default_runs_root())
    except ServeError as exc:
        _fail(f"jobgen: {exc}", 2)


def _duration(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    from jobgen.base.durations import DurationError, parse_duration

    if value is None:
        return None
    try:
        return parse_duration(value)
    except DurationError as exc:
        raise click.BadParameter(str(exc)) from None


def serve_command(export: Exporter) -> click.Command:
    """The ``serve`` command, exporting a run's checkpoints with ``export``."""

    @click.command(name="serve")
    @click.argument("ref", metavar="RUN|DIR")
    @click.option("--best", is_flag=True, help="the checkpoint with the lowest eval loss (checkpoints/best.json)")
    @click.option("--step", type=click.IntRange(0), help="the checkpoint of this step")
    @click.option("--local", "local", is_flag=True, help="run the serve script here, in the foreground, without Slurm")
    @click.option("--status", "show_status", is_flag=True, help="is it up, where, which job, which model")
    @click.option("--json", "as_json", is_flag=True, help="with --status: one JSON object")
    @click.option("--stop", is_flag=True, help="stop the serve job (scancel); its address file goes")
    @click.option("--wait", is_flag=True, help="after submitting, wait until the server answers and print where")
    @click.option(
        "--time", "time_limit", callback=_duration, help="time limit of this serve job (overrides serve.time)"
    )
    @click.option("--site", "site_ref", help="site profile for serving a DIR (default: $JOBGEN_SITE, else 'local')")
    def serve(
        ref: str,
        best: bool,
        step: int | None,
        local: bool,
        show_status: bool,
        as_json: bool,
        stop: bool,
        wait: bool,
        time_limit: int | None,
        site_ref: str | None,
    ) -> None:
        """An OpenAI-compatible server for the run's exported model, as a Slurm job.

        The model is an export of the run's newest checkpoint that loads (--best: the best by
        eval loss, --step N: step N's) under RUN/served/, or the model directory DIR as it is.
        The job, one node with the site profile and the run's [env] and [serve] table, runs
        `transformers serve` or `vllm serve` until its time limit and writes the server's
        address to RUN/serve.json as soon as it answers. Then: `jobgen chat RUN`, or any
        OpenAI client with base URL and model from `jobgen serve RUN --status`.

        \b
        jobgen serve RUN --wait          # submit, then wait until it answers
        jobgen serve RUN --status        # exit status 0 when it answers, 1 otherwise
        jobgen serve RUN --stop"""
        from jobgen.serve.status import ServeStateError

        if show_status + stop + (best or step is not None or local or wait or time_limit is not None) > 1:
            _fail("jobgen serve: --status and --stop go alone (with --json for --status)", 2)
        if as_json and not show_status:
            _fail("jobgen serve: --json goes with --status", 2)
        target = _target(ref)
        try:
            if show_status:
                _status(target, as_json)
            if stop:
                _stop(target)
            _start(target, export, best=best, step=step, local=local, wait=wait, time_limit=time_limit, site=site_ref)
        except ServeStateError as exc:
            _fail(f"jobgen serve: {exc}")

    return serve


def _status(target: Target, as_json: bool) -> NoReturn:
    from jobgen.serve.status import serve_status
    from jobgen.slurm import client as slurm

    try:
        status = serve_status(target.state)
    except slurm.SlurmError as exc:
        _fail(f"jobgen serve: cannot ask Slurm: {exc}")
    click.echo(json.dumps(status.to_json(), indent=2) if as_json else status.format())
    sys.exit(0 if status.state == "up" else 1)


def _stop(target: Target) -> NoReturn:
    from jobgen.serve.status import stop_serve
    from jobgen.slurm import client as slurm

    try:
        click.echo(stop_serve(target.state))
    except slurm.SlurmError as exc:
        _fail(f"jobgen serve: not stopped: {exc}")
    sys.exit(0)


def _start(
    target: Target,
    export: Exporter,
    *,
    best: bool,
    step: int | None,
    local: bool,
    wait: bool,
    time_limit: int | None,
    site: str | None,
) -> NoReturn:
    from jobgen.base.durations import format_human
    from jobgen.launch.environment import serve_environment_problem
    from jobgen.launch.executors import echo_bytes
    from jobgen.serve.status import ServeStateError, ensure_not_serving, wait_until_up
    from jobgen.serve.submit import ServeError, run_local, serve_job, submit_serve
    from jobgen.slurm import client as slurm

    state = target.state
    try:
        try:
            ensure_not_serving(state)  # asks Slurm: before an export that may take a while
        except slurm.SlurmUnavailable:
            if not local:
                raise
            # --local is for machines without Slurm: a serve job recorded there cannot be asked about.
        job = serve_job(target, export=export, best=best, step=step, time_limit=time_limit, site_ref=site)
        unservable = serve_environment_problem(job.site.python, here=local)
        if unservable:
            raise ServeError(unservable)
        what = f"model '{job.model_name}'" + (f" ({job.checkpoint} of {state.path})" if job.checkpoint else "")
        if local:
            limit = format_human(job.serve.time)
            click.echo(f"jobgen serve: {what} here until Ctrl-C or {limit}; its address goes to {state.serve_address}")
            sys.exit(run_local(job, echo_bytes))
        job_id = submit_serve(job)
    except (ServeError, ServeStateError) as exc:  # refused: nothing was started
        _fail(f"jobgen serve: {exc}", 2)
    except slurm.SlurmUnavailable as exc:
        _fail(f"jobgen serve: not submitted: {exc}\n  `jobgen serve --local` serves on this machine without Slurm")
    except slurm.SlurmError as exc:
        _fail(f"jobgen serve: not submitted: {exc}")
    click.echo(f"submitted serve job {job_id}: {what}, from {job.model_dir}")
    click.echo(
        f"  its address goes to {state.serve_address}; jobgen serve {state.path} --status; jobgen chat {state.path}"
    )
    if not wait:
        sys.exit(0)
    try:
        status = wait_until_up(state, job_id)
    except KeyboardInterrupt:
        _fail(f"stopped waiting; serve job {job_id} goes on (jobgen serve {state.path} --stop ends it)", 130)
    click.echo(status.format())
    sys.exit(0 if status.state == "up" else 1)


@click.command(name="chat")
@click.argument("ref", metavar="RUN|DIR")
@click.option("--system", help="a system message at the start of the conversation")
@click.option("--max-tokens", type=click.IntRange(1), help="at most this many tokens per reply")
@click.option("--temperature", type=click.FloatRange(0, 2), help="sampling temperature (0: greedy)")
def chat(ref: str, system: str | None, max_tokens: int | None, temperature: float | None) -> None:
    """Chat with the model `jobgen serve RUN` serves: each line you type (or pipe in) is the next
    message, the reply streams back, and the conversation is kept. /reset starts over, /exit or
    Ctrl-D ends it.

    \b
    jobgen chat RUN
    printf 'Hello\\nAnd then?\\n' | jobgen chat RUN --max-tokens 64"""
    from jobgen.serve.chat import Conversation
    from jobgen.serve.chat import chat as run_chat
    from jobgen.serve.status import ServeStateError, client_key, serve_status, shown
    from jobgen.slurm import client as slurm

    target = _target(ref)
    try:
        status = serve_status(target.state)
    except (ServeStateError, slurm.SlurmError) as exc:
        _fail(f"jobgen chat: {exc}")
    if status.state != "up":
        _fail(f"jobgen chat: no server answers for {target.label}:\n{status.format()}")
    name, key = status.address.get("api_key_env"), client_key(target.state.path, status.address)
    if isinstance(name, str) and key is None:
        why = (
            f"{target.state.serve_address} was not written by the directory's owner: jobgen sends your key to no "
            "address someone else wrote"
            if os.environ.get(name)
            else f"export {shown(name, 128)} (jobgen never stores the key)"
        )
        _fail(f"jobgen chat: the server asks for the API key in ${shown(name, 128)}: {why}")
    conversation = Conversation(
        url=str(status.url),
        api_key=key,
        model=str(status.address.get("model")),
        system=system,
        max_tokens=max_tokens,
        temperature=temperature,
    )
    try:
        code = run_chat(conversation, sys.stdin, sys.stdout, sys.stderr, prompt=sys.stdin.isatty())
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
