"""A watchdog home runs and unpickles only what its user alone can write (issue 30).

A link of a chain runs every job file of its cron.<interval>/ and is itself a pickle in
logs/<interval>/ that submitit unpickles when the job starts, both as the user who installed
it. A file another user owns or can write, or one in such a directory, is refused in one line
and never run or unpickled; homes are made without write for others whatever the umask.
The link's own batch script (as submitit renders it for sbatch, run here by bash as Slurm
would) checks its pickle before submitit reads it.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import pytest

from watchdogs.home_trust import UntrustedHome, private_directory, untrusted
from watchdogs.scheduler import Chain, WatchdogHome, run_job_files, submit_link, write_job_file


def _job_file(directory: Path, name: str, marker: Path, mode: int = 0o755) -> Path:
    path = directory / name
    path.write_text(f"#!/bin/sh\ntouch {marker}\n")
    os.chmod(path, mode)
    return path


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    return pwd.getpwnam("nobody").pw_uid


@pytest.mark.parametrize("how", ["group-writable file", "world-writable file", "group-writable directory", "owner"])
def test_a_job_file_another_user_could_write_is_refused_and_never_runs(tmp_path: Path, how):
    home = WatchdogHome(tmp_path / "home")
    private_directory(home.path)
    directory = private_directory(home.cron_dir("1m"))
    _job_file(directory, "a.ok", tmp_path / "ok-ran")
    bad = _job_file(directory, "b.planted", tmp_path / "pwned", {"group-writable file": 0o775}.get(how, 0o755))
    if how == "world-writable file":
        os.chmod(bad, 0o757)
    elif how == "group-writable directory":
        os.chmod(directory, 0o775)
    elif how == "owner":
        os.chown(bad, _nobody(), -1)
    chain = Chain("1m", 60, "tok", None, None, 180, 86400)
    results = {r["job_file"]: r for r in run_job_files(home, chain, time.time() + 120)}
    assert not (tmp_path / "pwned").exists()
    refused = results["b.planted"]
    assert refused["exit_code"] == 126 and refused["output"].startswith(f"refusing to run {bad}: "), refused
    assert "\n" not in refused["output"]
    if how == "group-writable directory":  # every file in it is refused: anyone in the group could swap one in
        assert "its directory" in refused["output"] and results["a.ok"]["exit_code"] == 126
    else:
        assert results["a.ok"]["exit_code"] == 0 and (tmp_path / "ok-ran").exists()
        assert ("belongs to nobody" if how == "owner" else "it is writable by others") in refused["output"]


def test_a_link_to_a_file_in_a_shared_directory_is_refused(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    target = _job_file(shared, "check", tmp_path / "pwned")
    home = WatchdogHome(tmp_path / "home")
    private_directory(home.path)
    link = private_directory(home.cron_dir("1m")) / "x.check"
    link.symlink_to(target)
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert untrusted(link) == f"the directory {shared} is writable by others than {me} (mode 777)"


def test_homes_are_made_without_write_for_others_whatever_the_umask(tmp_path: Path):
    old = os.umask(0o002)
    try:
        home = WatchdogHome(tmp_path / "runs" / ".watchdogs")
        path = write_job_file(home, 3600, "r.disk", "#!/bin/sh\n")
        older = tmp_path / "older"
        older.mkdir(mode=0o777)
        os.chmod(older, 0o777)  # a home an older jobgen made under umask 000
        private_directory(older)
    finally:
        os.umask(old)
    for directory in (home.path, home.cron_dir("hourly"), older):
        assert os.stat(directory).st_mode & 0o022 == 0, (directory, oct(os.stat(directory).st_mode))
    assert untrusted(path) is None


def test_another_users_home_is_refused(tmp_path: Path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, _nobody(), -1)
    with pytest.raises(UntrustedHome, match=f"{theirs} belongs to nobody"):
        write_job_file(WatchdogHome(theirs), 3600, "r.disk", "#!/bin/sh\n")
    assert not (theirs / "cron.hourly").exists()


@pytest.fixture()
def fake_slurm(tmp_path: Path, monkeypatch) -> Path:
    """sbatch that keeps the script it was given and answers job 4242; srun, which submitit
    looks for. The script lands in ``tmp_path/submitted.sh``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/submitted.sh\necho "Submitted batch job 4242"\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    for name in ("sbatch", "srun"):
        os.chmod(bin_dir / name, 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # as inside a link: the successor must not inherit it
    return tmp_path / "submitted.sh"


def _planted_pickle(path: Path, marker: Path) -> None:
    code = (
        "import os, sys, cloudpickle\n"
        "class P:\n    def __reduce__(self): return (os.system, (sys.argv[2],))\n"
        "open(sys.argv[1], 'wb').write(cloudpickle.dumps(P()))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path), f"touch {marker}"], check=True)


def test_a_link_unpickles_only_its_own_pickle(tmp_path: Path, fake_slurm: Path):
    home = WatchdogHome(tmp_path / "home")
    chain = Chain("hourly", 3600, "tok", None, None, 600, 86400)
    old = os.umask(0o002)
    try:
        assert submit_link(home, chain, 0) == 4242
    finally:
        os.umask(old)
    pickle = home.log_dir("hourly") / "4242_submitted.pkl"
    assert untrusted(pickle) is None  # written under umask 022, in a directory made for it
    script = fake_slurm.read_text()
    assert f"#SBATCH --chdir={home.path}" in script  # not wherever `install` happened to run

    def run_link_job() -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return subprocess.run(
            ["bash", str(fake_slurm)], env={**env, "SLURM_JOB_ID": "4242"}, capture_output=True, text=True, timeout=120
        )

    trusted = run_link_job()  # the check passes: submitit runs the link, which finds no chain record
    assert trusted.returncode == 0 and "link 4242 is not the recorded one" in trusted.stdout, trusted

    marker = tmp_path / "pwned"
    pickle.unlink()
    _planted_pickle(pickle, marker)
    os.chmod(pickle, 0o666)  # what a umask of 000, or a teammate, leaves
    planted = run_link_job()
    assert planted.returncode == 1 and not marker.exists(), planted
    assert planted.stdout.strip() == f"refusing to unpickle {pickle}: it is writable by others than " + (
        pwd.getpwuid(os.geteuid())[0] + " (mode 666)"
    )
