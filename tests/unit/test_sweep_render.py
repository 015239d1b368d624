"""A sweep's script on every kind of site Python: the claim runs in the job's own environment
(venv, modules, pyxis container), as the single-run script's Python does; and a point's
per-node launch logs carry the point's name, where ``jobgen logs`` looks for them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import check_shell, run_spec
from jobgen.launch.render import render
from jobgen.runs.rundir import RunDir
from jobgen.sweep.points import Sweep, load_sweep
from jobgen.sweep.render import render_sweep

# The Python environment part of a script (sbatch_templates/_python_env.j2).
PYTHON_ENV = re.compile(r"^# --- Python environment: .*?^export PYTHONPATH=.*?$", re.DOTALL | re.MULTILINE)


def sweep_on(directory: Path, profile: str) -> Sweep:
    """A 2-point sweep over train.lr on the site profile ``profile``."""
    (directory / "model").mkdir(exist_ok=True)
    (directory / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    extra = '[sweep]\nmax_parallel = 2\n[sweep.grid]\n"train.lr" = [1e-3, 2e-3]\n'
    job = {"time": "2m", "exit_grace": "50s", "array": 3, "runs_root": "runs"}
    path = run_spec(
        directory,
        "lrs",
        site={"profile": profile},
        job=job,
        model={"path": "model"},
        data={"path": "data.jsonl"},
        extra=extra,
    )
    return load_sweep(path)


@pytest.mark.parametrize("profile, kind", [("local", "venv"), ("h100-ib", "modules"), ("cloud-ethernet", "container")])
def test_the_claim_runs_in_the_jobs_own_python(tmp_path: Path, profile: str, kind: str):
    sweep = sweep_on(tmp_path, profile)
    assert sweep.base.site.python.kind == kind
    text = render_sweep(sweep)
    check_shell(text, tmp_path, "sweep.sbatch")

    assert "if ! answer=$(py_on_head python -m jobgen.sweep.claim --sweep" in text
    assert "python3" not in text
    # The same environment, text for text, as the base run's own script sets up.
    (env,) = PYTHON_ENV.findall(text)
    assert PYTHON_ENV.findall(render(sweep.base)) == [env]
    if kind == "container":
        assert "'--container-image=registry.example.org#team/jobgen:0.1.0'" in env
        (mounts,) = re.findall(r"'--container-mounts=([^']*)'", env)
        sources = [Path(mount.split(":")[0]) for mount in mounts.split(",")]
        assert any(sweep.base.runs_root.is_relative_to(source) for source in sources)  # holds the sweep
        assert 'py_on_head() { run_on_head "${SRUN_CONTAINER[@]}" "$@"; }' in env
        assert 'run_on_head() { srun --nodes=1 --ntasks=1 "$@"; }' in text
        assert text.index("run_on_head() {") < text.index("py_on_head() {")
    else:
        assert "SRUN_CONTAINER=()" in env and 'py_on_head() { "$@"; }' in env and "run_on_head" not in text
    if kind == "modules":
        assert "module purge" in env and "module load cuda/12.4.1" in env
        assert "source /lustre/shared/envs/llm/bin/activate" in env


def test_a_points_node_logs_carry_the_points_name(tmp_path: Path):
    """Slurm's %x in a sweep is the array's (the sweep's) name; the point's script names its
    node logs after the point, as jobgen logs reads them (RunDir.node_log)."""
    sweep = sweep_on(tmp_path, "consumer-nfs")
    assert sweep.base.site.slurm.output_per_node
    for point in sweep.points:
        (output,) = re.findall(r'--output=("\$JOBGEN_RUN_DIR/[^"]*")', render(point.spec))
        assert "%x" not in output
        expanded = output.strip('"').replace("$JOBGEN_RUN_DIR", str(point.spec.run_dir))
        expanded = expanded.replace("%j", "7").replace("%N", "node1")
        assert expanded == str(RunDir(point.spec.run_dir).node_log(point.name, 7, "node1"))


def test_render_o_lays_the_points_out_as_the_sweeps_directory_does(tmp_path: Path):
    from click.testing import CliRunner

    from jobgen.cli.main import main

    # Points named as the sweep's own script and index ('__-sweep.sbatch' -> 'sweep.sbatch').
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n')
    extra = '[sweep]\n[sweep.grid]\n"env.__" = ["sweep.sbatch", "sweep.json"]\n'
    job = {"time": "2m", "exit_grace": "50s", "runs_root": "runs"}
    path = run_spec(tmp_path, "lrs", job=job, model={"path": "model"}, data={"path": "data.jsonl"}, extra=extra)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["render", str(path), "-o", str(out)])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert (out / "sweep.sbatch").read_text() == render_sweep(load_sweep(path))
    for name in ("sweep.sbatch", "sweep.json"):
        assert (out / "points" / name / "train.sbatch").is_file(), sorted(out.rglob("*"))
