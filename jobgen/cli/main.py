"""The ``jobgen`` command line.

    jobgen validate run.toml
    jobgen render run.toml [-o DIR]
    jobgen submit run.toml [--array N] [--after JOBID] [--dry-run] [--local] [--ignore-memory-plan]
    jobgen plan run.toml [--json]
    jobgen status [RUN] [--json]  |  stop / save / abort RUN  |  logs RUN [-f]
    jobgen doctor [--nodes N]     |  schema  |  cluster up|down|status
    jobgen serve RUN|DIR [--best|--step N] [--local] [--status|--stop]  |  chat RUN
    jobgen compare SWEEP|RUN... [-o FILE.png] [--json]
    jobgen watchdog install|list|remove|run

Every command imports what it needs inside its function: ``jobgen --help`` must
stay fast, and nothing here ever imports torch, transformers or datasets. The longer
commands' bodies live beside it (``jobgen.cli.submit``, ``jobgen.cli.status``), and what
the commands share (failing with a message, finding a run) in ``jobgen.cli.common``.

This is the composition root: the one module of ``jobgen/`` that may use ``trainer/``
(``export``) and ``watchdogs/`` (the ``watchdog`` group, the alerts ``status`` shows),
wiring them into the subcommands. Every other jobgen module uses neither
(``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from jobgen import __version__
from jobgen.cli.common import TRAIN_EXTRA_MODULES, Commands, print_findings
from jobgen.cli.common import fail as _fail
from jobgen.cli.common import find_run as _find_run
from jobgen.cli.common import load as _load
from jobgen.cli.common import need_extra as _need_extra


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jobgen")
def main() -> None:
    """Generate, submit and supervise multi-node fine-tuning jobs on Slurm."""


@main.command()
@click.argument("spec_file", type=click.Path(dir_okay=False))
def validate(spec_file: str) -> None:
    """Validate RUN.toml and its site profile; list every problem by file and key."""
    from jobgen.cli.sweep import sweep_file, validate_sweep

    if sweep_file(spec_file):
        return validate_sweep(spec_file)  # every point, each as a full spec
    spec = _load(spec_file)
    click.echo(
        f"{spec_file}: ok ({spec.run.job.program} on {spec.layout} "
        f"= world size {spec.world_size}, site '{spec.site.name}', run dir {spec.run_dir})"
    )
    from jobgen.launch.environment import environment_findings
    from jobgen.launch.preflight import command_findings
    from jobgen.spec.named_files import lora_adapted

    mixture = spec.run.data.describe_sources() if spec.run.data else None
    if mixture:
        click.echo(mixture)
    adapted = lora_adapted(spec.run)
    if adapted is not None:
        click.echo(f"model.lora adapts {adapted}")
    findings = command_findings(spec) + environment_findings(spec)
    print_findings(findings)
    if any(finding.level == "error" for finding in findings):
        sys.exit(1)  # the job's environment cannot run it: submit would refuse it too


@main.command()
@click.argument("spec_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output_dir", type=click.Path(file_okay=False), help="write the script(s) here")
def render(spec_file: str, output_dir: str | None) -> None:
    """Print (or write) the exact sbatch script that submit would use."""
    from jobgen.base.atomic import write_text_atomic
    from jobgen.cli.sweep import render_sweep_command, sweep_file
    from jobgen.launch.render import render as render_script
    from jobgen.launch.render import script_name

    if sweep_file(spec_file):
        return render_sweep_command(spec_file, output_dir)  # the sweep's script and the point table
    spec = _load(spec_file)
    text = render_script(spec)
    if output_dir is None:
        click.echo(text, nl=False)
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / script_name(spec)
    write_text_atomic(target, text, mode=0o755)
    click.echo(str(target))


@main.command()
@click.argument("spec_file", type=click.Path(dir_okay=False))
@click.option("--array", type=click.IntRange(1, 1000), help="number of chained array tasks (overrides job.array)")
@click.option("--after", type=int, help="start after this job (array) ends: --dependency=afterany:JOBID")
@click.option("--dry-run", is_flag=True, help="preflight and print what would be submitted; create nothing")
@click.option("--local", "local", is_flag=True, help="run the script on this machine as a one-node job, without Slurm")
@click.option(
    "--ignore-memory-plan",
    is_flag=True,
    help="submit even when `jobgen plan` predicts the run does not fit in site slurm.device_memory",
)
@click.option("--wait", is_flag=True, help="then wait until the job's first training step, showing where it stands")
def submit(spec_file: str, **options: object) -> None:
    """Preflight against the cluster, write the run directory, sbatch --array=1-N%1.

    A training run that `jobgen plan` predicts will not fit in the memory of one device
    (site slurm.device_memory) is refused (exit status 2) with the changes that would make
    it fit; --ignore-memory-plan submits it anyway.

    --wait then follows the job until its first optimizer step (on a terminal, one line:
    pending and why, Slurm's expected start, then the start-up with the time earlier tasks
    took as its ETA) and exits 0, or 1 if it ended without one. Ctrl-C stops the waiting,
    not the job.

    --local runs the same script here, in the foreground, after the same checks. A SIGTERM
    to jobgen reaches the script as Slurm's would (the program saves and exits); on that or
    Ctrl-C, jobgen waits for the script to end, logging it, and exits with its status."""
    from jobgen.cli.submit import submit_command

    submit_command(spec_file, **options)  # the options above, by name


@main.command()
@click.argument("spec_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of the table")
def plan(spec_file: str, as_json: bool) -> None:
    """Per-device memory breakdown of a training run and whether it fits.

    Parameters, gradients, optimizer state, activations, logits, buffers and overhead of
    one rank, from the model's safetensors headers and config.json, against the site's
    slurm.device_memory; the cheapest changes that would make it fit. With a run
    directory whose metrics.json holds measured peaks, they are shown beside the plan.
    Without safetensors, a Llama-like model (Llama, Mistral, Qwen2/3, Gemma 1-3) or a mixture
    of experts (Mixtral, Qwen2/3-MoE, gpt-oss) is counted from config.json; a mixture of
    experts' routed activations and the experts FSDP gathers follow train.expert_parallel.

    \b
    On a GPU the verdict adds headroom to the predicted peak (max_memory_allocated):
      NCCL buffers   per communicator: channels x 2 peers x (NCCL_BUFFSIZE + LL + LL128
                     buffers), channels by network.transport (32 on "ib"), NCCL_BUFFSIZE and
                     NCCL_MAX_NCHANNELS honoured from the site's and the run's env
      CUDA context   1 GiB
      fragmentation  8 % of the peak, what the caching allocator reserves but cannot use
    "fits" up to 90 % of the budget; "tight" above (it may run, it may not: submit warns);
    "does not fit" above 100 %, or when train.cpu_offload's pinned host memory per node
    exceeds the site's slurm.mem (submit refuses). Suggestions include train.cpu_offload
    (host memory per node, slower steps), train.parallelism = "hsdp" and more nodes with
    the global batch kept.

    Exit status 0 when it fits, fits tightly (with a warning) or no verdict is possible (a
    hub id, no device memory in the site), 1 when it does not fit, 2 when the model's files
    are malformed or a local model's size cannot be worked out."""
    from jobgen.model.files import ModelFileError, UnsizedModel
    from jobgen.plan.memory_plan import plan_run

    spec = _load(spec_file)
    if not spec.run.job.kind.trains:
        _fail(f"{spec_file}: program = '{spec.run.job.program}' trains nothing; no memory plan", 2)
    try:
        result = plan_run(spec)
    except (ModelFileError, UnsizedModel) as exc:
        _fail(f"jobgen plan: {exc}", 2)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else result.format())
    sys.exit(1 if result.fits is False else 0)


@main.command()
@click.option("--site", "site_profile", is_flag=True, help="the schema of a site profile instead of run.toml")
@click.option("--markdown", is_flag=True, help="the Markdown reference (docs/reference/) instead of the JSON schema")
def schema(site_profile: bool, markdown: bool) -> None:
    """JSON schema of run.toml (or of a site profile), for editors; with --markdown, the
    reference documentation: every table and key with its type, default and description."""
    if markdown:
        from jobgen.spec.reference import MARKDOWN

        click.echo(MARKDOWN[site_profile](), nl=False)
        return
    from jobgen.spec.schema import run_schema, site_schema

    click.echo(json.dumps(site_schema() if site_profile else run_schema(), indent=2))


@main.command()
@click.argument("run_ref", metavar="[RUN]", required=False)
@click.option("--json", "as_json", is_flag=True, help="one JSON object (a list without RUN)")
@click.option(
    "--watch", is_flag=True, help="with RUN: print a line at every change until the run ends, then its status block"
)
def status(run_ref: str | None, as_json: bool, watch: bool) -> None:
    """Runs and their array tasks: Slurm state, step, switches.

    Without RUN, one line per run under the runs root (one squeue call for all of them).
    With RUN, the run and each of its array tasks (ARRAYID_TASK): state, nodes, start,
    elapsed/limit, steps, recomputed steps, time to first step and why it ended, also
    after Slurm has forgotten the job.

    Without RUN, a run whose spec.json or jobs.json cannot be read is listed with state
    'unreadable' and the file and error, the others as usual, and the exit status is 1
    (the listing is incomplete). With RUN, such a run is a one-line error, exit status 1.
    """
    from jobgen.cli.status import status_command
    from watchdogs.notify import run_alerts  # the watchdogs' alerts, handed to status (jobgen does not import them)

    status_command(run_ref, as_json, watch, run_alerts)


def _switch_command(name: str, doc: str):
    @main.command(name=name, help=doc)
    @click.argument("run_ref", metavar="RUN")
    def command(run_ref: str) -> None:
        from jobgen.base.visible import visible
        from jobgen.cli.sweep import switch_targets
        from jobgen.report.stop_requests import clear_stale
        from jobgen.runs.rundir import KILL_SWITCH, RunDirError

        runs = switch_targets(run_ref)  # a sweep: every point; SWEEP/POINT: that point
        for run in [_find_run(run_ref)] if runs is None else runs:
            try:
                path, created = run.set_switch({"stop": KILL_SWITCH}.get(name, name))
            except RunDirError as exc:  # e.g. a switches/ the user may not write: a sentence, not a traceback
                _fail(f"jobgen: {exc}")
            click.echo(f"{visible(path)} created" if created else f"{visible(path)} already set")
            try:
                clear_stale(run)  # stop requests of ended attempts: tidying, never the command's failure
            except (OSError, ValueError):
                pass

    return command


_switch_command("stop", "Kill switch: save a checkpoint and exit; queued array tasks exit at once.")
_switch_command("save", "Save switch: save a checkpoint now and continue.")
_switch_command("abort", "Abort switch: exit at once without saving.")


@main.command()
@click.argument("run_ref", metavar="RUN")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="default RUN/plot.png")
def plot(run_ref: str, output: Path | None) -> None:
    """Loss, learning rate and tokens/s against step and wall time, each resume marked and
    the time without a running job shaded, as one PNG (needs the [plot] extra: matplotlib).

    \b
    jobgen plot RUN -o progress.png"""
    from jobgen.report.plot import PlotError, draw, read_plot_data

    run = _find_run(run_ref)
    try:
        path = draw(read_plot_data(run), output or run.path / "plot.png")
    except PlotError as exc:
        _fail(f"jobgen: {exc}")
    click.echo(f"wrote {path}")


def _procs_per_node(ctx: click.Context, param: click.Parameter, value: str | None) -> int | list[int] | None:
    """``--procs-per-node N`` for every node, or ``N,M,...`` one per node (job.procs_per_node's
    list); the spec checks the numbers and names them."""
    if value is None:
        return None
    try:
        counts = [int(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: a number, or one number per node separated by commas (3,1)") from None
    return counts if "," in value else counts[0]


@main.command()
@click.option("--nodes", default=2, show_default=True, type=click.IntRange(1, 4096))
@click.option(
    "--procs-per-node",
    callback=_procs_per_node,
    metavar="N|N,M,...",
    help="default: the site's GPUs per node, or 2 on CPU sites; a list gives each node its own (3,1)",
)
@click.option("--site", "site_ref", default="local", show_default=True, help="site profile name or path")
@click.option("--partition", help="partition (default: the site's)")
@click.option("--time", "time_limit", default="10m", show_default=True)
@click.option("--wait/--no-wait", default=True, show_default=True, help="wait for the job and print its report")
@click.option(
    "--clear",
    "clear_run",
    metavar="RUN",
    help="check the nodes RUN quarantined (with its site) and release those that pass",
)
def doctor(
    nodes: int,
    procs_per_node: int | list[int] | None,
    site_ref: str,
    partition: str | None,
    time_limit: str,
    wait: bool,
    clear_run: str | None,
) -> None:
    """Node health job: every rank inits the process group, all-reduces, allocates
    memory and reports versions; names the nodes that fail. Then it checks what the site
    profile needs of every node (network.ifname, transport, /dev/shm, shared runs_root,
    data_cache and hf_home, the environment), naming the profile key that fixes each failure.

    \b
    jobgen doctor --nodes 2
    jobgen doctor --clear RUN     # release the nodes RUN quarantined once they pass"""
    from jobgen.launch.doctor import clear_quarantine, run_doctor

    if clear_run is not None:
        sys.exit(clear_quarantine(_find_run(clear_run), time_limit=time_limit))
    code, _ = run_doctor(
        nodes=nodes,
        procs_per_node=procs_per_node,
        site_ref=site_ref,
        partition=partition,
        time_limit=time_limit,
        wait=wait,
    )
    sys.exit(code)


@main.command(name="make-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--hidden-size", default=64, show_default=True, type=click.IntRange(8, 4096))
@click.option("--layers", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--heads", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--vocab-size", default=512, show_default=True, type=click.IntRange(300, 65536))
@click.option("--seed", default=0, show_default=True, type=int)
def make_tiny_model_command(
    directory: str, hidden_size: int, layers: int, heads: int, vocab_size: int, seed: int
) -> None:
    """A random tiny Llama-style model and a locally trained tokenizer with a chat template."""
    from jobgen.cli.tinymodel import make_tiny_model

    _need_extra("train", TRAIN_EXTRA_MODULES, "make-tiny-model")
    if hidden_size % heads:
        _fail(f"--hidden-size {hidden_size} must be a multiple of --heads {heads}", 2)
    try:
        path = make_tiny_model(
            Path(directory), hidden_size=hidden_size, layers=layers, heads=heads, vocab_size=vocab_size, seed=seed
        )
    except FileExistsError as exc:
        _fail(f"jobgen: {exc}", 2)
    click.echo(f"tiny model and tokenizer written to {path}")


@main.command()
@click.argument("run_ref", metavar="RUN")
@click.option("--to", "target", required=True, type=click.Path(file_okay=False), help="output directory (new or empty)")
@click.option("--checkpoint", help="checkpoint name, e.g. step-00000120 (default: the newest complete one)")
@click.option("--best", is_flag=True, help="the checkpoint with the lowest eval loss (checkpoints/best.json)")
@click.option("--step", type=click.IntRange(0), help="the checkpoint of this step")
@click.option("--merge-lora", is_flag=True, help="merge LoRA adapters into the base weights")
def export(run_ref: str, target: str, checkpoint: str | None, best: bool, step: int | None, merge_lora: bool) -> None:
    """A consolidated Hugging Face model (and tokenizer) from the run's checkpoint: the newest
    that loads, the best by eval loss (--best) or a given step (--step N)."""
    run = _find_run(run_ref)
    from jobgen.base.safe_read import DamagedFile, read_best
    from jobgen.runs.rundir import RunDirError

    if checkpoint and (best or step is not None):
        _fail("jobgen export: --checkpoint names one already; leave out --best and --step", 2)
    try:
        run.load_spec()  # a damaged spec.json (or best.json) is refused before anything is read or written
        if best:
            read_best(run.best_checkpoint)  # what is wrong with it, rather than "missing or unreadable"
        checkpoint = checkpoint or run.checkpoint_for(best=best, step=step)
    except (RunDirError, DamagedFile) as exc:
        _fail(f"jobgen export: {exc}", 2)
    from trainer.checkpoints.export import ExportError

    try:
        source = _export_checkpoint(run, Path(target), checkpoint, merge_lora, "jobgen export")
    except ExportError as exc:
        _fail(f"jobgen export: {exc}", 2)
    click.echo(f"exported {source} of {run.path} to {target}")


def _export_checkpoint(run, target: Path, checkpoint: str | None, merge_lora: bool, who: str) -> str:
    """trainer.checkpoints.export with a progress bar on a terminal (only the composition root may use
    trainer/); returns the checkpoint's name. Raises trainer.checkpoints.export.ExportError."""
    from jobgen.base.progress import Progress
    from trainer.checkpoints.export import export as do_export

    bar = Progress("export", unit="B")  # on a terminal only

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done)

    try:
        source = do_export(
            run.load_spec(),
            run.path,
            target,
            checkpoint=checkpoint,
            merge_lora=merge_lora,
            report=lambda line: click.echo(f"{who}: {line}", err=True),
            progress=progress,
        )
    finally:
        bar.close()
    return source.name


def _export_for_serve(run, checkpoint: str | None, target: Path) -> str:
    """``jobgen serve``'s exporter (jobgen.serve.submit.Exporter). A LoRA run is merged: servers load
    whole models."""
    from jobgen.serve.submit import ServeError
    from trainer.checkpoints.export import ExportError

    model = run.load_spec().run.model
    try:
        return _export_checkpoint(run, target, checkpoint, model is not None and model.lora is not None, "jobgen serve")
    except ExportError as exc:
        raise ServeError(f"cannot export a checkpoint of {run.path}: {exc}") from None


def _compare() -> click.Command:
    from jobgen.cli.compare import compare_command

    return compare_command


def _serve() -> click.Command:
    from jobgen.cli.serve import serve_command

    return serve_command(_export_for_serve)


def _chat() -> click.Command:
    from jobgen.cli.serve import chat

    return chat


def _cluster() -> click.Command:
    from jobgen.devcluster.cli import cluster

    return cluster


def _watchdog() -> click.Command:
    from watchdogs.cli import watchdog

    return watchdog


def _logs() -> click.Command:
    from jobgen.cli.logs import logs

    return logs


def _samples() -> click.Command:
    from jobgen.cli.samples import samples

    return samples


main.lazy.update(
    cluster=_cluster, watchdog=_watchdog, serve=_serve, chat=_chat, compare=_compare, logs=_logs, samples=_samples
)


def _site() -> click.Command:
    from jobgen.cli.site import site

    return site


def _example() -> click.Command:
    from jobgen.cli.examples import example

    return example


def _image() -> click.Command:
    from jobgen.cli.image import image

    return image


def _data() -> click.Command:
    from trainer.prepare_data import data

    return data


main.lazy.update(site=_site, example=_example, image=_image, data=_data)

if __name__ == "__main__":
    main()
