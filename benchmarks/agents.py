"""Node agents against one broker: what 100 agents x 8 GPUs cost the students' acquires.

    python benchmarks/agents.py                 # 3 rounds of 20 s per phase (~3 min on 2 cores)
    python benchmarks/agents.py --quick         # 2 rounds of 8 s per phase (~1 min)
    python benchmarks/agents.py --json out.json

One real broker (``--auth static``, SQLite in a temporary directory, ``--gpus agents``:
the pool is only what agents register) with 100 nodes of 8 GPUs (80 GiB) registered
through ``PUT /api/v1/nodes/{node}`` with agent tokens. 64 closed-loop clients acquire
(0.05) and release as fast as the broker answers (``broker_throughput.closed_loop``), in
two phases that alternate, round after round, in the same run:

``quiet``   no heartbeats (the broker's ``node_grace`` is long, so the nodes stay up);
``agents``  the 100 agents heartbeat every ``--interval`` s (default 5), staggered, each
            reporting two GPU processes per GPU (16 usage rows, as NVML lists them):
            99 simulated by this process over keep-alive HTTP with the real body, and one
            real ``python -m provisioner.node.agent`` (``--gpus nvml`` with the stand-in
            ``pynvml`` of ``tests/fake_nvml``, 8 GPUs, 16 processes), which runs
            through both phases (one heartbeat per interval: noise for ``quiet``).

Printed: acquire p99 and pairs/s per phase (median over the rounds) and their ratios
(agents / quiet; the aim is p99 <= 1.1x), the broker's CPU per heartbeat, and the real
agent's CPU per sample and as a share of one core (aim: < 1 %). The stand-in NVML reads
a JSON file at every call, so the agent's figure is an upper bound of what it costs with
the real library.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from broker_throughput import ROOT, HTTPConn, LoadResult, broker_process, closed_loop

from provisioner.devtools.testing import BrokerProcess, cpu_seconds, stop_process, wait_for

NODES = 100
GPUS_PER_NODE = 8
GPU_MB = 81920
CLIENTS = 64
FRACTION = 0.05
#: the aims: acquire p99 with agents at most 1.1x without, the agent under 1 % of a core
AIM_P99_RATIO = 1.1
AIM_AGENT_CPU_SHARE = 0.01


def node_gpus(
    node: str, count: int = GPUS_PER_NODE, memory_mb: int = GPU_MB
) -> list[dict[str, Any]]:
    return [
        {"uuid": f"GPU-{node}-{i}", "name": "A100", "memory_mb": memory_mb, "index": i}
        for i in range(count)
    ]


def usage_rows(node: str, n: int) -> list[dict[str, Any]]:
    """Two processes per GPU, as NVML lists them (pids of nobody's: they report unleased)."""
    return [
        {"pid": 400_000 + n * 100 + 2 * i + j, "gpu_uuid": f"GPU-{node}-{i}", "used_mb": 900}
        for i in range(GPUS_PER_NODE)
        for j in range(2)
    ]


def add_agent_tokens(broker: BrokerProcess, nodes: list[str]) -> dict[str, str]:
    """An agent token per node in the broker's tokens file (before it starts)."""
    data = json.loads(broker.tokens_file.read_text())
    tokens = {}
    for node in nodes:
        token = f"agent-{node}-{uuid.uuid4().hex}"
        tokens[node] = token
        data[token] = {"agent": True, "node": node}
    broker.tokens_file.write_text(json.dumps(data))
    return tokens


async def register(
    broker: BrokerProcess,
    tokens: dict[str, str],
    simulated: list[str],
    gpus_per_node: int = GPUS_PER_NODE,
    memory_mb: int = GPU_MB,
) -> None:
    """``PUT /api/v1/nodes/{node}`` for each node, ten at a time, with its agent's token."""

    async def one(node: str) -> None:
        conn = HTTPConn(broker.port, tokens[node])
        await conn.open()
        try:
            body = json.dumps(
                {
                    "gpus": node_gpus(node, gpus_per_node, memory_mb),
                    "agent_version": "bench",
                    "enforce": "report",
                }
            ).encode()
            request = conn.post_json(f"/api/v1/nodes/{node}", body).replace(b"POST", b"PUT", 1)
            status, answer = await conn.send(request)
            if status != 200:
                raise RuntimeError(f"registering {node}: {status} {answer[:300]!r}")
        finally:
            await conn.close()

    for start in range(0, len(simulated), 10):
        await asyncio.gather(*(one(n) for n in simulated[start : start + 10]))


async def heartbeats(
    broker: BrokerProcess,
    tokens: dict[str, str],
    nodes: list[str],
    interval: float,
    stop: asyncio.Event,
    counts: list[int],
) -> None:
    """Each simulated agent: a heartbeat every ``interval`` s, staggered over the interval."""

    async def agent(n: int, node: str) -> None:
        conn = HTTPConn(broker.port, tokens[node])
        await conn.open()
        try:
            await asyncio.sleep(interval * n / len(nodes))
            while not stop.is_set():
                body = json.dumps({"usage": usage_rows(node, n), "at": time.time()}).encode()
                status, answer = await conn.send(
                    conn.post_json(f"/api/v1/nodes/{node}/heartbeat", body)
                )
                if status != 200:
                    raise RuntimeError(f"heartbeat of {node}: {status} {answer[:300]!r}")
                counts[0] += 1
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            await conn.close()

    await asyncio.gather(*(agent(n, node) for n, node in enumerate(nodes)))


class RealAgent:
    """``python -m provisioner.node.agent`` with the stand-in NVML: 8 GPUs, 16 processes."""

    def __init__(self, broker: BrokerProcess, node: str, token: str, tmp: Path, interval: float):
        self.node = node
        nvml = tmp / "nvml.json"
        gpus = node_gpus(node)
        nvml.write_text(
            json.dumps(
                {
                    "gpus": [{k: g[k] for k in ("uuid", "name", "memory_mb")} for g in gpus],
                    "processes": {
                        g["uuid"]: [{"pid": 500_000 + 2 * i + j, "used_mb": 900} for j in range(2)]
                        for i, g in enumerate(gpus)
                    },
                }
            )
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "tests" / "fake_nvml"), str(ROOT), env.get("PYTHONPATH", "")]
        )
        env.update(FAKE_NVML_FILE=str(nvml), GPU_LEASE_AGENT_TOKEN=token)
        self.log = tmp / "agent.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "provisioner.node.agent", "--broker-url", broker.url,
                    "--node", node, "--interval", str(interval), "--log-level", "WARN",
                ],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        stop_process(self.proc, 20)


@dataclass
class Phase:
    name: str
    round: int
    load: LoadResult
    heartbeats: int
    broker_cpu_s: float
    agent_cpu_s: float
    agent_samples: int


async def run_phase(
    broker: BrokerProcess,
    tokens: dict[str, str],
    simulated: list[str],
    agent: RealAgent | None,
    args: argparse.Namespace,
    name: str,
    round_: int,
) -> Phase:
    stop = asyncio.Event()
    counts = [0]
    beats = (
        asyncio.create_task(heartbeats(broker, tokens, simulated, args.interval, stop, counts))
        if name == "agents"
        else None
    )
    b0, a0, t0 = broker.cpu(), agent.cpu() if agent else 0.0, time.monotonic()
    try:
        load = await closed_loop(
            broker, CLIENTS, warmup=args.warmup, duration=args.duration, fraction=FRACTION, db=name
        )
    finally:
        stop.set()
        if beats is not None:
            await beats
    wall = time.monotonic() - t0
    return Phase(
        name=name,
        round=round_,
        load=load,
        heartbeats=counts[0],
        broker_cpu_s=broker.cpu() - b0,
        agent_cpu_s=(agent.cpu() - a0) if agent else 0.0,
        agent_samples=int(wall / args.interval) if agent else 0,
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    nodes = [f"node{n:03d}" for n in range(NODES)]
    broker = broker_process(
        tmp,
        f"sqlite:///{tmp / 'agents.sqlite'}",
        "agents",
        ("--GPULeaseBroker.node_grace=3600", "--ttl", "600"),
    )
    tokens = add_agent_tokens(broker, nodes)
    broker.start(60.0)
    real: RealAgent | None = None
    phases: list[Phase] = []
    try:
        simulated = nodes[1:]
        await register(broker, tokens, simulated)
        real = RealAgent(broker, nodes[0], tokens[nodes[0]], tmp, args.interval)
        wait_for(
            lambda: broker.health()["gpus"] >= NODES * GPUS_PER_NODE or real.proc.poll(),
            60,
            "every node's registration",
        )
        if real.proc.poll() is not None:
            raise RuntimeError(f"the agent exited:\n{real.log.read_text()[-3000:]}")
        for r in range(args.rounds):
            order = ("quiet", "agents") if r % 2 == 0 else ("agents", "quiet")
            for name in order:
                phases.append(await run_phase(broker, tokens, simulated, real, args, name, r))
                p = phases[-1]
                print(
                    f"round {r} {name:6s}: {p.load.pairs_per_s:7.1f} pairs/s, acquire p99 "
                    f"{p.load.acquire_p99_ms:6.1f} ms, {p.heartbeats} simulated heartbeats",
                    flush=True,
                )
    finally:
        if real is not None:
            real.stop()
        broker.stop()
    return summarize(phases, args)


def summarize(phases: list[Phase], args: argparse.Namespace) -> dict[str, Any]:
    by = {n: [p for p in phases if p.name == n] for n in ("quiet", "agents")}
    p99 = {n: median([p.load.acquire_p99_ms for p in ps]) for n, ps in by.items()}
    rate = {n: median([p.load.pairs_per_s for p in ps]) for n, ps in by.items()}
    agents = by["agents"]
    # the broker's extra CPU per heartbeat: (agents - quiet) CPU per second of each phase,
    # over heartbeats per second (pairs differ little between the phases)
    beat_rate = median([p.heartbeats / (args.warmup + args.duration) for p in agents])
    extra_cpu = median([a.broker_cpu_s / (a.load.pairs or 1) for a in agents]) - median(
        [q.broker_cpu_s / (q.load.pairs or 1) for q in by["quiet"]]
    )
    agent_cpu = sum(p.agent_cpu_s for p in phases)
    agent_samples = sum(p.agent_samples for p in phases)
    agent_wall = len(phases) * (args.warmup + args.duration)
    return {
        "nodes": NODES,
        "gpus_per_node": GPUS_PER_NODE,
        "clients": CLIENTS,
        "interval_s": args.interval,
        "rounds": args.rounds,
        "duration_s": args.duration,
        "acquire_p99_ms": p99,
        "pairs_per_s": rate,
        "p99_ratio": p99["agents"] / p99["quiet"],
        "pairs_ratio": rate["agents"] / rate["quiet"],
        "heartbeats_per_s": beat_rate,
        "broker_cpu_us_per_pair_extra": extra_cpu * 1e6,
        "agent_cpu_ms_per_sample": agent_cpu / max(agent_samples, 1) * 1e3,
        "agent_cpu_share_of_core": agent_cpu / agent_wall,
        "phases": [{**asdict(p), "load": asdict(p.load)} for p in phases],
    }


def report(data: dict[str, Any]) -> str:
    p99, rate = data["acquire_p99_ms"], data["pairs_per_s"]
    ok_p99 = data["p99_ratio"] <= AIM_P99_RATIO
    ok_cpu = data["agent_cpu_share_of_core"] < AIM_AGENT_CPU_SHARE
    return "\n".join(
        [
            f"{data['nodes']} agents x {data['gpus_per_node']} GPUs, heartbeat every "
            f"{data['interval_s']:g} s ({data['heartbeats_per_s']:.1f}/s); {data['clients']} "
            f"clients; median of {data['rounds']} rounds of {data['duration_s']:g} s per phase",
            f"  acquire p99   quiet {p99['quiet']:.1f} ms, agents {p99['agents']:.1f} ms: "
            f"ratio {data['p99_ratio']:.2f} (aim <= {AIM_P99_RATIO}: "
            f"{'met' if ok_p99 else 'NOT met'})",
            f"  pairs/s       quiet {rate['quiet']:.0f}, agents {rate['agents']:.0f}: "
            f"ratio {data['pairs_ratio']:.2f}",
            f"  broker CPU    {data['broker_cpu_us_per_pair_extra']:+.0f} us per pair with agents",
            f"  real agent    {data['agent_cpu_ms_per_sample']:.2f} ms CPU per sample, "
            f"{100 * data['agent_cpu_share_of_core']:.3f} % of a core (aim < "
            f"{100 * AIM_AGENT_CPU_SHARE:g} %: {'met' if ok_cpu else 'NOT met'})",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 s per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=5.0, help="heartbeat interval (s)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration = 2, 8.0
    with tempfile.TemporaryDirectory(prefix="gl-agents-") as tmp:
        data = asyncio.run(run(args, Path(tmp)))
    print(report(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
