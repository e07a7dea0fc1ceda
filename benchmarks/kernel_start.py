"""Kernel start and restart time: GPULeaseProvisioner against LocalProvisioner, same kernel.

    python benchmarks/kernel_start.py                 # 30 interleaved rounds (~4-5 min on 2 cores)
    python benchmarks/kernel_start.py --quick         # 5 rounds
    python benchmarks/kernel_start.py --rounds 30 --json out.json

Two kernelspecs in a temporary ``JUPYTER_PATH`` with the same argv
(``<this python> -m ipykernel_launcher -f {connection_file}``): ``bench-plain`` (no
provisioner metadata: jupyter_client's ``LocalProvisioner``) and ``bench-gpu``
(``gpu-lease-provisioner`` with ``fraction`` 0.02), against a REAL broker subprocess
(``--gpus 1x81920:A100``, static tokens; ``GPU_LEASE_URL``/``GPU_LEASE_TOKEN`` in this
process's environment, as a Jupyter server has them).

Each round starts one kernel of each kind, in alternating order (AB, BA, ...), through
jupyter_client's ``AsyncKernelManager``:

``start``     ``start_kernel()`` until the first ``kernel_info`` reply (a fresh client's
              ``wait_for_ready``);
``restart``   ``restart_kernel()`` (graceful, as JupyterLab's restart button) until the
              next ``kernel_info`` reply;
``shutdown``  ``shutdown_kernel()`` (graceful; the GPU kernel releases its lease).

``start`` is also split in two: `` launch`` until ``start_kernel()`` returns (the
server's part: the provisioner's ``pre_launch``, the lease included, and the process
spawned) and `` ready`` from there to the ``kernel_info`` reply (the kernel's part).

Reported: medians, the ratio of medians (GPU / plain; the aim is judged on it), the
median of the per-round ratios and the ratio of the fastest runs (least disturbed by
other load on a shared machine). Where the GPU kernel costs more, the breakdown measures the parts separately:
the acquire round trip with a fresh ``BrokerClient`` (the provisioner opens one per
kernel), and the launcher (``gpu_lease_launcher.py -m MODULE`` against
``python -m MODULE`` for an empty module, plus importing the ``%gpu`` extension).

The package is byte-compiled first, as a wheel install is: with ``PYTHONDONTWRITEBYTECODE=1``
in the environment (our CI machines) every GPU kernel would otherwise compile the
``%gpu`` extension again (about 2.5 ms), a cost no installed kernel pays. The launcher
itself runs as a script, which Python compiles at every start anyway (about 1.5 ms,
inside the launcher figure).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from provisioner.devtools.testing import BrokerProcess, cpu_seconds  # noqa: E402

AIM_RATIO = 1.02  # the aim: kernel start with a lease within 2 % of LocalProvisioner
FRACTION = 0.02
PLAIN, GPU = "bench-plain", "bench-gpu"


def write_specs(root: Path) -> None:
    """The two kernelspecs; identical argv, only the provisioner differs."""
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    specs = {
        PLAIN: {"argv": argv, "display_name": "Python 3 (bench)", "language": "python"},
        GPU: {
            "argv": argv,
            "display_name": f"Python 3 (bench, GPU {FRACTION})",
            "language": "python",
            "metadata": {
                "kernel_provisioner": {
                    "provisioner_name": "gpu-lease-provisioner",
                    "config": {"fraction": FRACTION},
                }
            },
        },
    }
    for name, spec in specs.items():
        folder = root / "kernels" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.json").write_text(json.dumps(spec, indent=1))


async def one_kernel(name: str, log: Any, timeout: float = 120.0) -> dict[str, float]:
    """Start, restart and shut down one kernel; seconds for each. Its output goes to ``log``."""
    from jupyter_client.manager import AsyncKernelManager

    km = AsyncKernelManager(kernel_name=name)
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    c0 = time.process_time()
    await km.start_kernel(stdout=log, stderr=log)
    out["launch"] = time.perf_counter() - t0  # the server's part: lease, process spawned
    out["server_cpu"] = time.process_time() - c0  # the provisioner's work, in the server
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=timeout)
        out["start"] = time.perf_counter() - t0
        out["ready"] = out["start"] - out["launch"]  # the kernel's part: spawned to its reply
        out["kernel_cpu"] = cpu_seconds(km.provisioner.pid) if km.provisioner else 0.0
    finally:
        kc.stop_channels()
    t0 = time.perf_counter()
    await km.restart_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=timeout)
        out["restart"] = time.perf_counter() - t0
    finally:
        kc.stop_channels()
    t0 = time.perf_counter()
    await km.shutdown_kernel()
    out["shutdown"] = time.perf_counter() - t0
    return out


async def acquire_rtt(url: str, token: str, n: int) -> dict[str, float]:
    """Median milliseconds of what the provisioner does with the broker per kernel: build a
    ``BrokerClient`` (one per kernel), acquire (new connection), acquire again on the same
    client (what a restart does: the same lease back), and release (shutdown)."""
    from provisioner.client import BrokerClient

    parts: dict[str, list[float]] = {"client": [], "acquire": [], "repeat": [], "release": []}
    for i in range(n):
        kernel_id = f"rtt-{uuid.uuid4().hex}-{i}"
        t0 = time.perf_counter()
        client = BrokerClient(url, token)
        try:
            t1 = time.perf_counter()
            lease = await client.leases.acquire(kernel_id, FRACTION)
            t2 = time.perf_counter()
            await client.leases.acquire(kernel_id, FRACTION)
            t3 = time.perf_counter()
            await client.leases.release(lease.id)
            t4 = time.perf_counter()
        finally:
            await client.aclose()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[key].append(dt * 1e3)
    # the same calls through the standard library, right after: how much is the client
    # library (httpx) and how much the broker
    split = urlsplit(url)
    leases = f"{split.path.rstrip('/')}/api/v1/leases"
    headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}
    stdlib: dict[str, list[float]] = {"acquire_stdlib": [], "repeat_stdlib": []}
    for i in range(n):
        body = json.dumps({"kernel_id": f"rtt-stdlib-{uuid.uuid4().hex}-{i}", "fraction": FRACTION})
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(split.hostname or "127.0.0.1", split.port, timeout=10)
        try:
            conn.request("POST", leases, body, headers)
            resp = conn.getresponse()
            lease = json.loads(resp.read())
            t1 = time.perf_counter()
            conn.request("POST", leases, body, headers)
            conn.getresponse().read()
            t2 = time.perf_counter()
            conn.request("DELETE", f"{leases}/{lease['id']}", None, headers)
            conn.getresponse().read()
        finally:
            conn.close()
        stdlib["acquire_stdlib"].append((t1 - t0) * 1e3)
        stdlib["repeat_stdlib"].append((t2 - t1) * 1e3)
    return {key: statistics.median(v) for key, v in {**parts, **stdlib}.items()}


def launcher_overhead(tmp: Path, n: int) -> dict[str, float]:
    """Median process run time: ``python -m noop`` vs ``python LAUNCHER -m noop``, and the
    import of the ``%gpu`` extension module (what ``--ext=gpu_lease_magic`` loads)."""
    from provisioner.kernel.env import kernel_argv

    (tmp / "gl_noop.py").write_text("")
    plain = [sys.executable, "-m", "gl_noop"]
    wrapped = kernel_argv(plain).argv
    wrapped = [a for a in wrapped if not a.startswith("--ext=")]  # gl_noop is no IPython kernel
    launcher = Path(wrapped[1])
    times: dict[str, list[float]] = {"plain": [], "launcher": []}
    for i in range(n):
        order = [("plain", plain), ("launcher", wrapped)]
        for key, cmd in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=tmp, check=True)
            times[key].append(time.perf_counter() - t0)
    # json, os, re and time are loaded in every IPython kernel before its extensions: a
    # fresh interpreter's first import of them is not the extension's cost
    probe = (
        "import sys, time, json, os, re; sys.path.insert(0, sys.argv[1]); "
        "t = time.perf_counter(); import gpu_lease_magic; print(time.perf_counter() - t)"
    )
    ext = [
        float(
            subprocess.run(
                [sys.executable, "-c", probe, str(launcher.parent)],
                cwd=tmp,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for _ in range(max(3, n // 2))
    ]
    return {
        "python_m": statistics.median(times["plain"]),
        "launcher": statistics.median(times["launcher"]) - statistics.median(times["plain"]),
        "extension_import": statistics.median(ext),
    }


def median_ci(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap 95 % interval of the median of ``values`` (seeded: reruns agree)."""
    rng = random.Random(16)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for phase in ("start", "launch", "ready", "restart", "shutdown"):
        a = [r[PLAIN][phase] for r in runs]
        b = [r[GPU][phase] for r in runs]
        pairs = list(zip(a, b, strict=True))
        ratios = [y / x for x, y in pairs]
        lo, hi = median_ci(ratios)
        out[phase] = {
            "plain_median_s": statistics.median(a),
            "gpu_median_s": statistics.median(b),
            "plain_min_s": min(a),
            "gpu_min_s": min(b),
            "ratio_of_medians": statistics.median(b) / statistics.median(a),
            "median_of_ratios": statistics.median(ratios),
            "median_of_ratios_low": lo,
            "median_of_ratios_high": hi,
            "ratio_of_minima": min(b) / min(a),
            "extra_median_ms": (statistics.median(b) - statistics.median(a)) * 1e3,
            "extra_paired_ms": statistics.median(y - x for x, y in pairs) * 1e3,
        }
    # CPU, not wall: what a class starting at once on few cores pays for each kernel
    cpu: dict[str, float] = {}
    for part in ("server_cpu", "kernel_cpu"):
        cpu[f"plain_{part}_ms"] = statistics.median(r[PLAIN][part] for r in runs) * 1e3
        cpu[f"gpu_{part}_ms"] = statistics.median(r[GPU][part] for r in runs) * 1e3
    plain = cpu["plain_server_cpu_ms"] + cpu["plain_kernel_cpu_ms"]
    cpu["ratio"] = (cpu["gpu_server_cpu_ms"] + cpu["gpu_kernel_cpu_ms"]) / plain if plain else 0.0
    out["start_cpu"] = cpu
    return out


def report(data: dict[str, Any]) -> str:
    s = data["summary"]
    lines = [
        "",
        f"Kernel start/restart, {data['rounds']} interleaved rounds (median seconds)",
        f"{'phase':<10}{'plain':>9}{'GPU':>9}{'extra ms':>10}{'ratio':>8}{'med ratio':>11}"
        f"{'[95 % CI]':>16}{'min ratio':>11}  aim (ratio of medians)",
    ]
    for phase, x in s.items():
        if phase == "start_cpu":
            continue
        aim = ""
        if phase in ("start", "restart"):
            ok = x["ratio_of_medians"] <= AIM_RATIO
            aim = f"<= {AIM_RATIO}: {'met' if ok else 'NOT met'}"
        if phase in ("launch", "ready"):
            phase = f" {phase}"  # the two parts of start
        ci = f"[{x['median_of_ratios_low']:.3f}..{x['median_of_ratios_high']:.3f}]"
        lines.append(
            f"{phase:<10}{x['plain_median_s']:>9.3f}{x['gpu_median_s']:>9.3f}"
            f"{x['extra_median_ms']:>10.0f}{x['ratio_of_medians']:>8.3f}"
            f"{x['median_of_ratios']:>11.3f}{ci:>16}{x['ratio_of_minima']:>11.3f}  {aim}"
        )
    c = s.get("start_cpu")
    if c:
        lines += [
            "",
            "CPU to start (median ms; on a saturated machine, wall time follows CPU)",
            f"  in the server (start_kernel: provisioner)        plain {c['plain_server_cpu_ms']:>6.0f}"
            f"   GPU {c['gpu_server_cpu_ms']:>6.0f}",
            f"  in the kernel process, to its first reply        plain {c['plain_kernel_cpu_ms']:>6.0f}"
            f"   GPU {c['gpu_kernel_cpu_ms']:>6.0f}",
            f"  GPU/plain, server + kernel: {c['ratio']:.3f}",
        ]
    b = data.get("breakdown")
    if b:
        on_start = b["client_ms"] + b["acquire_ms"] + b["launcher_ms"] + b["extension_import_ms"]
        on_restart = b["repeat_acquire_ms"] + b["launcher_ms"] + b["extension_import_ms"]
        lines += [
            "",
            "Where the GPU kernel's extra time goes (medians in ms, each part measured alone)",
            f"  BrokerClient() construction (one per kernel)     {b['client_ms']:>7.1f}   start",
            f"  acquire, new connection                          {b['acquire_ms']:>7.1f}   start",
            f"  acquire again, same client (same lease back)     {b['repeat_acquire_ms']:>7.1f}   restart",
            f"    (the same two through the standard library's http.client: "
            f"{b['acquire_stdlib_ms']:.1f} and {b['repeat_stdlib_ms']:.1f} ms)",
            f"  release                                          {b['release_ms']:>7.1f}   shutdown",
            f"  launcher process overhead vs python -m           {b['launcher_ms']:>7.1f}   start, restart"
            f"  (python -m noop itself: {b['python_m_ms']:.0f} ms)",
            f"  %gpu extension import in the kernel              {b['extension_import_ms']:>7.1f}   start, restart",
            f"  start: measured extra {s['start']['extra_median_ms']:.0f} ms; parts add up to "
            f"{on_start:.0f} ms",
            f"  restart: measured extra {s['restart']['extra_median_ms']:.0f} ms; parts add up to "
            f"{on_restart:.0f} ms",
        ]
        if "launch" in s:
            # the server's part measured in place (short, so little noise) plus the
            # kernel-side parts measured alone: what the GPU path adds to a start
            own = s["launch"]["extra_paired_ms"] + b["launcher_ms"] + b["extension_import_ms"]
            est = 1 + own / (s["start"]["plain_median_s"] * 1e3)
            lines.append(
                f"  start, the GPU path's own cost: launch +{s['launch']['extra_paired_ms']:.1f} ms "
                f"(paired, in place) + launcher + %gpu import = {own:.1f} ms -> {est:.3f} of the "
                "plain start"
            )
    return "\n".join(lines)


async def measure(args: argparse.Namespace, broker: BrokerProcess, log: Any) -> dict[str, Any]:
    """The interleaved rounds, then the broker parts of the breakdown."""
    print("warm-up round (not counted)", flush=True)
    await one_kernel(PLAIN, log)
    await one_kernel(GPU, log)
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = [PLAIN, GPU] if i % 2 == 0 else [GPU, PLAIN]
        run: dict[str, Any] = {"order": order}
        for name in order:
            run[name] = await one_kernel(name, log)
        runs.append(run)
        print(
            f"  round {i + 1:>2}: start plain {run[PLAIN]['start']:.3f} gpu "
            f"{run[GPU]['start']:.3f}  restart plain {run[PLAIN]['restart']:.3f} gpu "
            f"{run[GPU]['restart']:.3f} s",
            flush=True,
        )
    data: dict[str, Any] = {"rounds": args.rounds, "runs": runs, "summary": summarize(runs)}
    print("breakdown:", flush=True)
    data["broker_parts_ms"] = await acquire_rtt(
        broker.url, os.environ["GPU_LEASE_TOKEN"], args.breakdown_n
    )
    return data


def isolate(tmp: Path) -> None:
    """This process's Jupyter paths under ``tmp``, with the two kernelspecs, and none of a
    hub's or node's environment (every kernel leases on the benchmark's broker alone)."""
    write_specs(tmp / "jupyter")
    os.environ["JUPYTER_PATH"] = str(tmp / "jupyter")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    os.environ["IPYTHONDIR"] = str(tmp / "ipython")
    for name in ("JUPYTERHUB_API_TOKEN", "GPU_LEASE_NODE", "GPU_LEASE_GPU_UUIDS"):
        os.environ.pop(name, None)


def run_all(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    isolate(tmp)
    db_url = f"sqlite:///{tmp / 'broker.sqlite'}"
    broker = BrokerProcess(tmp, db_url, {"u00": ([], False)}, gpus="1x81920:A100")
    broker.start(60.0)
    os.environ["GPU_LEASE_URL"] = broker.url
    os.environ["GPU_LEASE_TOKEN"] = next(iter(broker.tokens.values()))
    try:
        with open(tmp / "kernels.log", "wb") as log:
            data = asyncio.run(measure(args, broker, log))
        data["leases_left_active"] = broker.health()["active_leases"]
    finally:
        broker.stop()
    parts = data.pop("broker_parts_ms")
    launch = launcher_overhead(tmp, args.breakdown_n)
    data["breakdown"] = {
        "client_ms": parts["client"],
        "acquire_ms": parts["acquire"],
        "repeat_acquire_ms": parts["repeat"],
        "release_ms": parts["release"],
        "acquire_stdlib_ms": parts["acquire_stdlib"],
        "repeat_stdlib_ms": parts["repeat_stdlib"],
        "launcher_ms": launch["launcher"] * 1e3,
        "python_m_ms": launch["python_m"] * 1e3,
        "extension_import_ms": launch["extension_import"] * 1e3,
    }
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds instead of 30")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (30; quick 5)")
    ap.add_argument("--breakdown-n", type=int, default=15, help="repeats per breakdown part")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 30)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}, Python {platform.python_version()}",
        flush=True,
    )
    load0 = os.getloadavg()
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(ROOT / "provisioner")], check=True
    )
    with tempfile.TemporaryDirectory(prefix="gl-kstart-") as d:
        data = run_all(args, Path(d))
    data.update(
        date=time.strftime("%Y-%m-%d %H:%M %Z"),
        machine={
            "cpus": os.cpu_count(),
            "loadavg_at_start": load0,
            "loadavg_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    )
    print(report(data))
    if data["leases_left_active"]:
        print(f"note: {data['leases_left_active']} lease(s) still active after the runs")
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
