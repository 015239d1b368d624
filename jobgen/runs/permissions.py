"""Who may write what in a run directory: the modes jobgen gives it, their repair on a
continued run, and the one-line reason when a directory of it is not writable.

The names of the run directory live in :mod:`jobgen.runs.rundir`; this module takes paths
and spells none of them.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path
from typing import Any

from jobgen.base.atomic import current_umask

# switches/ is the team's one shared surface, whatever the owner's umask: group members
# flip switches (also with plain `touch`), setgid keeps the files in the run's group, and
# a switch file is group-writable so a teammate may touch it again. The sticky bit keeps
# one member from deleting or replacing another's file (a stop request the batch shell
# wrote, a switch): only its maker and the run's owner may. Everything else follows the
# umask: a teammate who could replace spec.json or plant a checkpoint (resume loads it)
# would run code as the owner.
SWITCHES_MODE = 0o3775
SWITCH_FILE_MODE = 0o664


def why_not_writable(directory: Path, exc: OSError) -> str:
    """A one-line reason for an error message (no traceback for a permission problem)."""
    try:
        st = directory.stat()
    except OSError:
        st = None
    if not isinstance(exc, PermissionError) or st is None:
        return f"{directory}: {exc.strerror}"
    owner, group = _account(pwd.getpwuid, st.st_uid), _account(grp.getgrgid, st.st_gid)
    return (
        f"{directory} is not writable by you (owner {owner}, group {group}, mode "
        f"{stat.S_IMODE(st.st_mode):o}); ask {owner} to set it, or to add you to group {group}"
    )


def _account(lookup: Any, ident: int) -> str:
    try:
        return lookup(ident)[0]
    except KeyError:  # an id with no name on this host (another site's NFS)
        return str(ident)


def repair_modes(root: Path, switches: Path) -> None:
    """A continued run gets the modes a new one has: switches/ shared (a missing or
    tightened one would lock the team out), and a root that runs made before jobgen
    followed the umask left group-writable (2775) loses what the umask forbids. Only
    an owner may chmod; what is someone else's waits for their next submission.
    ``root`` is the run directory, ``switches`` its switches/ (RunDir's names)."""
    me = os.geteuid()
    st = switches.stat()
    if st.st_uid == me and stat.S_IMODE(st.st_mode) != SWITCHES_MODE:
        os.chmod(switches, SWITCHES_MODE)
    st = root.stat()
    allowed = stat.S_IMODE(st.st_mode) & ~current_umask()
    if st.st_uid == me and allowed != stat.S_IMODE(st.st_mode):
        os.chmod(root, allowed)
