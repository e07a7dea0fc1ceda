"""``gpu-lease doctor``: an admin's self-test on a GPU node, before students use it.

Each check ends ``ok``, ``failed``, ``missing`` (an optional part is absent: worth
knowing, not an error) or ``not run`` (with why). The exit status says which:

* 0: every check ran and none failed;
* 1: a check failed (NVML is installed and finds the driver, but a call went wrong);
* 3: some checks could not run here (no NVIDIA GPU or driver, or not implemented yet).

What it checks today: NVML (nvidia-ml-py) and the driver version; each GPU with its
memory; the MPS control daemon (``nvidia-cuda-mps-control``) for ``enforcement=mps``;
which frameworks are installed (PyTorch, TensorFlow, JAX, CuPy; found, not imported).
Not yet: measuring each framework's CUDA context overhead by NVML and running capped
processes that try to allocate past their caps. Those need a GPU; until they are
written and validated on one, doctor lists them as ``not run`` and never guesses.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from .inventory import NVML_MODULE, _error_types, _nvml_module, _nvml_reason, _text
from .mps import MPS_CONTROL

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NOT_RUN = 3

#: frameworks whose memory caps the kernel sets (kernel/env.py), by import name
FRAMEWORKS = {"torch": "PyTorch", "tensorflow": "TensorFlow", "jax": "JAX", "cupy": "CuPy"}


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


def run_checks(
    processes: int = 4,
    nvml: ModuleType | Any = NVML_MODULE,
    which: Callable[[str], str | None] = shutil.which,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
) -> list[Check]:
    nvml_check = check_nvml(nvml)
    checks = [nvml_check, check_mps(which), *check_frameworks(find_spec)]
    why = (
        "no GPU here"
        if nvml_check.status != "ok"
        else "not implemented yet (needs validation on a GPU node)"
    )
    checks.append(Check("context_overhead", "not run", f"CUDA context overhead: {why}"))
    checks.append(
        Check(
            "cap_escape",
            "not run",
            f"{processes} capped processes allocating past their caps: {why}",
            {"processes": processes},
        )
    )
    return checks


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


def main(as_json: bool = False, processes: int = 4) -> int:
    checks = run_checks(processes)
    if as_json:
        print(json.dumps({"checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(report(checks))
    return exit_status(checks)
