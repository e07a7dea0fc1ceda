"""A kernel that is a Slurm job (``SlurmKernel``) against a local kernel, same machine, same run.

    python benchmarks/slurm_kernel.py                     # 10 rounds, 2,000 messages (~2 min)
    python benchmarks/slurm_kernel.py --rounds 20 --messages 5000 --json out.json

A Slurm cluster on this machine (``devtools/slurmcluster.py``: slurmctld and two slurmd,
every node 127.0.0.1), a real broker whose pool the two nodes' agents register, and one
lease on node2 that every Slurm kernel of the run uses. As root (``make install``'s
machines) the kernels are a student's (an account made for the run, ``sudo -E -u`` as a
root server submits); otherwise they are this user's own jobs.

Three figures, each Slurm ÷ local (``jupyter_client``'s ``AsyncKernelManager`` with
ipykernel's own ``python3`` kernelspec):

``start``       submit (``SlurmKernel.launch``) or ``start_kernel()`` until a fresh
                client's first ``kernel_info`` reply; rounds alternate the order;
``interrupt``   SIGINT sent (``SlurmKernel.signal``: ``scancel --signal=INT --full``;
                ``interrupt_kernel()``) until the interrupted ``time.sleep(60)`` cell's
                ``execute_reply``;
``messages``    ``kernel_info`` requests one after another (each waits for its reply)
                through one client: messages per second.

The loopback stands in for the network between a server and a compute node: the figures
are Slurm's and the exchange directory's costs, not a network's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import pwd
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from jupyter_client.asynchronous.client import AsyncKernelClient  # noqa: E402
from jupyter_client.connect import KernelConnectionInfo  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

from provisioner.client import BrokerClient  # noqa: E402
from provisioner.client.answers import GrantedLease  # noqa: E402
from provisioner.devtools.slurmcluster import SlurmCluster, agent_tokens, start_agent  # noqa: E402
from provisioner.devtools.testing import BrokerProcess, stop_process  # noqa: E402
from provisioner.kernel.env import lease_environment  # noqa: E402
from provisioner.kernel.remote import CONNECTION_FILE, LaunchJob, remote_environment  # noqa: E402
from provisioner.kernel.slurm_kernel import SlurmKernel, SlurmSettings  # noqa: E402


class Run:
    def __init__(self, tmp: Path, student: str | None, python: str) -> None:
        self.tmp = tmp
        self.student = student
        self.python = python
        self.cluster = SlurmCluster(tmp / "slurm")
        self.settings = SlurmSettings(python=python, bind="127.0.0.1", slurm_env=self.cluster.env())
        self.lease: GrantedLease | None = None
        #: submit -> the job's runner started (Slurm's part); runner -> the kernel listened
        self.parts: dict[str, list[float]] = {"queued": [], "kernel": []}

    def job(self) -> LaunchJob:
        assert self.lease is not None
        home = pwd.getpwnam(self.student).pw_dir if self.student else str(Path.home())
        return LaunchJob(
            kernel_id=str(uuid.uuid4()),
            lease=self.lease,
            argv=(self.python, "-m", "ipykernel_launcher", "-f", CONNECTION_FILE),
            env=remote_environment({"LANG": "C.UTF-8"}, {}, lease_environment(self.lease)),
            cwd=home,
            key=str(uuid.uuid4()),
        )


class Kernel:
    """One kernel of either kind, with a client, as the measurements use it."""

    def __init__(self, client: AsyncKernelClient, interrupt: Callable[[], Awaitable[None]],
                 stop: Callable[[], Awaitable[None]]) -> None:  # fmt: skip
        self.client = client
        self.interrupt = interrupt
        self.stop = stop


async def start_slurm(run: Run) -> tuple[Kernel, float, float]:
    job = run.job()
    kernel = SlurmKernel(run.settings, user=run.student)
    t0 = time.perf_counter()
    wall0 = time.time()
    launched = await kernel.launch(job)
    t_launch = time.perf_counter() - t0
    # the job's own clock (this machine's): Slurm's part, then the kernel's
    run.parts["queued"].append(float(launched.extra["started_at"]) - wall0)
    run.parts["kernel"].append(
        float(launched.extra["listening_at"]) - float(launched.extra["started_at"])
    )
    kc = AsyncKernelClient()
    info = launched.connection_info(job.key, job.signature_scheme)
    kc.load_connection_info(cast(KernelConnectionInfo, info))
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    total = time.perf_counter() - t0

    async def stop() -> None:
        kc.stop_channels()
        await kernel.signal(signal.SIGKILL)
        await kernel.wait(30)
        kernel.cleanup()

    return Kernel(kc, lambda: kernel.signal(signal.SIGINT), stop), total, t_launch


async def start_local() -> tuple[Kernel, float, float]:
    km = AsyncKernelManager(kernel_name="python3")
    t0 = time.perf_counter()
    await km.start_kernel()
    t_launch = time.perf_counter() - t0
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    total = time.perf_counter() - t0

    async def stop() -> None:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)

    return Kernel(kc, km.interrupt_kernel, stop), total, t_launch


async def interrupt_latency(k: Kernel) -> float:
    kc = k.client
    # the cell says when it sleeps: a SIGINT between execute_input and the cell's first
    # line reaches ipykernel's loop, not the cell ("KeyboardInterrupt caught in kernel")
    msg_id = kc.execute("import time; print('asleep', flush=True); time.sleep(60)")
    while True:
        msg = await kc.get_iopub_msg(timeout=30)
        if msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == msg_id:
            break
    t0 = time.perf_counter()
    await k.interrupt()
    while True:
        reply = await kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    took = time.perf_counter() - t0
    assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    return took


async def messages_per_second(k: Kernel, n: int) -> float:
    kc = k.client
    for _ in range(20):  # warm up
        await kc.kernel_info(reply=True, timeout=30)
    t0 = time.perf_counter()
    for _ in range(n):
        await kc.kernel_info(reply=True, timeout=30)
    return n / (time.perf_counter() - t0)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def measure(run: Run, rounds: int, messages: int) -> dict[str, Any]:
    starts: dict[str, list[float]] = {"slurm": [], "local": []}
    launches: dict[str, list[float]] = {"slurm": [], "local": []}
    interrupts: dict[str, list[float]] = {"slurm": [], "local": []}
    rates: dict[str, float] = {}
    starters = {"slurm": lambda: start_slurm(run), "local": start_local}
    for kind in ("slurm", "local"):  # warm-up kernel of each (imports, caches)
        k, _, _ = await starters[kind]()
        await k.stop()
    for i in range(rounds):
        order = ("slurm", "local") if i % 2 == 0 else ("local", "slurm")
        for kind in order:
            k, total, launch = await starters[kind]()
            try:
                starts[kind].append(total)
                launches[kind].append(launch)
                interrupts[kind].append(await interrupt_latency(k))
                if i == rounds - 1:
                    rates[kind] = await messages_per_second(k, messages)
            finally:
                await k.stop()
        print(
            f"round {i + 1}: start slurm {starts['slurm'][-1]:.3f} s local "
            f"{starts['local'][-1]:.3f} s; interrupt slurm {interrupts['slurm'][-1] * 1000:.0f} "
            f"ms local {interrupts['local'][-1] * 1000:.0f} ms",
            flush=True,
        )
    out: dict[str, Any] = {
        "rounds": rounds,
        "messages": messages,
        "start_s": {k: median(v) for k, v in starts.items()},
        "start_min_s": {k: min(v) for k, v in starts.items()},
        "launch_s": {k: median(v) for k, v in launches.items()},
        "interrupt_s": {k: median(v) for k, v in interrupts.items()},
        "messages_per_s": rates,
        "slurm_parts_s": {k: median(v) for k, v in run.parts.items()},
        "raw": {"start": starts, "launch": launches, "interrupt": interrupts, **run.parts},
    }
    out["ratios"] = {
        "start": out["start_s"]["slurm"] / out["start_s"]["local"],
        "start_fastest": out["start_min_s"]["slurm"] / out["start_min_s"]["local"],
        "interrupt": out["interrupt_s"]["slurm"] / out["interrupt_s"]["local"],
        "messages": rates["slurm"] / rates["local"],
    }
    return out


def report(out: dict[str, Any]) -> None:
    s, i, m, r = out["start_s"], out["interrupt_s"], out["messages_per_s"], out["ratios"]
    print()
    print("| measure | Slurm kernel | local kernel | Slurm ÷ local |")
    print("|---|---|---|---|")
    print(f"| start, median of {out['rounds']} (s) | {s['slurm']:.3f} | {s['local']:.3f} | "
          f"**{r['start']:.2f}** |")  # fmt: skip
    print(f"| start, fastest (s) | {out['start_min_s']['slurm']:.3f} | "
          f"{out['start_min_s']['local']:.3f} | {r['start_fastest']:.2f} |")  # fmt: skip
    print(f"| of which launch (s) | {out['launch_s']['slurm']:.3f} | "
          f"{out['launch_s']['local']:.3f} | |")  # fmt: skip
    p = out["slurm_parts_s"]
    print(f"| launch: submit → the job runs (s) | {p['queued']:.3f} | | |")
    print(f"| launch: the job runs → the kernel listens (s) | {p['kernel']:.3f} | | |")
    print(f"| interrupt, median (ms) | {i['slurm'] * 1000:.0f} | {i['local'] * 1000:.0f} | "
          f"{r['interrupt']:.2f} |")  # fmt: skip
    print(f"| kernel_info round trips, {out['messages']} (msg/s) | {m['slurm']:.0f} | "
          f"{m['local']:.0f} | **{r['messages']:.2f}** |")  # fmt: skip


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from tests.accounts import passable_dir, student_python, useradd, userdel

    student = f"glb-{uuid.uuid4().hex[:6]}" if os.geteuid() == 0 else None
    with passable_dir("gpu-lease-bench-slurm-") as tmp:
        agents: list[subprocess.Popen[bytes]] = []
        run: Run | None = None
        try:
            if student:
                useradd(student)
                python = student_python(tmp, student)
            else:
                python = sys.executable
            run = Run(tmp, student, python)
            run.cluster.start()
            user = student or pwd.getpwuid(os.getuid()).pw_name
            broker = BrokerProcess(
                tmp, f"sqlite:///{tmp / 'b.sqlite'}", {user: ([], False)}, gpus="agents"
            )
            tokens = agent_tokens(tmp / "agents.json", run.cluster.nodes)
            data = json.loads(broker.tokens_file.read_text())
            data.update(json.loads((tmp / "agents.json").read_text()))
            broker.tokens_file.write_text(json.dumps(data))
            with broker.running(timeout=60):
                for node, token in tokens.items():
                    agents.append(
                        start_agent(broker.url, node, token, "1x16384:T4", tmp / f"a-{node}.log")
                    )
                client = BrokerClient(broker.url, broker.tokens[user])
                try:
                    kid = str(uuid.uuid4())
                    deadline = time.monotonic() + 30
                    while True:  # until node2's agent registered
                        try:
                            run.lease = await client.leases.acquire(kid, 0.25, node="node2")
                            break
                        except Exception:
                            if time.monotonic() > deadline:
                                raise
                            await asyncio.sleep(0.2)
                    out = await measure(run, args.rounds, args.messages)
                    await client.leases.release(run.lease.id)
                finally:
                    await client.aclose()
        finally:
            for agent in agents:
                stop_process(agent)
            if run is not None:
                run.cluster.stop()
            if student:
                userdel(student)
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    out["as"] = "a student account (sudo -E -u)" if student else "this user"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = asyncio.run(amain(args))
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
