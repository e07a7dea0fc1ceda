"""Remote kernels, the node's side: the agent launches kernels for its node's leases
(``gpu-lease agent --launch-kernels``).

The node opens no listener: launches come only in the answers to the agent's own
heartbeats (which its orders long-poll brings at once), so only the broker, which checked
that the asker holds the lease and that the lease is on this node, can order one. The
agent checks again what it can see itself: the lease is among the node's leases in the
same answer, held by the account the launch names, and that account exists here and is
not root. Then, for each launch (:meth:`KernelLauncher.answer`):

1. a private directory for the kernel (``<kernel-dir>/<lease>-<generation>``, 0700, the
   student's), with the connection file (the key, 0600), the ``%gpu`` state file and the
   kernel's output;
2. five free ports on the node's kernel address (``--kernel-ip``, default: the address
   this node reaches the broker from), as jupyter_client's ``LocalProvisioner`` chooses
   them;
3. the working directory: the notebook's own where it lies under a directory shared by
   every node (``--shared-dirs``, e.g. ``/home``; it must exist here), else a scratch
   directory of the student's on the node; the kernel says which in its first output
   (``GPU_LEASE_REMOTE_NOTE``, read by ``startup/gpu_lease_magic.py``);
4. the process, as the student (uid, gid, groups; a session of its own, so signals reach
   its process group), in a cgroup of its own (``node/cgroups.py``), with the login
   variables of the account (HOME, USER, LOGNAME, SHELL, PATH) and the launch's;
5. ``running`` once its shell port accepts a connection (the kernel listens), or
   ``failed`` with the end of its output when it exits first: JupyterLab shows the node's
   reason, not a timeout.

Every beat reports every kernel (``remote_kernels``). The answer's ``kernel_ends`` ends a
kernel whose lease ended or that a newer generation replaces (SIGTERM to its process
group, SIGKILL after :data:`END_GRACE` s); ``kernel_signals`` are sent to the process
group; ``kernel_expiry`` says when each kernel's lease expires unless renewed: a node cut
off from the broker ends its kernels then. Each kernel's record (``agent.json`` in its
directory, root's) lets an agent that restarts find its kernels again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest
from ..node_report import LaunchOrder, RemoteKernelsReport, RemoteKernelStatus
from ..wire import KERNEL_CHANNELS, REMOTE_KERNEL_ENDED
from . import cgroups
from .feature import Beat
from .pidns import own_pid_ns

log = logging.getLogger("gpu_lease.agent")

#: seconds between SIGTERM and SIGKILL when the agent ends a kernel
END_GRACE = 3.0
#: seconds a launched kernel has to listen on its shell port before it counts as failed
LISTEN_TIMEOUT = 120.0
#: seconds past its lease's last known expiry that a kernel cut off from the broker runs
EXPIRY_GRACE = 5.0
#: the states of a launched kernel whose process may still run
LIVE = ("starting", "running")
#: seconds between two looks at a running kernel's process (has it exited?)
WATCH_EVERY = 0.2
#: the PATH a kernel gets (the node's, not the server's)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
#: how the kernel's own process (the student's) makes and enters its working folder
ENTER = 'mkdir -p -- "$1" && cd -- "$1" && shift && exec "$@"'
#: what a kernel id may keep in a scratch folder's name
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
#: the lines of a kernel's output a failure reports
TAIL_LINES = 6


@dataclass
class NodeKernel:
    """A kernel this agent launched (or found again after a restart)."""

    lease_id: str
    generation: int
    user: str
    kernel_id: str
    directory: str
    state: str = "starting"  # starting | running | exited | failed
    ip: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    pid: int | None = None
    start_time: int | None = None
    cgroup: str | None = None
    cwd: str = ""
    cwd_shared: bool = False
    exit_code: int | None = None
    reason: str | None = None
    signaled: int = 0
    expires_at: float | None = None
    ending_since: float | None = None
    process: subprocess.Popen[bytes] | None = None

    def status(self, pid_ns: int | None) -> RemoteKernelStatus | None:
        """The heartbeat's entry (None while starting: the broker waits for running)."""
        if self.state == "starting":
            return None
        running = self.state == "running"
        return RemoteKernelStatus(
            lease_id=self.lease_id,
            generation=self.generation,
            state=self.state,
            ip=self.ip if running else None,
            ports=dict(self.ports) if running else None,
            pid=self.pid,
            pid_ns=pid_ns if self.pid else None,
            cgroup=self.cgroup,
            cwd=self.cwd or None,
            cwd_shared=self.cwd_shared if self.cwd else None,
            exit_code=self.exit_code,
            reason=self.reason,
            signaled=self.signaled,
        )

    def record(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "generation": self.generation,
            "user": self.user,
            "kernel_id": self.kernel_id,
            "ip": self.ip,
            "ports": self.ports,
            "pid": self.pid,
            "start_time": self.start_time,
            "cgroup": self.cgroup,
            "cwd": self.cwd,
            "cwd_shared": self.cwd_shared,
            "signaled": self.signaled,
        }


def start_time(pid: int, proc: str = "/proc") -> int | None:
    """The process's start time (clock ticks since boot, field 22 of ``stat``): with the
    pid, it names one process across pid reuse."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def free_ports(ip: str, count: int = len(KERNEL_CHANNELS)) -> list[int]:
    """``count`` free TCP ports on ``ip`` (bound together, then released)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
            s.bind((ip, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def address_towards(url: str) -> str:
    """The local address this node reaches ``url``'s host from (no packet is sent)."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, 80, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def listening(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=0.5):
            return True
    except OSError:
        return False


def tail(path: str, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(x.strip() for x in text.strip().splitlines()[-lines:] if x.strip())


@dataclass
class LaunchSettings:
    """The agent's options for the kernels it launches."""

    node: str
    ip: str
    kernel_dir: str = "/var/lib/gpu-lease/kernels"
    scratch_dir: str = "/var/tmp/gpu-lease"
    shared_dirs: tuple[str, ...] = ()
    cgroup_parent: str = ""
    path: str = DEFAULT_PATH


class KernelLauncher:
    """The node feature ``--launch-kernels`` (see the module's text)."""

    def __init__(self, settings: LaunchSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.clock = clock
        self.ready: asyncio.Event | None = asyncio.Event()
        self.kernels: dict[str, NodeKernel] = {}
        self.wire = True
        self._tasks: set[asyncio.Future[Any]] = set()
        #: the ended kernels the last report carried (forgotten once it was answered)
        self._reported: set[tuple[str, int]] = set()
        self._pid_ns = own_pid_ns()
        os.makedirs(settings.kernel_dir, mode=0o700, exist_ok=True)
        os.chmod(settings.kernel_dir, 0o711)  # students reach their own kernel's folder
        self._find_again()

    # -- the feature's protocol ---------------------------------------------------------
    async def observe(self, beat: Beat) -> None:
        now = self.clock()
        for kernel in list(self.kernels.values()):
            self._reap(kernel)
            expired = kernel.expires_at is not None and now > kernel.expires_at + EXPIRY_GRACE
            if kernel.state == "running" and expired and kernel.ending_since is None:
                log.warning(
                    "Ending kernel of lease %s…: its lease expired at %.0f and the broker "
                    "did not renew it (cut off?)",
                    kernel.lease_id[:6],
                    kernel.expires_at,
                )
                self._end(kernel, "its lease expired")

    def report(self, beat: Beat) -> RemoteKernelsReport | None:
        if not self.wire:
            return None
        if self.ready is not None:
            self.ready.clear()
        statuses = [s for k in self.kernels.values() if (s := k.status(self._pid_ns))]
        self._reported = {
            (s.lease_id, s.generation) for s in statuses if s.state in REMOTE_KERNEL_ENDED
        }
        return RemoteKernelsReport(True, tuple(sorted(statuses, key=lambda s: s.lease_id)))

    async def answer(self, beat: Beat, answer: dict[str, Any]) -> None:
        if not self.wire:
            return
        # ended kernels were delivered with this beat: forgotten (their folders go)
        for kernel in list(self.kernels.values()):
            if (kernel.lease_id, kernel.generation) in self._reported:
                self._forget(kernel)
        self._reported = set()
        leases = {x.get("lease_id"): x for x in answer.get("leases") or [] if isinstance(x, dict)}
        for end in answer.get("kernel_ends") or []:
            ending = self.kernels.get(str(end.get("lease_id")))
            if ending is not None and ending.generation == end.get("generation"):
                self._end(ending, "its lease ended, or a restart replaced it")
        for entry in answer.get("kernel_signals") or []:
            self._send(entry)
        for lease_id, expires in (answer.get("kernel_expiry") or {}).items():
            held = self.kernels.get(lease_id)
            fresh = isinstance(expires, (int, float)) and held is not None
            if fresh and held is not None and held.expires_at != float(expires):
                held.expires_at = float(expires)
                state_expiry(held)
        for raw in answer.get("launch") or []:
            try:
                order = LaunchOrder.from_json(raw)
            except InvalidRequest as exc:
                log.error("A launch order the agent cannot read: %s", exc.message)
                continue
            self._take(order, leases.get(order.lease_id))

    def offered(self) -> frozenset[str]:
        return frozenset(RemoteKernelsReport.FIELDS) if self.wire else frozenset()

    def refused(self, fields: set[str], node: str) -> None:
        if fields & set(RemoteKernelsReport.FIELDS):
            self.wire = False
            log.warning(
                "The broker is older than remote kernels (it refused %s): node %s launches "
                "no kernels",
                ", ".join(sorted(fields)),
                node,
            )

    async def close(self) -> None:
        """The agent stops: kernels keep running (a restarted agent finds them again)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- launching ------------------------------------------------------------------------
    def _take(self, order: LaunchOrder, lease: dict[str, Any] | None) -> None:
        have = self.kernels.get(order.lease_id)
        if have is not None and have.generation >= order.generation:
            return  # taken already (the order repeats until reported)
        if have is not None:
            self._end(have, "a restart replaced it")
        kernel = NodeKernel(
            order.lease_id,
            order.generation,
            order.user,
            order.launch.kernel_id,
            os.path.join(self.settings.kernel_dir, f"{order.lease_id}-{order.generation}"),
        )
        self.kernels[order.lease_id] = kernel
        why = self._refusal(order, lease)
        if why is not None:
            log.warning("Refused to launch the kernel of lease %s…: %s", order.lease_id[:6], why)
            self._failed(kernel, why)
            return
        self._track(self._launch(kernel, order))

    def _refusal(self, order: LaunchOrder, lease: dict[str, Any] | None) -> str | None:
        node = self.settings.node
        if lease is None:
            return f"lease {order.lease_id} is not one of node {node}'s active leases"
        if lease.get("user") != order.user:
            return f"lease {order.lease_id} is held by {lease.get('user')!r}, not {order.user!r}"
        try:
            pw = pwd.getpwnam(order.user)
        except KeyError:
            return (
                f"there is no Unix account named {order.user!r} on node {node}; every "
                "student needs the same account name on every GPU node (ask an admin)"
            )
        if pw.pw_uid == 0:
            return "kernels are never launched as root"
        # the kernel's cgroup is named after its kernel id, which the student chooses: two
        # leases' kernels must never share one (one lease's enforcement would reach the
        # other's processes)
        kernel_id = order.launch.kernel_id
        if any(
            k.kernel_id == kernel_id and k.lease_id != order.lease_id and k.state in LIVE
            for k in self.kernels.values()
        ):
            return (
                f"kernel id {kernel_id!r} is already in use on node {node} by another "
                "lease's kernel; start the kernel again (it gets a new id)"
            )
        return None

    def _failed(self, kernel: NodeKernel, why: str) -> None:
        kernel.state, kernel.reason = "failed", why[:480]
        if self.ready is not None:
            self.ready.set()

    async def _launch(self, kernel: NodeKernel, order: LaunchOrder) -> None:
        try:
            await asyncio.to_thread(self._spawn, kernel, order)
        except OSError as exc:
            self._failed(kernel, f"node {self.settings.node} could not start it: {exc}")
            return
        deadline = self.clock() + LISTEN_TIMEOUT
        while kernel.state == "starting":
            self._reap(kernel)
            if kernel.state != "starting":
                break
            if await asyncio.to_thread(listening, kernel.ip, kernel.ports["shell_port"]):
                kernel.state = "running"
                self._save(kernel)
                self._track(self._watch(kernel))
                log.info(
                    "Launched kernel %s of %s (lease %s…) as pid %s at %s",
                    kernel.kernel_id,
                    kernel.user,
                    kernel.lease_id[:6],
                    kernel.pid,
                    kernel.ip,
                )
                break
            if self.clock() > deadline:
                self._end(kernel, "")
                self._failed(kernel, f"it did not listen within {LISTEN_TIMEOUT:g} s")
                break
            await asyncio.sleep(0.05)
        if self.ready is not None:
            self.ready.set()

    def _spawn(self, kernel: NodeKernel, order: LaunchOrder) -> None:
        """Start the kernel as the student (see the module's text).

        The agent is root and the student chooses the launch's folder and argv: nothing
        root does may follow a path the student controls. The kernel's folder stays
        root's (0711: the student reaches the files by name, creates nothing there), its
        files are made with ``O_EXCL|O_NOFOLLOW`` and then given to the student, and the
        working folder is made and entered by the kernel's own process, as the student
        (``/bin/sh -c 'mkdir -p … && cd …'``): Python's ``Popen(cwd=)`` would enter it as
        root, before dropping to the student, and so could leave the kernel inside a
        folder the student may not enter."""
        s = self.settings
        pw = pwd.getpwnam(order.user)
        launch = order.launch
        shutil.rmtree(kernel.directory, ignore_errors=True)  # a failed earlier attempt's
        os.mkdir(kernel.directory, 0o711)
        kernel.ip = s.ip
        kernel.ports = dict(zip(KERNEL_CHANNELS, free_ports(s.ip), strict=True))
        connection = os.path.join(kernel.directory, "kernel.json")
        info = {
            **kernel.ports,
            "ip": s.ip,
            "key": launch.key,
            "transport": "tcp",
            "signature_scheme": launch.signature_scheme,
            "kernel_name": "",
        }
        _write_new(connection, json.dumps(info), pw)
        env = dict(launch.env)
        state = env.pop("GPU_LEASE_STATE_JSON", None)
        state_file = os.path.join(kernel.directory, "gpu-lease.json")
        if state is not None:
            _write_new(state_file, state, pw)
            env["GPU_LEASE_STATE_FILE"] = state_file
        else:
            env.pop("GPU_LEASE_STATE_FILE", None)
        kernel.cwd, kernel.cwd_shared = self._cwd(launch.cwd, order.user, launch.kernel_id, pw)
        env.update(
            HOME=pw.pw_dir,
            USER=order.user,
            LOGNAME=order.user,
            SHELL=pw.pw_shell or "/bin/sh",
            PATH=s.path,
            GPU_LEASE_NODE=s.node,
            GPU_LEASE_REMOTE_NOTE=self._note(kernel, launch.cwd),
        )
        argv = [connection if a == "{connection_file}" else a for a in launch.argv]
        enter = ["/bin/sh", "-c", ENTER, "gpu-lease-kernel", kernel.cwd, *argv]
        fd = os.open(
            os.path.join(kernel.directory, "kernel.log"),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND,
            0o600,
        )
        with os.fdopen(fd, "ab") as out:
            os.fchown(out.fileno(), pw.pw_uid, pw.pw_gid)
            kernel.process = subprocess.Popen(
                enter,
                env=env,
                cwd="/",
                user=pw.pw_uid,
                group=pw.pw_gid,
                extra_groups=os.getgrouplist(order.user, pw.pw_gid),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                close_fds=True,
            )
        kernel.pid = kernel.process.pid
        kernel.start_time = start_time(kernel.pid)
        group, why = cgroups.create(f"kernel-{launch.kernel_id}", s.cgroup_parent)
        if group is not None:
            try:
                group.add(kernel.pid)
                kernel.cgroup = group.path
            except OSError as exc:
                why = f"cannot move it into {group.path}: {exc.strerror}"
        if kernel.cgroup is None:
            log.warning(
                "Kernel of lease %s… has no cgroup of its own: %s", kernel.lease_id[:6], why
            )
        self._save(kernel)

    def _cwd(self, asked: str | None, user: str, kernel_id: str, pw: Any) -> tuple[str, bool]:
        """The notebook's folder where it lies under a shared folder (the kernel enters it
        as the student, or fails saying why), else a scratch folder of the student's."""
        shared = self.settings.shared_dirs
        if asked and any(asked == d or asked.startswith(d.rstrip("/") + "/") for d in shared):
            return asked, True
        os.makedirs(self.settings.scratch_dir, mode=0o711, exist_ok=True)
        top = os.path.join(self.settings.scratch_dir, user)
        try:
            os.mkdir(top, 0o700)
            os.chown(top, pw.pw_uid, pw.pw_gid)
        except FileExistsError:
            st = os.lstat(top)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != pw.pw_uid:
                raise OSError(f"{top} is not a folder of {user}'s") from None
        leaf = _SAFE_NAME.sub("-", kernel_id).lstrip(".") or "kernel"
        return os.path.join(top, leaf), False  # made by the kernel's process, as the student

    def _note(self, kernel: NodeKernel, asked: str | None) -> str:
        where = f"This kernel runs on node {self.settings.node}"
        if kernel.cwd_shared:
            return f"{where}, in {kernel.cwd} (the notebook's folder, shared with the node)."
        elsewhere = f" (the notebook's folder {asked} is not shared with it)" if asked else ""
        return (
            f"{where}, in the scratch folder {kernel.cwd}{elsewhere}: files the notebook "
            "reads or writes by relative path are on the node, not beside the notebook."
        )

    # -- running kernels ----------------------------------------------------------------
    def _reap(self, kernel: NodeKernel) -> None:
        if kernel.state not in ("starting", "running") or kernel.pid is None:
            return
        code: int | None = None
        if kernel.process is not None:
            code = kernel.process.poll()
            if code is None:
                return
        elif start_time(kernel.pid) == kernel.start_time and kernel.start_time is not None:
            return  # found again after a restart, still running
        starting = kernel.state == "starting"
        kernel.state = "failed" if starting else "exited"
        kernel.exit_code = code if code is None or -255 <= code <= 255 else None
        said = tail(os.path.join(kernel.directory, "kernel.log"))
        if starting:
            kernel.reason = (
                f"the kernel exited (code {code}) before it listened on node "
                f"{self.settings.node}" + (f": {said}" if said else "")
            )[:480]
        elif kernel.ending_since is None and said:
            kernel.reason = f"it exited: {said}"[:480]
        if kernel.cgroup:
            mount = cgroups.v2_mount()
            if mount is not None:
                cgroups.KernelCgroup(kernel.cgroup, mount).remove()
        log.info(
            "Kernel of lease %s… (pid %s) %s with code %s",
            kernel.lease_id[:6],
            kernel.pid,
            kernel.state,
            code,
        )
        if self.ready is not None:
            self.ready.set()

    async def _watch(self, kernel: NodeKernel) -> None:
        """Until the kernel exits: then the next beat goes at once (its provisioner learns)."""
        while kernel.state == "running":
            self._reap(kernel)
            await asyncio.sleep(WATCH_EVERY)

    def _end(self, kernel: NodeKernel, why: str) -> None:
        """SIGTERM to the kernel's process group, SIGKILL :data:`END_GRACE` s later."""
        if kernel.state not in ("starting", "running") or kernel.ending_since is not None:
            return
        kernel.ending_since = self.clock()
        if why:
            kernel.reason = f"ended by node {self.settings.node}: {why}"
        self._signal_group(kernel, signal.SIGTERM)
        self._track(self._kill_later(kernel))

    async def _kill_later(self, kernel: NodeKernel) -> None:
        await asyncio.sleep(END_GRACE)
        self._reap(kernel)
        if kernel.state in ("starting", "running"):
            self._signal_group(kernel, signal.SIGKILL)

    def _track(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _signal_group(self, kernel: NodeKernel, signum: int) -> None:
        if kernel.pid is None:
            return
        if kernel.process is None and start_time(kernel.pid) != kernel.start_time:
            return  # not our process any more
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(kernel.pid, signum)

    def _send(self, entry: dict[str, Any]) -> None:
        kernel = self.kernels.get(str(entry.get("lease_id")))
        seq = entry.get("seq")
        if kernel is None or kernel.generation != entry.get("generation"):
            return
        if not isinstance(seq, int) or seq <= kernel.signaled or kernel.state != "running":
            return
        name = str(entry.get("signal"))
        signum = getattr(signal, name, None)
        if isinstance(signum, signal.Signals) and name.startswith("SIG"):
            self._signal_group(kernel, int(signum))
        kernel.signaled = seq
        self._save(kernel)
        if self.ready is not None:
            self.ready.set()

    # -- records: finding kernels again after a restart --------------------------------
    def _save(self, kernel: NodeKernel) -> None:
        path = os.path.join(kernel.directory, "agent.json")
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                json.dump(kernel.record(), f)
            os.replace(path + ".tmp", path)

    def _find_again(self) -> None:
        self.kernels.update(find_again(self.settings.kernel_dir))

    def _forget(self, kernel: NodeKernel) -> None:
        if self.kernels.get(kernel.lease_id) is kernel:
            del self.kernels[kernel.lease_id]
        shutil.rmtree(kernel.directory, ignore_errors=True)


def find_again(root: str) -> dict[str, NodeKernel]:
    """The kernels an earlier agent launched that still run (each kernel's ``agent.json``
    in its folder under ``root``, the same pid and start time); the others' folders go."""
    found: dict[str, NodeKernel] = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "agent.json")
        try:
            with open(path) as f:
                raw = json.load(f)
            kernel = NodeKernel(
                raw["lease_id"],
                int(raw["generation"]),
                raw["user"],
                raw["kernel_id"],
                os.path.join(root, name),
                state="running",
                ip=raw["ip"],
                ports={k: int(v) for k, v in raw["ports"].items()},
                pid=raw["pid"],
                start_time=raw["start_time"],
                cgroup=raw.get("cgroup"),
                cwd=raw.get("cwd") or "",
                cwd_shared=bool(raw.get("cwd_shared")),
                signaled=int(raw.get("signaled") or 0),
            )
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            continue
        if kernel.pid and start_time(kernel.pid) == kernel.start_time:
            found[kernel.lease_id] = kernel
            log.info("Found kernel of lease %s… (pid %s) again", kernel.lease_id[:6], kernel.pid)
        else:
            shutil.rmtree(kernel.directory, ignore_errors=True)
    return found


def state_expiry(kernel: NodeKernel) -> None:
    """The ``%gpu`` state file's ``expires_at``, as the broker renewed the lease."""
    path = os.path.join(kernel.directory, "gpu-lease.json")
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), encoding="utf-8") as f:
            data = json.load(f)
        data["expires_at"] = kernel.expires_at
        _rewrite(path, json.dumps(data), pwd.getpwnam(kernel.user))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # %gpu is a convenience, the kernel is not


def _write_new(path: str, text: str, pw: Any) -> None:
    """A new file ``path`` (never one that exists, never through a link), 0600, given to
    the account ``pw`` (the key's file, the state file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
        os.fchown(fd, pw.pw_uid, pw.pw_gid)
    finally:
        os.close(fd)


def _rewrite(path: str, text: str, pw: Any) -> None:
    """Replace the content of the student's file ``path`` in a folder of root's: only a
    plain file of theirs with one link (never a link to, or a hard link of, another file)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != pw.pw_uid or st.st_nlink != 1:
            raise OSError(f"{path} is not the student's own file")
        os.ftruncate(fd, 0)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


__all__ = ["KernelLauncher", "LaunchSettings", "NodeKernel", "address_towards", "free_ports"]
