"""What parking costs and saves on the control plane, on this machine's stand-ins.

    python benchmarks/park_cycle.py                  # 12 interleaved rounds (~4 min on 2 cores)
    python benchmarks/park_cycle.py --quick          # 3 rounds, 40 cells per hook block
    python benchmarks/park_cycle.py --reap 5 --heartbeat 5 --json out.json   # shipped defaults

No GPU: the agent runs on the stand-in driver (tests/standin_libcuda, whose checkpoint and
restore copy nothing) and the stand-in NVML (tests/fake_nvml). So this measures OUR path
(broker, agent, provisioner, the kernel's ``%gpu`` hook), not the driver's copy of the GPU
memory, which ``benchmarks/gpu/gpu_checks.py --park`` measures on a real GPU; on a real
node add that copy (seconds per GiB at the copy bandwidth) to the park and resume figures.

Set-up, real processes only: one broker subprocess (``--gpus agents``, SQLite, static
tokens; idle reclaim after ``--idle`` s, the reaper every ``--reap`` s, parking on: the
broker's defaults otherwise) and two ``gpu-lease agent`` processes, identical but for one
flag, each on its own node of one stand-in GPU (16 GiB) and heartbeating every
``--heartbeat`` s: ``gpu-park`` (the driver offers checkpointing: the broker parks there)
and ``gpu-reclaim`` (started ``--no-park``: the broker revokes there, as before parking).
Both run all the time, so both modes see the same background load. Kernels are ipykernel
kernels started by ``GPULeaseProvisioner`` (jupyter_client's ``AsyncKernelManager``,
fraction 0.6, so two do not fit on one GPU; renewals every ``--renew`` s), on the node
named by ``GPU_LEASE_NODE`` at their start; the stand-in NVML lists each kernel's real pid
with 1000 MiB, as a kernel that computed something holds.

Each round runs the two modes, in alternating order (park first, then reclaim first):

**The waiter.** Alice's kernel runs ``import numpy`` / ``x = 41`` and idles; once the agent
reported its memory, it has been idle past ``--idle``, and a random part (seeded) of the
longer period (reaper, heartbeat) has passed, bob asks the broker for 0.6 of the same
node's GPU (``POST /api/v1/leases`` long-poll). (Without that random pause every round
would meet the reaper and the agent at the same phase: the rounds move in step with the
agent's beats.) Timed: bob's request sent -> his 201. Park: the reaper's pass orders the
park (lease ``parking``), the agent's orders long-poll answers and its heartbeat at once
takes the order (``--orders-wait 0``: the next heartbeat does), checkpoints, and sends the
outcome at once; the broker frees the memory and grants bob. Reclaim: the
reaper's pass revokes alice's lease and grants bob in the same pass (the provisioner then
shuts her kernel down at its next renewal; that delay is shown, not timed into the
waiter's figure). The breakdown comes from the broker's and the agent's logs (millisecond
timestamps) and the agent's outcome ``seconds``.

**The returning student.** Once the kernel's state file says ``parked`` (its keeper
learns it at its next renewal), bob releases, the GPU is free; after another random pause:
park: the cell ``x`` run in the parked kernel, from ``execute`` to its reply (the
``%gpu`` hook sees ``parked`` in the state file and asks for the resume, the lease keeper
calls the broker, the broker re-reserves the GPU and orders the restore, which reaches
the agent through its long-poll, the agent restores, the keeper's long-poll answers ``active``, the hook
lets the cell run). Reclaim (the kernel is gone): a new kernel started through the
provisioner (``start_kernel``, its first ``kernel_info`` reply), the cell that rebuilt
``x`` (``import numpy`` / ``x = 41``: numpy's import stands for re-loading data; the real
cost of re-running a notebook is the student's work, often minutes), then the cell
``x``. Both end with the reply showing 41.

**The hook's per-cell cost** when not parked: in the park mode's kernel (extension loaded
by the launcher, the state file saying ``active``), ``--cells`` cells of ``pass`` with the
extension's ``pre_run_cell`` hook registered and as many with it unregistered (the same
kernel; blocks in alternating order), each timed from ``execute`` to its reply; plus the
hook call alone, timed in the kernel with ``timeit``. An empty cell would measure nothing:
IPython skips every hook for a cell of whitespace.

Reported: medians, the ratio of medians (park / reclaim; hook on / off), the median of the
per-round ratios, and the breakdowns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
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

import httpx  # noqa: E402

from provisioner.devtools.testing import BrokerProcess, wait_for_async  # noqa: E402
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json  # noqa: E402
from tests.standin_libcuda.build import build as build_libcuda  # noqa: E402

FAKE_NVML = ROOT / "tests" / "fake_nvml"
SPEC = "bench-park"
FRACTION = 0.6  # two do not fit on the one GPU
USED_MB = 1000  # what the stand-in NVML lists for each kernel's pid
GPU_MB = 16384
PARK, RECLAIM = "park", "reclaim"
REBUILD = "import numpy\nx = 41"
TIMEOUT = 90.0  # any single wait on a busy 2-core machine

#: runs in the park mode's kernel once: the extension's hook, and a switch for it
HOOK_SETUP = """\
_gl_ip = get_ipython()
_gl_hooks = [h for h in _gl_ip.events.callbacks['pre_run_cell']
             if type(h).__name__ == 'ParkedCellHook']
assert len(_gl_hooks) == 1, _gl_hooks
_gl_hook = _gl_hooks[0]
def _gl_switch(on):
    there = any(h is _gl_hook for h in _gl_ip.events.callbacks['pre_run_cell'])
    if on and not there:
        _gl_ip.events.register('pre_run_cell', _gl_hook)
        _gl_ip.ast_transformers.append(_gl_hook)
    elif not on and there:
        _gl_ip.events.unregister('pre_run_cell', _gl_hook)
        _gl_ip.ast_transformers.remove(_gl_hook)
    assert any(h is _gl_hook for h in _gl_ip.events.callbacks['pre_run_cell']) == on
"""
#: the hook's call alone when the state file says active (seconds per call, median of 5)
HOOK_TIMEIT = (
    "import timeit, statistics\n"
    "print(statistics.median(timeit.repeat(lambda: _gl_hook(None), number=500, repeat=5)) / 500)"
)

_STAMP = re.compile(r"^\[\w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[.,](\d{3}) ")


def log_events(path: Path) -> list[tuple[float, str]]:
    """(epoch seconds, line) of each log line with a timestamp (broker: ``.mmm``, agent:
    ``,mmm``; both local time, to the millisecond)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = _STAMP.match(line)
        if m:
            stamp = time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
            out.append((stamp, line))
    return out


def logged(path: Path, needle: str, after: float) -> tuple[float, str] | None:
    """The first line of ``path`` holding ``needle`` stamped at ``after`` or later (less
    the millisecond the stamp drops)."""
    for stamp, line in log_events(path):
        if stamp >= after - 0.002 and needle in line:
            return stamp, line
    return None


class Node:
    """One ``gpu-lease agent`` process on one stand-in GPU: its NVML in a JSON file, its
    driver state in a folder, its log."""

    def __init__(self, name: str, tmp: Path, libdir: Path, park: bool) -> None:
        self.name = name
        self.park = park
        self.token = f"agent-{name}-{uuid.uuid4().hex}"
        self.nvml_file = tmp / f"nvml-{name}.json"
        self.driver = tmp / f"driver-{name}"
        self.driver.mkdir()
        self.libdir = libdir
        self.log_path = tmp / f"agent-{name}.log"
        self.gpu = {"uuid": f"GPU-{name}-0", "name": "T4", "memory_mb": GPU_MB}
        self.proc: subprocess.Popen[bytes] | None = None
        self.set_processes({})

    def set_processes(self, used: dict[int, int]) -> None:
        """What NVML lists on the GPU: pid -> MiB (the stand-in reads it at every call)."""
        procs = {self.gpu["uuid"]: [{"pid": p, "used_mb": mb} for p, mb in used.items()]}
        tmp = self.nvml_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": [self.gpu], "processes": procs}))
        os.replace(tmp, self.nvml_file)

    def start(self, url: str, interval: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_NVML), str(ROOT)]))
        env["FAKE_NVML_FILE"] = str(self.nvml_file)
        env["GPU_LEASE_AGENT_TOKEN"] = self.token
        env["LD_LIBRARY_PATH"] = str(self.libdir)  # the stand-in libcuda.so.1
        env["STANDIN_LIBCUDA_DIR"] = str(self.driver)
        cmd = [sys.executable, "-m", "provisioner.node.agent", "--broker-url", url]
        cmd += ["--node", self.name, "--interval", str(interval)]
        if not self.park:
            cmd.append("--no-park")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


async def cell(kc: Any, code: str, timeout: float = TIMEOUT) -> tuple[float, str, dict[str, Any]]:
    """Run ``code``: seconds from ``execute`` to its reply, its output (stdout, results,
    errors) and the reply's content."""
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "execute_result":
            out.append(content["data"].get("text/plain", "") + "\n")
        elif kind == "error":
            out.append(f"{content['ename']}: {content['evalue']}\n")

    t0 = time.perf_counter()
    reply = await kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    took = time.perf_counter() - t0
    content = dict(reply["content"])
    if content["status"] != "ok":
        raise RuntimeError(f"cell {code!r} failed: {''.join(out)}")
    return took, "".join(out), content


class Bench:
    """The broker, the two nodes and the users' HTTP clients, for the rounds."""

    def __init__(self, args: argparse.Namespace, tmp: Path, broker: BrokerProcess) -> None:
        self.args = args
        self.tmp = tmp
        self.broker = broker
        self.nodes: dict[str, Node] = {}
        self.http: dict[str, httpx.AsyncClient] = {}
        self.kernel_log = open(tmp / "kernels.log", "wb")  # noqa: SIM115 - closed in close()
        self.rng = random.Random(28)  # the same phases at every run with the same options

    async def open(self) -> None:
        for user in ("alice", "bob", "admin"):
            self.http[user] = httpx.AsyncClient(
                base_url=f"{self.broker.url}/api/v1",
                headers={"Authorization": f"token {self.broker.tokens[user]}"},
                timeout=TIMEOUT,
            )

    async def close(self) -> None:
        for client in self.http.values():
            await client.aclose()
        self.kernel_log.close()

    # -- the broker, as its users see it ---------------------------------------------------
    async def lease(self, lease_id: str) -> dict[str, Any]:
        r = await self.http["alice"].get(f"/leases/{lease_id}")
        if r.status_code != 200:
            return {"state": f"HTTP {r.status_code}"}
        return dict(r.json())

    async def bob_waits(self, node: Node) -> tuple[float, float, str]:
        """Bob asks for the node's GPU and waits for it: (sent, answered) epoch seconds and
        his lease id."""
        ask = {"kernel_id": f"bob-{uuid.uuid4()}", "fraction": FRACTION, "node": node.name}
        sent = time.time()
        while True:
            r = await self.http["bob"].post("/leases", json={**ask, "wait": 60})
            if r.status_code == 201:
                return sent, time.time(), str(r.json()["id"])
            if r.status_code != 202 or time.time() - sent > TIMEOUT:
                raise RuntimeError(f"bob's acquire answered {r.status_code}: {r.text}")

    async def release(self, user: str, lease_id: str) -> None:
        r = await self.http[user].delete(f"/leases/{lease_id}")
        if r.status_code != 204:
            raise RuntimeError(f"release answered {r.status_code}: {r.text}")

    # -- kernels ----------------------------------------------------------------------------
    async def start_kernel(self, node: Node) -> tuple[Any, Any, dict[str, float]]:
        """A GPU kernel on ``node`` through the provisioner, its client ready: (manager,
        client, {launch, ready}: seconds of start_kernel and then to kernel_info)."""
        from jupyter_client.manager import AsyncKernelManager

        os.environ["GPU_LEASE_NODE"] = node.name  # the server's placement (placement.py)
        runtime = self.tmp / "runtime"
        runtime.mkdir(exist_ok=True)
        km = AsyncKernelManager(
            kernel_name=SPEC, connection_file=str(runtime / f"kernel-{uuid.uuid4()}.json")
        )
        t0 = time.perf_counter()
        await km.start_kernel(stdout=self.kernel_log, stderr=self.kernel_log)
        t1 = time.perf_counter()
        kc = km.client()
        kc.start_channels()
        await kc.wait_for_ready(timeout=TIMEOUT)
        return km, kc, {"launch": t1 - t0, "ready": time.perf_counter() - t1}

    async def idle_holder(self, node: Node, km: Any, kc: Any, started: float) -> str:
        """Alice's kernel: its pid listed on the GPU with USED_MB, the agent's report of it
        seen by the broker, and idle past ``idle_reclaim_after`` (no Jupyter server reports
        activity here, so the broker counts idle from the lease's creation, before
        ``started``). Its lease id."""
        _, out, _ = await cell(kc, "import os; print(os.getpid())")
        pid = int(out.strip().splitlines()[-1])
        node.set_processes({pid: USED_MB})
        lease_id = str(km.provisioner.lease_keeper.lease.id)

        async def reported() -> bool:
            return (await self.lease(lease_id)).get("used_mb") == USED_MB

        await wait_for_async(reported, TIMEOUT, "the agent to report the kernel's memory")
        rest = started + self.args.idle + 0.1 - time.time()
        if rest > 0:
            await asyncio.sleep(rest)
        return lease_id

    async def random_phase(self) -> None:
        """Sleep a random part of the reaper's and the heartbeat's period: each round
        waits for the reaper and the agent up to the same moments otherwise (the holder is
        ready right after a heartbeat, a park's outcome resets the agent's beat), so every
        round would hit the same phase of them, not a student's random one."""
        await asyncio.sleep(self.rng.uniform(0.0, max(self.args.reap, self.args.heartbeat)))

    async def stop_kernel(self, km: Any, kc: Any) -> None:
        kc.stop_channels()
        if km.has_kernel:
            await km.shutdown_kernel()

    # -- the hook ---------------------------------------------------------------------------
    async def hook_cells(self, kc: Any, first_on: bool) -> dict[str, Any]:
        """``--cells`` cells of ``pass`` with the hook and as many without, in that order or
        the other; the hook left registered. Seconds per cell, and the hook call alone."""
        await cell(kc, HOOK_SETUP)
        times: dict[str, list[float]] = {"on": [], "off": []}
        for on in (first_on, not first_on):
            await cell(kc, f"_gl_switch({on})")
            for _ in range(self.args.cells):
                took, _, _ = await cell(kc, "pass")
                times["on" if on else "off"].append(took)
        await cell(kc, "_gl_switch(True)")
        _, out, _ = await cell(kc, HOOK_TIMEIT)
        return {**times, "call_s": float(out.strip().splitlines()[-1])}

    # -- the rounds -------------------------------------------------------------------------
    async def park_round(self, first_on: bool) -> dict[str, Any]:
        node = self.nodes[PARK]
        km, kc, _ = await self.start_kernel(node)
        started = time.time()
        try:
            await cell(kc, REBUILD)
            hook = await self.hook_cells(kc, first_on)  # while the kernel waits to be idle
            lease_id = await self.idle_holder(node, km, kc, started)
            await self.random_phase()
            short = lease_id[:6]
            sent, granted, bobs = await self.bob_waits(node)
            state = (await self.lease(lease_id))["state"]
            if state != "parked":
                raise RuntimeError(f"alice's lease is {state}, not parked:\n{node.log()}")
            waiter = self.park_parts(short, sent, granted, "Parking idle lease", "Parked lease")
            state_path = Path(km.provisioner.lease_keeper.state_file.path)
            await wait_for_async(
                lambda: '"state": "parked"' in state_path.read_text(),
                TIMEOUT,
                "the kernel's state file to say parked",
            )
            await self.release("bob", bobs)
            await self.random_phase()
            asked = time.time()
            took, out, _ = await cell(kc, "x")
            if out.strip().splitlines()[-1] != "41" or "variables are intact" not in out:
                raise RuntimeError(f"the resumed cell printed {out!r}")
            back = self.park_parts(short, asked, asked + took, "Resuming lease", "Resumed lease")
            back["total"] = took
            if (await self.lease(lease_id))["state"] != "active":
                raise RuntimeError("alice's lease is not active after the resume")
        finally:
            await self.stop_kernel(km, kc)
            node.set_processes({})
        return {"waiter": waiter, "return": back, "hook": hook}

    def park_parts(
        self, short: str, t0: float, t1: float, ordered: str, done: str
    ) -> dict[str, float]:
        """A park's or a resume's timeline from the logs: the broker's order (``ordered``),
        the agent's ``done`` line (with its outcome's seconds), the broker's applying it."""
        node = self.nodes[PARK]
        order = logged(self.broker.log_path, f"{ordered} {short}…", t0)
        agent = logged(node.log_path, f"{done} {short}:", t0)
        applied = logged(self.broker.log_path, f"{done} {short}…", t0)
        out = {"total": t1 - t0}
        if order is None or agent is None or applied is None:
            return out  # a log line missing: the total only
        m = re.search(r" in ([\d.]+) s", agent[1])
        seconds = float(m[1]) if m else 0.0
        out["to_order"] = order[0] - t0
        out["heartbeat_wait"] = agent[0] - seconds - order[0]
        out["driver"] = seconds  # the agent's outcome seconds (its log: 2 decimals)
        out["outcome_to_broker"] = applied[0] - agent[0]
        out["to_answer"] = t1 - applied[0]
        return out

    async def reclaim_round(self) -> dict[str, Any]:
        node = self.nodes[RECLAIM]
        km, kc, _ = await self.start_kernel(node)
        started = time.time()
        try:
            await cell(kc, REBUILD)
            lease_id = await self.idle_holder(node, km, kc, started)
            await self.random_phase()
            sent, granted, bobs = await self.bob_waits(node)
            waiter: dict[str, float] = {"total": granted - sent}
            revoked = logged(self.broker.log_path, f"Revoked idle lease {lease_id[:6]}…", sent)
            if revoked is not None:
                waiter["to_order"] = revoked[0] - sent
                waiter["to_answer"] = granted - revoked[0]
            state = (await self.lease(lease_id))["state"]
            if state != "revoked":
                raise RuntimeError(f"alice's lease is {state}, not revoked")
            await wait_for_async(
                lambda: not km.has_kernel, TIMEOUT, "the provisioner to shut the kernel down"
            )
            waiter["kernel_shut_down_after"] = time.time() - granted
        finally:
            await self.stop_kernel(km, kc)
            node.set_processes({})
        await self.release("bob", bobs)
        await self.random_phase()
        t0 = time.perf_counter()
        km, kc, start = await self.start_kernel(node)
        try:
            rebuild, _, _ = await cell(kc, REBUILD)
            x, out, _ = await cell(kc, "x")
            total = time.perf_counter() - t0
            if out.strip().splitlines()[-1] != "41":
                raise RuntimeError(f"the cell x printed {out!r}")
        finally:
            await self.stop_kernel(km, kc)
        back = {"total": total, **start, "rebuild_cell": rebuild, "x_cell": x}
        return {"waiter": waiter, "return": back}

    async def rounds(self) -> list[dict[str, Any]]:
        for _ in range(self.args.warmup):
            print("warm-up round (not counted)", flush=True)
            await self.park_round(True)
            await self.reclaim_round()
        runs = []
        for i in range(self.args.rounds):
            order = [PARK, RECLAIM] if i % 2 == 0 else [RECLAIM, PARK]
            run: dict[str, Any] = {"order": order}
            for mode in order:
                run[mode] = (
                    await self.park_round(first_on=i % 4 < 2)
                    if mode == PARK
                    else await self.reclaim_round()
                )
            runs.append(run)
            p, r = run[PARK], run[RECLAIM]
            print(
                f"  round {i + 1:>2}: waiter park {p['waiter']['total']:.2f} reclaim "
                f"{r['waiter']['total']:.2f} s; return park {p['return']['total']:.2f} reclaim "
                f"{r['return']['total']:.2f} s; cell hook on {statistics.median(p['hook']['on']) * 1e3:.2f}"
                f" off {statistics.median(p['hook']['off']) * 1e3:.2f} ms",
                flush=True,
            )
        return runs


# -- summary ---------------------------------------------------------------------------------
def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def parts(runs: list[dict[str, Any]], mode: str, what: str) -> dict[str, float]:
    """Median of each part of ``what`` over the rounds (parts missing in a round skipped)."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run[mode][what] if k not in keys]
    return {k: med([run[mode][what][k] for run in runs if k in run[mode][what]]) for k in keys}


def compare(runs: list[dict[str, Any]], what: str) -> dict[str, float]:
    park = [run[PARK][what]["total"] for run in runs]
    reclaim = [run[RECLAIM][what]["total"] for run in runs]
    return {
        "park_median_s": med(park),
        "reclaim_median_s": med(reclaim),
        "park_min_s": min(park),
        "park_max_s": max(park),
        "reclaim_min_s": min(reclaim),
        "reclaim_max_s": max(reclaim),
        "ratio_of_medians": med(park) / med(reclaim),
        "median_of_ratios": med([p / r for p, r in zip(park, reclaim, strict=True)]),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    on = [t for run in runs for t in run[PARK]["hook"]["on"]]
    off = [t for run in runs for t in run[PARK]["hook"]["off"]]
    per_round = [med(run[PARK]["hook"]["on"]) / med(run[PARK]["hook"]["off"]) for run in runs]
    return {
        "waiter": compare(runs, "waiter"),
        "return": compare(runs, "return"),
        "waiter_parts": {m: parts(runs, m, "waiter") for m in (PARK, RECLAIM)},
        "return_parts": {m: parts(runs, m, "return") for m in (PARK, RECLAIM)},
        "hook": {
            "cells_each": len(on),
            "on_median_ms": med(on) * 1e3,
            "off_median_ms": med(off) * 1e3,
            "ratio_of_medians": med(on) / med(off),
            "median_of_round_ratios": med(per_round),
            "extra_median_us": (med(on) - med(off)) * 1e6,
            "call_us": med([run[PARK]["hook"]["call_s"] for run in runs]) * 1e6,
        },
    }


def report(data: dict[str, Any]) -> str:
    s, a = data["summary"], data["settings"]
    lines = [
        "",
        f"Parking's control plane on stand-ins, {data['rounds']} interleaved rounds "
        f"(reap {a['reap']:g} s, agent heartbeat {a['heartbeat']:g} s, idle reclaim after "
        f"{a['idle']:g} s, renewals {a['renew']:g} s)",
        f"{'':<38}{'park':>8}{'reclaim':>9}{'ratio':>8}{'med ratio':>11}   (median s)",
    ]
    for key, label in (
        ("waiter", "the waiter: acquire -> grant"),
        ("return", "the returning student: cell -> x back"),
    ):
        x = s[key]
        lines.append(
            f"{label:<38}{x['park_median_s']:>8.2f}{x['reclaim_median_s']:>9.2f}"
            f"{x['ratio_of_medians']:>8.2f}{x['median_of_ratios']:>11.2f}"
            f"   park {x['park_min_s']:.2f}..{x['park_max_s']:.2f}, reclaim "
            f"{x['reclaim_min_s']:.2f}..{x['reclaim_max_s']:.2f}"
        )
    wp, wr = s["waiter_parts"][PARK], s["waiter_parts"][RECLAIM]
    rp, rr = s["return_parts"][PARK], s["return_parts"][RECLAIM]

    def part(d: dict[str, float], k: str) -> str:
        return f"{d[k]:.3f}" if k in d else "–"

    lines += [
        "",
        "The waiter, where the time goes (medians of each part, s)",
        f"  park:    to the reaper's order {part(wp, 'to_order')}, the order to the agent "
        f"{part(wp, 'heartbeat_wait')}, checkpoint (agent's seconds) {part(wp, 'driver')}, "
        f"outcome to the broker {part(wp, 'outcome_to_broker')}, grant to bob's reply "
        f"{part(wp, 'to_answer')}",
        f"  reclaim: to the reaper's revoke {part(wr, 'to_order')}, grant to bob's reply "
        f"{part(wr, 'to_answer')}; alice's kernel then shut down by its provisioner after "
        f"{part(wr, 'kernel_shut_down_after')}",
        "The returning student (medians, s)",
        f"  park:    cell to the broker's resume {part(rp, 'to_order')} (hook, keeper's watch, "
        f"resume call), the order to the agent {part(rp, 'heartbeat_wait')}, restore "
        f"(agent's seconds) {part(rp, 'driver')}, outcome to the broker "
        f"{part(rp, 'outcome_to_broker')}, to the reply {part(rp, 'to_answer')} (keeper's "
        "long-poll, state file, hook's poll, the cell)",
        f"  reclaim: start_kernel {part(rr, 'launch')}, to kernel_info {part(rr, 'ready')}, "
        f"rebuild cell {part(rr, 'rebuild_cell')}, cell x {part(rr, 'x_cell')}",
    ]
    h = s["hook"]
    lines += [
        "",
        f"The %gpu hook when not parked: {h['cells_each']} cells of `pass` each way",
        f"  per cell, hook on {h['on_median_ms']:.3f} ms, off {h['off_median_ms']:.3f} ms: "
        f"ratio {h['ratio_of_medians']:.3f} (median of round ratios "
        f"{h['median_of_round_ratios']:.3f}), {h['extra_median_us']:+.0f} µs",
        f"  the hook's call alone (timeit in the kernel): {h['call_us']:.1f} µs",
    ]
    return "\n".join(lines)


# -- set-up ----------------------------------------------------------------------------------
def isolate(tmp: Path, renew: float) -> None:
    """This process's Jupyter paths under ``tmp`` with the GPU kernelspec, and none of a
    hub's or node's environment."""
    spec = build_kernelspec(FRACTION, display_name="Python 3 (park bench)")
    spec["metadata"]["kernel_provisioner"]["config"]["renew_interval"] = renew
    folder = tmp / "jupyter" / "kernels" / SPEC
    folder.mkdir(parents=True)
    (folder / "kernel.json").write_text(spec_json(spec))
    os.environ["JUPYTER_PATH"] = str(tmp / "jupyter")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    os.environ["IPYTHONDIR"] = str(tmp / "ipython")
    for name in ("JUPYTERHUB_API_TOKEN", "GPU_LEASE_NODE", "GPU_LEASE_GPU_UUIDS"):
        os.environ.pop(name, None)


async def measure(args: argparse.Namespace, tmp: Path, broker: BrokerProcess) -> dict[str, Any]:
    bench = Bench(args, tmp, broker)
    libdir = build_libcuda(tmp / "libcuda")
    for mode in (PARK, RECLAIM):
        node = Node(f"gpu-{mode}", tmp, libdir, park=mode == PARK)
        bench.nodes[mode] = node
    # the agents' tokens, before the broker reads the tokens file
    tokens = json.loads(broker.tokens_file.read_text())
    for node in bench.nodes.values():
        tokens[node.token] = {"agent": True, "node": node.name}
    broker.tokens_file.write_text(json.dumps(tokens))
    broker.start(60.0)
    os.environ["GPU_LEASE_URL"] = broker.url
    os.environ["GPU_LEASE_TOKEN"] = broker.tokens["alice"]
    await bench.open()
    try:
        for node in bench.nodes.values():
            node.start(broker.url, args.heartbeat)

        async def both_up() -> bool:
            r = await bench.http["admin"].get("/nodes")
            up = {n["node"] for n in r.json()["nodes"] if n.get("last_seen")}
            return up >= {n.name for n in bench.nodes.values()}

        await wait_for_async(both_up, TIMEOUT, "both agents to heartbeat")
        runs = await bench.rounds()
        r = await bench.http["admin"].get("/leases", params={"all": "1"})
        left = [x for x in r.json()["leases"] if x["state"] in ("active", "parked")]
    finally:
        await bench.close()
        for node in bench.nodes.values():
            node.stop()
    return {"rounds": args.rounds, "runs": runs, "leases_left": len(left)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds, 40 cells per hook block")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (12; quick 3)")
    ap.add_argument("--cells", type=int, help="cells of `pass` per hook block (100; quick 40)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds not counted, first (1)")
    ap.add_argument("--reap", type=float, default=1.0, help="broker reap_interval, s (1)")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="agent --interval, s (2)")
    ap.add_argument("--idle", type=float, default=2.0, help="broker idle_reclaim_after, s (2)")
    ap.add_argument("--renew", type=float, default=1.0, help="kernels' renew_interval, s (1)")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 12)
    args.cells = args.cells or (40 if args.quick else 100)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}, Python {platform.python_version()}",
        flush=True,
    )
    load0 = os.getloadavg()
    began = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(ROOT / "provisioner")], check=True
    )
    with tempfile.TemporaryDirectory(prefix="gl-park-") as d:
        tmp = Path(d)
        isolate(tmp, args.renew)
        broker = BrokerProcess(
            tmp,
            f"sqlite:///{tmp / 'broker.sqlite'}",
            {"alice": ([], False), "bob": ([], False), "admin": ([], True)},
            extra=(
                "--gpus",
                "agents",
                f"--GPULeaseBroker.reap_interval={args.reap}",
                f"--GPULeaseBroker.idle_reclaim_after={args.idle}",
            ),
        )
        try:
            data = asyncio.run(measure(args, tmp, broker))
        finally:
            broker.stop()
    data["summary"] = summarize(data["runs"])
    data.update(
        settings={k: getattr(args, k) for k in ("reap", "heartbeat", "idle", "renew", "cells")},
        date=time.strftime("%Y-%m-%d %H:%M %Z"),
        wall_s=time.monotonic() - began,
        machine={
            "cpus": os.cpu_count(),
            "loadavg_at_start": load0,
            "loadavg_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    )
    print(report(data))
    print(f"({data['wall_s']:.0f} s in all; load average at the end {os.getloadavg()[0]:.2f})")
    if data["leases_left"]:
        print(f"note: {data['leases_left']} lease(s) still held after the runs")
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if data["leases_left"] else 0


if __name__ == "__main__":
    sys.exit(main())
