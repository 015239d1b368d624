"""Bring the dev cluster up, repair it, and read its status (``down`` is in teardown.py).

Entry points (also behind ``jobgen cluster up|down|status``)::

    python -c 'import jobgen.devcluster as c; c.up(nodes=2, netns=True)'
    python -c 'import jobgen.devcluster as c; c.down()'

Rules that shape the code:

* Every resource is recorded in the state file the moment it exists, so a
  killed ``up`` leaves a record and ``down`` (or the next ``up``) undoes it.
* ``down`` only touches what the record names: pids are verified against
  their command line, /etc/slurm/slurm.conf is removed only if it still points
  at our slurm.conf, and munged only if we started it.
* A second ``up`` with the same shape restarts any dead daemon and otherwise
  does nothing; a record whose daemons are all dead is stale and is cleaned.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import time
from pathlib import Path

from . import accounting, daemons, instances, nodelocal, procs, slurm_builds
from . import netns as netns_mod
from .config import (
    DEFAULT_PARTITION,
    MARIADB_PORT,
    PARTITIONS,
    SLURMCTLD_PORT,
    SLURMD_BASE_PORT,
    SLURMDBD_PORT,
    Layout,
    make_gpu_files,
    render_gres_conf,
    render_slurm_conf,
)
from .daemons import log
from .state import (
    ClusterError,
    ClusterInfo,
    State,
    global_lock,
    load_state,
    require_root,
    resolve_state_dir,
    save_state,
)
from .teardown import log_warnings, teardown

SYSTEM_SLURM_CONF = Path("/etc/slurm/slurm.conf")
DEFAULT_TIMEOUT = 120.0
# What a state dir may hold; anything else means the directory is not ours to wipe.
OUR_ENTRIES = {
    *("state.json", "slurm.conf", "slurmdbd.conf", ".slurmdbd.conf.tmp", "gres.conf"),
    *("log", "run", "slurmctld", "spool", "mariadb", "gpus", "node-local", "nodes"),
}


def _hostname() -> str:
    # slurmctld only starts on a host whose short name matches SlurmctldHost.
    return socket.gethostname().split(".")[0]


def status(state_dir: str | os.PathLike[str] | None = None) -> ClusterInfo | None:
    """The running cluster's info with live node states, or None when it is not up.

    ``jobgen cluster status [--json]``.

    Safe for plain users and other processes: it only reads the state file,
    /proc/PID/cmdline and ``sinfo``.
    """
    state = load_state(resolve_state_dir(state_dir))
    if state is None or state.phase != "up":
        return None
    live = daemons.live_daemons(state)
    if "slurmctld" not in live:
        return None
    info = state.info
    info.daemons = live
    try:
        info.node_states = daemons.node_states(info.slurm_conf, slurm_prefix=info.slurm_prefix)
    except Exception:  # noqa: BLE001 - best effort: a hung slurmctld must not break status()
        info.node_states = {}
    return info


# --- up ------------------------------------------------------------------------


def up(
    nodes: int = 2,
    cpus_per_node: int = 4,
    netns: bool = False,
    state_dir: str | os.PathLike[str] | None = None,
    *,
    mem_per_node_mb: int = 4096,
    timeout: float = DEFAULT_TIMEOUT,
    gpus: list[int] | None = None,
    slurm: str = slurm_builds.SYSTEM_SERIES,
) -> ClusterInfo:
    """Start (or repair) the dev cluster and return its status once every node answers.

    ``jobgen cluster up --nodes N --cpus-per-node C [--netns] [--gpus 3,1] [--slurm 24.11] [--state-dir DIR]``.
    ``gpus``: fake GPUs (GRES) node by node, one count for every node or one per node. ``slurm``:
    this machine's packages, or a release built once into a cache (jobgen.devcluster.slurm_builds).
    Same shape as a running cluster: restart dead daemons, else do nothing. Other shape:
    ClusterError (run ``down`` first). A record whose daemons are all dead is torn down first.
    Installs slurm-wlm, munge, slurmdbd and mariadb-server if missing.
    """
    require_root("up")
    _check_asked(nodes, cpus_per_node, mem_per_node_mb, netns, slurm)
    root = resolve_state_dir(state_dir)
    per_node = gpu_counts(gpus, nodes)
    wanted = {
        "nodes": nodes,
        "cpus_per_node": cpus_per_node,
        "mem_per_node_mb": mem_per_node_mb,
        "netns": netns,
        "gpus": per_node,
        "slurm": slurm,
    }
    with global_lock():
        existing = load_state(root)
        if existing is not None:
            if not daemons.live_daemons(existing):
                log(f"found a stale dev cluster record in {root} (no daemon alive); cleaning it up")
                log_warnings(teardown(existing))
            elif existing.info.shape != wanted:
                raise ClusterError(
                    f"a dev cluster with a different shape is up in {root} "
                    f"({_describe(existing.info.shape)}; asked for {_describe(wanted)}); "
                    f"run `jobgen cluster down` first"
                )
            else:
                _repair(existing, timeout)
                info = status(root)
                if info is None:
                    raise ClusterError(f"the dev cluster in {root} did not come back; run `jobgen cluster down`")
                return info
        _check_system_conf(root)
        instance = instances.claim(root, alive=_alive)
        _check_port_free(instance.port(SLURMCTLD_PORT))
        _fresh_up(root, instance, nodes, cpus_per_node, netns, mem_per_node_mb, timeout, per_node, slurm)
    info = status(root)
    if info is None:
        raise ClusterError(f"the dev cluster in {root} went away right after starting")
    return info


def _check_asked(nodes: int, cpus_per_node: int, mem_per_node_mb: int, netns: bool, slurm: str) -> None:
    """Refuse a cluster that cannot be, before anything starts."""
    if nodes < 1 or cpus_per_node < 1 or mem_per_node_mb < 64:
        raise ClusterError("need nodes >= 1, cpus_per_node >= 1 and mem_per_node_mb >= 64")
    slurm_builds.prefix_of(slurm)  # an unknown series
    if slurm != slurm_builds.SYSTEM_SERIES and not netns:
        # Checked on 24.11 only with netns, where each node is a host of its own (config.render_slurm_conf).
        raise ClusterError(f"--slurm {slurm} needs --netns: its nodes must each be a host of their own")


def gpu_counts(gpus: list[int] | None, nodes: int) -> list[int]:
    """``--gpus``, node by node: one count is every node's, else one count per node."""
    if not gpus:
        return [0] * nodes
    if any(count < 0 for count in gpus):
        raise ClusterError(f"--gpus {','.join(map(str, gpus))}: a node cannot have fewer than 0 GPUs")
    if len(gpus) == 1:
        return gpus * nodes
    if len(gpus) != nodes:
        raise ClusterError(f"--gpus {','.join(map(str, gpus))}: one count, or one per node ({nodes})")
    return list(gpus)


def _alive(state_dir: Path) -> bool:
    """Whether a dev cluster is recorded in ``state_dir`` with a daemon still running."""
    state = load_state(state_dir)
    return state is not None and bool(daemons.live_daemons(state))


def _describe(shape: dict[str, object]) -> str:
    mode = "netns" if shape["netns"] else "loopback"
    gpus = shape.get("gpus") or []
    gpu_text = f", GPUs {','.join(map(str, gpus))}" if any(gpus) else ""
    slurm = shape.get("slurm", slurm_builds.SYSTEM_SERIES)
    return (
        f"{shape['nodes']} nodes x {shape['cpus_per_node']} CPUs, {shape['mem_per_node_mb']} MB{gpu_text}, "
        f"{mode}, Slurm {slurm}"
    )


def _check_system_conf(root: Path) -> None:
    """/etc/slurm/slurm.conf must be absent, ours, or a leftover of a dead dev cluster."""
    conf = SYSTEM_SLURM_CONF
    if not conf.is_symlink():
        if conf.exists():
            raise ClusterError(
                f"{conf} exists and is not a dev-cluster symlink; this machine has its own Slurm. "
                f"Move it away to use `jobgen cluster up`."
            )
        return
    target = Path(os.readlink(conf))
    if target == root / "slurm.conf":
        # Ours, left by a run whose record is gone: recreate it, so that this
        # run records it and `down` removes it.
        conf.unlink()
        return
    other = load_state(target.parent) if target.parent.is_dir() else None
    if other is not None and daemons.live_daemons(other):
        return  # another dev cluster's, up: it keeps the link, this one is reached by SLURM_CONF
    if other is not None:
        log(f"cleaning up the stale dev cluster in {target.parent}")
        log_warnings(teardown(other))
    elif target.exists():
        raise ClusterError(f"{conf} is a symlink to {target}, which is not a dev cluster's; remove it first")
    if conf.is_symlink():
        log(f"removing dangling {conf} -> {target} left by a killed dev cluster")
        conf.unlink()


def _check_port_free(port: int) -> None:
    if not accounting.port_free(port):
        raise ClusterError(
            f"port {port} (slurmctld) is in use by another process; is another Slurm controller running?"
        )


def _fresh_up(
    root: Path,
    instance: instances.Instance,
    nodes: int,
    cpus: int,
    use_netns: bool,
    mem_mb: int,
    timeout: float,
    gpus: list[int],
    slurm: str,
) -> None:
    """A new cluster from nothing: packages, state dir, record, network, slurm.conf, daemons
    (MariaDB and slurmdbd before slurmctld, which reports every job to slurmdbd).
    Each resource is recorded as it is created; a failure undoes them all."""
    started = time.monotonic()
    if nodes > instances.MAX_NODES:
        raise ClusterError(f"a dev cluster has at most {instances.MAX_NODES} nodes")
    names = instance.node_names(nodes)
    prefix = slurm_builds.ensure(slurm, log, daemons.apt_install)
    apt_installed = _install_missing_packages(use_netns)
    net_plan = netns_mod.plan(names, instance.bridge) if use_netns else None
    _clear_state_dir(root)
    layout = Layout(root)
    layout.mkdirs(names)
    state = State(info=_new_cluster_info(layout, instance, names, net_plan, cpus, mem_mb))
    state.info.gpus = {name: count for name, count in zip(names, gpus) if count}
    state.info.slurm, state.info.slurm_prefix = slurm, str(prefix or "")
    if not nodelocal.set_up(state.info, layout, daemons.DAEMON_PATH):
        log(f"node-local directories: {nodelocal.UNAVAILABLE}")
    state.info.slurmdbd_port = accounting.pick_port(instance.port(SLURMDBD_PORT), "slurmdbd")
    state.info.mariadb_port = accounting.pick_port(instance.port(MARIADB_PORT), "the cluster's MariaDB")
    state.resources.apt_installed = apt_installed
    save_state(state)
    log(f"starting a {_describe(state.info.shape)} dev cluster in {root}")
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            # mariadb-install-db (about half a second) while the network and munge come up.
            datadir = pool.submit(accounting.init_datadir, layout)
            _create_network(state, net_plan)
            _write_slurm_conf(state, layout)
            _ensure_munge(state, layout)
            datadir.result()
        env = daemons.daemon_env(root, layout.slurm_conf, state.info.slurm_prefix)
        accounting.start(state, layout, env, set(accounting.DAEMONS), timeout)
        _start_slurm(state, layout, only=None, timeout=timeout, want={"idle"})
        state.phase = "up"
        save_state(state)
    except BaseException as exc:
        log(f"`up` failed ({type(exc).__name__}); undoing what it created")
        log_warnings(teardown(state))
        raise
    log(f"up in {time.monotonic() - started:.1f}s")


def _install_missing_packages(use_netns: bool) -> list[str]:
    """apt-get install what brings a missing binary: Slurm and munge, slurmdbd and MariaDB
    (and iproute2 for netns mode); returns the packages installed, for the record."""
    extra = ("ip", "nsenter") if use_netns else ()
    missing = daemons.missing_binaries(extra)
    if not missing:
        return []
    packages = sorted({daemons.PACKAGE_OF[b] for b in missing})
    log(f"missing {', '.join(missing)}; installing {' '.join(packages)}")
    daemons.apt_install(packages)
    still = daemons.missing_binaries(extra)
    if still:
        raise ClusterError(f"still missing after apt-get install: {', '.join(still)}")
    return packages


def _clear_state_dir(root: Path) -> None:
    """Remove the leftovers of a killed ``up`` that left no usable record; refuse a
    directory that holds anything a dev cluster does not write."""
    if not root.exists():
        return
    foreign = [p.name for p in root.iterdir() if p.name not in OUR_ENTRIES and not p.name.startswith(".state.")]
    if foreign:
        raise ClusterError(
            f"{root} exists and holds files that are not a dev cluster's ({', '.join(sorted(foreign)[:5])}); "
            f"choose another --state-dir"
        )
    shutil.rmtree(root)


def _new_cluster_info(
    layout: Layout,
    instance: instances.Instance,
    names: list[str],
    net_plan: netns_mod.NetPlan | None,
    cpus: int,
    mem_mb: int,
) -> ClusterInfo:
    """The record's description of the cluster about to start: nodes on their own addresses
    behind a bridge (netns mode), or all on 127.0.0.1."""
    use_netns = net_plan is not None
    if net_plan is not None:
        node_addrs, controller = net_plan.node_addrs, net_plan.bridge_addr
    else:
        node_addrs, controller = {n: "127.0.0.1" for n in names}, "127.0.0.1"
    return ClusterInfo(
        state_dir=str(layout.root),
        nodes=names,
        netns=use_netns,
        node_addrs=node_addrs,
        nic="eth0" if use_netns else "lo",
        partitions=list(PARTITIONS),
        slurm_conf=str(layout.slurm_conf),
        default_partition=DEFAULT_PARTITION,
        cpus_per_node=cpus,
        mem_per_node_mb=mem_mb,
        hostname=_hostname(),
        controller_addr=controller,
        slurmctld_port=instance.port(SLURMCTLD_PORT),
        slurmd_ports={n: instance.port(SLURMD_BASE_PORT) + i for i, n in enumerate(names)},
        bridge=instance.bridge if use_netns else None,
        netns_names={n: netns_mod.ns_name(n) for n in names} if use_netns else {},
        log_dir=str(layout.log_dir),
        created_at=time.time(),
        instance=instance.number,
    )


def _create_network(state: State, net_plan: netns_mod.NetPlan | None) -> None:
    """netns mode: the bridge, a namespace and a veth pair per node. Both modes: the node
    names in /etc/hosts, so scripts may use them as hosts."""
    res = state.resources
    if net_plan is not None:

        def record(kind: str, name: str) -> None:
            if kind == "netns_dir":
                res.netns_dir_created = True
            elif kind == "bridge":
                res.bridge = name
            elif kind == "netns" and name not in res.namespaces:
                res.namespaces.append(name)
            elif kind == "veth" and name not in res.veths:
                res.veths.append(name)
            save_state(state)

        netns_mod.create(net_plan, record, instances.Instance(state.info.instance).bridge)
    res.hosts_block = True
    save_state(state)
    netns_mod.add_hosts(state.info.node_addrs, instances.Instance(state.info.instance).hosts_marker)


def _write_slurm_conf(state: State, layout: Layout) -> None:
    """The cluster's slurm.conf, and the /etc/slurm/slurm.conf symlink to it unless one exists."""
    info, res = state.info, state.resources
    layout.slurm_conf.write_text(
        render_slurm_conf(
            layout=layout,
            hostname=info.hostname,
            controller_addr=info.controller_addr,
            node_addrs=info.node_addrs,
            cpus_per_node=info.cpus_per_node,
            mem_per_node_mb=info.mem_per_node_mb,
            slurmdbd_port=info.slurmdbd_port,
            slurmctld_port=info.slurmctld_port,
            slurmd_ports=info.slurmd_ports,
            gpus=info.gpus,
            own_hosts=info.netns,
        )
    )
    layout.slurm_conf.chmod(0o644)
    if info.gpus:
        make_gpu_files(layout, info.gpus)
        layout.gres_conf.write_text(render_gres_conf(layout, info.gpus))
        layout.gres_conf.chmod(0o644)
    if not os.path.lexists(SYSTEM_SLURM_CONF):
        SYSTEM_SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SYSTEM_SLURM_CONF.symlink_to(layout.slurm_conf)
        res.slurm_conf_symlink = str(SYSTEM_SLURM_CONF)
        save_state(state)


def _ensure_munge(state: State, layout: Layout) -> None:
    if daemons.munge_answers():
        return
    res = state.resources
    if daemons.ensure_munge_key():
        res.munge_key_created = True
        save_state(state)
    log("starting munged")
    pid, rundir_created = daemons.start_munged(layout)
    res.munged_pid = pid
    res.munge_rundir_created = res.munge_rundir_created or rundir_created
    save_state(state)


def _start_slurm(state: State, layout: Layout, only: set[str] | None, timeout: float, want: set[str]) -> None:
    """Start slurmctld and the slurmds named in ``only`` (all when None), then wait.

    slurmctld must answer before the slurmds start: a slurmd that cannot
    register at startup waits for the controller's next ping, which is slow.
    """
    info, res = state.info, state.resources
    env = daemons.daemon_env(Path(info.state_dir), layout.slurm_conf, info.slurm_prefix)
    names = info.nodes if only is None else [n for n in info.nodes if n in only]
    # Watch the daemons left running too: one that dies meanwhile should fail
    # the wait at once, not after the timeout.
    watched = dict(daemons.live_daemons(state)) if only is not None else {}
    if only is None or "slurmctld" in only:
        pid = daemons.start_slurmctld(layout, env)
        res.daemons["slurmctld"] = pid
        save_state(state)
        watched["slurmctld"] = pid
        _wait_for_controller(layout, pid, info.slurm_prefix, timeout)
    for node in names:
        netns_path = netns_mod.ns_path(node) if info.netns else None
        pid = daemons.start_slurmd(layout, env, node, netns_path, node_local=bool(info.node_local))
        res.daemons[f"slurmd:{node}"] = pid
        save_state(state)
        watched[f"slurmd:{node}"] = pid
    daemons.wait_for_nodes(layout, info.nodes, watched, timeout, want=want, slurm_prefix=info.slurm_prefix)


def _wait_for_controller(layout: Layout, pid: int, slurm_prefix: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not procs.is_alive(pid):
            raise ClusterError(f"slurmctld (pid {pid}) exited at startup:\n" + daemons.logs_report(layout, []))
        try:
            daemons.node_states(layout.slurm_conf, timeout=5, slurm_prefix=slurm_prefix)
            return
        except Exception:  # noqa: BLE001 - not up yet, whatever the error: retry until the deadline
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"slurmctld did not answer within {timeout:.0f}s:\n" + daemons.logs_report(layout, [])
                ) from None
            time.sleep(0.3)


def _repair(state: State, timeout: float) -> None:
    """Restart whatever died (munged, MariaDB, slurmdbd, slurmctld, slurmds) in a cluster that is up."""
    layout = Layout(Path(state.info.state_dir))
    live = daemons.live_daemons(state)
    dead = {name for name in daemons.daemon_names(state) if name not in live}
    if not dead and daemons.munge_answers():
        log(f"already up in {state.info.state_dir}: nothing to do")
        return
    _ensure_munge(state, layout)
    if not dead:
        return
    log(f"restarting {', '.join(sorted(dead))}")
    if state.info.netns:
        missing = [n for n in state.info.nodes if not os.path.exists(netns_mod.ns_path(n))]
        if missing:
            raise ClusterError(
                f"the network namespaces of {', '.join(missing)} are gone; run `jobgen cluster down` and `up` again"
            )
    if state.info.node_local:
        nodelocal.make_dirs(layout, state.info.nodes)  # a slurmd whose directory is gone would not start
    env = daemons.daemon_env(Path(state.info.state_dir), layout.slurm_conf, state.info.slurm_prefix)
    accounting.start(state, layout, env, dead & set(accounting.DAEMONS), timeout)
    slurm = {name.removeprefix("slurmd:") for name in dead - set(accounting.DAEMONS)}
    if slurm:
        # Responsive is enough: nodes may be running jobs, or recovering to idle.
        _start_slurm(state, layout, only=slurm, timeout=timeout, want=daemons.RESPONSIVE)
    state.phase = "up"
    save_state(state)
