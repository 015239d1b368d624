"""Take a dev cluster down: undo exactly what its record names.

Owns ``down`` (``jobgen cluster down``) and :func:`teardown`, which ``down`` runs,
and ``up`` too, on a stale record or after a failed start. It stops the Slurm daemons (slurmdbd
included) and every job process below them, then the cluster's MariaDB, munged if ``up``
started it, then removes the munge key and run dir,
/etc/slurm/slurm.conf and the /etc/hosts block if ``up`` created them, and the
network namespaces, veths and bridge. The nodes' mount namespaces (nodelocal.py) end with
their last process, and their node-local directories go with the state dir. Pids are verified
against their command line first; errors are collected, and the state dir is removed only when
there were none, so that ``down`` can be run again.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from . import daemons, instances, procs
from . import netns as netns_mod
from .config import Layout
from .daemons import log
from .state import ClusterError, State, global_lock, load_state, require_root, resolve_state_dir


def down(state_dir: str | os.PathLike[str] | None = None, *, quiet: bool = False) -> bool:
    """Stop what ``up`` started and remove what it created; False when nothing was up (said
    unless ``quiet``: ``--all`` says it once for all clusters).

    ``jobgen cluster down [--state-dir DIR]``.  Packages installed by ``up``
    stay installed.
    """
    require_root("down")
    root = resolve_state_dir(state_dir)
    with global_lock():
        state = load_state(root)
        if state is None:
            if not quiet:
                log(f"no dev cluster recorded in {root}; nothing to do")
            return False
        started = time.monotonic()
        errors = teardown(state)
        log_warnings(errors)
        if errors:
            raise ClusterError("`down` could not undo everything:\n  " + "\n  ".join(errors))
        log(f"down in {time.monotonic() - started:.1f}s")
        return True


def teardown(state: State) -> list[str]:
    """Undo everything in the record, in reverse order; collect errors, never stop early."""
    info, res = state.info, state.resources
    layout = Layout(Path(info.state_dir))
    errors: list[str] = []

    # Slurm first: daemons, the slurmstepds they left behind, and every job
    # process below those (or, in netns mode, anywhere in the nodes' namespaces).
    # MariaDB last, once slurmdbd, its one client, is gone.
    live = daemons.live_daemons(state)
    mariadb = live.pop("mariadb", None)
    roots = set(live.values())
    roots |= procs.marked_pids(info.state_dir, info.slurm_conf)
    if info.netns:
        roots |= procs.pids_in_netns(netns_mod.ns_path(n) for n in info.nodes)
    if info.node_local:
        roots |= procs.pids_in_node_mntns(roots)
    targets = procs.with_descendants(roots)
    if targets:
        stepds = {p for p in targets if procs.comm(p) == "slurmstepd"}
        hard = procs.terminate(targets, grace=5.0, kill_first=stepds)
        if hard:
            log(f"killed {len(hard)} process(es) that ignored SIGTERM")
    left = [p for p in targets if procs.is_alive(p)] if targets else []
    left = [p for p in left if p not in procs.own_lineage()]
    if left:
        errors.append(f"processes still alive: {left}")
    if mariadb is not None and procs.terminate([mariadb], grace=30.0):
        # SIGTERM is a clean shutdown; only one stuck for 30 s is killed.
        log(f"killed mariadbd (pid {mariadb}), which ignored SIGTERM")

    # munged serves every dev cluster of the machine: the one that started it leaves it (and its
    # key) to the others while any of them is up.
    if not any(_up(other) for other in instances.others(Path(info.state_dir))):
        _stop_munge(state)

    if res.slurm_conf_symlink:
        link = Path(res.slurm_conf_symlink)
        if link.is_symlink() and Path(os.readlink(link)) == layout.slurm_conf:
            link.unlink()

    if res.hosts_block:
        try:
            netns_mod.remove_hosts(instances.Instance(info.instance).hosts_marker)
        except OSError as exc:
            errors.append(f"/etc/hosts: {exc}")

    errors += netns_mod.destroy(
        namespaces=res.namespaces, veths=res.veths, bridge=res.bridge, netns_dir=res.netns_dir_created
    )

    if not errors:
        shutil.rmtree(info.state_dir, ignore_errors=True)
        instances.release(Path(info.state_dir), info.instance)
    return errors


def _up(state_dir: Path) -> bool:
    other = load_state(state_dir)
    return other is not None and bool(daemons.live_daemons(other))


def _stop_munge(state: State) -> None:
    """munged, its key and its run dir, as far as ``up`` started or made them."""
    res = state.resources
    if res.munged_pid and procs.matches(res.munged_pid, "munged"):
        procs.terminate([res.munged_pid], grace=5.0)
    if res.munge_key_created:
        try:
            daemons.MUNGE_KEY.unlink()
        except FileNotFoundError:
            pass
    if res.munge_rundir_created:
        shutil.rmtree(daemons.MUNGE_RUNDIR, ignore_errors=True)


def log_warnings(errors: list[str]) -> None:
    for err in errors:
        log(f"warning: {err}")
