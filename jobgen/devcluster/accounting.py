"""The dev cluster's accounting: slurmdbd on a MariaDB server of its own, so that ``sacct``
answers as on a production cluster.

What ``up`` runs for a state dir S, before slurmctld (which sends slurmdbd every job)::

    mariadb-install-db --no-defaults --datadir=S/mariadb/data --user=mysql    (once)
    mariadbd --no-defaults --datadir=S/mariadb/data --socket=S/mariadb/mariadb.sock
             --port=P --bind-address=127.0.0.1 ...     (as user mysql; root where mysql
                                                        may not enter S: see _server_user)
    mariadb --no-defaults --socket=S/mariadb/mariadb.sock -u root  < SQL      (database and user)
    slurmdbd -D                                  (SLURM_CONF=S/slurm.conf: it reads S/slurmdbd.conf)

No ``sacctmgr add cluster``: slurmctld 22.05 adds its cluster to the database itself when it
first registers with slurmdbd (measured: `sacctmgr list cluster` shows it, and sacct answers,
right after `up`), and sacctmgr would cost ~0.6 s of `up` creating the same tables.

Never the machine's own MariaDB: ``--no-defaults`` keeps /etc/mysql out, and the datadir,
socket and port are the cluster's. The password of slurmdbd's database user is generated
here and written only into slurmdbd.conf (mode 0600, owned by the SlurmUser); the SQL that
sets it goes through the client's stdin, never its command line.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import re
import secrets
import socket
import subprocess
import time

from . import procs
from .config import ACCT_DB_NAME, ACCT_DB_USER, SLURM_USER, Layout, render_slurmdbd_conf
from .daemons import DAEMON_PATH, log, spawn, tail
from .state import ClusterError, State, save_state

# The names of the accounting daemons in the record, in the order they start.
DAEMONS = ("mariadb", "slurmdbd")

# The user Debian's mariadb-server package creates, for its server to run as.
MARIADB_USER = "mysql"
# A Unix socket path longer than this does not fit in sockaddr_un.
MAX_SOCKET_PATH = 107
_CLIENT_ENV = {"PATH": DAEMON_PATH, "LANG": "C.UTF-8", "HOME": "/nonexistent"}
# Server options for both mariadb-install-db's bootstrap and mariadbd: a redo log of another
# size would be rebuilt at the first start. The sizes and the lock timeout are Slurm's
# recommendations (slurmdbd logs an error below half of them); the buffer pool is reserved,
# not touched, so it costs address space rather than memory.
_SERVER_OPTIONS = (
    # The grants name 127.0.0.1, whatever the host's resolver says about it.
    "--skip-name-resolve",
    "--innodb-log-file-size=64M",
    "--innodb-buffer-pool-size=512M",
    "--innodb-lock-wait-timeout=900",
)


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` (any address): what ``up`` checks before using it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def pick_port(preferred: int, what: str) -> int:
    """``preferred`` when it is free, else a free port the kernel hands out: only slurm.conf
    and slurmdbd.conf name these ports, so any free one does."""
    if port_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        port = sock.getsockname()[1]
    log(f"port {preferred} ({what}) is in use by another process; using port {port}")
    return port


def start(state: State, layout: Layout, env: dict[str, str], names: set[str], timeout: float) -> None:
    """Start those of ``DAEMONS`` named (all on a fresh cluster, the dead ones on a repair),
    recording each pid the moment it exists; return once slurmdbd answers. ``env`` is the
    Slurm daemons' environment (SLURM_CONF, the marker)."""
    info, res = state.info, state.resources
    password = password_for(layout)
    if "mariadb" in names:
        init_datadir(layout)
        log(f"starting mariadbd on 127.0.0.1:{info.mariadb_port}")
        pid = start_mariadb(layout, info.mariadb_port)
        res.daemons["mariadb"] = pid
        save_state(state)
        wait_for_mariadb(layout, pid, timeout)
        ensure_database(layout, password)
    if "slurmdbd" not in names:
        return
    conf = render_slurmdbd_conf(
        layout=layout,
        hostname=info.hostname,
        dbd_addr=info.controller_addr,
        dbd_port=info.slurmdbd_port,
        mariadb_port=info.mariadb_port,
        password=password,
    )
    write_slurmdbd_conf(layout, conf)
    log(f"starting slurmdbd on {info.controller_addr}:{info.slurmdbd_port}")
    pid = start_slurmdbd(layout, env)
    res.daemons["slurmdbd"] = pid
    save_state(state)
    wait_for_slurmdbd(layout, pid, info.controller_addr, info.slurmdbd_port, timeout)


# --- MariaDB -----------------------------------------------------------------


def _server_user(layout: Layout) -> pwd.struct_passwd:
    """Who runs the cluster's mariadbd: mysql, as on a production server, when that user may
    enter the state dir; else root (a state dir below a directory only root may enter, such as
    pytest's /tmp/pytest-of-root, is out of mysql's reach, and the cluster's other daemons
    run as root anyway). Once the MariaDB directory exists, its owner decides."""
    if layout.mariadb_dir.is_dir():
        return pwd.getpwuid(layout.mariadb_dir.stat().st_uid)
    try:
        mysql = pwd.getpwnam(MARIADB_USER)
    except KeyError:
        raise ClusterError(f"no user {MARIADB_USER!r}; is mariadb-server installed?") from None
    probe = subprocess.run(
        ["test", "-x", str(layout.root)], user=mysql.pw_uid, group=mysql.pw_gid, extra_groups=[], env=_CLIENT_ENV
    )
    if probe.returncode == 0:
        return mysql
    log(f"user {MARIADB_USER} may not enter {layout.root}; the cluster's mariadbd runs as root")
    return pwd.getpwnam("root")


def init_datadir(layout: Layout) -> None:
    """Create the cluster's MariaDB directory and its system tables, once."""
    if len(str(layout.mariadb_socket)) > MAX_SOCKET_PATH:
        raise ClusterError(f"the state dir {layout.root} is too long for MariaDB's socket path; choose a shorter one")
    user = _server_user(layout)
    layout.mariadb_dir.mkdir(mode=0o750, exist_ok=True)
    os.chown(layout.mariadb_dir, user.pw_uid, user.pw_gid)
    if (layout.mariadb_datadir / "mysql").is_dir():
        return
    argv = [
        "mariadb-install-db",
        "--no-defaults",
        f"--datadir={layout.mariadb_datadir}",
        f"--user={user.pw_name}",
        "--auth-root-authentication-method=socket",
        "--skip-test-db",
        *_SERVER_OPTIONS,
    ]
    with open(layout.stdout_log("mariadb-install-db"), "ab") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=_CLIENT_ENV, cwd="/", timeout=300)
    if proc.returncode != 0:
        raise ClusterError(
            f"mariadb-install-db failed (exit {proc.returncode}):\n" + tail(layout.stdout_log("mariadb-install-db"))
        )


def start_mariadb(layout: Layout, port: int) -> int:
    """Start the cluster's mariadbd as the owner of its directory; its pid (it runs in the
    foreground)."""
    user = _server_user(layout)
    argv = [
        "mariadbd",
        "--no-defaults",  # first: nothing from /etc/mysql, which configures the system's server
        f"--datadir={layout.mariadb_datadir}",
        f"--socket={layout.mariadb_socket}",
        f"--pid-file={layout.mariadb_pidfile}",
        f"--log-error={layout.mariadb_log}",
        f"--port={port}",
        "--bind-address=127.0.0.1",
        *_SERVER_OPTIONS,
        # mariadbd refuses to run as root unless told so.
        *(["--user=root"] if user.pw_uid == 0 else []),
    ]
    ids = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    return spawn(argv, layout.stdout_log("mariadbd"), _CLIENT_ENV, cwd="/", **ids)


def wait_for_mariadb(layout: Layout, pid: int, timeout: float) -> None:
    """Until mariadbd accepts connections on its socket; at once an error if it dies."""
    deadline = time.monotonic() + timeout
    while True:
        if not procs.is_alive(pid):
            raise ClusterError(f"mariadbd (pid {pid}) exited at startup:\n" + tail(layout.mariadb_log))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(str(layout.mariadb_socket))
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise ClusterError(f"mariadbd did not answer within {timeout:.0f}s:\n" + tail(layout.mariadb_log))
        time.sleep(0.1)


def ensure_database(layout: Layout, password: str) -> None:
    """slurmdbd's database and user, created or brought up to date (idempotent). Root logs
    in through the socket (unix_socket authentication: this process is root)."""
    user = f"'{ACCT_DB_USER}'@'127.0.0.1'"
    sql = "\n".join(
        [
            f"CREATE DATABASE IF NOT EXISTS {ACCT_DB_NAME};",
            f"CREATE USER IF NOT EXISTS {user} IDENTIFIED BY '{password}';",
            f"ALTER USER {user} IDENTIFIED BY '{password}';",
            f"GRANT ALL PRIVILEGES ON {ACCT_DB_NAME}.* TO {user};",
        ]
    )
    argv = ["mariadb", "--no-defaults", f"--socket={layout.mariadb_socket}", "--user=root", "--batch"]
    proc = subprocess.run(argv, input=sql, capture_output=True, text=True, env=_CLIENT_ENV, timeout=60)
    if proc.returncode != 0:
        # The client echoes no statement on error, so its message holds no password.
        raise ClusterError(f"creating slurmdbd's database failed: {proc.stderr.strip()}")


# --- slurmdbd ----------------------------------------------------------------


def password_for(layout: Layout) -> str:
    """The database password: the one slurmdbd.conf already holds (a restart keeps the
    user's password), else a new random one."""
    try:
        text = layout.slurmdbd_conf.read_text()
    except FileNotFoundError:
        return secrets.token_hex(24)
    found = re.search(r"^StoragePass=(\S+)$", text, re.MULTILINE)
    return found.group(1) if found else secrets.token_hex(24)


def write_slurmdbd_conf(layout: Layout, text: str) -> None:
    """Write slurmdbd.conf created mode 0600 and owned by the SlurmUser, as slurmdbd requires:
    it holds the password, so no moment exists when others could read it."""
    user = pwd.getpwnam(SLURM_USER)
    tmp = layout.slurmdbd_conf.with_name(f".{layout.slurmdbd_conf.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        os.fchown(fh.fileno(), user.pw_uid, grp.getgrgid(user.pw_gid).gr_gid)
        fh.write(text)
    os.replace(tmp, layout.slurmdbd_conf)


def start_slurmdbd(layout: Layout, env: dict[str, str]) -> int:
    # slurmdbd finds slurmdbd.conf in the directory of $SLURM_CONF (in ``env``).
    return spawn(["slurmdbd", "-D"], layout.stdout_log("slurmdbd"), env, cwd=str(layout.root))


def wait_for_slurmdbd(layout: Layout, pid: int, addr: str, port: int, timeout: float) -> None:
    """Until slurmdbd listens on ``addr:port``, which it does once its tables are in place."""
    deadline = time.monotonic() + timeout
    while True:
        if not procs.is_alive(pid):
            raise ClusterError(
                f"slurmdbd (pid {pid}) exited at startup:\n"
                + tail(layout.slurmdbd_log)
                + "\n"
                + tail(layout.stdout_log("slurmdbd"), 5)
            )
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ClusterError(
                f"slurmdbd did not listen on {addr}:{port} within {timeout:.0f}s:\n" + tail(layout.slurmdbd_log)
            )
        time.sleep(0.1)
