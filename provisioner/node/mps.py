"""MPS control daemons, one per GPU, run and watched by the node agent (``--mps``).

A kernel started with ``enforcement=mps`` gets ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its
lease's cap) and ``CUDA_MPS_PIPE_DIRECTORY`` of its GPU's daemon; the MPS server then
refuses that kernel's allocations past the cap, for every framework and for code that
calls CUDA directly, and past the limit the agent sets in the daemon (below) even when the
kernel drops the variable. That holds only while the GPU's daemon runs, so the agent starts one
``nvidia-cuda-mps-control -f`` (foreground) per GPU, each with::

    CUDA_VISIBLE_DEVICES=<gpu uuid>
    CUDA_MPS_PIPE_DIRECTORY=<mps_dir>/<gpu uuid>/pipe     (:func:`pipe_directory`)
    CUDA_MPS_LOG_DIRECTORY=<mps_dir>/<gpu uuid>/log

restarts a daemon that exits (1 s, doubling to 30 s), reports each GPU's daemon
``running`` or ``down`` in its heartbeats (the broker shows it per lease, and ``%gpu``
and ``gpu-lease top`` say which layer holds), and on its way out asks each daemon to
``quit`` (``echo quit | nvidia-cuda-mps-control``), then SIGTERM, then SIGKILL.

MPS serves **one Unix user per GPU at a time**: the daemon starts an MPS server for the
uid of the first client, and a client of another uid does not fail, it waits (its CUDA
call hangs) until that server's clients are all gone. So before each heartbeat the agent
asks each running daemon which uid its server serves (:meth:`MPSDaemon.server_uid`:
``get_server_list``, then ``get_client_list PID`` for each server, and the server
process's uid from ``/proc/PID/status``); a server without clients counts as none (it
gives way to the next uid at once). The broker then places an ``enforcement=mps`` kernel
only on a GPU whose server serves its uid or none (``node_rules.mps_blocked``).

The provisioner computes the same pipe directory from its ``mps_dir`` (default
:data:`DEFAULT_MPS_DIR`, the agent's default too).

**Daemon-side memory limits**. The kernel's ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
is the student's to unset (a cell can do it before importing torch), so the agent also sets
the limit where the student cannot reach it, in the control daemon, which it runs as root.
What the control daemon offers (``man nvidia-cuda-mps-control``, "Commands available to
Volta MPS control", R450+; NVIDIA's MPS guide, "Appendix: Tools and Interface Reference"):

- ``set_default_device_pinned_mem_limit <dev> <value>``: "the default device pinned memory
  limit for **each MPS client**"; "if there is already a server spawned, this command will
  only affect the next server"; "the set value is lost if a quit command is executed";
  ``<value>`` is an integer with ``M`` or ``G``; by default memory limiting is disabled.
- ``set_device_pinned_mem_limit <PID> <dev> <value>``: the limit "for each client of MPS
  server instance of the given PID for the device dev. All clients created with that server
  afterwards will observe the new limit. **Existing clients are not affected.**"
- ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` in a client's environment limits that client; where
  the server has a limit too, the lower one binds: a client may tighten, never lift, the
  server's (the MPS guide's environment appendix, 4.2.7, and operators' notes, e.g. "client
  side can further tighten, cannot break through the server's lower limit"; the stand-in
  ``tests/fake_mps`` encodes exactly that).

So the limit is **per client** (each CUDA process), not a server total. The agent sets, for
each GPU's running server (serving uid U), the *largest* memory (cap + context, the
heartbeat answer's ``memory_mb``) of the MPS leases U holds on that GPU: each of U's kernels
is then held to at most its largest lease there. A sum would let one client take all of U's
leases' memory; the smallest would cut U's larger kernels short. Where a lease's ``user`` is
no account on this node (one uid for every student, e.g. Kubernetes pods as uid 1000), the
agent cannot tell whose it is, and bounds by the largest MPS lease on the GPU. The default
for the GPU's next server is also the largest MPS lease there, so a server started between
two heartbeats is bounded too (dev ``0``: each daemon sees one GPU, ``CUDA_VISIBLE_DEVICES``);
on a GPU where the broker names no MPS lease, both are :data:`EMPTY_GPU_LIMIT_MB` (once
the broker is known to name its kernels' memory): a client there belongs to no lease the
agent knows of. The broker's answer names every lease of the node from its grant on
(``leases``), and once the limits in force cover a lease the agent lists its digest in
``<mps_dir>/<uuid>/covered`` (:meth:`MPSDaemon.tell_covered`); the provisioner starts an
MPS kernel only then (``c.GPULeaseProvisioner.mps_limit_wait``, 15 s, then with a
warning), so an honest kernel's first CUDA call meets its own lease's limit, never the
1 MiB of a GPU the agent had not yet seen it on (a client keeps the limit of its start).
Both are re-applied when leases come and go, and after a daemon restart (``quit`` loses
them). What remains (docs/admins.md, "Which cap holds against whom"): a client keeps the
limit of its start ("existing clients are not affected"); a student with two leases on one
GPU may use the larger twice; and a kernel that unsets ``CUDA_MPS_PIPE_DIRECTORY`` before
CUDA starts is no MPS client at all ("if the connection attempt fails, the program
continues to run as it normally would without MPS", the man page), so no MPS limit
reaches it. The agent's ``--enforce`` report/revoke/kill covers these after the fact; for
the last, :meth:`MPSDaemon.server_uid` keeps every server's client pids, and a GPU process
of a proven MPS kernel that is none of them makes the lease over its cap
(:func:`~provisioner.node.proof.outside_mps`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..node_report import MPSReport
from ..wire import DEFAULT_MPS_DIR, MPS_STATES, lease_digest, mps_covered_file, pipe_directory
from .feature import Beat

log = logging.getLogger("gpu_lease.agent.mps")

#: the MPS control program of the NVIDIA driver
MPS_CONTROL = "nvidia-cuda-mps-control"
#: seconds before the first restart of a daemon that exited, and the most between two
RESTART_FIRST, RESTART_MAX = 1.0, 30.0
#: seconds a daemon has to stop after ``quit``, then after SIGTERM
STOP_TIMEOUT = 10.0
#: seconds one query of a daemon (``get_server_list``, ``get_client_list``) may take
QUERY_TIMEOUT = 3.0
#: MiB each client may pin on a GPU where the broker names no MPS lease (a client there
#: belongs to no lease the agent knows of yet): the smallest limit the daemon takes
EMPTY_GPU_LIMIT_MB = 1


def uid_of(pid: int, proc: str = "/proc") -> int | None:
    """The real uid of process ``pid`` (``Uid:`` in ``/proc/PID/status``); None if gone."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _pids(text: str | None) -> list[int]:
    """The pids a ``get_*_list`` answer lists, one a line (other lines are skipped)."""
    return [int(w) for w in (text or "").split() if w.isdigit()]


def log_directory(mps_dir: str, gpu_uuid: str) -> str:
    """The ``CUDA_MPS_LOG_DIRECTORY`` of ``gpu_uuid``'s daemon."""
    return os.path.join(mps_dir, gpu_uuid, "log")


@dataclass(frozen=True)
class MPSLease:
    """A lease whose kernel may be a client of a GPU's MPS server, from a heartbeat answer."""

    gpu_uuid: str
    #: MiB the lease holds on the GPU (cap + context)
    memory_mb: int
    #: the lease's user (an account name), None where the answer does not say
    user: str | None = None
    #: the lease's id, None where the answer does not say (an older broker's ``limits``)
    lease_id: str | None = None


def mps_leases(answer: Mapping[str, Any]) -> list[MPSLease]:
    """The leases a heartbeat answer names with their GPU and memory: its ``leases``
    (``{lease_id, user, gpu_uuid, memory_mb, enforcement}``: every active lease of the node,
    from its grant on, whether or not its kernel has reported a pid); from a broker older
    than that, each ``kernels`` entry (leases whose kernel reported a pid); from one whose
    ``kernels`` carry no ``memory_mb`` either, the ``limits`` entries (whose, they do not
    say). Every lease counts, whatever its ``enforcement``: the broker keeps an acquire's
    MPS hint in memory only, so after its restart an MPS lease may read ``cooperative``,
    and a bound too tight would cut an honest kernel short for its life."""
    entries: list[dict[str, Any]] = [x for x in answer.get("leases") or [] if isinstance(x, dict)]
    if "leases" not in answer:
        entries = [k for k in answer.get("kernels") or [] if isinstance(k, dict)]
        if not any("memory_mb" in k for k in entries):
            entries = [x for x in answer.get("limits") or [] if isinstance(x, dict)]
    out = []
    for entry in entries:
        gpu, memory, user = entry.get("gpu_uuid"), entry.get("memory_mb"), entry.get("user")
        lease_id = entry.get("lease_id")
        if not isinstance(gpu, str):
            continue
        if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0:
            out.append(
                MPSLease(
                    gpu,
                    memory,
                    user if isinstance(user, str) else None,
                    lease_id if isinstance(lease_id, str) else None,
                )
            )
    return out


def account_uid(user: str) -> int | None:
    """The uid of the account ``user`` on this node (None: no such account)."""
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def pinned_limit_mb(
    leases: Sequence[MPSLease],
    gpu_uuid: str,
    uid: int | None,
    uid_of_user: Callable[[str], int | None] = account_uid,
    empty: int | None = None,
) -> int | None:
    """MiB each client of ``gpu_uuid``'s MPS server may pin, for a server serving ``uid``
    (None: for the GPU's next server): the largest of the GPU's MPS leases that ``uid``'s
    user holds, counting those whose user is no account here (they may be anyone's); with
    none, the largest of the GPU's; ``empty`` when the GPU has no MPS lease (None: nothing
    to bound by, the limit in force stays)."""
    here = [x for x in leases if x.gpu_uuid == gpu_uuid]
    if not here:
        return empty
    if uid is not None:
        names = {x.user for x in here if x.user is not None}
        uids = {name: uid_of_user(name) for name in names}
        mine = [x for x in here if x.user is None or uids[x.user] in (None, uid)]
        if mine:
            return max(x.memory_mb for x in mine)
    return max(x.memory_mb for x in here)


class MPSDaemon:
    """One GPU's control daemon: started, restarted when it exits, stopped on request."""

    def __init__(self, gpu_uuid: str, mps_dir: str, control: str = MPS_CONTROL) -> None:
        self.gpu_uuid = gpu_uuid
        self.mps_dir = mps_dir
        self.control = control
        #: what :meth:`tell_covered` last wrote
        self._covered: str | None = None
        self.env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": pipe_directory(mps_dir, gpu_uuid),
            "CUDA_MPS_LOG_DIRECTORY": log_directory(mps_dir, gpu_uuid),
        }
        self.proc: asyncio.subprocess.Process | None = None
        #: how many times the daemon was started
        self.starts = 0
        #: server pid -> the uid it serves, as the last :meth:`server_uid` found them
        self.servers: dict[int, int | None] = {}
        #: the pids of every server's clients as the last :meth:`server_uid` found them
        #: (None: not running, or a query failed: then nobody is judged outside MPS)
        self.clients: frozenset[int] | None = None
        #: the default limit set, with the start it was set on (``quit`` loses it)
        self._default_set: tuple[int, int] | None = None
        #: server pid -> the limit set on it
        self._server_set: dict[int, int] = {}

    @property
    def state(self) -> str:
        running = self.proc is not None and self.proc.returncode is None
        return "running" if running else "down"

    async def _start(self) -> bool:
        for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            # the pipe directory must be reachable by every kernel's user
            os.makedirs(self.env[key], mode=0o755, exist_ok=True)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.control,
                "-f",
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except OSError as exc:
            log.error("Cannot start %s for GPU %s: %s", self.control, self.gpu_uuid, exc)
            return False
        self.starts += 1
        log.info(
            "MPS control daemon for GPU %s started (pid %d, pipe %s)",
            self.gpu_uuid,
            self.proc.pid,
            self.env["CUDA_MPS_PIPE_DIRECTORY"],
        )
        return True

    async def _control(self, command: str, timeout: float) -> bytes | None:
        """``command`` to this GPU's daemon through the control program: its output, or
        None when the program cannot start, fails, or is silent past ``timeout`` (then it
        is killed). Each failure is logged."""
        try:
            client = await asyncio.create_subprocess_exec(
                self.control,
                env=self.env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except OSError as exc:
            log.warning(
                "Cannot send %r to the MPS daemon of GPU %s: %s", command, self.gpu_uuid, exc
            )
            return None
        try:
            out, _ = await asyncio.wait_for(client.communicate(command.encode() + b"\n"), timeout)
        except asyncio.TimeoutError:
            client.kill()
            await client.wait()
            log.warning("The MPS daemon of GPU %s did not answer %r", self.gpu_uuid, command)
            return None
        return out if client.returncode == 0 else None

    async def query(self, command: str) -> str | None:
        """One command to this GPU's daemon; its answer, or None (not running, failed, or
        silent past :data:`QUERY_TIMEOUT`)."""
        if self.state != "running":
            return None
        out = await self._control(command, QUERY_TIMEOUT)
        return None if out is None else out.decode(errors="replace")

    async def server_uid(self, proc: str = "/proc") -> int | None:
        """The uid this GPU's MPS server serves clients of now; None: no server, or one
        without clients (it gives way to another uid's first client at once). Each
        server's uid is kept in :attr:`servers` (for :meth:`set_limits`), every server's
        client pids in :attr:`clients` (for :func:`~provisioner.node.proof.outside_mps`).
        Those are None where a query failed, or where a listed client is no process of
        the server's uid here (gone meanwhile, or the daemon numbers pids in another pid
        namespace than the agent's /proc): a list not understood proves no one outside MPS."""
        serving = None
        self.servers = {}
        listed = await self.query("get_server_list")
        clients: set[int] | None = None if listed is None else set()
        for server in _pids(listed):
            uid = self.servers[server] = uid_of(server, proc)
            answer = await self.query(f"get_client_list {server}")
            pids = _pids(answer)
            if answer is None or any(uid is None or uid_of(pid, proc) != uid for pid in pids):
                clients = None
            elif clients is not None:
                clients.update(pids)
            if serving is None and pids:
                serving = uid
        self.clients = None if clients is None else frozenset(clients)
        return serving

    async def set_limits(
        self,
        leases: Sequence[MPSLease],
        uid_of_user: Callable[[str], int | None] = account_uid,
        empty: int | None = None,
    ) -> bool:
        """Set the daemon-side pinned memory limits ``leases`` allow (:func:`pinned_limit_mb`,
        ``empty`` on a GPU without MPS leases): the default for the GPU's next server and
        each running server's (for the uid it serves). Only what changed is sent; after a
        restart of the daemon, all again. True when every limit ``leases`` call for is in
        force (what :meth:`MPSSupervisor.apply_limits` then tells the provisioners)."""
        if self.state != "running":
            return False
        applied = True
        default = pinned_limit_mb(leases, self.gpu_uuid, None, uid_of_user, empty)
        if default is not None and self._default_set != (self.starts, default):
            command = f"set_default_device_pinned_mem_limit 0 {default}M"
            if await self.query(command) is not None:
                self._default_set = (self.starts, default)
                log.info("MPS daemon of GPU %s: %s", self.gpu_uuid, command)
            else:
                applied = False
        self._server_set = {p: mb for p, mb in self._server_set.items() if p in self.servers}
        for server, uid in self.servers.items():
            limit = pinned_limit_mb(leases, self.gpu_uuid, uid, uid_of_user, empty)
            if limit is None or uid is None or self._server_set.get(server) == limit:
                continue
            command = f"set_device_pinned_mem_limit {server} 0 {limit}M"
            if await self.query(command) is None:
                applied = False
                continue
            self._server_set[server] = limit
            log.info(
                "MPS server %d of GPU %s (uid %d): each new client may pin %d MiB",
                server,
                self.gpu_uuid,
                uid,
                limit,
            )
        return applied

    def tell_covered(self, leases: Sequence[MPSLease]) -> None:
        """Write which leases of this GPU the limits in force cover (``covered`` beside
        the pipe directory, :func:`~provisioner.wire.mps_covered_file`: one
        :func:`~provisioner.wire.lease_digest` a line, never a lease id): a provisioner
        starts an MPS kernel only once its lease is listed, so that its first CUDA call
        meets its lease's limit, not the tighter one of a GPU without it."""
        digests = sorted({lease_digest(x.lease_id) for x in leases if x.lease_id})
        text = "".join(f"{d}\n" for d in digests)
        path = mps_covered_file(self.mps_dir, self.gpu_uuid)
        if text == self._covered:
            return
        tmp = f"{path}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("Cannot write %s: %s", path, exc)
            return
        self._covered = text

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the daemon running until ``stop``; then stop it."""
        delay = RESTART_FIRST
        try:
            while not stop.is_set():
                if await self._start():
                    assert self.proc is not None
                    ended = asyncio.ensure_future(self.proc.wait())
                    stopping = asyncio.ensure_future(stop.wait())
                    await asyncio.wait({ended, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    stopping.cancel()
                    if stop.is_set():
                        ended.cancel()
                        break
                    log.warning(
                        "MPS control daemon for GPU %s exited with %s; restarting in %g s "
                        "(kernels with enforcement=mps on it are not capped meanwhile)",
                        self.gpu_uuid,
                        self.proc.returncode,
                        delay,
                    )
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(RESTART_MAX, delay * 2)
        finally:
            await self.stop()

    async def stop(self) -> None:
        """``quit`` through the control program, then SIGTERM, then SIGKILL."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        await self._control("quit", STOP_TIMEOUT)  # then the signals, whatever it answered
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and proc.returncode is None:
                proc.send_signal(sig)
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT)
                break
            except asyncio.TimeoutError:
                continue
        log.info("MPS control daemon for GPU %s stopped", self.gpu_uuid)


class MPSSupervisor:
    """The daemons of a node's GPUs (``gpu-lease agent --mps``)."""

    def __init__(
        self, gpu_uuids: Sequence[str], mps_dir: str = DEFAULT_MPS_DIR, control: str = MPS_CONTROL
    ) -> None:
        self.daemons = [MPSDaemon(u, mps_dir, control) for u in gpu_uuids]
        #: whether the broker names its kernels' memory (``kernels[].memory_mb``):
        #: only then does a GPU it names no MPS lease on get :data:`EMPTY_GPU_LIMIT_MB`
        #: (an older broker's silence says nothing)
        self.names_memory = False

    def states(self) -> dict[str, str]:
        """GPU uuid -> ``running`` | ``down``, for the heartbeat."""
        return {d.gpu_uuid: d.state for d in self.daemons}

    async def server_uids(self) -> dict[str, int | None]:
        """GPU uuid -> the uid its MPS server serves clients of (None: none), for the
        heartbeat's ``mps_uid``."""
        uids = await asyncio.gather(*(d.server_uid() for d in self.daemons))
        return {d.gpu_uuid: uid for d, uid in zip(self.daemons, uids, strict=True)}

    def clients(self) -> dict[str, frozenset[int] | None]:
        """GPU uuid -> the pids of its MPS server's clients as the last
        :meth:`server_uids` found them (None: the daemon is down or did not answer)."""
        return {d.gpu_uuid: d.clients if d.state == "running" else None for d in self.daemons}

    async def apply_limits(self, answer: Mapping[str, Any]) -> None:
        """After each heartbeat: each GPU's daemon-side pinned memory limits, from the
        leases the broker's answer names (:meth:`MPSDaemon.set_limits`)."""
        kernels = answer.get("kernels") or []
        if "leases" in answer or any(isinstance(k, dict) and "memory_mb" in k for k in kernels):
            self.names_memory = True
        leases = mps_leases(answer)
        empty = EMPTY_GPU_LIMIT_MB if self.names_memory else None
        applied = await asyncio.gather(*(d.set_limits(leases, empty=empty) for d in self.daemons))
        for daemon, ok in zip(self.daemons, applied, strict=True):
            if ok:
                daemon.tell_covered([x for x in leases if x.gpu_uuid == daemon.gpu_uuid])

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(d.run(stop) for d in self.daemons))


class MPSFeature:
    """MPS as a node feature (``--mps``): each heartbeat carries the GPUs' daemon states
    (``mps``) and the uid each GPU's MPS server serves (``mps_uid``, asked after the
    sample: a client in it is listed now), so that the broker places no MPS kernel where
    it would hang; the servers' client pids go to the kernel proofs (a kernel process
    outside MPS); each answer's leases set the daemons' own memory limits, which a kernel
    cannot lift. A failed query or limit is logged, never fatal."""

    ready: asyncio.Event | None = None

    def __init__(self, supervisor: MPSSupervisor) -> None:
        self.supervisor = supervisor
        self.uids: dict[str, int | None] | None = None

    async def observe(self, beat: Beat) -> None:
        self.uids = None
        try:
            self.uids = await self.supervisor.server_uids()
        except Exception:  # noqa: BLE001 - a failed query must not stop the heartbeats
            log.exception("Cannot learn which uid each GPU's MPS server serves")
        beat.mps_clients = self.supervisor.clients() if self.uids is not None else {}

    def report(self, beat: Beat) -> MPSReport:
        return MPSReport(self.supervisor.states(), self.uids)

    async def answer(self, beat: Beat, answer: dict[str, Any]) -> None:
        try:
            await self.supervisor.apply_limits(answer)
        except Exception:  # noqa: BLE001 - a failed limit must not stop the heartbeats
            log.exception("Cannot set the MPS daemons' memory limits")

    def offered(self) -> frozenset[str]:
        return frozenset()

    def refused(self, fields: set[str], node: str) -> None:
        pass


__all__ = [
    "DEFAULT_MPS_DIR",
    "EMPTY_GPU_LIMIT_MB",
    "MPS_CONTROL",
    "MPS_STATES",
    "MPSDaemon",
    "MPSFeature",
    "MPSLease",
    "MPSSupervisor",
    "account_uid",
    "log_directory",
    "mps_leases",
    "pinned_limit_mb",
    "pipe_directory",
    "uid_of",
]
