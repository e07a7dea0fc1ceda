"""The broker with many nodes: acquire latency as nodes, GPUs and leases grow; a node's loss.

    python benchmarks/scale.py                  # 300 probes per cell (~4 min on 2 cores)
    python benchmarks/scale.py --probes 100     # quicker
    python benchmarks/scale.py --json out.json

``grid``  one broker per pool, all running at once: 1 GPU on 1 node, 100 GPUs on 10 nodes,
          1,000 GPUs on 100 nodes, every node registered through ``PUT /api/v1/nodes/{node}``
          with its own agent token (``--gpus agents``: the pool is what agents register;
          nodes stay up, ``node_grace`` is long). For 0, 1,000 and 10,000 active leases
          (filled through the API by 64 clients; 1 h TTL; none on the 1-GPU pool beyond
          what one GPU holds): one client's acquire+release latency, probed in interleaved
          batches of 50 across the pools (``broker_throughput.probe``). As in
          ``broker_throughput.py --only scaling``, ``context_overhead_mb=0`` lets 10,000
          leases fit; the overhead is irrelevant to the cost measured.
          Aim: acquire p99 at 1,000 GPUs / 100 nodes / 10,000 leases < 1.5 x the p99 at
          1 GPU / 1 node / no lease.
``loss``  a broker with two 10-GPU nodes, both heartbeating every 0.3 s; 400 leases of
          0.025 on node ``lossy`` (all of it), renewed once together. Then ``lossy``'s agent
          falls silent and its kernels stop renewing, as when the host dies. Measured: when
          the broker marks the node lost (``node_grace`` 1 s), and from the leases' expiry
          (TTL 10 s after their renewal) to the moment none is active, wall time and the
          broker's CPU time in that window (which also serves the other node's heartbeats
          and this script's polls, 10 a second). Aim: handled in < 1 s of broker time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from agents import add_agent_tokens, register
from broker_throughput import (
    HTTPConn,
    broker_process,
    fill,
    fill_fraction,
    percentile,
    probe,
)

from provisioner.devtools.testing import BrokerProcess, wait_for

#: (GPUs, nodes) of each pool
POOLS = ((1, 1), (100, 10), (1000, 100))
LEASES = (0, 1000, 10_000)
GPU_MB = 81920
AIM_P99_GROWTH = 1.5
AIM_LOSS_CPU_S = 1.0


def node_names(n: int, prefix: str = "n") -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def start_pool(stack: ExitStack, tmp: Path, gpus: int, nodes: int, extra: tuple[str, ...]) -> Any:
    names = node_names(nodes)
    broker = broker_process(tmp, f"sqlite:///{tmp / f'scale-{gpus}.sqlite'}", "agents", extra)
    tokens = add_agent_tokens(broker, names)
    stack.enter_context(broker.running(60.0))
    asyncio.run(register(broker, tokens, names, gpus // nodes, GPU_MB))
    assert int(broker.health()["gpus"]) == gpus
    return broker


def run_grid(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    extra = ("--ttl", "3600", "--GPULeaseBroker.context_overhead_mb=0",
             "--GPULeaseBroker.node_grace=86400")  # fmt: skip
    rows: list[dict[str, Any]] = []
    top = max(LEASES)
    batches = max(1, args.probes // 50)
    with ExitStack() as stack:
        brokers = {(g, n): start_pool(stack, tmp, g, n, extra) for g, n in POOLS}
        for n_leases in LEASES:
            live = {}
            for (g, n), broker in brokers.items():
                fraction = fill_fraction(g, top)
                if n_leases * fraction > 0.9 * g:  # more than the pool holds with room
                    continue
                asyncio.run(fill(broker, n_leases, fraction))
                assert int(broker.health()["active_leases"]) == n_leases
                live[(g, n)] = broker
            acq: dict[tuple[int, int], list[float]] = {k: [] for k in live}
            for _ in range(batches):
                for key, broker in live.items():
                    a, _ = asyncio.run(
                        probe(broker, args.probes // batches, fill_fraction(key[0], top))
                    )
                    acq[key] += a
            for g, n in live:
                row = {
                    "gpus": g,
                    "nodes": n,
                    "leases": n_leases,
                    "acquire_p50_ms": percentile(acq[(g, n)], 50) * 1e3,
                    "acquire_p99_ms": percentile(acq[(g, n)], 99) * 1e3,
                }
                rows.append(row)
                print(
                    f"  {g:>5} GPUs {n:>4} nodes {n_leases:>6} leases: acquire p50 "
                    f"{row['acquire_p50_ms']:6.2f} p99 {row['acquire_p99_ms']:6.2f} ms",
                    flush=True,
                )
    return rows


async def _heartbeat(broker: BrokerProcess, token: str, node: str, stop: asyncio.Event) -> None:
    conn = HTTPConn(broker.port, token)
    await conn.open()
    try:
        while not stop.is_set():
            body = json.dumps({"usage": []}).encode()
            status, answer = await conn.send(
                conn.post_json(f"/api/v1/nodes/{node}/heartbeat", body)
            )
            if status != 200:
                raise RuntimeError(f"heartbeat of {node}: {status} {answer[:200]!r}")
            try:
                await asyncio.wait_for(stop.wait(), 0.3)
            except asyncio.TimeoutError:
                pass
    finally:
        await conn.close()


async def _on_node(
    broker: BrokerProcess, node: str, count: int, fraction: float
) -> tuple[int, float]:
    """Acquire ``count`` leases on ``node`` (16 clients), then renew each once, together:
    they expire one TTL after their renewal. Returns how many, and when the renewals began."""
    users = list(broker.tokens)
    conns = [HTTPConn(broker.port, broker.tokens[users[i % len(users)]]) for i in range(16)]
    await asyncio.gather(*(c.open() for c in conns))
    held: dict[int, list[str]] = {i: [] for i in range(len(conns))}
    todo = iter(range(count))
    run = uuid.uuid4().hex[:8]

    async def acquire(n: int, conn: HTTPConn) -> None:
        for i in todo:
            body = json.dumps({"kernel_id": f"lossy-{run}-{i}", "fraction": fraction, "node": node})
            status, answer = await conn.send(conn.post_json("/api/v1/leases", body.encode()))
            if status != 201:
                raise RuntimeError(f"acquire on {node}: {status} {answer[:300]!r}")
            held[n].append(json.loads(answer)["id"])

    async def renew(n: int, conn: HTTPConn) -> None:
        for lid in held[n]:
            status, answer = await conn.send(conn.post_json(f"/api/v1/leases/{lid}/renew", b"{}"))
            if status != 200:
                raise RuntimeError(f"renew {lid}: {status} {answer[:300]!r}")

    try:
        await asyncio.gather(*(acquire(n, c) for n, c in enumerate(conns)))
        began = time.time()
        await asyncio.gather(*(renew(n, c) for n, c in enumerate(conns)))
    finally:
        await asyncio.gather(*(c.close() for c in conns))
    return sum(len(x) for x in held.values()), began


def run_loss(tmp: Path) -> dict[str, Any]:
    ttl, grace = 10.0, 1.0
    extra = ("--ttl", str(ttl), f"--GPULeaseBroker.node_grace={grace}",
             "--GPULeaseBroker.reap_interval=0.2")  # fmt: skip
    broker = broker_process(tmp, f"sqlite:///{tmp / 'loss.sqlite'}", "agents", extra)
    tokens = add_agent_tokens(broker, ["lossy", "steady"])
    with broker.running(60.0):
        asyncio.run(register(broker, tokens, ["lossy", "steady"], 10, GPU_MB))

        async def scenario() -> dict[str, Any]:
            stops = {n: asyncio.Event() for n in tokens}
            beats = [
                asyncio.create_task(_heartbeat(broker, tokens[n], n, stops[n])) for n in tokens
            ]
            granted, renewals_began = await _on_node(broker, "lossy", 400, 0.025)
            renewed_at = time.time()  # the last renewal ended now
            t_loss = time.monotonic()
            stops["lossy"].set()  # the host dies: its agent falls silent, nobody renews
            await asyncio.to_thread(
                wait_for, lambda: _node_state(broker, "lossy") == "lost", 10 * grace, "lost", 0.02
            )
            t_lost = time.monotonic() - t_loss
            expiry = renewed_at + ttl  # the last lease's expiry
            # from just before the first lease's expiry until none is left
            await asyncio.sleep(max(0.0, renewals_began + ttl - time.time() - 0.2))
            c0, w0 = broker.cpu(), time.time()
            await asyncio.to_thread(
                wait_for, lambda: int(broker.health()["active_leases"]) == 0, 30, "expiry", 0.1
            )
            c1, w1 = broker.cpu(), time.time()
            stops["steady"].set()
            await asyncio.gather(*beats)
            return {
                "leases": granted,
                "node_grace_s": grace,
                "lost_after_s": t_lost,
                "expired_after_expiry_s": w1 - expiry,
                "broker_cpu_s_in_window": c1 - c0,
                "window_s": w1 - w0,
            }

        return asyncio.run(scenario())


def _node_state(broker: BrokerProcess, node: str) -> str:
    import httpx

    r = httpx.get(
        f"{broker.url}/api/v1/nodes", headers={"Authorization": f"token {broker.tokens['u00']}"}
    )
    return str({n["node"]: n["state"] for n in r.json()["nodes"]}.get(node))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probes", type=int, default=300, help="acquire+release pairs per cell")
    parser.add_argument("--only", choices=("grid", "loss"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    data: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gl-scale-") as tmp:
        if args.only in (None, "grid"):
            print("grid: one client's acquire latency (ms)", flush=True)
            data["grid"] = run_grid(args, Path(tmp))
        if args.only in (None, "loss"):
            data["loss"] = run_loss(Path(tmp))
    if "grid" in data:
        cells = {(r["gpus"], r["nodes"], r["leases"]): r for r in data["grid"]}
        small, big = cells.get((1, 1, 0)), cells.get((1000, 100, 10_000))
        if small and big:
            growth = big["acquire_p99_ms"] / small["acquire_p99_ms"]
            data["p99_growth"] = growth
            print(
                f"p99 1,000 GPUs / 100 nodes / 10,000 leases ÷ 1 GPU / 1 node / none: "
                f"{growth:.2f} (aim < {AIM_P99_GROWTH}: {'met' if growth < AIM_P99_GROWTH else 'NOT met'})"
            )
    if "loss" in data:
        loss = data["loss"]
        ok = loss["broker_cpu_s_in_window"] < AIM_LOSS_CPU_S
        print(
            f"node loss: {loss['leases']} leases; lost {loss['lost_after_s']:.2f} s after its agent "
            f"fell silent (node_grace {loss['node_grace_s']:g} s); all expired "
            f"{loss['expired_after_expiry_s']:.2f} s after their expiry; broker CPU "
            f"{loss['broker_cpu_s_in_window']:.3f} s in the {loss['window_s']:.2f} s window "
            f"(aim < {AIM_LOSS_CPU_S:g} s: {'met' if ok else 'NOT met'})"
        )
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
