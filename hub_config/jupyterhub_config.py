"""JupyterHub configuration: a GPU classroom on one machine.

``jupyterhub -f hub_config/jupyterhub_config.py`` (``make demo`` runs it through
``python -m provisioner.devtools.demo``, which sets the environment below and prints how to
log in). What it wires:

- the broker as the hub-managed service ``gpu-lease`` (URL prefix /services/gpu-lease/),
  ``--auth hub``, SQLite in the state directory, quotas from ``courses.toml``;
- courses from ``courses.toml`` as hub groups; its ``admins`` as hub admins; its
  instructors get the role ``gpu-lease-instructor`` (scope ``custom:gpu-lease:admin``);
- every user, and every single-user server's ``JUPYTERHUB_API_TOKEN``, gets
  ``access:services!service=gpu-lease`` so kernels can lease GPUs;
- ``GPU_LEASE_URL`` in every server's environment;
- SimpleLocalProcessSpawner (one process per student, no system accounts) and
  SharedPasswordAuthenticator (one demo password) -- for production use
  SystemdSpawner or KubeSpawner and your real authenticator (see docs);
- ``GPU_LEASE_SPAWNER=system-users``: each student's server runs as the Unix account of
  the same name (a root hub; PAM logins; the broker as its own service account, its
  database in a directory only it reads): docs/admins.md, "A hub with an account per
  student";

Every setting below that a test or a second demo needs to change is read from an
environment variable (``GPU_LEASE_*``); the defaults are the demo's.

RBAC, and why each scope:

=====================================  =====================================================
``access:services!service=gpu-lease``  users and their server tokens: call the broker
                                       (it refuses tokens without it).
``custom:gpu-lease:admin``             admins/instructors: set quotas, see every lease.
                                       Also on server tokens (``server_token_scopes``
                                       grants only the subset a user holds) so an
                                       instructor's ``gpu-lease top`` works in a terminal.
``users:activity!user``,               the default ``server`` role's scopes, kept: a
``access:servers!server``              server reports activity; its token reaches itself.
``read:users:groups`` (the broker)      it identifies callers by asking ``/hub/api/user``
                                       *with the caller's token* (JupyterHub adds the
                                       owner's ``name``, ``admin`` and ``groups``: no scope
                                       needed); this one scope lets it read *another*
                                       user's groups for an admin's ``gpu-lease quota show
                                       --user NAME`` (role ``gpu-lease-broker``).
service ``gpu-lease-admin``            the demo's operator token (CLI, examples/classroom.py):
                                       admin:users, admin:servers, tokens, access:servers,
                                       list/read:users, the broker's access scope and
                                       custom:gpu-lease:admin.
=====================================  =====================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import psutil
from jupyterhub.app import JupyterHub
from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner

from provisioner.broker.courses import load_courses
from provisioner.errors import NoGPUFound
from provisioner.inventory import discover_nvml

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
env = os.environ.get


def _port(name: str, default: int) -> int:
    return int(env(name) or default)


STATE = Path(env("GPU_LEASE_STATE_DIR") or ROOT / ".demo").resolve()
#: every student's server runs as the student's own Unix account (see "system accounts")
SYSTEM_USERS = env("GPU_LEASE_SPAWNER") == "system-users"
#: every student's server a Slurm job (hub_config/slurm_config.py)
SLURM = env("GPU_LEASE_SPAWNER") == "slurm"
#: the servers run as the students' own accounts: with system-users, and with Slurm (a
#: root hub submits each job as its user, batchspawner's ``sudo -u``) unless the jobs of
#: a test cluster's account-less students run as the hub's user
ACCOUNTS = SYSTEM_USERS or (SLURM and env("GPU_LEASE_SLURM_SUBMIT_AS_HUB") != "1")
#: the umask the students' servers get (the hub's own files are private: see below)
SERVER_UMASK = 0o022
if SYSTEM_USERS:
    if os.getuid() != 0:
        sys.exit(
            "GPU_LEASE_SPAWNER=system-users: the hub must run as root (it starts each "
            "student's server as the student's account); start it as root, or unset "
            "GPU_LEASE_SPAWNER for one shared account."
        )
    # whatever the hub, the proxy and the broker create from now on (the hub's database,
    # the broker's, pid files) is theirs alone; the students' servers get SERVER_UMASK
    os.umask(0o077)
STATE.mkdir(parents=True, exist_ok=True)
if ACCOUNTS:  # students pass through (to their runtime dirs), never list or read it
    STATE.chmod(0o711)
HUB_IP = env("GPU_LEASE_HUB_IP") or "127.0.0.1"
HUB_PORT = _port("GPU_LEASE_HUB_PORT", 8000)
BROKER_PORT = _port("GPU_LEASE_BROKER_PORT", 10101)
COURSES_FILE = Path(env("GPU_LEASE_COURSES") or HERE / "courses.toml").resolve()
SERVICE = "gpu-lease"
ACCESS_SCOPE = f"access:services!service={SERVICE}"
ADMIN_SCOPE = "custom:gpu-lease:admin"


def _secret(var: str, filename: str, nbytes: int) -> str:
    """A secret from the environment, else from the state directory (made once, mode 0600)."""
    value = env(var)
    if value:
        return value
    path = STATE / filename
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secrets.token_hex(nbytes))
    return path.read_text(encoding="utf-8").strip()


def _gpus() -> str:
    """GPU_LEASE_GPUS, else 'nvml' when NVML sees a GPU, else the declared demo V100."""
    declared = env("GPU_LEASE_GPUS")
    if declared:
        return declared
    try:
        discover_nvml()
    except NoGPUFound as exc:
        print(f"[gpu-lease] {exc.message} (the demo declares that pool).", file=sys.stderr)
        return "1x32768:V100"
    return "nvml"


courses = load_courses(str(COURSES_FILE))

# -- the hub and its proxy -------------------------------------------------------------
c.JupyterHub.ip = HUB_IP
c.JupyterHub.port = HUB_PORT
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = _port("GPU_LEASE_HUB_API_PORT", 8081)
HUB_DB = STATE / "jupyterhub.sqlite"
with contextlib.suppress(FileExistsError):  # the hub's database: its alone, whatever the umask
    os.close(os.open(HUB_DB, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
c.JupyterHub.db_url = f"sqlite:///{HUB_DB}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every server and kernel
c.ConfigurableHTTPProxy.command = [str(ROOT / "node_modules" / ".bin" / "configurable-http-proxy")]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{_port('GPU_LEASE_PROXY_API_PORT', 8001)}"
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")

# -- people: one shared password for the demo; admins log in with the admin password ----
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = env("GPU_LEASE_USER_PASSWORD") or "gpu-lease-demo"
c.SharedPasswordAuthenticator.admin_password = _secret(
    "GPU_LEASE_ADMIN_PASSWORD", "admin-password", 16
)
c.Authenticator.admin_users = set(courses.admins)
c.Authenticator.allowed_users = set(courses.users()) | {"guest01"}
if SYSTEM_USERS:
    # the Unix accounts' own passwords (PAM), unless the site names another authenticator;
    # every name in the courses file must be an account (JupyterHub checks at start), or
    # the hub makes the missing ones where the admin allows it (GPU_LEASE_CREATE_USERS=1)
    c.JupyterHub.authenticator_class = env("GPU_LEASE_AUTHENTICATOR") or "pam"
    c.Authenticator.allowed_users = set(courses.users())
    c.LocalAuthenticator.create_system_users = env("GPU_LEASE_CREATE_USERS") == "1"
c.Authenticator.allow_all = env("GPU_LEASE_ALLOW_ALL", "0") == "1"
c.JupyterHub.load_groups = courses.hub_groups()

# -- scopes ----------------------------------------------------------------------------
c.JupyterHub.custom_scopes = {
    ADMIN_SCOPE: {"description": "Administer GPU leases: quotas, every lease, usage."},
}
c.Spawner.server_token_scopes = [
    "users:activity!user",
    "access:servers!server",
    ACCESS_SCOPE,
    ADMIN_SCOPE,  # only the users who hold it get it (a subset is granted)
]
roles = [
    {
        "name": "gpu-lease-instructor",
        "description": "Course instructors and admins: administer GPU leases.",
        "scopes": [ADMIN_SCOPE, ACCESS_SCOPE],
        "users": sorted(set(courses.instructors()) | set(courses.admins)),
    },
    {
        "name": "gpu-lease-operator",
        "description": "The demo's operator token: run classrooms, administer GPU leases.",
        "scopes": [
            "admin:users",
            "admin:servers",
            "tokens",
            "list:users",
            "read:users",
            "access:servers",
            ACCESS_SCOPE,
            ADMIN_SCOPE,
        ],
        "services": ["gpu-lease-admin"],
    },
]
roles.append(
    {
        "name": "gpu-lease-broker",
        "description": "The broker reads users' groups for an admin's effective-quota view.",
        "scopes": ["read:users:groups"],
        "services": [SERVICE],
    }
)
if "extra_user_scopes" in JupyterHub.class_trait_names():  # JupyterHub >= 6
    c.JupyterHub.extra_user_scopes = {ACCESS_SCOPE}
else:  # JupyterHub 5: redefine the user role with the same scope added
    roles.append({"name": "user", "scopes": ["self", ACCESS_SCOPE]})
c.JupyterHub.load_roles = roles


# -- system accounts: the broker's own account and directory ----------------------------
def _private_dir(path: Path, uid: int, gid: int, mode: int = 0o700) -> None:
    """``path`` a directory owned by ``uid``:``gid`` with ``mode`` (made, or fixed, by root).

    Whatever sits there that is not a directory (a link a student planted) is removed.
    """
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    os.chown(path, uid, gid, follow_symlinks=False)
    path.chmod(mode)


def _broker_account(command: list[str]) -> dict[str, Any]:
    """The broker service's ``user`` and ``cwd`` with system accounts; its database moves to
    a directory that account alone owns (0700). Exits with what to do when the account is
    missing or the agents' tokens file is readable by others."""
    import pwd

    name = env("GPU_LEASE_BROKER_USER") or "gpu-lease"
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        sys.exit(
            f"GPU_LEASE_SPAWNER=system-users: the broker's account {name!r} does not exist; "
            f"create it (useradd --system --shell /usr/sbin/nologin {name}) or name another "
            "with GPU_LEASE_BROKER_USER."
        )
    if account.pw_uid == 0:
        sys.exit(
            f"GPU_LEASE_BROKER_USER={name} is root: the broker runs as an unprivileged "
            "account of its own; create one (useradd --system gpu-lease) and name it."
        )
    folder = Path(env("GPU_LEASE_BROKER_DIR") or STATE / "broker").resolve()
    _private_dir(folder, account.pw_uid, account.pw_gid)
    database = folder / "gpu-lease.sqlite"
    command[command.index(f"sqlite:///{STATE / 'gpu-lease.sqlite'}")] = f"sqlite:///{database}"
    tokens = env("GPU_LEASE_AGENT_TOKENS")
    if tokens:
        st = Path(tokens).stat()
        readable = st.st_uid == account.pw_uid or (
            st.st_gid == account.pw_gid and st.st_mode & 0o040
        )
        if st.st_mode & 0o007 or not readable:
            sys.exit(
                f"The agents' tokens file {tokens} must be readable by the broker's account "
                f"and nobody else: chown {name} {tokens}; chmod 600 {tokens}."
            )
    return {"user": name, "cwd": str(folder)}


# -- the broker, a hub-managed service ----------------------------------------------------
# make demo (GPU_LEASE_FAST_EXIT=1) runs the broker and the servers through
# provisioner/devtools/fastexit.py: they stop as usual but skip Python's teardown at exit,
# so that Ctrl-C stops 60 servers in seconds rather than a minute
FAST_EXIT = (
    [sys.executable, "-m", "provisioner.devtools.fastexit"]
    if env("GPU_LEASE_FAST_EXIT") == "1"
    else []
)
broker_cmd = [
    *(FAST_EXIT or [sys.executable, "-m"]),
    "provisioner.broker.app",
    "--auth",
    "hub",
    "--db-url",
    f"sqlite:///{STATE / 'gpu-lease.sqlite'}",
    "--gpus",
    _gpus(),
    "--quotas-file",
    str(COURSES_FILE),
    "--ttl",
    env("GPU_LEASE_TTL") or "90",
    f"--GPULeaseBroker.reap_interval={env('GPU_LEASE_REAP_INTERVAL') or '5'}",
]
if env("GPU_LEASE_HTTP_PROCESSES"):  # HTTP in front processes (docs/admins.md, "Many kernels")
    broker_cmd += ["--http-processes", str(int(env("GPU_LEASE_HTTP_PROCESSES", "")))]
if env("GPU_LEASE_NODE_GRACE"):  # seconds a node agent may be silent before its node is lost
    broker_cmd.append(f"--GPULeaseBroker.node_grace={float(env('GPU_LEASE_NODE_GRACE', ''))}")
if env("GPU_LEASE_IDLE_RECLAIM_AFTER"):  # seconds idle before a kernel is parked/reclaimed
    broker_cmd.append(
        f"--GPULeaseBroker.idle_reclaim_after={float(env('GPU_LEASE_IDLE_RECLAIM_AFTER', ''))}"
    )
if env("GPU_LEASE_AGENT_TOKENS"):  # node agents' tokens ({"agent": true, "node": ...} only)
    broker_cmd += ["--tokens-file", str(Path(env("GPU_LEASE_AGENT_TOKENS")).resolve())]
if env("GPU_LEASE_BROKER_IP"):  # node agents on other machines reach the broker there
    broker_cmd += ["--ip", env("GPU_LEASE_BROKER_IP", "")]
broker_service: dict[str, Any] = {"cwd": str(STATE)}
if SYSTEM_USERS:
    broker_service = _broker_account(broker_cmd)
c.JupyterHub.services = [
    {
        "name": SERVICE,
        "display": True,
        "url": f"http://127.0.0.1:{BROKER_PORT}",  # the broker listens here (JUPYTERHUB_SERVICE_URL)
        "command": broker_cmd,
        **broker_service,  # its working directory (and, with system accounts, its account)
        "oauth_no_confirm": True,
        # the dashboard's browser login: let an instructor's OAuth token carry the admin scope
        "oauth_client_allowed_scopes": [ADMIN_SCOPE],
    },
    {
        "name": "gpu-lease-admin",
        "api_token": _secret("GPU_LEASE_ADMIN_TOKEN", "admin-token", 32),
        "display": False,
    },
]


# -- single-user servers ----------------------------------------------------------------
SERVER_PORT_BASE = int(env("GPU_LEASE_SERVER_PORT_BASE") or 21000)
#: servers listen on a port in [SERVER_PORT_BASE, SERVER_PORT_BASE + SERVER_PORT_SPAN)
SERVER_PORT_SPAN = 8000
#: ports a spawn tries before it fails (each one taken by someone else meanwhile)
SERVER_PORT_ATTEMPTS = 3


def _server_port() -> int:
    """A random port below Linux's ephemeral range (32768+) that nothing listens on now.

    The stock spawner picks a random *ephemeral* port, where kernels and outgoing
    connections take ports all the time. A port outside that range, chosen at random
    (not per user: two hubs on one machine number their users alike), rarely collides;
    when it does, ``GracefulLocalProcessSpawner.start`` skips it. 0
    (GPU_LEASE_SERVER_PORT_BASE=0) restores the stock random port.
    """
    if not SERVER_PORT_BASE:
        return 0
    for _ in range(20):
        port = SERVER_PORT_BASE + secrets.randbelow(SERVER_PORT_SPAN)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return 0


def _listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` (or a child, with a ``shell_cmd``) listens on TCP ``port``."""
    try:
        process = psutil.Process(pid)
        for p in (process, *process.children(recursive=True)):
            for conn in p.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr[1] == port:
                    return True
    except psutil.Error:
        return False
    return False


class GracefulSpawner(LocalProcessSpawner):
    """A local process spawner that routes a student only to their own server, and
    stops a server with SIGTERM first.

    The port: the hub counts any HTTP answer at a server's address as "up" and then routes
    the student there. A port free when chosen may be bound by another process before the
    server binds it (over a minute when 50 start at once) -- another hub's server on this
    machine spawning at the same moment, say; the server then exits
    (``--ServerApp.port_retries=0``) and the hub would send the student to that other
    server. So ``start`` returns only once the server's own process listens on its port;
    if the process exits first, the port is skipped and the server starts again on
    another (``SERVER_PORT_ATTEMPTS`` in all), and the spawn fails rather than route
    anywhere else.

    The stop: the stock spawner sends SIGINT first; jupyter_server installs its graceful
    SIGINT handler only when its stdin is a terminal, so a hub started without one (a
    service manager, a test) made SIGINT a KeyboardInterrupt: the server exited without
    shutting its kernels down, and their GPU leases stayed held until they expired. SIGTERM
    always runs jupyter_server's cleanup, which shuts every kernel down (releasing its lease).
    """

    async def start(self) -> object:
        """Start the server on a free port; return once it listens there (see above).

        Each attempt gets the server's API token again: stopping the exited attempt polls
        it, and ``LocalProcessSpawner.poll`` clears the spawner's state of a process that
        is gone, the token included (``Spawner.clear_state``), so the next attempt would
        start with an empty ``JUPYTERHUB_API_TOKEN``. Its server then could not check any
        token with the hub: every API call a student's token made to it got 401, and its
        activity reports 403 (seen: one of ten students starting at once under load,
        after "exited before it listened")."""
        token = self.api_token
        for attempt in range(1, SERVER_PORT_ATTEMPTS + 1):
            self.port = _server_port()
            self.api_token = token
            url = await super().start()
            port = self.port
            while self.proc is not None and self.proc.poll() is None:
                if _listens_on(self.pid, port):
                    return url
                await asyncio.sleep(0.2)
            self.log.warning(
                "%s's server exited before it listened on port %d (attempt %d of %d): "
                "the port was probably taken meanwhile.",
                self.user.name,
                port,
                attempt,
                SERVER_PORT_ATTEMPTS,
            )
            await super().stop(now=True)
        raise RuntimeError(
            f"The server of {self.user.name} exited {SERVER_PORT_ATTEMPTS} times before it "
            "listened on its port; see the hub's log for its errors."
        )

    async def stop(self, now: bool = False) -> None:
        if not now and await self.poll() is None:
            await self._signal(signal.SIGTERM)
            await self.wait_for_death(self.term_timeout)
        await super().stop(now=True)

    async def wait_for_death(self, timeout: float = 10) -> None:
        """Notice a server's exit within 0.2 s.

        The stock spawner polls with an exponential backoff (0.1, 0.3, 0.7, 1.5, 3.1, 6.3,
        12.7 s after the signal): a server that took 4 s to exit counted as stopped after
        6.3 s, one that took 7 s after 12.7 s, and stopping a class took that much longer.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        while await self.poll() is None:
            if asyncio.get_running_loop().time() >= deadline:
                self.log.warning("Process %s did not die in %.0f seconds", self.pid, timeout)
                return
            await asyncio.sleep(0.2)


class GracefulLocalProcessSpawner(GracefulSpawner, SimpleLocalProcessSpawner):
    """Every server as the hub's own user, homes under the state directory (the demo)."""


def _account(name: str) -> Any:
    import pwd

    return pwd.getpwnam(name)


def _private_dirs(spawner: Any) -> None:
    """The ``pre_spawn_hook`` when servers run as the students' accounts (``ACCOUNTS``): the
    server's runtime and temporary directories, ``<root>/<uid>``, made (or fixed) by the
    hub before each start, owned by the account, 0700."""
    name = spawner.user.name
    try:
        account = _account(name)
    except KeyError:
        also = (
            "; on a test cluster whose students have no accounts, set "
            "GPU_LEASE_SLURM_SUBMIT_AS_HUB=1 to run their jobs as the hub's user"
            if SLURM
            else ""
        )
        raise RuntimeError(
            f"{name} has no Unix account on the hub's host, and each server runs as the "
            f"account of its user's name: create it (useradd --create-home {name}){also}."
        ) from None
    for root in (RUNTIME_ROOT, TMP_DIR):
        _private_dir(root / str(account.pw_uid), account.pw_uid, account.pw_gid)


class SystemUserSpawner(GracefulSpawner):
    """Each server as the Unix account of the student's name (LocalProcessSpawner's setuid,
    home and shell), with the site's usual umask, and a runtime and temporary directory of
    its own (:func:`_private_dirs`).
    """

    def make_preexec_fn(self, name: str) -> Any:
        become = super().make_preexec_fn(name)

        def preexec() -> None:
            os.umask(SERVER_UMASK)  # the hub's is 0077, for its own files
            become()

        return preexec


c.JupyterHub.spawner_class = SystemUserSpawner if SYSTEM_USERS else GracefulLocalProcessSpawner
c.Spawner.term_timeout = 30  # kernels get jupyter_client's shutdown, then leases are released
c.SimpleLocalProcessSpawner.home_dir_template = str(STATE / "home" / "{username}")
c.Spawner.cmd = [str(Path(sys.executable).parent / "jupyterhub-singleuser")]
if FAST_EXIT:
    c.Spawner.cmd = [*FAST_EXIT, "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = int(env("GPU_LEASE_SPAWN_TIMEOUT") or 300)
c.Spawner.http_timeout = int(env("GPU_LEASE_SPAWN_TIMEOUT") or 300)
# forgets refused GPU kernel starts so servers stop in seconds (see provisioner/kernel/server.py)
c.Spawner.args = [
    "--ServerApp.kernel_manager_class=provisioner.kernel.server.GPULeaseKernelManager",
    # the launcher offers each user only the GPU kernels the broker would let them start
    # (course, quota; see provisioner/kernel/offered.py); "mark" lists the others with why
    "--ServerApp.kernel_spec_manager_class=provisioner.kernel.offered.GPULeaseKernelSpecManager",
    f"--GPULeaseKernelSpecManager.unavailable={env('GPU_LEASE_UNAVAILABLE_KERNELS') or 'hide'}",
    # the spawner picks a random free port; if another server took it meanwhile, fail the
    # spawn instead of silently moving to the next port (the proxy would then route this
    # user to someone else's server: seen with 50 concurrent spawns)
    "--ServerApp.port_retries=0",
]
# Kernels talk to their server over Unix sockets, not TCP: a server picks a kernel's five
# TCP ports before the kernel binds them, and with a class starting 100 kernels at once
# kernels of different servers got the same port ("Address already in use", "Invalid
# Signature" cross-talk). The socket paths live in a short per-user runtime directory
# (Unix socket paths are limited to 107 bytes).
KERNEL_TRANSPORT = env("GPU_LEASE_KERNEL_TRANSPORT") or "ipc"
if KERNEL_TRANSPORT == "ipc":
    c.Spawner.args.append("--KernelManager.transport=ipc")
if os.getuid() == 0 and not ACCOUNTS:  # servers as root: only one-account hubs
    c.Spawner.args.append("--allow-root")
# JupyterLab's settings defaults for every student: no "Would you like to get notified
# about official Jupyter news?" toast on first login, and no requests from students'
# browsers to jupyter.org for news or updates (the hub admin decides about upgrades).
LAB_DEFAULTS = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}
}
LAB_SETTINGS = STATE / "lab-settings"  # read by every server: world-readable, on purpose
LAB_SETTINGS.mkdir(exist_ok=True)
LAB_SETTINGS.chmod(0o755)
(LAB_SETTINGS / "overrides.json").write_text(json.dumps(LAB_DEFAULTS, indent=1), encoding="utf-8")
(LAB_SETTINGS / "overrides.json").chmod(0o644)
c.Spawner.args.append(f"--LabApp.app_settings_dir={LAB_SETTINGS}")
# The broker's own address, not the proxy's: every server runs on this machine, so the
# kernels' lease calls (acquire, renew every ttl/3 s, release) skip a hop and keep working
# while the proxy restarts. With servers on other machines (KubeSpawner) use the proxy:
# f"http://<hub-host>:{HUB_PORT}/services/gpu-lease".
server_env: dict[str, Any] = {"GPU_LEASE_URL": f"http://127.0.0.1:{BROKER_PORT}/services/{SERVICE}"}
# ... and the account it listens as: a server sends its token to no other account's listener
# on that port (a student's process that took the port while the broker restarted)
server_env["GPU_LEASE_BROKER_UID"] = str(
    _account(broker_service["user"]).pw_uid if "user" in broker_service else os.getuid()
)
# `gpu-lease` (and this Python's other commands) on the servers' PATH, first: an
# instructor runs `gpu-lease kernelspec install` in a JupyterLab terminal. The hub may run
# without its environment activated (`make demo`, a service manager), so its PATH lacks
# this directory. Not resolved: the venv's bin is where the console scripts are.
BIN = str(Path(sys.executable).parent)
server_env["PATH"] = os.pathsep.join([BIN, *[p for p in env("PATH", "").split(os.pathsep) if p]])
# remote kernels: GPU kernels start on the node their lease names (docs/admins.md)
if env("GPU_LEASE_LAUNCHER"):
    server_env["GPU_LEASE_LAUNCHER"] = env("GPU_LEASE_LAUNCHER")
# ... and the terminals keep that PATH: started without a terminal (by a spawner), a
# server's terminals run a *login* shell, and Debian's /etc/profile sets PATH anew, which
# drops this directory. An interactive non-login bash keeps the server's environment
# (sites that need /etc/profile put this directory in an /etc/profile.d/ file instead).
c.Spawner.args.append(
    f"--ServerApp.terminado_settings=shell_command={shutil.which('bash') or '/bin/bash'}"
)
if env("GPU_LEASE_KERNELS_PREFIX"):  # kernelspecs installed outside sys.prefix (tests)
    # ... first; a JUPYTER_PATH the hub was given stays after it (a JupyterLab extension
    # built in a development tree: JUPYTER_PATH=<tree>/.jupyter-dev)
    server_env["JUPYTER_PATH"] = os.pathsep.join(
        [
            str(Path(env("GPU_LEASE_KERNELS_PREFIX", "")) / "share/jupyter"),
            *[p for p in env("JUPYTER_PATH", "").split(os.pathsep) if p],
        ]
    )
# The servers' runtime files (cookie secrets, kernels' connection files and sockets) and
# temporary files (ipykernel's per-kernel folders) stay in the state directory: stopping
# the hub leaves nothing of its users in the system's temporary folder. A kernel's sockets
# are <runtime dir>/kernel-<uuid>-ipc-N, 50 bytes after the directory of Linux's 107, so the
# per-user directories are named by user id; `make demo` moves the runtime directory to
# the system's temporary folder only when the state directory's path is too long for
# that (GPU_LEASE_RUNTIME_DIR) and removes it when it stops.
# With the students' accounts (system-users, Slurm jobs submitted as their users) each
# account's directories are named by its uid, made by the hub before each start
# (_private_dirs) and private to it; the roots are root's, 0711: a student passes through
# to their own directory, and lists nobody's.
RUNTIME_ROOT = Path(env("GPU_LEASE_RUNTIME_DIR") or STATE / "rt")
#: the longest runtime root whose kernels' sockets fit (<root>/<id>/kernel-<uuid>-ipc-N)
MAX_RUNTIME_ROOT = 50
if KERNEL_TRANSPORT == "ipc" and len(str(RUNTIME_ROOT)) > MAX_RUNTIME_ROOT:
    sys.exit(
        f"The servers' runtime directory {RUNTIME_ROOT} is {len(str(RUNTIME_ROOT))} bytes "
        f"long: kernels' Unix sockets under it would exceed Linux's 107 bytes and every "
        f"kernel start would fail. Name one of at most {MAX_RUNTIME_ROOT} bytes with "
        "GPU_LEASE_RUNTIME_DIR (or use GPU_LEASE_KERNEL_TRANSPORT=tcp)."
    )
TMP_DIR = STATE / "tmp"
TMP_DIR.mkdir(exist_ok=True)
if ACCOUNTS:
    c.Spawner.pre_spawn_hook = _private_dirs
    for _root in (RUNTIME_ROOT, TMP_DIR):
        _root.mkdir(parents=True, exist_ok=True)
        _root.chmod(0o711)
    server_env["JUPYTER_RUNTIME_DIR"] = lambda spawner: str(
        RUNTIME_ROOT / str(_account(spawner.user.name).pw_uid)
    )
    server_env["TMPDIR"] = lambda spawner: str(TMP_DIR / str(_account(spawner.user.name).pw_uid))
else:
    server_env["JUPYTER_RUNTIME_DIR"] = lambda spawner: str(RUNTIME_ROOT / str(spawner.user.id))
    server_env["TMPDIR"] = str(TMP_DIR)
c.Spawner.environment = server_env

# -- variants ------------------------------------------------------------------------------
if SLURM:  # every server a Slurm job (batchspawner)
    load_subconfig(str(HERE / "slurm_config.py"))  # type: ignore[name-defined]  # noqa: F821
