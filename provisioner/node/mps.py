"""MPS control daemons, one per GPU, run and watched by the node agent (``--mps``).

A kernel started with ``enforcement=mps`` gets ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its
lease's cap) and ``CUDA_MPS_PIPE_DIRECTORY`` of its GPU's daemon; the MPS server then
refuses that kernel's allocations past the cap, for every framework and for code that
calls CUDA directly. That holds only while the GPU's daemon runs, so the agent starts one
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
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence

from ..wire import DEFAULT_MPS_DIR, MPS_STATES, pipe_directory

log = logging.getLogger("gpu_lease.agent.mps")

#: the MPS control program of the NVIDIA driver
MPS_CONTROL = "nvidia-cuda-mps-control"
#: seconds before the first restart of a daemon that exited, and the most between two
RESTART_FIRST, RESTART_MAX = 1.0, 30.0
#: seconds a daemon has to stop after ``quit``, then after SIGTERM
STOP_TIMEOUT = 10.0
#: seconds one query of a daemon (``get_server_list``, ``get_client_list``) may take
QUERY_TIMEOUT = 3.0


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


class MPSDaemon:
    """One GPU's control daemon: started, restarted when it exits, stopped on request."""

    def __init__(self, gpu_uuid: str, mps_dir: str, control: str = MPS_CONTROL) -> None:
        self.gpu_uuid = gpu_uuid
        self.control = control
        self.env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": pipe_directory(mps_dir, gpu_uuid),
            "CUDA_MPS_LOG_DIRECTORY": log_directory(mps_dir, gpu_uuid),
        }
        self.proc: asyncio.subprocess.Process | None = None
        #: how many times the daemon was started
        self.starts = 0

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
        without clients (it gives way to another uid's first client at once)."""
        for server in _pids(await self.query("get_server_list")):
            if _pids(await self.query(f"get_client_list {server}")):
                return uid_of(server, proc)
        return None

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

    def states(self) -> dict[str, str]:
        """GPU uuid -> ``running`` | ``down``, for the heartbeat."""
        return {d.gpu_uuid: d.state for d in self.daemons}

    async def server_uids(self) -> dict[str, int | None]:
        """GPU uuid -> the uid its MPS server serves clients of (None: none), for the
        heartbeat's ``mps_uid``."""
        uids = await asyncio.gather(*(d.server_uid() for d in self.daemons))
        return {d.gpu_uuid: uid for d, uid in zip(self.daemons, uids, strict=True)}

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(d.run(stop) for d in self.daemons))


__all__ = [
    "DEFAULT_MPS_DIR",
    "MPS_CONTROL",
    "MPS_STATES",
    "MPSDaemon",
    "MPSSupervisor",
    "log_directory",
    "pipe_directory",
    "uid_of",
]
