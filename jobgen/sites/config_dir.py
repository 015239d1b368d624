"""Where a user's own site profiles live: ``$XDG_CONFIG_HOME/jobgen/sites/<name>.toml``
(``~/.config/jobgen/sites`` without XDG_CONFIG_HOME), and writing one there.

The directory is the user's own (0700 when created here): a profile may name an account, a
reservation, a mail relay. A profile there is never replaced by accident: ``jobgen site init``
over an existing one needs ``--force``. It is written to a temporary name, fsynced and renamed
(:mod:`jobgen.base.atomic`), so that a run loading it meanwhile reads the old or the new one,
never half of one.
"""

from __future__ import annotations

from pathlib import Path

from jobgen.base.atomic import write_text_atomic
from jobgen.base.paths import user_config_dir
from jobgen.sites.profile_writer import spec_value
from jobgen.spec.tables.site import SiteName


class ProfileExists(FileExistsError):
    """A profile of that name is already there, and ``--force`` was not given."""


def user_sites_dir() -> Path:
    """``$XDG_CONFIG_HOME/jobgen/sites``, or ``~/.config/jobgen/sites``: the directory the
    loader searches for a profile name after $JOBGEN_SITE_PATH (jobgen.spec.loader), by the same
    :func:`jobgen.base.paths.user_config_dir`, so that what is written here is what a run finds."""
    return user_config_dir() / "sites"


def profile_path(name: str) -> Path:
    """Where the user's profile ``name`` lives. The name is checked as a site name first: it
    becomes a file name, and '../x' or '/etc/x' must not."""
    return user_sites_dir() / f"{spec_value(SiteName, name, 'site name')}.toml"


def write_profile(name: str, text: str, force: bool = False) -> Path:
    """Write profile ``name`` into :func:`user_sites_dir` (created 0700 if missing) and return
    its path; :class:`ProfileExists` when one is there and ``force`` is not given."""
    path = profile_path(name)
    # 0700 before the umask, for the directories created here only: one that exists is the
    # user's, with the modes they chose.
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists() and not force:
        raise ProfileExists(f"{path} exists; `jobgen site init {name} --force` replaces it")
    # 0600: the profile may name an account or a reservation, nobody else's business.
    write_text_atomic(path, text, mode=0o600)
    return path
