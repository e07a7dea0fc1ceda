"""``gpu-lease doctor``: an admin's self-test on a GPU node, before students use it.

Each check ends ``ok``, ``failed``, ``missing`` (an optional part is absent: worth
knowing, not an error) or ``not run`` (with why). The exit status says which:

* 0: every check ran and none failed;
* 1: a check failed (NVML is installed and finds the driver, but a call went wrong);
* 3: some checks could not run here (no NVIDIA GPU or driver, or not implemented yet).

What it checks: NVML (nvidia-ml-py) and the driver version; each GPU with its memory;
the MPS control daemon (``nvidia-cuda-mps-control``) for ``enforcement=mps``; whether the
driver sets memory limits per kernel cgroup (``driver_limits``: R615+, cgroup v2); which
frameworks are installed (PyTorch, TensorFlow, JAX, CuPy). Then, on GPU 0, for each
installed framework that sees the GPU, ``--processes`` capped processes at once
(:mod:`provisioner.node.probe`, started the way a kernel is, under the launcher with a lease's
environment and a cap of ``--cap-mb``):

* ``context_overhead``: the GPU memory NVML shows for each framework's process right after
  it created its CUDA context; failed when one exceeds ``--context-overhead-mb`` (the
  broker's ``context_overhead_mb``, whose default is 512), since each lease reserves only
  that much beside its cap;
* ``cap_escape``: each process asks for one block of its cap plus a margin and then for
  chunks; failed unless every framework refused both, held no more than its cap, and NVML
  showed no more than the cap plus the context.

* ``checkpoint``: whether this node can *park* idle kernels: the driver's
  process checkpoint API through ``libcuda.so.1`` (:mod:`provisioner.node.checkpoint`);
  where it is offered, one more capped probe holds its cap and is parked and resumed: its
  GPU memory must leave the GPU and come back, and the check reports the GiB/s each way.
  ``missing`` where the driver lacks it (older than 570, not x86-64, no driver): idle
  kernels there are reclaimed as before.

A framework that sees no GPU (a CPU build) is ``not run`` with why, never a pass.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from ..inventory import (
    NVML_MODULE,
    InventoryError,
    _error_types,
    _nvml_module,
    _nvml_reason,
    _text,
    running_processes,
)
from ..wire import DEFAULT_CONTEXT_OVERHEAD_MB
from . import cgroups, driver_limits
from .checkpoint import CheckpointFailed, CheckpointUnavailable, CudaCheckpoint, support
from .mps import MPS_CONTROL

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NOT_RUN = 3

#: frameworks whose memory caps the kernel sets (kernel/env.py), by import name
FRAMEWORKS = {"torch": "PyTorch", "tensorflow": "TensorFlow", "jax": "JAX", "cupy": "CuPy"}
#: the probes' cap when --cap-mb is not given: 1 GiB, or an eighth of a smaller GPU
DEFAULT_CAP_MB = 1024
#: NVML may show this much above the cap plus the context (allocator rounding) and still pass
SLACK_MB = 64
#: seconds a probe may take for one step (an import of TensorFlow or JAX, a CUDA context)
PROBE_STEP_TIMEOUT = 180.0


@dataclass
class Check:
    name: str
    status: str  # ok | failed | missing | not run
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def check_nvml(nvml: ModuleType | Any = NVML_MODULE) -> Check:
    """NVML, the driver version and every GPU (name, memory), or why not."""
    try:
        nvml = _nvml_module(nvml)
    except ImportError:
        return Check("nvml", "not run", "nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    errors = _error_types(nvml)
    try:
        nvml.nvmlInit()
    except errors as exc:
        return Check("nvml", "not run", f"no NVIDIA driver here: {_nvml_reason(nvml, exc)}")
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                {
                    "index": i,
                    "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                    "name": _text(nvml.nvmlDeviceGetName(handle)),
                    "memory_mb": int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20,
                }
            )
    except errors as exc:
        return Check("nvml", "failed", f"NVML call failed: {_nvml_reason(nvml, exc)}")
    finally:
        try:
            nvml.nvmlShutdown()
        except errors:
            pass
    data = {"driver": driver, "gpus": gpus}
    if not gpus:
        return Check("nvml", "not run", f"driver {driver} reports 0 GPUs", data)
    return Check("nvml", "ok", f"driver {driver}, {len(gpus)} GPU(s)", data)


def check_mps(which: Callable[[str], str | None] = shutil.which) -> Check:
    path = which(MPS_CONTROL)
    if path is None:
        return Check(
            "mps",
            "missing",
            f"{MPS_CONTROL} is not on PATH: enforcement=mps is not available on this node",
        )
    return Check("mps", "ok", f"{MPS_CONTROL} at {path}", {"path": path})


def check_driver_limits(
    nvml: ModuleType | Any = NVML_MODULE, mountinfo: str = "/proc/self/mountinfo"
) -> Check:
    """Whether this node's driver caps a kernel's cgroup (``nvmlDeviceSetMemoryLimits_v1``,
    R615+) and where cgroup v2 is: ``ok``, or ``missing`` with why (driver 580 has no such
    function: that is said, not failed)."""
    nvml = _nvml_module(nvml)
    errors = _error_types(nvml)
    mount = cgroups.v2_mount(mountinfo)
    data: dict[str, Any] = {"cgroup_v2": mount}
    try:
        nvml.nvmlInit()
    except errors as exc:
        return Check(
            "driver_limits", "not run", f"no NVIDIA driver here: {_nvml_reason(nvml, exc)}"
        )
    try:
        offered, why = driver_limits.offered(nvml)
    finally:
        try:
            nvml.nvmlShutdown()
        except errors:
            pass
    data["offered"] = offered
    if not offered:
        return Check("driver_limits", "missing", why, data)
    if mount is None:
        return Check(
            "driver_limits",
            "missing",
            f"{why}, but no cgroup v2 hierarchy is mounted, so kernels get no cgroup to cap",
            data,
        )
    return Check("driver_limits", "ok", f"{why} (cgroup v2 at {mount})", data)


def check_frameworks(
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
) -> list[Check]:
    checks = []
    for module, label in FRAMEWORKS.items():
        found = find_spec(module) is not None
        checks.append(
            Check(
                f"framework:{module}",
                "ok" if found else "missing",
                f"{label} is installed" if found else f"{label} is not installed",
            )
        )
    return checks


class _ProbeProcess:
    """One ``provisioner.node.probe`` subprocess, capped like a kernel; its JSON lines in a queue."""

    def __init__(self, framework: str, gpu: dict[str, Any], cap: int, overhead: int) -> None:
        from ..client.answers import GrantedLease
        from ..kernel.env import kernel_argv, lease_environment

        self.framework = framework
        self.cap = cap
        lease = GrantedLease.from_json(
            {
                "id": f"doctor-{framework}",
                "fraction": min(1.0, (cap + overhead) / gpu["memory_mb"]),
                "memory_limit_mb": cap,
                "gpu": {"uuid": gpu["uuid"], "name": gpu["name"], "memory_mb": gpu["memory_mb"]},
            }
        )
        env = dict(os.environ)
        env.update(lease_environment(lease, base_env=os.environ))
        # the probe imports this package: the same one, wherever it was imported from
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        argv = kernel_argv([sys.executable, "-m", "provisioner.node.probe", framework]).argv
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def event(self, timeout: float = PROBE_STEP_TIMEOUT) -> dict[str, Any]:
        """The next JSON event, or an error event (the process ended, timed out, spoke garbage)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.0, left))
            except queue.Empty:
                return {"event": "error", "error": f"no answer in {timeout:g} s"}
            if line is None:
                tail = "".join(self.stderr[-5:]).strip()[-500:]
                return {"event": "error", "error": f"exited ({self.proc.wait()}): {tail}"}
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a framework's own print on stdout
            if isinstance(event, dict) and "event" in event:
                return event

    def step(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        self.step()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _used_mb(nvml: Any, pids: list[int]) -> dict[int, int]:
    """NVML's memory of each pid (summed over GPUs); pids it does not list are absent."""
    out: dict[int, int] = {}
    for pid, _uuid, mb in running_processes(nvml):
        if pid in pids:
            out[pid] = out.get(pid, 0) + mb
    return out


def check_caps(
    gpu: dict[str, Any],
    frameworks: list[str],
    processes: int,
    cap_mb: int | None = None,
    context_overhead_mb: int = DEFAULT_CONTEXT_OVERHEAD_MB,
    nvml: ModuleType | Any = NVML_MODULE,
) -> tuple[Check, Check]:
    """``context_overhead`` and ``cap_escape`` on ``gpu`` (NVML's record of GPU 0)."""
    cap = cap_mb or min(DEFAULT_CAP_MB, gpu["memory_mb"] // 8)
    what = f"{processes} capped processes allocating past a {cap} MiB cap"
    if not frameworks:
        why = "no framework installed (PyTorch, TensorFlow, JAX, CuPy)"
        return (
            Check("context_overhead", "not run", f"CUDA context overhead: {why}"),
            Check("cap_escape", "not run", f"{what}: {why}", {"processes": processes}),
        )
    nvml = _nvml_module(nvml)
    nvml.nvmlInit()
    probes: list[_ProbeProcess] = []
    try:
        for i in range(processes):
            fw = frameworks[i % len(frameworks)]
            probes.append(_ProbeProcess(fw, gpu, cap, context_overhead_mb))
        ready = [p.event() for p in probes]
        live = [p for p, e in zip(probes, ready, strict=True) if e["event"] == "ready"]
        context = _used_mb(nvml, [p.proc.pid for p in live])
        for p in live:
            p.step()
        holding = {id(p): p.event() for p in live}
        peak = _used_mb(nvml, [p.proc.pid for p in live])
    finally:
        for p in probes:
            p.close()
        try:
            nvml.nvmlShutdown()
        except _error_types(nvml):
            pass
    return _verdicts(probes, ready, holding, context, peak, cap, context_overhead_mb, what)


def _verdicts(
    probes: list[_ProbeProcess],
    ready: list[dict[str, Any]],
    holding: dict[int, dict[str, Any]],
    context: dict[int, int],
    peak: dict[int, int],
    cap: int,
    overhead: int,
    what: str,
) -> tuple[Check, Check]:
    rows: list[dict[str, Any]] = []
    for p, r in zip(probes, ready, strict=True):
        pid = p.proc.pid
        row: dict[str, Any] = {"framework": p.framework, "pid": pid}
        if r["event"] != "ready":
            row.update(status="not run" if r.get("no_gpu") else "failed", error=r.get("error"))
            rows.append(row)
            continue
        row.update(version=r.get("version"), cap_report=r.get("cap_report"))
        reserved = (r.get("warm") or {}).get("reserved_mb") or 0
        used = context.get(pid)
        # NVML shows the context and the libraries plus what the allocator holds (the cap's)
        row.update(context_mb=None if used is None else max(0, used - reserved))
        row.update(nvml_ready_mb=used, reserved_mb=reserved, peak_mb=peak.get(pid))
        h = holding.get(id(p), {})
        if h.get("event") != "holding":
            row.update(status="failed", error=h.get("error", "no answer"))
            rows.append(row)
            continue
        row.update(block=h.get("block"), chunks=h.get("chunks"))
        ctx = row["context_mb"] or 0
        nvml_ok = peak.get(pid) is None or (peak.get(pid) or 0) <= cap + ctx + SLACK_MB
        row["status"] = "ok" if h.get("held") and nvml_ok else "failed"
        rows.append(row)

    measured: dict[str, int] = {}
    for row in rows:
        if row.get("context_mb"):
            fw = row["framework"]
            measured[fw] = max(measured.get(fw, 0), row["context_mb"])
    ran = [r for r in rows if r["status"] != "not run"]
    if measured:
        worst = max(measured, key=lambda fw: measured[fw])
        text = ", ".join(f"{fw} {mb} MiB" for fw, mb in sorted(measured.items()))
        over = measured[worst] > overhead
        context_check = Check(
            "context_overhead",
            "failed" if over else "ok",
            f"CUDA context by NVML: {text}"
            + (
                f"; {worst} needs more than the {overhead} MiB a lease reserves for it: set "
                f"the broker's context_overhead_mb to at least {measured[worst]}"
                if over
                else f" (within the {overhead} MiB a lease reserves)"
            ),
            {"context_mb": measured, "context_overhead_mb": overhead},
        )
    elif any("context_mb" in r for r in rows):
        context_check = Check(
            "context_overhead",
            "not run",
            "CUDA context overhead: NVML lists no memory for these processes on this node "
            "(the driver does not report per-process memory here)",
        )
    else:
        why = "; ".join(sorted({str(r.get("error")) for r in rows}))
        context_check = Check("context_overhead", "not run", f"CUDA context overhead: {why}")
    data = {"processes": len(probes), "cap_mb": cap, "results": rows}
    failed = [r for r in rows if r["status"] == "failed"]
    skipped = [r for r in rows if r["status"] == "not run"]
    if failed:
        not_held = sorted({r["framework"] for r in failed if "error" not in r})
        broken = sorted({f"{r['framework']} ({r['error']})" for r in failed if "error" in r})
        parts = ([f"not held by {', '.join(not_held)}"] if not_held else []) + (
            [f"could not run: {'; '.join(broken)}"] if broken else []
        )
        status, detail = "failed", f"{what}: {'; '.join(parts)}"
    elif skipped and not ran:
        why = "; ".join(sorted({str(r.get("error")) for r in skipped}))
        status, detail = "not run", f"{what}: {why}"
    else:
        names = ", ".join(sorted({r["framework"] for r in ran}))
        status, detail = "ok", f"{what}: held by {names}"
        if skipped:
            detail += "; not run: " + "; ".join(sorted({str(r.get("error")) for r in skipped}))
    return context_check, Check("cap_escape", status, detail, data)


def run_checks(
    processes: int = 4,
    nvml: ModuleType | Any = NVML_MODULE,
    which: Callable[[str], str | None] = shutil.which,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
    cap_mb: int | None = None,
    context_overhead_mb: int = DEFAULT_CONTEXT_OVERHEAD_MB,
) -> list[Check]:
    nvml_check = check_nvml(nvml)
    frameworks = check_frameworks(find_spec)
    checks = [nvml_check, check_mps(which), *frameworks]
    if nvml_check.status != "ok":
        why = "no GPU here"
        checks.insert(2, Check("driver_limits", "not run", f"driver memory limits: {why}"))
        checks.append(Check("context_overhead", "not run", f"CUDA context overhead: {why}"))
        checks.append(
            Check(
                "cap_escape",
                "not run",
                f"{processes} capped processes allocating past their caps: {why}",
                {"processes": processes},
            )
        )
        checks.append(check_checkpoint(None, []))
        return checks
    checks.insert(2, check_driver_limits(nvml))
    installed = [c.name.split(":", 1)[1] for c in frameworks if c.status == "ok"]
    errors: tuple[type[BaseException], ...] = (InventoryError, *_error_types(_nvml_module(nvml)))
    try:
        checks.extend(
            check_caps(
                nvml_check.data["gpus"][0], installed, processes, cap_mb, context_overhead_mb, nvml
            )
        )
    except errors as exc:
        checks.append(Check("cap_escape", "failed", f"the cap checks failed: {exc}"))
    try:
        checks.append(
            check_checkpoint(
                nvml_check.data["gpus"][0], installed, cap_mb, context_overhead_mb, nvml
            )
        )
    except errors as exc:
        checks.append(Check("checkpoint", "failed", f"the checkpoint check failed: {exc}"))
    return checks


def check_checkpoint(
    gpu: dict[str, Any] | None,
    frameworks: list[str],
    cap_mb: int | None = None,
    context_overhead_mb: int = DEFAULT_CONTEXT_OVERHEAD_MB,
    nvml: ModuleType | Any = NVML_MODULE,
) -> Check:
    """Can this node park kernels? The driver's answer, then one probe parked and resumed."""
    verdict = support()
    if not verdict.works:
        return Check("checkpoint", "missing", f"parking idle kernels: {verdict.reason}")
    what = f"parking idle kernels ({verdict.reason}, CUDA API {verdict.driver_api})"
    if gpu is None:
        return Check("checkpoint", "not run", f"{what}: no GPU here")
    if not frameworks:
        return Check("checkpoint", "not run", f"{what}: no framework to hold GPU memory")
    cap = cap_mb or min(DEFAULT_CAP_MB, gpu["memory_mb"] // 8)
    nvml = _nvml_module(nvml)
    nvml.nvmlInit()
    data: dict[str, Any] = {"driver_api": verdict.driver_api}
    probe: _ProbeProcess | None = None
    try:
        for framework in frameworks:  # the first one that sees the GPU holds the memory
            candidate = _ProbeProcess(framework, gpu, cap, context_overhead_mb)
            ready = candidate.event()
            if ready["event"] == "ready":
                probe = candidate
                break
            candidate.close()
            if not ready.get("no_gpu"):
                return Check(
                    "checkpoint",
                    "failed",
                    f"{what}: the {framework} probe failed: {ready.get('error')}",
                )
        if probe is None:
            return Check("checkpoint", "not run", f"{what}: no installed framework sees the GPU")
        data["framework"] = probe.framework
        probe.step()
        probe.event()  # holding its cap
        pid = probe.proc.pid
        data["before_mb"] = _used_mb(nvml, [pid]).get(pid, 0)
        handle = CudaCheckpoint()
        park_s = handle.park(pid)
        data["park_s"] = round(park_s, 4)
        data["parked_mb"] = _used_mb(nvml, [pid]).get(pid, 0)
        resume_s = handle.resume(pid)
        data["resume_s"] = round(resume_s, 4)
        data["after_mb"] = _used_mb(nvml, [pid]).get(pid, 0)
    except (CheckpointFailed, CheckpointUnavailable) as exc:
        return Check("checkpoint", "failed", f"{what}: {exc}", data)
    finally:
        if probe is not None:
            probe.close()
        try:
            nvml.nvmlShutdown()
        except _error_types(nvml):
            pass
    gib = data["before_mb"] / 1024
    # measured rates: what a park and a resume of a kernel of N GiB take here (a tiny
    # time cannot divide by zero)
    data["park_gib_per_s"] = round(gib / max(park_s, 1e-6), 2)
    data["resume_gib_per_s"] = round(gib / max(resume_s, 1e-6), 2)
    freed = data["parked_mb"] <= data["before_mb"] // 10
    back = data["after_mb"] >= data["before_mb"] - SLACK_MB
    detail = (
        f"parked and resumed a {data['framework']} process holding {data['before_mb']} MiB: "
        f"out in {data['park_s']} s ({data['park_gib_per_s']} GiB/s, {data['parked_mb']} MiB "
        f"left on the GPU), back in {data['resume_s']} s ({data['resume_gib_per_s']} GiB/s, "
        f"{data['after_mb']} MiB)"
    )
    return Check("checkpoint", "ok" if freed and back else "failed", detail, data)


def exit_status(checks: list[Check]) -> int:
    if any(c.status == "failed" for c in checks):
        return EXIT_FAILED
    if any(c.status == "not run" for c in checks):
        return EXIT_NOT_RUN
    return EXIT_OK


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{c.name:<{width}}  {c.status:<8}  {c.detail}" for c in checks]
    for c in checks:
        for gpu in c.data.get("gpus", []):
            lines.append(
                f"{'':<{width}}  {'':<8}  GPU {gpu['index']}: {gpu['name']}, "
                f"{gpu['memory_mb']} MiB, {gpu['uuid']}"
            )
    not_run = [c.name for c in checks if c.status == "not run"]
    if not_run:
        lines.append(f"not run here: {', '.join(not_run)} (exit status {EXIT_NOT_RUN})")
    return "\n".join(lines)


def main(
    as_json: bool = False,
    processes: int = 4,
    cap_mb: int | None = None,
    context_overhead_mb: int = DEFAULT_CONTEXT_OVERHEAD_MB,
    context_overhead_source: str = "the broker's default",
) -> int:
    checks = run_checks(processes, cap_mb=cap_mb, context_overhead_mb=context_overhead_mb)
    for check in checks:
        if check.name == "context_overhead" and "context_overhead_mb" in check.data:
            check.detail += f" [{context_overhead_mb} MiB: {context_overhead_source}]"
            check.data["context_overhead_source"] = context_overhead_source
    if as_json:
        print(json.dumps({"checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(report(checks))
    return exit_status(checks)
