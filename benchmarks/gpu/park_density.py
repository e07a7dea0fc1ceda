"""Parking's checks on a real GPU: parking a kernel's GPU memory, and density at 0.02.

Driven by ``gpu_checks.py --steps park density`` (one device call); each returns a JSON
record for ``benchmarks/gpu/README.md``:

- :func:`park_check`: a PyTorch kernel holds ``gib`` GiB (a seeded tensor and its checksum);
  the node's checkpoint handle (:class:`provisioner.node.checkpoint.CudaCheckpoint`, the one
  the agent uses) locks and checkpoints the kernel's process; NVML must show its memory
  freed, and another process then allocates more than was free before the park; after a
  resume the kernel's checksum must be equal. Park and resume times are divided into the
  size and compared with the host<->device copy bandwidth measured in the same kernel
  (pinned memory, best of three): the aim is >= 0.5 of it.
- :func:`density_check`: as many kernels at ``fraction`` as the GPU's leases allow (50 at
  0.02), each training the same small CNN on the same synthetic batch, all starting at one
  instant for ``seconds``; their summed steps/s over one exclusive process's (a kernel at
  1.0 alone, same code), with and without MPS; each kernel's peak memory against its cap,
  any allocation failure, and every lease released at the end.

``device="cpu"`` runs the same code paths with no GPU (the stand-in NVML and libcuda):
``tests/test_gpu_checks.py`` uses it so the script cannot rot between device runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from typing import Any

from provisioner.node.checkpoint import CudaCheckpoint

PARK_SETUP = """
import json, os, time, torch
_dev = {device!r}
_g = torch.Generator(device=_dev).manual_seed(28)
_x = torch.randn({gib} * 2**28, device=_dev, generator=_g)
_sum = float(_x.double().sum())
_bw = {{"h2d": None, "d2h": None}}
if _dev == "cuda":
    torch.cuda.synchronize()
    _h = torch.empty(2**28, dtype=torch.float32, pin_memory=True)
    _d = torch.empty(2**28, dtype=torch.float32, device="cuda")
    for _name, _dst, _src in (("h2d", _d, _h), ("d2h", _h, _d)):
        _best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            _t = time.perf_counter()
            _dst.copy_(_src, non_blocking=True)
            torch.cuda.synchronize()
            _best = max(_best, 1.0 / (time.perf_counter() - _t))
        _bw[_name] = round(_best, 2)
    del _h, _d
    torch.cuda.empty_cache()
print(json.dumps({{"checksum": _sum, "gib_per_s": _bw, "pid": os.getpid()}}))
"""

PARK_CHECK = """
_again = float(_x.double().sum())
print(json.dumps({"checksum": _again, "equal": _again == _sum}))
"""

OTHER_ALLOCATES = """
import sys, torch
x = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("allocated", sys.argv[1])
"""


def park_fraction(gib: int, memory_mb: int, overhead_mb: int) -> float:
    """The smallest fraction (in hundredths) whose cap holds ``gib`` GiB plus 1 GiB of room."""
    need = gib * 1024 + 1024 + overhead_mb
    return min(1.0, math.ceil(100 * need / memory_mb) / 100)


async def park_check(
    g: Any, kernels: Any, gib: int, *, device: str = "cuda", memory_mb: int, overhead_mb: int
) -> dict[str, Any]:
    """Park and resume one PyTorch kernel holding ``gib`` GiB (see the module docstring).

    ``g`` is the ``gpu_checks`` module (its kernels, NVML and execute helpers)."""
    kernel_pid, last_json, lease_of, run = g.kernel_pid, g.last_json, g.lease_of, g.run
    nvml_free_mb, nvml_used = g.nvml_free_mb, g.nvml_used

    rec: dict[str, Any] = {"gib": gib, "device": device}
    fraction = park_fraction(gib, memory_mb, overhead_mb)
    rec["fraction"] = fraction
    km = await kernels.start(kernels.spec(fraction))
    try:
        pid = kernel_pid(km)
        rec["lease"] = {
            k: v
            for k, v in lease_of(kernels.site, km.kernel_id).items()
            if k in ("id", "memory_limit_mb")
        }
        out, reply = await run(km, PARK_SETUP.format(device=device, gib=gib), timeout=600)
        if reply["status"] != "ok":
            rec["setup_error"] = out[-2000:]
            return rec
        setup = last_json(out)
        rec["bandwidth_gib_per_s"] = setup["gib_per_s"]
        rec["nvml_before_mb"] = nvml_used(pid)
        rec["free_before_mb"] = nvml_free_mb()
        handle = CudaCheckpoint()
        rec["driver_api"] = handle.driver_api
        park_s = handle.park(pid)
        rec["park_s"] = round(park_s, 3)
        rec["park_gib_per_s"] = round(gib / park_s, 2) if park_s > 0 else None
        rec["state_parked"] = handle.state(pid).name
        await asyncio.sleep(0.5)
        rec["nvml_parked_mb"] = nvml_used(pid)
        rec["free_parked_mb"] = nvml_free_mb()
        if device == "cuda" and rec["free_parked_mb"] is not None:
            # more than was free before the park: only the parked kernel's memory makes room
            ask = int(rec["free_parked_mb"]) - 1024
            rec["other_asked_mb"] = ask
            rec["other_asked_more_than_free_before"] = ask > int(rec["free_before_mb"] or 0)
            done = subprocess.run(  # noqa: ASYNC221 (the kernel is parked; nothing else runs)
                [sys.executable, "-c", OTHER_ALLOCATES, str(ask)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            rec["other_allocated"] = done.returncode == 0 and "allocated" in done.stdout
            rec["other_error"] = done.stderr[-800:] if done.returncode else None
        resume_s = handle.resume(pid)
        rec["resume_s"] = round(resume_s, 3)
        rec["resume_gib_per_s"] = round(gib / resume_s, 2) if resume_s > 0 else None
        rec["state_resumed"] = handle.state(pid).name
        out, reply = await run(km, PARK_CHECK, timeout=600)
        check = last_json(out) if reply["status"] == "ok" else {"error": out[-2000:]}
        rec["checksum_equal"] = bool(check.get("equal"))
        rec["nvml_resumed_mb"] = nvml_used(pid)
        d2h = (setup["gib_per_s"] or {}).get("d2h")
        h2d = (setup["gib_per_s"] or {}).get("h2d")
        if d2h and rec["park_gib_per_s"]:
            rec["park_ratio_to_d2h"] = round(rec["park_gib_per_s"] / d2h, 2)
        if h2d and rec["resume_gib_per_s"]:
            rec["resume_ratio_to_h2d"] = round(rec["resume_gib_per_s"] / h2d, 2)
    finally:
        await km.shutdown_kernel(now=True)
    return rec


CNN_SETUP = """
import json, os, time, torch, torch.nn as nn
torch.manual_seed(0)
_dev = {device!r}
_model = nn.Sequential(
    nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, 10),
).to(_dev)
_opt = torch.optim.SGD(_model.parameters(), lr=0.01)
_xb = torch.randn(64, 1, 28, 28, device=_dev)
_yb = torch.randint(0, 10, (64,), device=_dev)

def _train(seconds, start_at=0.0):
    while time.time() < start_at:
        time.sleep(0.005)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _opt.zero_grad()
        nn.functional.cross_entropy(_model(_xb), _yb).backward()
        _opt.step()
        steps += 1
    if _dev == "cuda":
        torch.cuda.synchronize()
    return steps, time.perf_counter() - t0

_train(1.0)
print(json.dumps({{"warm": True}}))
"""

CNN_RUN = """
_out = {{"error": None}}
try:
    _steps, _secs = _train({seconds}, {start_at})
    _out.update(steps=_steps, seconds=_secs)
except Exception as exc:
    _out["error"] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:300]
if _dev == "cuda":
    _out["peak_mb"] = torch.cuda.max_memory_reserved() // 2**20
_out["cap_mb"] = int(os.environ.get("GPU_LEASE_MEMORY_MB", 0))
print(json.dumps(_out))
"""


async def _train_all(g: Any, kms: list[Any], seconds: float) -> list[dict[str, Any]]:
    last_json, run = g.last_json, g.run

    start_at = time.time() + 3.0 + 0.05 * len(kms)
    code = CNN_RUN.format(seconds=seconds, start_at=start_at)
    outs = await asyncio.gather(*(run(km, code, timeout=seconds + 120) for km in kms))
    return [
        last_json(out) if reply["status"] == "ok" else {"error": out[-500:]} for out, reply in outs
    ]


async def density_check(
    g: Any,
    kernels: Any,
    *,
    fraction: float,
    n: int,
    seconds: float,
    device: str = "cuda",
    enforcement: str = "cooperative",
) -> dict[str, Any]:
    """``n`` kernels at ``fraction`` training at once against one exclusive kernel
    (``g``: the ``gpu_checks`` module)."""
    run = g.run

    rec: dict[str, Any] = {
        "fraction": fraction,
        "asked": n,
        "seconds": seconds,
        "enforcement": enforcement,
    }
    setup = CNN_SETUP.format(device=device)
    solo = await kernels.start(kernels.spec(1.0, enforcement))
    try:
        out, reply = await run(solo, setup, timeout=300)
        if reply["status"] != "ok":
            rec["solo_error"] = out[-2000:]
            return rec
        (one,) = await _train_all(g, [solo], seconds)
        rec["exclusive"] = one
        rec["exclusive_steps_per_s"] = (
            round(one["steps"] / one["seconds"], 1) if one.get("steps") else None
        )
    finally:
        await solo.shutdown_kernel(now=True)

    spec = kernels.spec(fraction, enforcement, queue_timeout=5)
    kms: list[Any] = []
    rec["start_errors"] = []
    t0 = time.monotonic()
    for batch in range(0, n, 8):
        started = await asyncio.gather(
            *(kernels.start(spec) for _ in range(min(8, n - batch))), return_exceptions=True
        )
        for km in started:
            if isinstance(km, BaseException):
                rec["start_errors"].append(f"{type(km).__name__}: {str(km)[:200]}")
            else:
                kms.append(km)
    rec["started"] = len(kms)
    rec["start_s"] = round(time.monotonic() - t0, 1)
    try:
        warm = await asyncio.gather(*(run(km, setup, timeout=600) for km in kms))
        rec["warm_errors"] = [out[-300:] for out, reply in warm if reply["status"] != "ok"]
        runs = await _train_all(g, kms, seconds)
        rec["runs"] = runs
        rate = sum(r["steps"] / r["seconds"] for r in runs if r.get("steps"))
        rec["aggregate_steps_per_s"] = round(rate, 1)
        if rec.get("exclusive_steps_per_s"):
            rec["aggregate_over_exclusive"] = round(rate / rec["exclusive_steps_per_s"], 3)
        rec["allocation_failures"] = [r["error"] for r in runs if r.get("error")]
        rec["over_cap"] = [
            r
            for r in runs
            if r.get("peak_mb") is not None and r["cap_mb"] and r["peak_mb"] > r["cap_mb"]
        ]
    finally:
        await asyncio.gather(*(km.shutdown_kernel(now=True) for km in kms), return_exceptions=True)
    await asyncio.sleep(1.0)
    active = [x for x in kernels.site.get("/leases?all=1")["leases"] if x["state"] == "active"]
    rec["active_leases_after"] = len(active)
    return rec


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The park and density lines of ``gpu_checks.txt``."""
    lines = []
    for r in results.get("park", {}).get("runs", []):
        lines.append(
            f"- park {r.get('gib')} GiB: park {r.get('park_s')} s ({r.get('park_gib_per_s')} GiB/s,"
            f" {r.get('park_ratio_to_d2h')} of d2h {(r.get('bandwidth_gib_per_s') or {}).get('d2h')}),"
            f" resume {r.get('resume_s')} s ({r.get('resume_ratio_to_h2d')} of h2d), freed"
            f" {r.get('nvml_before_mb')} -> {r.get('nvml_parked_mb')} MiB, other allocated"
            f" {r.get('other_allocated')} ({r.get('other_asked_mb')} MiB), checksum equal"
            f" {r.get('checksum_equal')}" + (f" ERROR {r.get('error')}" if r.get("error") else "")
        )
    for key in ("density", "density_mps"):
        d = results.get(key)
        if d:
            lines.append(
                f"- {key}: {d.get('started')}/{d.get('asked')} kernels at {d.get('fraction')},"
                f" aggregate {d.get('aggregate_steps_per_s')} steps/s = {d.get('aggregate_over_exclusive')}"
                f" of one exclusive ({d.get('exclusive_steps_per_s')}), failures"
                f" {len(d.get('allocation_failures') or [])}, over cap {len(d.get('over_cap') or [])},"
                f" leases left {d.get('active_leases_after')}"
            )
    return lines


def dumps(rec: dict[str, Any]) -> str:
    return json.dumps(rec, indent=1, default=str)
