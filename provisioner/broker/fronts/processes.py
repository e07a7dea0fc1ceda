"""``--http-processes N``: the broker process starts, watches and stops its HTTP processes.

The broker binds ``--ip/--port`` itself (a busy port is its own start-up error, as with
one process), starts the :class:`~provisioner.broker.fronts.service_channel.ServiceServer` on a Unix
socket in a fresh directory only its user may enter, and starts ``N`` front processes:
``python -m provisioner.broker.app`` with the broker's own command line, told the
socket's path and the listening sockets they inherit in ``$GPU_LEASE_BROKER_FRONT``
(each its own ``SO_REUSEPORT`` socket when there are several: the kernel spreads new
connections over them). With browser login (hub OAuth) the
fronts share one cookie secret, given in their environment.

A front that exits while the broker serves is started again (its clients' connections
were cut; their retries land on the others). One that keeps exiting within seconds of
its start is a configuration the broker cannot serve with: after
:data:`MAX_QUICK_EXITS` such exits the broker stops (``failed``). A front whose broker
process is gone exits at once, so the port is free for the broker's restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..services.broker_service import BrokerService
from .service_channel import ServiceServer

log = logging.getLogger("gpu_lease.broker.fronts")

#: the fronts' shared cookie secret (hex), in their environment only
COOKIE_SECRET_ENV = "GPU_LEASE_FRONT_COOKIE_SECRET"
#: ``{"service_socket": PATH, "fds": [FD, ...]}``: what makes a broker process a front
FRONT_ENV = "GPU_LEASE_BROKER_FRONT"
#: a front that exits sooner than this after its start exited "quickly"
QUICK_EXIT_S = 5.0
#: quick exits in a row after which the broker gives up (and stops)
MAX_QUICK_EXITS = 3
#: seconds between a front's exit and its restart
RESTART_DELAY_S = 0.5
#: seconds a front may take to finish its answers after SIGTERM, then SIGKILL
STOP_TIMEOUT_S = 5.0


class Fronts:
    """The HTTP processes of one broker; ``stop``/``close_all_connections`` as a server's."""

    def __init__(
        self,
        count: int,
        argv: list[str],
        sockets: list[list[socket.socket]],
        service: BrokerService,
        render_metrics: Callable[[], Any],
        *,
        browser_login: bool,
        failed: Callable[[str], None],
    ) -> None:
        self.count = count
        self.argv = list(argv)
        self.sockets = sockets
        self.server = ServiceServer(service, render_metrics)
        self.failed = failed
        self.dir = tempfile.mkdtemp(prefix="gpu-lease-broker-")  # mode 0700
        self.path = os.path.join(self.dir, "service.sock")
        self.env = dict(os.environ)
        if browser_login:
            self.env[COOKIE_SECRET_ENV] = secrets.token_hex(32)
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self.stopping = False

    def environment(self, i: int) -> dict[str, str]:
        fds = [s.fileno() for s in self.sockets[i]]
        return {**self.env, FRONT_ENV: json.dumps({"service_socket": self.path, "fds": fds})}

    async def start(self) -> None:
        await self.server.start(self.path)
        self._watchers = [asyncio.create_task(self._keep(i)) for i in range(self.count)]

    async def _keep(self, i: int) -> None:
        """Run front ``i`` until the broker stops, starting it again when it exits."""
        quick = 0
        while not self.stopping:
            started = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "provisioner.broker.app",
                    *self.argv,
                    pass_fds=[s.fileno() for s in self.sockets[i]],
                    env=self.environment(i),
                )
            except OSError as exc:
                self.failed(f"Cannot start HTTP process {i + 1}: {exc}")
                return
            self.procs[i] = proc
            status = await proc.wait()
            # a SIGTERM to the whole group (systemd's stop) reaches the fronts first
            await asyncio.sleep(RESTART_DELAY_S)
            if self.stopping:
                return
            quick = quick + 1 if time.monotonic() - started < QUICK_EXIT_S else 0
            if quick >= MAX_QUICK_EXITS:
                self.failed(
                    f"HTTP process {i + 1} exited {quick} times in a row right after its "
                    f"start (last status {status}); its log lines above say why."
                )
                return
            log.warning(
                "HTTP process %d (pid %d) exited with status %s; starting another",
                i + 1,
                proc.pid,
                status,
            )

    def stop(self) -> None:
        """No more restarts (the fronts go on answering until ``close_all_connections``)."""
        self.stopping = True

    async def close_all_connections(self) -> None:
        """Stop the fronts (SIGTERM: they finish what they answer; SIGKILL after
        ``STOP_TIMEOUT_S``), then the service socket; close the listening sockets."""
        self.stopping = True
        live = [p for p in self.procs.values() if p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            for proc in live:
                if proc.returncode is None:
                    log.warning("HTTP process pid %d did not stop; killing it", proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            await asyncio.gather(*(p.wait() for p in live))
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await self.server.close()
        for mine in self.sockets:
            for s in mine:
                s.close()
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["COOKIE_SECRET_ENV", "FRONT_ENV", "Fronts"]
