"""A classroom, end to end, against a running hub (``make demo``).

N students log in through the hub API (a token each) and spawn their servers; once
all are up, each starts a "Python 3 (GPU 0.02)" kernel and a plain "Python 3" kernel
together (both requests at once, alternating whose leaves first), all students at once,
runs a cell in each, and stops. It reports the time
from the first login to the last kernel ready, the GPU leases held at that moment,
the broker's queue waits, the GPU/plain kernel start times, and the leases left
after every server stopped (leaks; must be 0)::

    python examples/classroom.py -n 10      # reads .demo/demo.json for URL and token
    GPU_LEASE_TOKEN=... python examples/classroom.py --hub-url http://127.0.0.1:8000 -n 50
    python examples/classroom.py --hub-url http://127.0.0.1:8000 --token-file op.token -n 50

The token is the demo's operator token (``gpu-lease-admin`` service: admin:users,
admin:servers, tokens, custom:gpu-lease:admin), read from ``GPU_LEASE_TOKEN`` or from a
file only its owner may read (``--token-file``, mode 0600), never from the command line,
where every account's ``ps`` would see it (``--token`` is refused with that advice). ``tests/test_hub.py`` imports
:func:`run_classroom`; ``benchmarks/classroom.py`` builds on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

CELL = "import os; print('lease=' + os.environ.get('GPU_LEASE_ID', ''))"


class WebsocketClosed(RuntimeError):
    """The server closed a kernel's websocket before the cell's reply."""


@dataclass
class Student:
    name: str
    login_s: float = 0.0
    server_s: float = 0.0
    gpu_kernel_s: float = 0.0
    plain_kernel_s: float | None = None
    gpu_first: bool = True
    ready_at: float = 0.0
    kernel_ids: list[str] = field(default_factory=list)
    #: every round's (GPU kernel started first?, GPU kernel s, plain kernel s or None)
    samples: list[tuple[bool, float, float | None]] = field(default_factory=list)
    lease_id: str = ""
    error: str = ""


@dataclass
class Report:
    n: int
    all_ready_s: float = 0.0
    servers_ready_s: float = 0.0
    leases_held: int = 0
    queued: int = 0
    queue_wait_s: float = 0.0
    gpu_kernel_median_s: float = 0.0
    plain_kernel_median_s: float | None = None
    gpu_over_plain: float | None = None
    gpu_over_plain_pooled: float | None = None
    server_median_s: float = 0.0
    stop_s: float = 0.0
    leaks: int = 0
    errors: list[str] = field(default_factory=list)
    students: list[Student] = field(default_factory=list)

    def summary(self) -> str:
        plain = (
            f", plain kernel {self.plain_kernel_median_s:.2f} s (GPU/plain: median of each "
            f"student's pair {self.gpu_over_plain:.2f}, ratio of medians "
            f"{self.gpu_over_plain_pooled:.2f})"
            if self.plain_kernel_median_s is not None
            and self.gpu_over_plain is not None
            and self.gpu_over_plain_pooled is not None
            else ""
        )
        return (
            f"{self.n} students: all servers up {self.servers_ready_s:.1f} s and all kernels ready "
            f"{self.all_ready_s:.1f} s after the first login; "
            f"median server start {self.server_median_s:.1f} s, GPU kernel "
            f"{self.gpu_kernel_median_s:.2f} s{plain}; {self.leases_held} GPU lease(s) held; "
            f"{self.queued} queued ({self.queue_wait_s:.2f} s waited in all); "
            f"stop {self.stop_s:.1f} s; leaks after stop: {self.leaks}; errors: {len(self.errors)}"
        )


class Classroom:
    """The hub, the broker behind it, and the operator token."""

    def __init__(self, hub_url: str, token: str, *, timeout: float = 300.0) -> None:
        self.hub_url = hub_url.rstrip("/")
        self.broker_url = f"{self.hub_url}/services/gpu-lease"
        self.token = token
        self.timeout = timeout
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=30.0),
            # idle connections are dropped before the proxy's own 5 s keep-alive ends: a
            # request sent on a connection the proxy is closing fails with "Server
            # disconnected without sending a response" (seen once in 150 kernel starts)
            limits=httpx.Limits(
                max_connections=400, max_keepalive_connections=100, keepalive_expiry=2.0
            ),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def _auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"token {token or self.token}"}

    async def call(
        self,
        method: str,
        url: str,
        token: str | None = None,
        *,
        ok: tuple[int, ...] = (),
        **kw: Any,
    ) -> httpx.Response:
        r = await self.http.request(method, url, headers=self._auth(token), **kw)
        if r.status_code >= 400 and r.status_code not in ok:
            raise RuntimeError(f"{method} {url} -> {r.status_code}: {r.text[:300]}")
        return r

    # -- hub -----------------------------------------------------------------------------
    async def login(self, name: str) -> tuple[str, str]:
        """A fresh API token for ``name`` (created by the operator): (token, token id)."""
        hub = f"{self.hub_url}/hub/api"
        r = await self.call("GET", f"{hub}/users/{name}", ok=(404,))
        if r.status_code == 404:
            await self.call("POST", f"{hub}/users/{name}")
        r = await self.call(
            "POST", f"{hub}/users/{name}/tokens", json={"note": "classroom", "expires_in": 7200}
        )
        body = r.json()
        return body["token"], body["id"]

    async def logout(self, name: str, token_id: str) -> None:
        await self.call(
            "DELETE", f"{self.hub_url}/hub/api/users/{name}/tokens/{token_id}", ok=(404,)
        )

    async def spawn(self, name: str, token: str, attempts: int = 2) -> None:
        """Start the server and wait until it is ready; a failed start is retried once
        (with many concurrent spawns, the port the spawner picked may be taken)."""
        hub = f"{self.hub_url}/hub/api"
        for _ in range(attempts):
            await self.call("POST", f"{hub}/users/{name}/server", token, ok=(400,))
            await asyncio.sleep(0.5)
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                model = (await self.call("GET", f"{hub}/users/{name}", token)).json()
                server = (model.get("servers") or {}).get("")
                if server and server.get("ready"):
                    return
                if not model.get("pending") and not server:
                    break
                await asyncio.sleep(0.5)
            else:
                raise RuntimeError(f"the server of {name} was not ready in {self.timeout:.0f} s")
        raise RuntimeError(f"the server of {name} failed to start {attempts} times")

    async def stop(self, name: str, token: str | None = None) -> None:
        hub = f"{self.hub_url}/hub/api"
        await self.call("DELETE", f"{hub}/users/{name}/server", token, ok=(400, 404))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            model = (await self.call("GET", f"{hub}/users/{name}")).json()
            if not model.get("servers") and not model.get("pending"):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the server of {name} did not stop in {self.timeout:.0f} s")

    # -- a user's server ---------------------------------------------------------------------
    async def start_kernel(self, name: str, token: str, spec: str) -> dict[str, Any]:
        """``POST /user/<name>/api/kernels``; raises with the server's message on failure."""
        r = await self.call(
            "POST", f"{self.hub_url}/user/{name}/api/kernels", token, json={"name": spec}
        )
        return dict(r.json())

    async def run_cell(self, name: str, token: str, kernel_id: str, code: str = CELL) -> str:
        """Execute ``code`` over the kernel's websocket; returns its stdout.

        jupyter_server closes a kernel's websocket when the kernel does not answer
        ``kernel_info`` in time (a kernel still starting on a busy machine); the cell is
        then sent again on a new connection, up to three times.
        """
        for attempt in range(3):
            try:
                return await self._run_cell_once(name, token, kernel_id, code)
            except WebsocketClosed:
                if attempt == 2:
                    raise
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    async def _run_cell_once(self, name: str, token: str, kernel_id: str, code: str) -> str:
        ws_url = (
            self.hub_url.replace("http", "ws", 1) + f"/user/{name}/api/kernels/{kernel_id}/channels"
        )
        conn = await websocket_connect(
            HTTPRequest(ws_url, headers=self._auth(token), request_timeout=self.timeout)
        )
        msg_id = uuid.uuid4().hex
        try:
            conn.write_message(
                json.dumps(
                    {
                        "header": {
                            "msg_id": msg_id,
                            "msg_type": "execute_request",
                            "username": name,
                            "session": uuid.uuid4().hex,
                            "version": "5.3",
                        },
                        "parent_header": {},
                        "metadata": {},
                        "content": {
                            "code": code,
                            "silent": False,
                            "store_history": False,
                            "user_expressions": {},
                            "allow_stdin": False,
                            "stop_on_error": True,
                        },
                        "channel": "shell",
                        "buffers": [],
                    }
                )
            )
            out: list[str] = []
            replied = idle = False
            deadline = time.monotonic() + self.timeout
            while not (replied and idle):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the kernel of {name} did not run the cell in time")
                raw = await asyncio.wait_for(conn.read_message(), left)
                if raw is None:
                    raise WebsocketClosed(f"the kernel websocket of {name} closed")
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = msg["header"]["msg_type"]
                if kind == "stream":
                    out.append(msg["content"]["text"])
                elif kind == "error":
                    raise RuntimeError(f"the cell failed in {name}'s kernel: {msg['content']}")
                elif kind == "execute_reply":
                    replied = True
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
            return "".join(out)
        finally:
            protocol = conn.protocol  # close() forgets it
            conn.close()
            try:  # wait for the server's close frame (a clean close)
                while await asyncio.wait_for(conn.read_message(), 5.0) is not None:
                    pass
            except (asyncio.TimeoutError, OSError):
                pass
            # Without the server's answer, tornado closes the socket only from a 5 s timer,
            # which never fires once this event loop has ended: close it now (idempotent).
            if protocol is not None and protocol.stream is not None:
                protocol.stream.close()

    # -- broker ------------------------------------------------------------------------------
    async def leases(self, users: set[str] | None = None) -> list[dict[str, Any]]:
        r = await self.call("GET", f"{self.broker_url}/api/v1/leases", params={"all": "1"})
        leases = r.json()["leases"]
        return [
            x for x in leases if x["state"] == "active" and (users is None or x["user"] in users)
        ]

    async def queue_metrics(self) -> tuple[int, float]:
        """(requests that waited, seconds waited in all) from the broker's /metrics."""
        text = (await self.call("GET", f"{self.broker_url}/metrics")).text
        count = total = 0.0
        for line in text.splitlines():
            if line.startswith("gpu_lease_queue_wait_seconds_count"):
                count = float(line.split()[-1])
            elif line.startswith("gpu_lease_queue_wait_seconds_sum"):
                total = float(line.split()[-1])
        return int(count), total


async def _spawn(room: Classroom, st: Student, tokens: dict[str, tuple[str, str]]) -> None:
    """Log in and start the student's server."""
    try:
        t = time.monotonic()
        token, token_id = await room.login(st.name)
        tokens[st.name] = (token, token_id)
        st.login_s = time.monotonic() - t
        t = time.monotonic()
        await room.spawn(st.name, token)
        st.server_s = time.monotonic() - t
    except Exception as exc:
        st.error = f"{st.name}: {exc}"


async def _kernels(
    room: Classroom,
    st: Student,
    token: str,
    t0: float,
    gpu_spec: str,
    plain_spec: str | None,
    gpu_first: bool,
) -> None:
    """Start the GPU and the plain kernel at once, run a cell in each; GPU kernel must see its lease.

    Both requests leave together (``gpu_first`` says whose goes first), so the two
    kernels of one student start under the same load, in the same server: their ratio
    is a paired comparison.
    """
    st.gpu_first = gpu_first

    async def one(spec: str) -> tuple[str, float, str]:
        t = time.monotonic()
        kernel = await room.start_kernel(st.name, token, spec)
        st.kernel_ids.append(kernel["id"])
        out = await room.run_cell(st.name, token, kernel["id"])
        return spec, time.monotonic() - t, out

    try:
        order = [gpu_spec, plain_spec] if gpu_first else [plain_spec, gpu_spec]
        tasks = [asyncio.ensure_future(one(spec)) for spec in order if spec is not None]
        for spec, took, out in await asyncio.gather(*tasks):
            if spec == gpu_spec:
                st.gpu_kernel_s = took
                st.lease_id = out.strip().partition("lease=")[2].strip()
                if not st.lease_id:
                    raise RuntimeError(f"{st.name}'s GPU kernel does not see a GPU_LEASE_ID")
            else:
                st.plain_kernel_s = took
        st.ready_at = time.monotonic() - t0
        st.samples.append((gpu_first, st.gpu_kernel_s, st.plain_kernel_s))
    except Exception as exc:
        st.error = f"{st.name}: {exc}"


async def _shut_kernels(
    room: Classroom,
    students: list[Student],
    tokens: dict[str, tuple[str, str]],
    users: set[str],
) -> None:
    """Between rounds: every student shuts their kernels down; every GPU lease must end."""

    async def shut(st: Student) -> None:
        token = tokens[st.name][0]
        for kernel_id in st.kernel_ids:
            await room.call(
                "DELETE", f"{room.hub_url}/user/{st.name}/api/kernels/{kernel_id}", token, ok=(404,)
            )
        st.kernel_ids.clear()

    await asyncio.gather(*(shut(st) for st in students if not st.error))
    deadline = time.monotonic() + 60
    while await room.leases(users):
        if time.monotonic() > deadline:
            raise RuntimeError("GPU leases were still active 60 s after their kernels shut down")
        await asyncio.sleep(0.5)


async def run_classroom(
    hub_url: str,
    token: str,
    n: int,
    *,
    names: list[str] | None = None,
    gpu_spec: str = "python3-gpu-0.02",
    plain_spec: str | None = "python3",
    stop: bool = True,
    timeout: float = 300.0,
    before_stop: Callable[[Classroom], Awaitable[Any]] | None = None,
    rounds: int = 1,
) -> Report:
    """Run the classroom; returns the :class:`Report` (``leaks`` must be 0).

    ``before_stop(room)`` runs while every kernel is up (a benchmark's extra checks).
    With ``rounds`` > 1 every student shuts their kernels down (each GPU lease must be
    released) and the whole class starts them again, in the other order; kernel start
    times are taken from every round, ``all_ready_s`` from the first.
    """
    names = names or [f"student{i:02d}" for i in range(1, n + 1)]
    room = Classroom(hub_url, token, timeout=timeout)
    report = Report(n=len(names))
    students = [Student(name) for name in names]
    tokens: dict[str, tuple[str, str]] = {}
    try:
        queued0, waited0 = await room.queue_metrics()
        t0 = time.monotonic()
        # phase 1: everyone logs in and spawns; phase 2: everyone starts kernels at once
        # (a class starting together; kernel start times are not mixed with server starts)
        await asyncio.gather(*(_spawn(room, st, tokens) for st in students))
        report.servers_ready_s = time.monotonic() - t0
        users = set(names)
        for r in range(rounds):
            if r:
                await _shut_kernels(room, students, tokens, users)
            await asyncio.gather(
                *(
                    _kernels(
                        room, st, tokens[st.name][0], t0, gpu_spec, plain_spec, (i + r) % 2 == 0
                    )
                    for i, st in enumerate(students)
                    if not st.error
                )
            )
            if not r:
                report.all_ready_s = time.monotonic() - t0
        held = await room.leases(users)
        report.leases_held = len(held)
        queued1, waited1 = await room.queue_metrics()
        report.queued, report.queue_wait_s = queued1 - queued0, waited1 - waited0
        ok = [st for st in students if not st.error]
        if ok:
            report.gpu_kernel_median_s = statistics.median(g for st in ok for _, g, _ in st.samples)
            report.server_median_s = statistics.median(st.server_s for st in ok)
            plain = [p for st in ok for _, _, p in st.samples if p is not None]
            if plain:
                report.plain_kernel_median_s = statistics.median(plain)
                report.gpu_over_plain_pooled = (
                    report.gpu_kernel_median_s / report.plain_kernel_median_s
                )
                report.gpu_over_plain = statistics.median(
                    g / p for st in ok for _, g, p in st.samples if p
                )
        held_ids = {x["id"] for x in held}
        for st in ok:
            if st.lease_id not in held_ids:
                st.error = f"{st.name}: the lease its kernel saw ({st.lease_id}) is not active"
        if before_stop is not None:
            await before_stop(room)
        if stop:
            t = time.monotonic()
            await asyncio.gather(*(room.stop(name) for name in names), return_exceptions=True)
            report.stop_s = time.monotonic() - t
            report.leaks = len(await room.leases(users))
            await asyncio.gather(
                *(room.logout(name, tid) for name, (_, tid) in tokens.items()),
                return_exceptions=True,
            )
    finally:
        await room.aclose()
    report.students = students
    report.errors = [st.error for st in students if st.error]
    return report


#: the operator token's variable (the command line is never the place: ``ps`` shows it)
TOKEN_ENV = "GPU_LEASE_TOKEN"


def operator_token(
    token_file: str | None, environ: dict[str, str] | os._Environ[str], demo: dict[str, str]
) -> str:
    """The operator token: ``--token-file`` (mode 0600 or stricter), else ``GPU_LEASE_TOKEN``,
    else the demo's (``.demo/demo.json``); ``""`` if none. ValueError says what to fix."""
    if token_file:
        path = Path(token_file)
        try:
            mode = path.stat().st_mode & 0o777
            token = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read --token-file {token_file}: {exc.strerror}") from exc
        if mode & 0o077:
            raise ValueError(
                f"--token-file {token_file} is readable by others (mode {mode:04o}): the "
                f"operator token must be its owner's alone; chmod 600 {token_file}"
            )
        if not token:
            raise ValueError(f"--token-file {token_file} is empty: write the operator token in it")
        return token
    return environ.get(TOKEN_ENV) or demo.get("admin_token", "")


def _demo_defaults() -> dict[str, str]:
    path = Path(__file__).resolve().parent.parent / ".demo" / "demo.json"
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    demo = _demo_defaults()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hub-url", default=demo.get("url", "http://127.0.0.1:8000"))
    p.add_argument(
        "--token-file",
        help=f"a file (mode 0600) holding the operator token; default: ${TOKEN_ENV}, else "
        "the demo's",
    )
    p.add_argument("--token", help=argparse.SUPPRESS)  # refused: see operator_token
    p.add_argument("-n", type=int, default=10, help="students (student01 ... studentNN)")
    p.add_argument("--gpu-kernel", default="python3-gpu-0.02")
    p.add_argument("--plain-kernel", default="python3", help="'' for GPU kernels only")
    p.add_argument("--keep", action="store_true", help="leave the servers running")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.token is not None:
        p.error(
            "--token puts the operator token where every account's ps sees it: put it in "
            f"{TOKEN_ENV} or in a file only you may read (chmod 600) given with --token-file"
        )
    try:
        token = operator_token(args.token_file, os.environ, demo)
    except ValueError as exc:
        p.error(str(exc))
    if not token:
        p.error(
            f"no operator token: set {TOKEN_ENV} or give --token-file (the demo prints its "
            "operator token), or run `make demo` first"
        )
    report = asyncio.run(
        run_classroom(
            args.hub_url,
            token,
            args.n,
            gpu_spec=args.gpu_kernel,
            plain_spec=args.plain_kernel or None,
            stop=not args.keep,
        )
    )
    if args.json:
        print(json.dumps(asdict(report), indent=1))
    else:
        print(report.summary())
        for err in report.errors:
            print("  error:", err)
    return 1 if report.errors or report.leaks else 0


if __name__ == "__main__":
    sys.exit(main())
