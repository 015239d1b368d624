"""What a watchdog link may run or unpickle: a file of this user's, in a directory of this
user's, neither writable by anyone else.

A watchdog home (default ``<runs_root>/.watchdogs``) lives where a team may share the runs
root. Each link of a chain runs, as the user who installed it, every executable in
``cron.<interval>/`` (watchdogs.scheduler.run_job_files), and each link is a pickle in
``logs/<interval>/`` that submitit unpickles when the job starts. A teammate who could write
either would run code as that user. So:

- the home and the directories the links run from are made without write for group and
  other, whatever the umask (:func:`private_directory`), and a link's files are written
  under umask 022;
- a job file or link pickle that is not this user's, or that another can write, or whose
  directory is not this user's or is writable by another, is refused in one line and never
  run or unpickled (:func:`untrusted`). A link checks its own pickle before submitit reads it:

      python -m watchdogs.home_trust --wait 60 LOGS/<job id>_submitted.pkl || exit 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import time
from pathlib import Path

from jobgen.base.owned_dir import owner_name

PRIVATE_MODE = 0o755
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UntrustedHome(RuntimeError):
    """A watchdog home (or a directory in it) that is another user's: jobgen will not use it."""


def untrusted(path: Path) -> str | None:
    """Why this user may not run or unpickle ``path`` (one line naming the file), or None."""
    me = os.geteuid()
    target = path.resolve()  # a link is judged by where it is and by what it leads to
    checked = [(path.parent, f"its directory {path.parent}"), (target, "it")]
    if target.parent != path.parent:
        checked.insert(1, (target.parent, f"the directory {target.parent}"))
    for what, said in checked:
        try:
            info = os.stat(what)
        except OSError as exc:
            return f"{said}: {exc.strerror}"
        if info.st_uid != me:
            return f"{said} belongs to {owner_name(info.st_uid)}, not to {owner_name(me)}"
        if info.st_mode & OTHERS_WRITE:
            return f"{said} is writable by others than {owner_name(me)} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def private_directory(path: Path) -> Path:
    """``path`` as a directory only this user can change: made with mode 0755 if missing (its
    parents as the umask has them), write for group and other taken off if it is this user's.
    Raises UntrustedHome when it is another user's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=PRIVATE_MODE)
    info = os.stat(path)
    if info.st_uid != os.geteuid():
        raise UntrustedHome(
            f"{path} belongs to {owner_name(info.st_uid)}: a watchdog home runs its files as its user, so it must be "
            f"yours alone ([watchdogs] home = a directory of your own)"
        )
    if info.st_mode & OTHERS_WRITE:  # an older home, a umask of 002, a default ACL
        os.chmod(path, stat.S_IMODE(info.st_mode) & ~OTHERS_WRITE)
    return path


def check_command(python: str, pickle: str) -> str:
    """The shell line a link's batch script runs before submitit unpickles ``pickle`` (a shell
    word, may name $SLURM_JOB_ID): the job ends there when the pickle is not trusted."""
    return f"{python} -m watchdogs.home_trust --wait 60 {pickle} || exit 1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Exit 1 with one line unless FILE is safe to run or unpickle.")
    parser.add_argument("file", type=Path)
    parser.add_argument("--wait", type=float, default=0, help="seconds to wait for FILE to appear (submitit's 60)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.wait
    while not args.file.exists() and time.monotonic() < deadline:
        time.sleep(1)  # submitit moves the pickle into place only once sbatch has answered
    reason = untrusted(args.file)
    if reason is not None:
        print(f"refusing to unpickle {args.file}: {reason}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
