"""The one way the benchmarks set up and run jobgen's trainer: the spec a user would write
(tests/helpers.run_spec), the run directory ``jobgen submit`` would make of it, and
``torchrun --standalone`` on this machine. A benchmark names only what it measures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import run_spec, torchrun


def random_bf16_model(target: Path, shape: dict[str, int], *, max_positions: int, max_shard_size: str = "5GB") -> None:
    """A Llama of ``shape`` with random bf16 weights, written as sharded safetensors with the
    tokenizer (once per working directory), built on the GPU when there is one."""
    if (target / "config.json").exists():
        return
    import torch

    from jobgen.cli.tinymodel import make_tiny_model

    make_tiny_model(
        target,
        **shape,
        model_vocab_size=32000,
        max_position_embeddings=max_positions,
        dtype="bfloat16",
        device="cuda" if torch.cuda.is_available() else "cpu",
        max_shard_size=max_shard_size,
    )


def prepared_run(
    work: Path, name: str, *, procs: int = 1, site: str | dict[str, object] = "local", **tables: dict
) -> tuple[Path, Path]:
    """The run directory and spec file (``work/NAME.toml``) of a run of these tables
    ([model], [data], [train], [eval]...) with ``procs`` ranks and a 2-hour [job] (with the keys
    of a ``job`` table given). A run
    directory an earlier invocation left is removed (it would only say "already finished");
    the data cache beside it (runs/.cache) stays, as it would for a user's second run."""
    from jobgen.launch.render import render
    from jobgen.runs.materialize import materialize
    from jobgen.spec.loader import load_run

    job = {"time": "2h", "runs_root": "runs", "procs_per_node": procs, **tables.pop("job", {})}
    spec_file = run_spec(work, name, site=site, filename=f"{name}.toml", job=job, **tables)
    spec = load_run(spec_file)
    shutil.rmtree(spec.run_dir, ignore_errors=True)
    run, _ = materialize(spec, render(spec), spec_file.read_text())
    return run.path, spec_file


def write_result(path: Path | None, result: dict) -> None:
    """A GPU proof's ``--json FILE``: its figures and checks (or its error), which
    bench/gpu_proofs.py turns into a row of its table; nothing without ``--json``."""
    if path is not None:
        path.write_text(json.dumps(result, indent=2) + "\n")


def train(
    run: Path, procs: int, *, env: dict[str, str] | None = None, timeout: float = 7200
) -> subprocess.CompletedProcess[str]:
    """The trainer on ``run`` under torchrun with ``procs`` ranks; a failed run ends the
    benchmark with the tail of its output (a figure of a failed run means nothing)."""
    proc = torchrun(run, nproc=procs, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{run.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc
