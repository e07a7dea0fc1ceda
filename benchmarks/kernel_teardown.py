"""Kernel shutdown through jupyter_server's kernel managers: GPULeaseProvisioner against
LocalProvisioner, in the same run.

    python benchmarks/kernel_teardown.py               # 8 interleaved rounds (~3 min on 2 cores)
    python benchmarks/kernel_teardown.py --rounds 20 --json out.json

What jupyter_server's ``DELETE /api/kernels/{id}`` does: ``await
kernel_manager.shutdown_kernel(kernel_id)``, inside the server's running event loop, with
either of its two managers:

``sync``   ``MappingKernelManager`` (deprecated, still the default of some deployments and
           of jupyter_server's own tests): each kernel's blocking ``KernelManager`` runs its
           calls on a runner loop, and a call inside it on a nested runner loop while the
           outer one waits (``jupyter_core.utils.run_sync``). The release of the lease
           used to wait 10 s there for the outer loop.
``async``  ``AsyncMappingKernelManager`` (jupyter_server's default).

Two kernelspecs in a temporary ``JUPYTER_PATH`` with the same argv: ``bench-plain``
(jupyter_client's ``LocalProvisioner``) and ``bench-gpu`` (``gpu-lease-provisioner``,
fraction 0.02), against a REAL broker subprocess (static tokens, ``--gpus 1x81920:A100``).
Each round, per manager: one kernel of each kind is started (alternating order, each
until its first ``kernel_info`` reply), then each is shut down (graceful) and timed, as
the kernel API does (``shutdown_kernel``); then one kernel of each kind again, each shut
down alone by ``shutdown_all()`` (as the server's exit does). Reported: median and maximum
seconds, and GPU / plain (ratio of medians); every lease must have been released at the
end (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from kernel_start import GPU, PLAIN, isolate  # noqa: E402

from provisioner.devtools.testing import BrokerProcess  # noqa: E402

MANAGERS = ("sync", "async")
#: how a kernel is shut down: the kernel API's DELETE, and the server's exit
WAYS = ("shutdown_kernel", "shutdown_all")


def manager(kind: str, root: Path) -> Any:
    """jupyter_server's kernel manager of ``kind``, as a server makes it."""
    from jupyter_server.services.kernels.kernelmanager import (
        AsyncMappingKernelManager,
        MappingKernelManager,
    )

    cls = MappingKernelManager if kind == "sync" else AsyncMappingKernelManager
    return cls(root_dir=str(root), connection_dir=os.environ["JUPYTER_RUNTIME_DIR"])


async def ready(mkm: Any, kernel_id: str, timeout: float = 120.0) -> None:
    """Until the kernel's first ``kernel_info`` reply (a started kernel, not a spawned one)."""
    kc = mkm.get_kernel(kernel_id).client()
    kc.start_channels()
    try:
        result = kc.wait_for_ready(timeout=timeout)
        if asyncio.iscoroutine(result):
            await result
    finally:
        kc.stop_channels()


async def shutdown_all(mkm: Any) -> None:
    """``shutdown_all()`` as the server's exit calls it: the synchronous manager's is a
    blocking call inside the running loop (its kernels' shutdowns run on a nested runner
    loop, the case that stalled 10 s per kernel), the async one's is awaited."""
    result = mkm.shutdown_all()
    if asyncio.iscoroutine(result):
        await result


async def rounds(kind: str, n: int, root: Path, log: Any) -> list[dict[str, dict[str, float]]]:
    """``n`` rounds on one manager of ``kind``: seconds of each way to shut a kernel down."""
    mkm = manager(kind, root)
    out: list[dict[str, dict[str, float]]] = []
    for i in range(n + 1):  # round 0 warms up (imports, the first connection)
        order = [PLAIN, GPU] if i % 2 == 0 else [GPU, PLAIN]
        took: dict[str, dict[str, float]] = {way: {} for way in WAYS}
        ids = {
            name: await mkm.start_kernel(kernel_name=name, stdout=log, stderr=log) for name in order
        }
        for kernel_id in ids.values():
            await ready(mkm, kernel_id)
        for name in order:  # DELETE /api/kernels/{id}
            t0 = time.perf_counter()
            await mkm.shutdown_kernel(ids[name])
            took["shutdown_kernel"][name] = time.perf_counter() - t0
        for name in order:  # the server's exit, one kernel left
            kernel_id = await mkm.start_kernel(kernel_name=name, stdout=log, stderr=log)
            await ready(mkm, kernel_id)
            t0 = time.perf_counter()
            await shutdown_all(mkm)
            took["shutdown_all"][name] = time.perf_counter() - t0
        if i:
            out.append(took)
            print(
                f"  {kind:>5} round {i:>2}: "
                + ", ".join(
                    f"{way} plain {x[PLAIN]:.3f} s, gpu {x[GPU]:.3f} s" for way, x in took.items()
                ),
                flush=True,
            )
    return out


def summarize(runs: list[dict[str, dict[str, float]]], way: str) -> dict[str, float]:
    plain = [r[way][PLAIN] for r in runs]
    gpu = [r[way][GPU] for r in runs]
    return {
        "plain_median_s": statistics.median(plain),
        "gpu_median_s": statistics.median(gpu),
        "plain_max_s": max(plain),
        "gpu_max_s": max(gpu),
        "ratio_of_medians": statistics.median(gpu) / statistics.median(plain),
    }


def report(data: dict[str, Any]) -> str:
    lines = [
        "",
        f"Kernel shutdown through jupyter_server's kernel managers, {data['rounds']} rounds "
        "(seconds)",
        f"{'manager':<8}{'call':<17}{'plain med':>10}{'GPU med':>10}{'plain max':>11}"
        f"{'GPU max':>10}{'GPU/plain':>11}",
    ]
    for kind, ways in data["summary"].items():
        for way, x in ways.items():
            lines.append(
                f"{kind:<8}{way:<17}{x['plain_median_s']:>10.3f}{x['gpu_median_s']:>10.3f}"
                f"{x['plain_max_s']:>11.3f}{x['gpu_max_s']:>10.3f}{x['ratio_of_medians']:>11.2f}"
            )
    lines.append(f"leases left active: {data['leases_left_active']}")
    return "\n".join(lines)


def run_all(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    isolate(tmp)
    (tmp / "runtime").mkdir()
    broker = BrokerProcess(
        tmp, f"sqlite:///{tmp / 'broker.sqlite'}", {"u00": ([], False)}, gpus="1x81920:A100"
    )
    broker.start(60.0)
    os.environ["GPU_LEASE_URL"] = broker.url
    os.environ["GPU_LEASE_TOKEN"] = next(iter(broker.tokens.values()))
    data: dict[str, Any] = {"rounds": args.rounds, "runs": {}, "summary": {}}
    try:
        with warnings.catch_warnings():
            # the synchronous MappingKernelManager is deprecated: measured all the same
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            with open(tmp / "kernels.log", "wb") as log:
                for kind in args.managers:
                    runs = asyncio.run(rounds(kind, args.rounds, tmp, log))
                    data["runs"][kind] = runs
                    data["summary"][kind] = {way: summarize(runs, way) for way in WAYS}
        data["leases_left_active"] = broker.health()["active_leases"]
    finally:
        broker.stop()
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per manager (8)")
    ap.add_argument(
        "--managers", nargs="+", choices=MANAGERS, default=list(MANAGERS), help="sync, async"
    )
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}, Python {platform.python_version()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gpu-lease-teardown-") as tmp:
        data = run_all(args, Path(tmp))
    data["load_average_after"] = os.getloadavg()[0]
    print(report(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    return 0 if data["leases_left_active"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
