"""Rendered scripts: golden files, shell syntax, shellcheck, quoting, and every branch.

Golden files change only with ``pytest tests/unit/test_render.py --update-golden``; a
diff in review is the point.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DATA, GOLDEN, check_shell, doctor_spec, jobgen, run_spec
from jobgen.base.exit_codes import ExitCode
from jobgen.base.paths import CHECKOUT
from jobgen.launch.render import build_context, render, sbatch_directives
from jobgen.runs.rundir import STARTUP_SWITCHES, RunDir
from jobgen.spec.loader import load_run

SPECS = sorted(p for p in (GOLDEN / "specs").glob("*.toml") if not p.name.endswith("-site.toml"))


def rendered(spec_path: Path) -> str:
    return render(load_run(spec_path))


def assert_golden(text: str, golden: Path, update_golden: bool) -> None:
    """The rendered text is the reviewed golden file; ``--update-golden`` rewrites it."""
    if update_golden or not golden.exists():
        if not update_golden:
            pytest.fail(f"{golden} missing: run pytest --update-golden and review it")
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs; review and run pytest --update-golden"


def script_lines_output(lines: list[str], env: dict[str, str]) -> str:
    """What bash prints running these lines of a rendered script, with only ``env`` (and PATH)
    set: how a value the script computes comes out on a node."""
    proc = subprocess.run(
        ["bash", "-c", "\n".join(lines)],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "PATH": "/usr/bin:/bin"},
    )
    return proc.stdout


def normalised(text: str) -> str:
    # The environment the tests run in (python.kind = "auto" resolves to it), then the checkout:
    # the golden files hold neither's path.
    return text.replace(sys.prefix, "@VENV@").replace(str(CHECKOUT), "@PROJECT@")


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
def test_matches_golden(spec_path: Path, update_golden: bool):
    assert_golden(normalised(rendered(spec_path)), GOLDEN / f"{spec_path.stem}.sbatch", update_golden)


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
def test_bash_syntax_and_shellcheck(spec_path: Path, tmp_path: Path):
    check_shell(rendered(spec_path), tmp_path, "job.sbatch")


def directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def by_name(stem: str) -> str:
    return rendered(GOLDEN / "specs" / f"{stem}.toml")


def test_header_derives_every_number_from_the_spec():
    text = by_name("h100-ib-train")
    d = directives(text)
    assert "--nodes=4" in d and "--ntasks-per-node=1" in d and "--cpus-per-task=96" in d
    assert "--gres=gpu:8" in d and "--time=2-00:00:00" in d and "--signal=B:USR2@600" in d
    assert "--exclude=gpu017,gpu[20-22]" in d and "--hint=nomultithread" in d and "--exclusive" in d
    assert "--constraint=h100&ib" in d and "--account=llm" in d and "--qos=normal" in d and "--gpu-bind=none" in d
    assert "--nproc-per-node=8" in text and '--expected-world-size "$((SLURM_NNODES * 8))"' in text
    assert "EXPECTED_NODES=4" in text and "export OMP_NUM_THREADS=12" in text
    assert "sbatch --array=1-10%1 train.sbatch" in text


def test_ib_versus_sockets():
    ib, sock = by_name("h100-ib-train"), by_name("cloud-ethernet-train")
    assert "export NCCL_IB_DISABLE=0" in ib and "export NCCL_IB_HCA=mlx5" in ib and "NCCL_NET=Socket" not in ib
    assert "export NCCL_IB_DISABLE=1" in sock and "export NCCL_NET=Socket" in sock
    assert "export NCCL_SOCKET_IFNAME=ib0" in ib and "export GLOO_SOCKET_IFNAME=eth0" in sock


def test_venv_modules_container():
    venv, modules, container = by_name("local-doctor"), by_name("h100-ib-train"), by_name("cloud-ethernet-train")
    assert f"source {sys.prefix}/bin/activate" in venv and "module load" not in venv
    assert "module purge" in modules and "module load cuda/12.4.1" in modules
    assert modules.index("module load gcc/12.2.0") < modules.index("module load nccl/2.21.5")
    assert "source /lustre/shared/envs/llm/bin/activate" in modules
    assert "'--container-image=registry.example.org#team/jobgen:0.1.0'" in container
    # The runs root, the snapshots' memory and the checkout at their paths; the site's /fsx covers HF_HOME.
    mounts = f"/shared/runs:/shared/runs,/dev/shm:/dev/shm,{CHECKOUT}:{CHECKOUT},/fsx:/fsx"
    assert f"'--container-mounts={mounts}'" in container
    # The launch line runs the node script in the image; so do the supervisor's helper steps.
    assert "--container-workdir=/shared/runs" in container and 'bash -c "$NODE_LAUNCH"' in container
    # The supervisor on the batch host, with the Python that submitted; PYTHONNOUSERSITE for the steps.
    assert f'exec {sys.prefix}/bin/python3 -m jobgen.job --settings "$JOBGEN_SUPERVISOR"' in container
    assert "export PYTHONNOUSERSITE=1" in container
    assert '"container": [\n    "--container-image=registry.example.org#team/jobgen:0.1.0",' in container
    assert 'py_on_head() { run_on_head "${SRUN_CONTAINER[@]}" "$@"; }' in container


def test_per_node_output_and_debug():
    text = by_name("consumer-nfs-train")
    # The run's own name, not %x: inside a sweep %x is the sweep's name, not the point's.
    assert '--output="$JOBGEN_RUN_DIR/logs/lora-sft-%j-%N.out"' in text
    assert "export NCCL_DEBUG=INFO" in text
    assert 'NCCL_DEBUG_FILE="${RUN_DIR//\\%/%%}/logs/nccl-$SLURM_JOB_ID-%h-%p.log"' in text
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text and "export NCCL_P2P_DISABLE=1" in text
    assert "--gres=gpu:rtx4090:4" in directives(text) and "--nodelist=ws[01-03]" in directives(text)
    assert "%N" not in by_name("h100-ib-train")


def test_bare_site_branches():
    text = by_name("bare-train")
    d = directives(text)
    assert "--no-requeue" in d and not any(x.startswith("--partition") for x in d)
    assert not any(x.startswith(("--gres", "--gpus", "--mem", "--exclude", "--hint")) for x in d)
    assert "RDZV_PORT=29400" in text and 'HEAD_ADDR="$HEAD_NODE"' in text
    assert '--local-addr="$NODE_ADDR"' not in text and "NCCL_SOCKET_IFNAME" not in text.split("if ! on_slurm")[0]
    assert "run_on_head" not in text
    assert "source " not in text and "module " not in text


def test_kill_switch_is_checked_before_anything_else():
    text = by_name("local-doctor")
    body = text.split("set -euo pipefail", 1)[1]
    check = body.index("for switch in kill abort; do")
    test = body.index('[[ -f "$SWITCHES/$switch" && ! -L "$SWITCHES/$switch" ]]')  # a link is no switch
    assert check < test < body.index("srun") and check < body.index("source ")
    train = by_name("h100-ib-train")
    # kill/abort, then a failure that would repeat, then done: all before the environment.
    switches, failed, done = (
        train.index("for switch in kill abort"),
        train.index("/failed ]]"),
        train.index("/done ]]"),
    )
    assert switches < failed < done < train.index("module purge")


def test_no_localhost_fallback_for_the_head_node():
    text = by_name("h100-ib-train")
    assert "localhost" not in text.replace("fall back to localhost", "")
    assert "127.0.0.1" not in text
    assert 'die "no head node' in text and 'die "head node $HEAD_NODE has no IPv4 address' in text


def test_the_supervisor_takes_the_signals_and_runs_the_launch_line():
    text = by_name("local-doctor")
    # The batch shell becomes the supervisor (exec: Slurm's B: signal reaches it); until it has
    # installed its handlers the lead-time signal and SIGTERM are ignored, not fatal.
    assert text.rstrip().endswith('exec python -m jobgen.job --settings "$JOBGEN_SUPERVISOR"')
    assert text.index("trap '' USR1 TERM") < text.index("exec python -m jobgen.job")
    train = by_name("h100-ib-train")
    # Earlier attempts' stop requests are deleted before the supervisor exists to leave one.
    assert train.index('rm -f "$SWITCHES/stop.') < train.index("exec python -m jobgen.job")
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600" in train  # torchrun default 30 s would cut a save on SIGTERM
    # torchrun's agent must survive a USR1 sent to the whole step; the workers catch it.
    assert text.index("trap '' USR1 USR2") < text.index("exec python -m jobgen.runtime.torchrun")
    # The launch line a user can copy: srun, one task per node, the node script.
    assert 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1' in train
    assert 'bash -c "$NODE_LAUNCH"' in train and "export NODE_LAUNCH JOBGEN_SRUN_LAUNCH" in train


@pytest.mark.parametrize(
    "code, words, exits, comment",
    [
        (13, "", 0, "jobgen: time limit near: saved and stopped (exit 13)"),
        (12, "time limit (USR1 90 s before the limit): saving and exiting", 0, None),
        (10, "", 0, None),
        (0, "reached max_steps", 0, None),
        (11, "", 11, "jobgen: abort switch: stopped without saving (exit 11)"),
        (1, 'crashed: RuntimeError: boom \\ "quoted"\tand\x01', 1, None),
        (14, "", 14, None),
        (137, "", 137, "jobgen: the program ended with status 137 and left no exit record"),
    ],
)
def test_planned_stops_exit_0_and_every_end_sets_the_comment(tmp_path: Path, code, words, exits, comment):
    """The script's finish(): Slurm records COMPLETED (exit 0) for the planned stops and
    FAILED with jobgen's code otherwise; the reason goes to scontrol update Comment=."""
    text = render(load_run(GOLDEN / "specs" / "bare-train.toml"))
    functions = text[text.index("log() {") : text.index("\n", text.index("die() {"))]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/scontrol.args\n')
    (fake / "scontrol").chmod(0o755)
    probe = f"set -euo pipefail\n{functions}\nfinish {code} {shlex.quote(words)}\necho not reached"
    (tmp_path / "logs").mkdir()
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_ARRAY_JOB_ID": "41",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "RUN_DIR": str(tmp_path),
        "JOBGEN_JOB_START": "1700000000",
    }
    proc = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env)
    assert proc.returncode == exits, proc.stderr
    assert "not reached" not in proc.stdout
    args = (tmp_path / "scontrol.args").read_text().splitlines()
    # ARRAYID_TASK: the last task's own id is the array's id, and JobId=<it> names every task.
    assert args[:2] == ["update", "JobId=41_2"]
    told = words or ExitCode(code).reason if code in ExitCode._value2member_map_ else words
    expected = comment or f"jobgen: {told} (exit {code})"
    assert args[2].startswith(f"Comment={expected}"), args
    # The script's own record, for status once Slurm forgot the job: valid JSON whatever the reason holds.
    record = json.loads((tmp_path / "logs" / "task.42.0.json").read_text())
    assert record["exit_code"] == code and record["slurm_exit"] == exits
    ids = (record["job_id"], record["array_job_id"], record["array_task"], record["nodes"])
    assert ids == ("42", "41", "2", "node[1-2]")
    assert record["job_start"] == 1700000000 and record["end"] >= record["job_start"]
    if code == 1:
        assert record["reason"] == 'crashed: RuntimeError: boom \\ "quoted" and '
    assert not list((tmp_path / "logs").glob("*.tmp.*"))


def test_env_values_reach_bash_verbatim(tmp_path: Path):
    """Run the rendered export lines in bash and read the values back: nothing executes."""
    spec = load_run(GOLDEN / "specs" / "bare-train.toml")
    text = render(spec)
    exports = "\n".join(
        line
        for line in text.splitlines()
        if line.startswith("export ") and "=" in line and line.split("=")[0].split()[-1] in spec.run.env
    )
    marker = tmp_path / "pwned"
    probe = (
        exports.replace("/tmp/pwned", str(marker))
        + "\n"
        + "\n".join(f'printf "%s\\0" "${name}"' for name in sorted(spec.run.env))
    )
    out = subprocess.run(["bash", "-c", probe], capture_output=True, check=True).stdout.decode()
    expected = [v.replace("/tmp/pwned", str(marker)) for _, v in sorted(spec.run.env.items())]
    assert out.split("\0")[:-1] == expected
    assert not marker.exists()


def test_context_is_pure_and_complete():
    """Rendering needs no cluster: building the context runs no subprocess."""
    spec = load_run(GOLDEN / "specs" / "local-doctor.toml")
    orig = subprocess.Popen
    try:
        subprocess.Popen = None  # type: ignore[assignment,misc]
        ctx = build_context(spec)
        render(spec)
    finally:
        subprocess.Popen = orig  # type: ignore[misc]
    assert ctx["world_size"] == 4 and ctx["omp_threads"] == 1
    assert ctx["entry_words"].startswith("-m trainer.doctor --run-dir")


def test_render_cli_writes_files(tmp_path: Path):
    proc = jobgen("render", str(GOLDEN / "specs" / "local-doctor.toml"), "-o", str(tmp_path / "out"), check=True)
    out = tmp_path / "out" / "doctor.sbatch"
    assert str(out) in proc.stdout and out.read_text() == rendered(GOLDEN / "specs" / "local-doctor.toml")
    assert re.match(r"#!/bin/bash\n", out.read_text())


# --- Paths and options the user does not fully control (issue 9, defects 8 and 9) ---------------------------


def sbatch_arguments(text: str) -> list[str]:
    """The argv sbatch builds from the script's #SBATCH lines, parsed as Slurm 22.05 does
    (src/sbatch/opt.c get_argument): whitespace splits, '…' and "…" group, a backslash
    escapes the next character, an unquoted '#' starts a comment; parsing stops at the
    first line that is neither blank nor a comment."""
    args: list[str] = []
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            if line.strip():
                break
            continue
        if not line.startswith("#SBATCH"):
            continue
        i, rest = 0, line[len("#SBATCH") :]
        while i < len(rest):
            while i < len(rest) and rest[i].isspace():
                i += 1
            if i == len(rest):
                break
            arg, quote, escaped = "", "", False
            while i < len(rest) and (quote or not rest[i].isspace()):
                ch = rest[i]
                i += 1
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                    continue
                elif quote:
                    if ch == quote:
                        quote = ""
                        continue
                elif ch in "\"'":
                    quote = ch
                    continue
                elif ch == "#":
                    i = len(rest)
                    break
                arg += ch
            assert not quote, f"sbatch: unmatched quote in {line!r}"
            if arg:
                args.append(arg)
    return args


def option(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def batch_filename(pattern: str, job_name: str, job_id: int) -> str:
    """What slurmd makes of a batch job's --output (src/slurmd/common/fname.c): a backslash
    anywhere turns every replacement off, '%%' is a '%', %x and %j are the name and id."""
    assert "\\" not in pattern, "a backslash would turn off %x and %j"
    return re.sub(r"%([%xj])", lambda m: {"%": "%", "x": job_name, "j": str(job_id)}[m.group(1)], pattern)


def test_spec_path_cannot_break_out_of_the_header_comment(tmp_path: Path):
    """A directory name with a newline must stay inside the comment, not become a command."""
    marker = tmp_path / "pwned"
    spec_file = doctor_spec(tmp_path / f"x\ntouch {marker}\n#", runs_root=str(tmp_path / "runs"))
    text = render(load_run(spec_file))
    check_shell(text, tmp_path)
    lines = text.splitlines()
    assert not any(line.startswith("touch") for line in lines)
    header = [line for line in lines if line.startswith("# Generated by jobgen")]
    assert len(header) == 1 and repr(str(spec_file)) in header[0]
    # sbatch still reads every #SBATCH line: the first command comes after them.
    assert option(sbatch_arguments(text), "job-name") == "doc"
    subprocess.run(["bash", "-c", text.split("\nset -euo pipefail", 1)[0]], check=True)
    assert not marker.exists()


@pytest.mark.parametrize("dirname", ["my runs", "a%jb", "odd #dir", 'it\'s "quoted"', "tab\there", "50%%x"])
def test_run_dir_reaches_sbatch_literally(tmp_path: Path, dirname: str):
    """A relative runs_root resolves under the run.toml's directory, whatever its name:
    --chdir gets the literal path, --output the literal path with Slurm's %-patterns escaped."""
    spec = load_run(doctor_spec(tmp_path / dirname))
    run_dir = str(tmp_path / dirname / "runs" / "doc")
    assert str(spec.run_dir) == run_dir
    text = render(spec)
    args = sbatch_arguments(text)
    assert option(args, "chdir") == run_dir
    assert batch_filename(option(args, "output"), "doc", 42) == f"{run_dir}/logs/doc-42.out"
    assert option(args, "job-name") == "doc" and "--open-mode=append" in args
    check_shell(text, tmp_path)


def test_extra_sbatch_option_with_a_space_is_one_argument(tmp_path: Path):
    site = {"profile": "local", "slurm": {"extra_sbatch": ["--comment=my run #1", "--gpu-bind=none"]}}
    text = render(load_run(doctor_spec(tmp_path, site=site)))
    args = sbatch_arguments(text)
    assert "--comment=my run #1" in args and "--gpu-bind=none" in args
    assert "--gpu-bind=none" in directives(text)  # plain tokens stay as they were
    check_shell(text, tmp_path)


def test_nccl_debug_file_keeps_a_percent_in_the_run_dir(tmp_path: Path):
    """NCCL expands %h, %p and %% in NCCL_DEBUG_FILE (src/debug.cc): the run dir part must be literal."""
    spec = load_run(doctor_spec(tmp_path / "a%hb c", site={"profile": "local", "network": {"debug": True}}))
    text = render(spec)
    lines = text.splitlines()
    probe = [
        next(line for line in lines if line.startswith("RUN_DIR=")),
        next(line for line in lines if line.startswith("export NCCL_DEBUG_FILE=")),
        'printf "%s" "$NCCL_DEBUG_FILE"',
    ]
    value = script_lines_output(probe, {"SLURM_JOB_ID": "7"})
    nccl = re.sub(r"%([%hp])", lambda m: {"%": "%", "h": "node1", "p": "99"}[m.group(1)], value)
    assert nccl == f"{spec.run_dir}/logs/nccl-7-node1-99.log"
    check_shell(text, tmp_path)


# --- One layout (issue 10): the script's names are RunDir's, its #SBATCH lines are data -------------------


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
def test_sbatch_lines_are_the_directives_list(spec_path: Path):
    spec = load_run(spec_path)
    assert directives(render(spec)) == sbatch_directives(spec)


def test_names_the_script_builds_are_the_run_directorys(tmp_path: Path):
    """Run the script's own lines in bash, as attempt 2 of job 7 on node1: every name it builds
    is the one RunDir gives Python, whatever the run directory is called."""
    # A relative runs_root lands under it. (No '%': srun's --output of the per-node logs would
    # read one as a pattern; NCCL's file name is checked with one above.)
    home = tmp_path / "my 'odd' dir"
    (home / "model").mkdir(parents=True)
    (home / "data.jsonl").write_text("{}\n")
    spec = load_run(
        run_spec(
            home,
            "doc",
            site={"profile": "local", "network": {"debug": True}, "slurm": {"output_per_node": True}},
            job={"time": "1h", "runs_root": "runs"},
            model={"path": "model"},
            data={"path": "data.jsonl"},
        )
    )
    run = RunDir(spec.run_dir)
    text = render(spec)
    lines = text.splitlines()

    def line(prefix: str) -> str:
        (found,) = [x.strip() for x in lines if x.strip().startswith(prefix)]
        return found

    run.switches.mkdir(parents=True)
    for name in ("stop.7", "stop.7.0", "stop.7.1", "stop.70.0", "stop.8.0", "kill"):
        (run.switches / name).touch()
    probe = [
        line("RUN_DIR="),
        line("SWITCHES="),
        'JOBGEN_RUN_DIR="$RUN_DIR"',
        line("REPRO_DIR="),
        line("export NCCL_DEBUG_FILE="),
        "LOG_DIR=" + line("--log-dir=").removeprefix("--log-dir=").removesuffix(" \\"),
        "NODE_LOG=" + line('--output="$JOBGEN_RUN_DIR').removeprefix("--output=").removesuffix(" \\"),
        line('rm -f "$SWITCHES/stop.'),  # the clean-up of earlier attempts' requests
        'printf "%s\\n" "$REPRO_DIR" "$LOG_DIR" "$NODE_LOG" "$NCCL_DEBUG_FILE"',
    ]
    out = script_lines_output(probe, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2", "SLURMD_NODENAME": "node1"})
    out = out.splitlines()
    slurm_names = {"x": "doc", "j": "7", "N": "node1", "h": "node1", "p": "99", "%": "%"}
    node_log = re.sub(r"%([%xjN])", lambda m: slurm_names[m.group(1)], out[2])
    nccl = re.sub(r"%([%hp])", lambda m: slurm_names[m.group(1)], out[3])
    assert out[:2] == [
        str(run.repro(7)),
        str(run.rank_logs(7, "node1")),
    ]
    assert node_log == str(run.node_log("doc", 7, "node1")) and nccl == str(run.nccl_debug_log(7, "node1", "99"))
    assert batch_filename(option(sbatch_arguments(text), "output"), "doc", 7) == str(run.batch_log("doc", 7))
    # Every request an attempt of job 7 can have left is gone; other jobs' and the switches stay.
    assert sorted(p.name for p in run.switches.iterdir()) == ["kill", "stop.70.0", "stop.8.0"]
    assert f"for switch in {' '.join(STARTUP_SWITCHES)}; do" in lines


def test_without_graceful_stop_no_lead_time_signal_is_asked_for(tmp_path: Path):
    graceful = render(load_run(doctor_spec(tmp_path / "a")))
    assert option(sbatch_arguments(graceful), "signal") == "B:USR1@60"  # exit_grace 1m
    text = render(load_run(doctor_spec(tmp_path / "b", graceful_stop=False)))
    assert not any(arg.startswith("--signal") for arg in sbatch_arguments(text))
    assert "# job.graceful_stop = false" in text
    check_shell(text, tmp_path)


# --- The serve job (jobgen serve): its own script on the same environment parts ----------------------------

SERVE_SPECS = [
    GOLDEN / "serve-specs" / "local-serve.toml",  # every [serve] key
    GOLDEN / "specs" / "h100-ib-train.toml",  # the defaults on a GPU site with modules
    GOLDEN / "specs" / "cloud-ethernet-train.toml",  # a pyxis container
]


def serve_job_of(spec_path: Path):
    from jobgen.serve.render import serve_job_for_run

    spec = load_run(spec_path)
    return serve_job_for_run(spec, spec.run_dir / "served" / "step-00000040", "step-00000040", state_dir=spec.run_dir)


def rendered_serve(spec_path: Path) -> str:
    from jobgen.serve.render import render_serve

    return render_serve(serve_job_of(spec_path))


@pytest.mark.parametrize("spec_path", SERVE_SPECS, ids=lambda p: p.stem)
def test_serve_script_matches_golden(spec_path: Path, update_golden: bool):
    assert_golden(normalised(rendered_serve(spec_path)), GOLDEN / f"serve-{spec_path.stem}.sbatch", update_golden)


@pytest.mark.parametrize("spec_path", SERVE_SPECS, ids=lambda p: p.stem)
def test_serve_script_syntax_shellcheck_and_directives(spec_path: Path, tmp_path: Path):
    from jobgen.serve.render import serve_directives

    text = rendered_serve(spec_path)
    check_shell(text, tmp_path)
    assert directives(text) == serve_directives(serve_job_of(spec_path))


def test_serve_script_is_pure():
    """Rendering the serve script runs no subprocess (the engine is chosen on the node)."""
    job = serve_job_of(SERVE_SPECS[1])
    orig = subprocess.Popen
    try:
        subprocess.Popen = None  # type: ignore[assignment,misc]
        from jobgen.serve.render import render_serve

        text = render_serve(job)
    finally:
        subprocess.Popen = orig  # type: ignore[misc]
    assert "--engine auto" in text and "--gpus 1" in text


def test_serve_header_is_one_node_with_the_serve_tables_resources():
    local = sbatch_arguments(rendered_serve(SERVE_SPECS[0]))
    for expected in ("--job-name=llama-sft-serve", "--nodes=1", "--ntasks=1", "--cpus-per-task=2", "--mem=8G"):
        assert expected in local
    assert option(local, "time") == "00:30:00" and option(local, "partition") == "short"
    assert option(local, "exclude") == "node3" and "--no-requeue" in local
    assert not any(a.startswith(("--gres", "--gpus", "--signal", "--array")) for a in local)
    assert option(local, "chdir") == "/shared/runs/llama-sft"
    assert batch_filename(option(local, "output"), "llama-sft-serve", 42) == "/shared/runs/llama-sft/logs/serve/42.out"
    gpu = sbatch_arguments(rendered_serve(SERVE_SPECS[1]))
    assert "--gres=gpu:1" in gpu and option(gpu, "time") == "04:00:00" and option(gpu, "partition") == "gpu"
    assert "--cpus-per-task=96" in gpu and "--gpu-bind=none" in gpu  # the site's, and its extra options
    container = rendered_serve(SERVE_SPECS[2])
    assert '"${SRUN_CONTAINER[@]}" "${SERVE[@]}" &' in container
    assert "--container-mounts=/shared/runs/qwen-sft:/shared/runs/qwen-sft," in container


def test_serve_arguments_reach_the_supervisor_verbatim(tmp_path: Path):
    """Run the script's SERVE=(...) lines in bash: each value arrives as one argument, as typed,
    whatever the run directory is called; nothing executes."""
    from jobgen.serve.render import render_serve, serve_job_for_run

    marker = tmp_path / "pwned"
    home = tmp_path / "my 'odd' dir"
    args = ["--log-level", "info", f'it\'s $(touch {marker}) `touch {marker}`; "x"']
    spec_file = run_spec(
        home,
        "llm",
        job={"time": "1h", "runs_root": "runs"},
        model={"path": "org/model"},
        data={"path": str(DATA)},
        serve={"engine": "transformers", "port": 8123, "model_name": "team/llm", "args": args},
    )
    spec = load_run(spec_file)
    model_dir = spec.run_dir / "served" / "step-00000040"
    text = render_serve(serve_job_for_run(spec, model_dir, "step-00000040", state_dir=spec.run_dir))
    check_shell(text, tmp_path)
    block = text[text.index("\nSERVE=(\n") : text.index("\n)\n", text.index("\nSERVE=(\n")) + 3]
    run_dir_line = next(line for line in text.splitlines() if line.startswith("RUN_DIR="))
    probe = f'{run_dir_line}\n{block}\nprintf "%s\\0" "${{SERVE[@]}}"'
    env = {"SLURM_JOB_ID": "7", "JOBGEN_IFNAME": "eth0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", probe], capture_output=True, check=True, env=env).stdout.decode()
    assert out.split("\0")[:-1] == [
        *("python", "-m", "jobgen.serve.node", "--state-dir", str(spec.run_dir), "--job-id", "7"),
        *("--model-dir", str(model_dir), "--model-name", "team/llm", "--checkpoint", "step-00000040"),
        *("--engine", "transformers", "--gpus", "0", "--dtype", "auto", "--interface", "eth0", "--port", "8123"),
        *("--ready-timeout", "900", "--stop-grace", "20", "--", *args),
    ]
    assert not marker.exists()
