"""Start-up costs: the CLI's latency, and a job's time from start to its first step.

1. **CLI latency.** ``jobgen --help``, ``jobgen validate`` and ``jobgen render`` of the main
   example (examples/sft.toml, its model made locally), each the median of ``--repeats``
   runs, against ``python -c pass`` (the interpreter's own start) and ``python -c "import
   torch"`` (what the CLI must never pay). Each command is also checked not to import torch,
   transformers or datasets.
2. **Start to first step** of the bundled trainer under ``torchrun`` (2 processes on gloo, the
   example's model and data), from the trainer's own ``first_step`` record: total seconds and
   the phases (launch, imports, rendezvous, data, model, resume, first_step). Three runs: a cold
   data cache (the data is tokenized), a warm cache, and a resume from a checkpoint.
   Under Slurm the launch phase also holds the scheduler's and srun's share; bench/goodput.py
   reports it for jobs on the dev cluster.
3. **CPU a start pays**, median CPU-seconds (user + system) of fresh interpreters, each against
   its baseline measured in the same run: a rank reading the warm cache entry of run 2 after
   ``import torch`` (``datasets.load_from_disk``, what ranks did before, against
   :class:`trainer.data.examples.Examples`, what they do), and an array task's
   reproducibility record (``import torch`` for versions.json plus ``pip freeze``, before,
   against ``python -m jobgen.launch.repro --versions`` and ``--freeze``). On 2 shared cores
   the suite's wall time is its CPU, and every rank and task of it pays these.

On any machine with the [train] extra, no cluster needed (about 2 minutes on 2 CPU cores):

    .venv/bin/python bench/startup.py --work DIR [--repeats 10]

Prints two tables and writes ``DIR/startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import REPO, VENV_BIN, make_run, read_jsonl, torchrun
from jobgen.base.paths import EXAMPLES_DIR

HEAVY = ("torch", "transformers", "datasets")
# Runs the CLI in-process, then reports whether any heavy module was imported.
CLI_PROBE = (
    "import sys; from click.testing import CliRunner; from jobgen.cli.main import main; "
    "r = CliRunner().invoke(main, sys.argv[1:]); assert r.exit_code == 0, r.output; "
    f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
)


def median_seconds(argv: list[str], repeats: int, cwd: Path) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cli_latency(work: Path, repeats: int) -> dict[str, dict[str, float | list[str]]]:
    example = work / "example"
    shutil.rmtree(example, ignore_errors=True)
    shutil.copytree(EXAMPLES_DIR, example, ignore=shutil.ignore_patterns("tiny-model"))
    subprocess.run([VENV_BIN / "jobgen", "make-tiny-model", example / "tiny-model"], check=True, capture_output=True)
    python, jobgen, spec = str(VENV_BIN / "python"), str(VENV_BIN / "jobgen"), str(example / "sft.toml")
    commands = {
        "python -c pass": ([python, "-c", "pass"], None),
        "python -c 'import torch'": ([python, "-c", "import torch"], None),
        "jobgen --help": ([jobgen, "--help"], ["--help"]),
        "jobgen validate sft.toml": ([jobgen, "validate", spec], ["validate", spec]),
        "jobgen render sft.toml": ([jobgen, "render", spec], ["render", spec]),
    }
    results: dict[str, dict[str, float | list[str]]] = {}
    for name, (argv, cli_args) in commands.items():
        entry: dict[str, float | list[str]] = {"seconds": round(median_seconds(argv, repeats, work), 4)}
        if cli_args is not None:
            probe = subprocess.run([python, "-c", CLI_PROBE, *cli_args], capture_output=True, text=True, check=True)
            entry["heavy_imports"] = json.loads(probe.stdout.strip().splitlines()[-1].replace("'", '"'))
        results[name] = entry
    return results


def cpu_seconds(argv: list[str], repeats: int, cwd: Path) -> float:
    """Median CPU-seconds (user + system) of ``argv`` run to its end."""
    samples = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        samples.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(samples)


# The batch script's versions.json before it read package metadata: an import of torch per task.
VERSIONS_BY_IMPORT = """
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
import torch
info["torch"] = torch.__version__
info["cuda"] = torch.version.cuda
info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
print(json.dumps(info, indent=2))
"""


def start_cpu(work: Path, repeats: int) -> dict[str, float]:
    """CPU-seconds of what every rank and every array task pays at its start (section 3)."""
    (entry,) = (work / "startup-run").rglob("dataset/state.json")
    python, dataset = str(VENV_BIN / "python"), str(entry.parent)
    read = (
        f"from pathlib import Path; from trainer.data.examples import Examples; len(Examples.open(Path({dataset!r})))"
    )
    probes = {
        "rank: import torch": [python, "-c", "import torch"],
        "rank: + datasets.load_from_disk": [
            python,
            "-c",
            f"import torch, datasets; len(datasets.load_from_disk({dataset!r}))",
        ],
        "rank: + Examples.open": [python, "-c", f"import torch; {read}"],
        "task record: torch import + pip freeze": [python, "-c", VERSIONS_BY_IMPORT],
        "task record: repro --versions + --freeze": [python, "-m", "jobgen.launch.repro", "--versions"],
    }
    cpu = {name: cpu_seconds(argv, repeats, REPO) for name, argv in probes.items()}
    cpu["task record: torch import + pip freeze"] += cpu_seconds([python, "-m", "pip", "freeze"], repeats, REPO)
    cpu["task record: repro --versions + --freeze"] += cpu_seconds(
        [python, "-m", "jobgen.launch.repro", "--freeze"], repeats, REPO
    )
    return {name: round(seconds, 3) for name, seconds in cpu.items()}


def first_step(work: Path, model: Path) -> dict[str, dict[str, float]]:
    shutil.rmtree(work / "startup-run", ignore_errors=True)  # its data cache (runs/.cache) included
    run = make_run(work / "startup-run", model, max_steps=4, save_every_steps=2)
    results = {}
    for case, max_steps in (("cold data cache", 2), ("warm data cache", 2), ("resume from a checkpoint", 4)):
        if case == "warm data cache":
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
            (run / "done").unlink(missing_ok=True)
        if case == "resume from a checkpoint":
            (run / "done").unlink(missing_ok=True)
        spec = json.loads((run / "spec.json").read_text())
        spec["run"]["train"]["max_steps"] = max_steps
        (run / "spec.json").write_text(json.dumps(spec))
        proc = torchrun(run, nproc=2, env={"JOBGEN_JOB_START": str(time.time())})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        record = [r for r in read_jsonl(run / "tasks.jsonl") if r["event"] == "first_step"][-1]
        results[case] = {"seconds_to_first_step": record["seconds_to_first_step"], **record["startup_seconds"]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["HF_HUB_OFFLINE"] = "1"

    cli = cli_latency(args.work, args.repeats)
    base = cli["python -c pass"]["seconds"]
    print(f"CLI latency, median of {args.repeats} ({platform.node()}, {os.cpu_count()} CPUs)")
    for name, entry in cli.items():
        heavy = entry.get("heavy_imports")
        imports = ""
        if heavy is not None:
            imports = f"imports {heavy}!" if heavy else "imports none of torch, transformers, datasets"
        print(f"  {name:<28} {entry['seconds'] * 1000:7.0f} ms  {entry['seconds'] / base:6.1f}x python  {imports}")

    starts = first_step(args.work, args.work / "example" / "tiny-model")
    print("Start to first step, torchrun 2 processes (seconds)")
    phases = ["launch", "imports", "rendezvous", "data", "model", "resume", "first_step"]
    print(f"  {'':<26} {'total':>6}" + "".join(f" {p:>10}" for p in phases))
    for case, entry in starts.items():
        cells = "".join(f" {entry.get(p, 0):10.2f}" for p in phases)
        print(f"  {case:<26} {entry['seconds_to_first_step']:6.2f}{cells}")
    cpu = start_cpu(args.work, args.repeats)
    print(f"CPU a start pays, median of {args.repeats} fresh interpreters (CPU-seconds)")
    base = cpu["rank: import torch"]
    old, new = cpu["rank: + datasets.load_from_disk"] - base, cpu["rank: + Examples.open"] - base
    for name, seconds in cpu.items():
        print(f"  {name:<42} {seconds:6.2f}")
    print(f"  reading the entry after torch: {old:.2f} -> {new:.2f} CPU-s per rank ({old / max(new, 1e-3):.1f}x)")
    old, new = cpu["task record: torch import + pip freeze"], cpu["task record: repro --versions + --freeze"]
    print(f"  the record of an array task: {old:.2f} -> {new:.2f} CPU-s ({old / max(new, 1e-3):.1f}x)")
    out = {
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs",
        "cli": cli,
        "first_step": starts,
        "start_cpu": cpu,
    }
    (args.work / "startup.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
