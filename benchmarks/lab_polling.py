"""What JupyterLab's GPU lease status costs the broker: requests per server per 5 s.

Real processes: a broker (1x32768:V100, lease TTL 90 s as deployed), ``--servers`` Jupyter
servers with the server extension, each running GPU kernels of 0.25 (the first four hold
the GPU, the rest wait in the queue), and ``--notebooks`` browser tabs in all, each
polling its server's ``GET /gpu-lease/api/kernels`` every 2 s as the extension does (its
default ``refreshInterval``). For ``--seconds`` the broker's access log counts every
request by endpoint; the extension's own are the ``GET /api/v1/queue`` (the provisioners
make the rest: acquire long-polls, renewals). A second phase with no kernel waiting
shows what the status bar costs when everyone holds a lease.

    .venv/bin/python benchmarks/lab_polling.py [--servers 2] [--notebooks 60] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioner.devtools.labserver import (  # noqa: E402
    JupyterServerProcess,
    install_kernelspecs,
)
from provisioner.devtools.testing import BrokerProcess  # noqa: E402

ACCESS = re.compile(r"\b(\d{3}) (GET|POST|PUT|DELETE) (\S+) \(")
POLL_S = 2.0


def count(log: Path, start: int) -> Counter[str]:
    """Requests in the broker's access log after byte ``start``, by method and endpoint."""
    text = log.read_bytes()[start:].decode(errors="replace")
    out: Counter[str] = Counter()
    for _, method, path in ACCESS.findall(text):
        path = re.sub(r"/leases/[^/]+", "/leases/{id}", path)
        out[f"{method} {path}"] += 1
    return out


async def poll(servers: list[JupyterServerProcess], notebooks: int, seconds: float) -> int:
    """``notebooks`` tabs spread over the servers, each polling every 2 s; the polls made."""
    done = 0

    async def tab(server: JupyterServerProcess, offset: float) -> None:
        nonlocal done
        await asyncio.sleep(offset)
        headers = {"Authorization": f"token {server.token}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as http:
            end = time.monotonic() + seconds - offset
            while time.monotonic() < end:
                r = await http.get("/gpu-lease/api/kernels")
                r.raise_for_status()
                done += 1
                await asyncio.sleep(POLL_S)

    await asyncio.gather(
        *(tab(servers[i % len(servers)], POLL_S * i / notebooks) for i in range(notebooks))
    )
    return done


def start_kernels(server: JupyterServerProcess, spec: str, n: int, *, wait: bool) -> None:
    """Start ``n`` notebook kernels (``POST /api/sessions``); ``wait``: until they run."""

    def one(i: int) -> None:
        body = server.session_body(str(uuid.uuid4()), spec)
        body["name"] = f"nb{i}-{uuid.uuid4().hex[:6]}.ipynb"
        with httpx.Client(base_url=server.url, timeout=900,
                          headers={"Authorization": f"token {server.token}"}) as http:  # fmt: skip
            try:
                http.post("/api/sessions", json=body)
            except httpx.HTTPError:
                pass  # the server stopped while it waited

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    if wait:
        for t in threads:
            t.join()


def measure(broker: BrokerProcess, servers: list[JupyterServerProcess], args: argparse.Namespace, label: str) -> None:  # fmt: skip
    time.sleep(3)  # the servers' first looks at the queue
    start = broker.log_path.stat().st_size
    t0 = time.monotonic()
    polls = asyncio.run(poll(servers, args.notebooks, args.seconds))
    elapsed = time.monotonic() - t0
    counts = count(broker.log_path, start)
    windows = elapsed / 5.0
    queue = counts.get("GET /api/v1/queue", 0)
    print(f"\n{label}: {polls} polls of the server extension in {elapsed:.0f} s "
          f"({polls / elapsed:.1f}/s from {args.notebooks} notebooks)")  # fmt: skip
    print(f"  caused by the extension (GET /api/v1/queue): {queue} = "
          f"{queue / len(servers) / windows:.2f} per server per 5 s")  # fmt: skip
    for key, n in sorted(counts.items()):
        print(f"  {key:35s} {n:5d}  ({n / len(servers) / windows:.2f} per server per 5 s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--notebooks", type=int, default=60)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kernels", type=int, default=4, help="GPU kernels per server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gl-lab-polling-") as tmpdir:
        tmp = Path(tmpdir)
        users = {f"user{i}": ([], False) for i in range(args.servers)}
        broker = BrokerProcess(
            tmp, f"sqlite:///{tmp / 'b.sqlite'}", users, extra=("--log-level", "DEBUG")
        )
        broker.start()
        (spec,) = install_kernelspecs(tmp / "prefix", [0.25])
        servers = [
            JupyterServerProcess(
                tmp,
                broker.url,
                broker.tokens[f"user{i}"],
                kernels_prefix=tmp / "prefix",
                name=f"server{i}",
            )  # fmt: skip
            for i in range(args.servers)
        ]
        try:
            for s in servers:
                s.start()
            holding = 4  # four 0.25 kernels fill the V100
            per = [holding // args.servers + (i < holding % args.servers) for i in range(args.servers)]  # fmt: skip
            for s, n in zip(servers, per, strict=True):
                start_kernels(s, spec, n, wait=True)
            print(f"{args.servers} servers, {holding} GPU kernels holding the GPU", flush=True)
            measure(broker, servers, args, "phase 1, nobody waits")
            for s, n in zip(servers, per, strict=True):
                start_kernels(s, spec, args.kernels - n, wait=False)
            waiting = sum(args.kernels - n for n in per)
            print(f"\n{waiting} more GPU kernels wait in the queue", flush=True)
            measure(broker, servers, args, "phase 2, kernels wait")
        finally:
            for s in servers:
                s.stop(timeout=60)
            broker.stop()


if __name__ == "__main__":
    main()
