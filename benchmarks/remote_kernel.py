"""Remote kernels (``launcher='node'``) against local ones, on this machine.

    sudo python benchmarks/remote_kernel.py             # 10 interleaved rounds (~2 min on 2 cores)
    sudo python benchmarks/remote_kernel.py --quick     # 3 rounds
    sudo python benchmarks/remote_kernel.py --rounds 10 --json out.json

Root: it makes a Unix account for the student (``useradd``, removed at the end), as the
node agent launches remote kernels as the lease holder's account.

Set-up, real processes only: one broker subprocess (``--gpus agents``, SQLite, static
tokens) and one ``gpu-lease agent --launch-kernels`` (stand-in NVML, one 16 GiB GPU, the
shipped heartbeat interval of 5 s: launches and signals come through its orders long-poll,
not its heartbeats). Two kernelspecs with the same argv (a Python the student can run,
``-m ipykernel_launcher``) and the same ``GPULeaseProvisioner`` (fraction 0.1): ``local``
(the kernel beside this process, as today) and ``node`` (the agent launches it, as the
student, and reports its ports). Both hold a lease; the difference is the launch path.

Each round runs both kinds, alternating which goes first, through jupyter_client's
``AsyncKernelManager``:

``start``      ``start_kernel()`` until a fresh client's first ``kernel_info`` reply;
``interrupt``  a running cell (``time.sleep`` in a loop), ``interrupt_kernel()``, until the
               ``KeyboardInterrupt`` reply (local: a signal to the process group; remote:
               the broker relays the signal to the node, whose agent sends it);
``msgs/s``     ``--messages`` ``kernel_info`` requests sent at once on the shell channel,
               until every reply is in (ZMQ, HMAC-signed, through the kernel's address);
``shutdown``   ``shutdown_kernel()`` (the lease released; the node ends a remote kernel).

Reported: medians per kind and the ratios remote / local (start and interrupt: lower is
better, the aim is start <= 1.2x; msgs/s: higher is better, the aim is >= 0.9x). On one
machine the network is the loopback: across machines add the network's round trips to
the start (a handful) and to each message (one).
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from jupyter_client.manager import AsyncKernelManager  # noqa: E402

from provisioner.devtools.testing import (  # noqa: E402
    BrokerProcess,
    interrupt_a_sleeping_cell,
    wait_for,
)
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json  # noqa: E402
from tests.accounts import passable_dir, student_python, useradd, userdel  # noqa: E402

KINDS = ("local", "node")
NODE = "bench-node"


def write_specs(root: Path, python: str) -> None:
    for kind in KINDS:
        spec = build_kernelspec(0.1)
        spec["argv"] = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        spec["metadata"]["kernel_provisioner"]["config"].update(
            {"launcher": kind, "node": NODE, "renew_interval": 10.0}
        )
        folder = root / "kernels" / f"bench-{kind}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.json").write_text(spec_json(spec))


async def one_kernel(kind: str, messages: int) -> dict[str, float]:
    km = AsyncKernelManager(kernel_name=f"bench-{kind}")
    t0 = time.perf_counter()
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    out: dict[str, float] = {}
    try:
        await kc.wait_for_ready(timeout=120)
        out["start"] = time.perf_counter() - t0
        content, out["interrupt"] = await interrupt_a_sleeping_cell(
            km, kc, seconds=30, settle=0.3, timeout=60
        )
        assert content.get("ename") == "KeyboardInterrupt", content
        t0 = time.perf_counter()
        ids = {kc.kernel_info() for _ in range(messages)}
        while ids:
            reply = await kc.get_shell_msg(timeout=60)
            ids.discard(reply["parent_header"].get("msg_id"))
        out["msgs/s"] = messages / (time.perf_counter() - t0)
    finally:
        kc.stop_channels()
        t0 = time.perf_counter()
        await km.shutdown_kernel()
        out["shutdown"] = time.perf_counter() - t0
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = {
        kind: {
            m: statistics.median(r[kind][m] for r in runs)
            for m in ("start", "interrupt", "msgs/s", "shutdown")
        }
        for kind in KINDS
    }
    ratio = {m: med["node"][m] / med["local"][m] for m in med["local"]}
    return {"median": med, "ratio": ratio, "rounds": len(runs)}


def report(s: dict[str, Any]) -> str:
    lines = [f"{s['rounds']} rounds (medians)", f"{'':10} {'local':>10} {'node':>10} {'ratio':>7}"]
    for m in ("start", "interrupt", "msgs/s", "shutdown"):
        unit = "" if m == "msgs/s" else " s"
        lines.append(
            f"{m:10} {s['median']['local'][m]:>8.3f}{unit:2} {s['median']['node'][m]:>8.3f}"
            f"{unit:2} {s['ratio'][m]:>6.2f}x"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    student = f"glb{uuid.uuid4().hex[:6]}"
    with passable_dir("gl-bench-") as base, tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        useradd(student)
        agent: subprocess.Popen[bytes] | None = None
        try:
            python = student_python(base, student)
            broker = BrokerProcess(
                tmp,
                f"sqlite:///{tmp / 'b.sqlite'}",
                {student: ([], False), "admin": ([], True)},
                gpus="agents",
            )
            data = json.loads(broker.tokens_file.read_text())
            agent_token = f"agent-{uuid.uuid4().hex}"
            data[agent_token] = {"agent": True, "node": NODE}
            broker.tokens_file.write_text(json.dumps(data))
            nvml = tmp / "nvml.json"
            gpu = {"uuid": f"GPU-bench-{uuid.uuid4().hex[:8]}", "name": "T4", "memory_mb": 16384}
            nvml.write_text(json.dumps({"gpus": [gpu], "processes": {}}))
            broker.start(timeout=60)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "fake_nvml"), str(ROOT)])
            env.update(FAKE_NVML_FILE=str(nvml), GPU_LEASE_AGENT_TOKEN=agent_token)
            node_root = base / "node"
            node_root.mkdir(mode=0o711)
            with open(tmp / "agent.log", "wb") as log:
                agent = subprocess.Popen(
                    [sys.executable, "-m", "provisioner.node.agent", "--broker-url", broker.url,
                     "--node", NODE, "--launch-kernels", "--kernel-ip", "127.0.0.1",
                     "--kernel-dir", str(node_root / "kernels"),
                     "--scratch-dir", str(node_root / "scratch")],
                    stdout=log, stderr=subprocess.STDOUT, env=env,
                )  # fmt: skip
            wait_for(lambda: "Registered node" in (tmp / "agent.log").read_text(), timeout=30)
            os.environ.update(
                JUPYTER_PATH=str(tmp / "jupyter"),
                JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                GPU_LEASE_URL=broker.url,
                GPU_LEASE_TOKEN=broker.tokens[student],
            )
            write_specs(tmp / "jupyter", python)
            runs = []

            async def rounds() -> None:
                for kind in KINDS:  # warm-up: imports, byte-code, the student's venv
                    await one_kernel(kind, 50)
                for i in range(args.rounds):
                    order = KINDS if i % 2 == 0 else tuple(reversed(KINDS))
                    runs.append({kind: await one_kernel(kind, args.messages) for kind in order})
                    print(
                        f"round {i + 1}: "
                        + ", ".join(f"{k} start {runs[-1][k]['start']:.3f} s" for k in KINDS),
                        flush=True,
                    )

            asyncio.run(rounds())
            broker.terminate()
            return summarize(runs)
        finally:
            if agent is not None:
                agent.kill()
                agent.wait()
            userdel(student)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="3 rounds, 500 messages")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.messages = 3, 500
    if os.geteuid() != 0:
        print("run as root: the agent launches kernels as a Unix account this makes")
        return 2
    summary = run(args)
    print(report(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
