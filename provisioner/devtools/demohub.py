"""``make demo`` as a subprocess, for the demo's own test and benchmark.

:class:`DemoHub` starts ``python -m provisioner.devtools.demo`` on free ports with a state
directory, kernelspecs in a private prefix, and a ``TMPDIR`` and ``HOME`` of its own
(empty at start: whatever the demo leaves outside its state directory shows there);
starts servers through the hub API with the operator token; and interrupts it with
SIGINT as Ctrl-C would, timing how long until the demo has exited and until every
process it had started is gone. ``tests/test_demo.py`` and ``benchmarks/demo_stop.py``
use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from .testing import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGINATED = {"Accept": "application/jupyterhub-pagination+json"}


def demo_command(
    state: Path,
    prefix: Path,
    port: int,
    gpus: str,
    *extra: str,
    server_port_base: int | None = None,
) -> list[str]:
    """``python -m provisioner.devtools.demo`` on ``port``, every other port free and random."""
    if server_port_base is None:
        server_port_base = random.randrange(10000, 24000)
    return [
        sys.executable,
        "-m",
        "provisioner.devtools.demo",
        "--state-dir",
        str(state),
        "--kernels-prefix",
        str(prefix),
        "--port",
        str(port),
        "--hub-api-port",
        str(free_port()),
        "--proxy-api-port",
        str(free_port()),
        "--broker-port",
        str(free_port()),
        "--gpus",
        gpus,
        "--server-port-base",
        str(server_port_base),
        *extra,
    ]


@dataclass
class Stopped:
    """What one Ctrl-C did: seconds until the demo exited and until all was gone."""

    exit_code: int
    exit_s: float
    all_gone_s: float
    processes: int
    survivors: list[str] = field(default_factory=list)
    port_free: bool = True
    left_outside: list[str] = field(default_factory=list)
    log_tail: str = ""


class DemoHub:
    """The demo on free ports under ``tmp`` (state in ``tmp/.demo``, unless ``state``)."""

    def __init__(self, tmp: Path, *, gpus: str = "1x32768:V100", state: Path | None = None) -> None:
        self.tmp = tmp
        self.state = state or tmp / ".demo"
        self.port = free_port()
        self.systmp = tmp / "systmp"  # the demo's TMPDIR: must stay empty
        self.home = tmp / "home"  # the demo's HOME: must stay empty
        for d in (self.systmp, self.home):
            d.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "demo.log"
        self.args = demo_command(self.state, tmp / "prefix", self.port, gpus)
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240.0) -> float:
        """Start the demo; returns seconds until it printed its banner (``demo.json``)."""
        env = dict(os.environ)
        for name in ("JUPYTERHUB_API_TOKEN", "GPU_LEASE_TOKEN", "GPU_LEASE_URL"):
            env.pop(name, None)
        env.update(TMPDIR=str(self.systmp), HOME=str(self.home))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        info_file = self.state / "demo.json"
        while not info_file.exists():
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.kill()
                raise RuntimeError(f"the demo did not start:\n{self.log()}")
            time.sleep(0.2)
        self.info = json.loads(info_file.read_text())
        return time.monotonic() - t0

    def log(self, limit: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    # -- servers ------------------------------------------------------------------------
    def spawn(self, users: list[str], timeout: float = 600.0) -> float:
        """Start these users' servers all at once; returns seconds until all are ready."""
        return asyncio.run(self._spawn(users, timeout))

    async def _spawn(self, users: list[str], timeout: float) -> float:
        headers = {"Authorization": f"token {self.info['admin_token']}", **PAGINATED}
        t0 = time.monotonic()
        async with httpx.AsyncClient(
            base_url=f"{self.url}/hub/api", headers=headers, timeout=timeout
        ) as c:
            answers = await asyncio.gather(*(c.post(f"/users/{u}/server") for u in users))
            bad = [r.text for r in answers if r.status_code not in (201, 202)]
            if bad:
                raise RuntimeError(f"the hub refused to start servers: {bad[:3]}")
            while True:
                ready = await self.ready_users(c)
                if set(users) <= ready:
                    return time.monotonic() - t0
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(
                        f"{len(set(users) - ready)} server(s) not ready in {timeout:.0f} s:\n"
                        + self.log()
                    )
                await asyncio.sleep(0.5)

    @staticmethod
    async def ready_users(c: httpx.AsyncClient) -> set[str]:
        ready: set[str] = set()
        offset = 0
        while True:
            r = await c.get("/users", params={"state": "ready", "offset": offset, "limit": 200})
            r.raise_for_status()
            items = r.json()["items"]
            ready.update(u["name"] for u in items)
            if len(items) < 200:
                return ready
            offset += len(items)

    def processes(self) -> list[psutil.Process]:
        """Every process below the demo now."""
        assert self.proc is not None
        try:
            return list(psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.Error:
            return []

    # -- stopping ---------------------------------------------------------------------
    def interrupt(self, timeout: float = 120.0) -> Stopped:
        """Ctrl-C: SIGINT to the demo; wait until it exits and every process it ran is gone."""
        assert self.proc is not None
        procs = self.processes()
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = -1
        exit_s = time.monotonic() - t0
        survivors = alive(procs)
        while survivors and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
            survivors = alive(procs)
        all_gone_s = time.monotonic() - t0
        return Stopped(
            exit_code=code,
            exit_s=exit_s,
            all_gone_s=all_gone_s,
            processes=len(procs),
            survivors=[describe(p) for p in survivors],
            port_free=port_free(self.port),
            left_outside=self.left_outside(),
            log_tail=self.log(3000),
        )

    def left_outside(self) -> list[str]:
        """What the demo left in its TMPDIR and HOME (both empty at start)."""
        return sorted(str(p) for d in (self.systmp, self.home) for p in d.iterdir())

    def kill(self) -> None:
        """Kill the demo and everything below it (cleanup after a failure)."""
        if self.proc is None:
            return
        procs = self.processes()
        for p in [*procs, psutil.Process(self.proc.pid)] if self.proc.poll() is None else procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        psutil.wait_procs(procs, timeout=10)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return str(p.pid)


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
