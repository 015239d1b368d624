"""Who may change a run directory: its owner, as the umask says; the team only through
``switches/`` (setgid, group-writable), and a teammate's `jobgen stop` never tracebacks.

Teammates are real throwaway accounts (this suite runs as root, as on the CI machine),
and `jobgen` runs as them in a forked child (helpers.jobgen_as).
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import doctor_spec, jobgen_as, script_supervisor
from jobgen.job.effects import LocalEffects
from jobgen.job.settings import SupervisorSettings, Task
from jobgen.job.supervisor import Supervisor
from jobgen.launch.render import render
from jobgen.runs.materialize import materialize
from jobgen.runs.rundir import RunDir
from jobgen.spec.loader import load_run

GROUP, MATE, STRANGER = "jgperm", "jgpmate", "jgpstranger"


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def make_run(spec_dir: Path, runs_root: Path, name: str = "team") -> RunDir:
    spec = load_run(doctor_spec(spec_dir, name, runs_root=runs_root))
    run, _ = materialize(spec, render(spec), None)
    return run


@pytest.mark.parametrize(
    ("mask", "dirs", "files", "scripts"),
    [
        (0o022, 0o755, 0o644, 0o755),
        (0o002, 0o775, 0o664, 0o775),  # the user asked for a group-writable run: so be it
        (0o077, 0o700, 0o600, 0o700),
    ],
)
def test_the_run_directory_follows_the_umask_but_switches_are_shared(tmp_path: Path, mask, dirs, files, scripts):
    with umask(mask):
        run = make_run(tmp_path, tmp_path / "runs")
        run.record_job({"job_id": 1})
    assert mode(run.path) == dirs, oct(mode(run.path))
    for sub in ("logs", "checkpoints", "repro", "history"):
        assert mode(run.path / sub) == dirs, sub
    assert mode(run.spec_file) == files and mode(run.jobs_file) == files
    assert mode(run.script("doctor")) == scripts
    # The team's one shared surface, whatever the umask.
    assert mode(run.switches) == 0o3775


def test_continuing_a_run_repairs_its_switches_and_tightens_an_old_group_writable_root(tmp_path: Path):
    with umask(0o022):
        run = make_run(tmp_path, tmp_path / "runs")
        run.switches.chmod(0o755)  # as an older jobgen or a careful user left it
        run.path.chmod(0o2775)  # as jobgen left every run before it respected the umask
        make_run(tmp_path, tmp_path / "runs")
    assert mode(run.switches) == 0o3775
    assert mode(run.path) & 0o022 == 0, oct(mode(run.path))


def test_switch_files_are_group_writable_and_setting_twice_is_no_error(tmp_path: Path):
    with umask(0o022):
        run = make_run(tmp_path, tmp_path / "runs")
        path, created = run.set_switch("kill")
        assert (
            created and mode(path) == 0o664
        )  # a teammate may touch it; only its maker and the owner remove it (sticky)
        assert run.set_switch("kill") == (path, False)


# ------------------------------------------------------------ real teammates


def _ensure(kind: str, name: str, *args: str) -> bool:
    lookup = ["getent", "group", name] if kind == "group" else ["id", name]
    if subprocess.run(lookup, capture_output=True).returncode == 0:
        return False
    subprocess.run([f"{kind}add", *args, name], check=True, capture_output=True)
    return True


@pytest.fixture()
def team() -> Iterator[Path]:
    """A project directory of group GROUP (setgid, 2775) with MATE in the group and
    STRANGER outside it; the accounts go again afterwards."""
    if os.geteuid() != 0:
        pytest.fail("needs root to create throwaway accounts (the CI machine runs as root)")
    made_group = _ensure("group", GROUP)
    made_mate = _ensure("user", MATE, "--no-create-home", "--gid", GROUP, "--shell", "/bin/sh")
    made_stranger = _ensure("user", STRANGER, "--no-create-home", "--gid", "nogroup", "--shell", "/bin/sh")
    root = Path(f"/var/tmp/jobgen-perm-{uuid.uuid4().hex[:8]}")
    root.mkdir()
    shutil.chown(root, group=GROUP)
    root.chmod(0o2775)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for made, kind, name in (
            (made_stranger, "user", STRANGER),
            (made_mate, "user", MATE),
            (made_group, "group", GROUP),
        ):
            if made:
                subprocess.run([f"{kind}del", name], capture_output=True)


def test_a_teammate_stops_a_run_whose_kill_switch_the_owner_already_set(team: Path, tmp_path: Path):
    with umask(0o022):
        run = make_run(tmp_path, team)
        run.set_switch("kill")  # the owner was first
    owners = run.switches / "kill"
    code, out = jobgen_as(MATE, ["stop", str(run.path)], tmp_path / "out")
    assert code == 0 and "Traceback" not in out, out
    assert "already set" in out and pwd.getpwuid(owners.stat().st_uid).pw_name == "root"

    # The teammate first: their file stays in the run's group, writable by the owner's team.
    code, out = jobgen_as(MATE, ["save", str(run.path)], tmp_path / "out")
    saved = run.switches / "save"
    assert code == 0 and "created" in out, out
    assert pwd.getpwuid(saved.stat().st_uid).pw_name == MATE and grp.getgrgid(saved.stat().st_gid).gr_name == GROUP
    assert mode(saved) == 0o664


def test_someone_outside_the_team_gets_a_clean_error(team: Path, tmp_path: Path):
    with umask(0o022):
        run = make_run(tmp_path, team)
        spec_before = run.spec_file.read_bytes()
    code, out = jobgen_as(STRANGER, ["abort", str(run.path)], tmp_path / "out")
    assert code == 1 and "Traceback" not in out, out
    assert out.startswith("jobgen: ") and str(run.switches) in out and "abort" in out, out
    assert not (run.switches / "abort").exists()
    # Nor can the team touch what is not theirs: spec.json and checkpoints are the owner's.
    assert run.spec_file.read_bytes() == spec_before and mode(run.path) & 0o022 == 0


def _shell_function(text: str, name: str) -> str:
    """A function of the rendered script, from its ``name() {`` line to its closing brace."""
    lines = text.splitlines()
    one_line = [x for x in lines if x.startswith(f"{name}() {{ ") and x.endswith("}")]
    if one_line:
        return one_line[0]
    start = next(i for i, x in enumerate(lines) if x.startswith(f"{name}() {{"))
    end = lines.index("}", start)
    return "\n".join(lines[start : end + 1])


def test_the_stop_request_replaces_a_planted_link_instead_of_writing_through_it(tmp_path: Path):
    # A teammate plants switches/stop.<job>.<restart> -> a file of the owner's after the start-up
    # clean-up; then Slurm's lead-time signal arrives and the supervisor leaves its request.
    with umask(0o022):
        run = make_run(tmp_path, tmp_path / "runs")
    text = render(load_run(tmp_path / "run.toml"))
    victim = tmp_path / "owners-file"
    victim.write_text("precious\n")
    planted = run.stop_request(7, 0)
    planted.symlink_to(victim)
    settings = SupervisorSettings.model_validate(script_supervisor(text))
    task = Task.from_env({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0", "JOBGEN_LOCAL": "1"})
    effects = LocalEffects(settings, task, run)
    Supervisor(settings, task, effects, {})._request_stop("USR1")  # what its signal handler's flag leads to
    assert victim.read_text() == "precious\n"  # nothing written through the link
    assert not planted.is_symlink() and planted.read_text().split()[0] == "USR1"
    assert [p.name for p in run.switches.iterdir()] == [planted.name]  # no temporary file left
    assert mode(run.switches) & stat.S_ISVTX  # the sticky bit: a member cannot swap another's file


@pytest.mark.parametrize("target", ["nowhere", "spec.json"], ids=["dangling", "to-a-file"])
def test_a_link_at_a_switch_is_not_a_switch_for_anyone(tmp_path: Path, target: str):
    from jobgen.runtime.stopping import Action, startup_switch

    with umask(0o022):
        run = make_run(tmp_path, tmp_path / "runs")
    kill = run.switches / "kill"
    kill.symlink_to(run.path / target)
    # The trainer, the batch script and `jobgen stop` agree: a link is not a set switch...
    assert startup_switch(run.switches) is Action.CONTINUE
    text = render(load_run(tmp_path / "run.toml"))
    (check,) = [x.strip() for x in text.splitlines() if x.strip().startswith('if [[ -f "$SWITCHES/$switch"')]
    probe = f"SWITCHES={shlex.quote(str(run.switches))}; switch=kill; {check} echo set; else echo unset; fi"
    assert subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout == "unset\n"
    # ...so `jobgen stop` sets the switch, and then all of them see it.
    _path, created = run.set_switch("kill")
    assert created and not kill.is_symlink() and kill.is_file()
    assert startup_switch(run.switches) is Action.KILL
    assert subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout == "set\n"


@pytest.mark.parametrize("target", ["another run directory", "a directory of yours", "nothing"])
def test_a_link_at_the_run_directorys_name_is_refused_and_nothing_is_written_through_it(tmp_path: Path, target):
    """Issue 45: a teammate who can write a shared runs root puts a link at your run's name;
    submitting the run refuses it instead of writing spec, scripts and later checkpoints
    through it."""
    from jobgen.runs.rundir import RunDirError

    runs_root = tmp_path / "runs"
    other = make_run(tmp_path / "other-spec", tmp_path / "elsewhere", name="team")  # a spec.json to find there
    where = {"another run directory": other.path, "a directory of yours": tmp_path / "mine", "nothing": tmp_path / "x"}
    (tmp_path / "mine").mkdir()
    runs_root.mkdir()
    os.symlink(where[target], runs_root / "team")
    before = sorted(p.name for p in where[target].iterdir()) if where[target].exists() else None
    with pytest.raises(RunDirError, match="is a symbolic link: jobgen writes a run only into its own directory"):
        make_run(tmp_path / "spec", runs_root)
    after = sorted(p.name for p in where[target].iterdir()) if where[target].exists() else None
    assert before == after and (runs_root / "team").is_symlink()
