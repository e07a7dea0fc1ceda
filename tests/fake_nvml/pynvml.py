"""A stand-in for nvidia-ml-py's ``pynvml`` (a foreign library NVML cannot back here).

Put this directory first on a subprocess's ``PYTHONPATH``; the GPUs and processes come
from the JSON file named by ``FAKE_NVML_FILE``, read again at every call so a test can
change them while the agent runs::

    {"gpus": [{"uuid": "GPU-1", "name": "T4", "memory_mb": 16384}],
     "processes": {"GPU-1": [{"pid": 1234, "used_mb": 900}]}}

With the stand-in libcuda beside it (``STANDIN_LIBCUDA_DIR``, tests/standin_libcuda), a
process that the driver holds CHECKPOINTED has its GPU memory in host RAM, so NVML lists it
with 0 MiB on the GPU, as the real driver does after ``cuCheckpointProcessCheckpoint``.

A driver of 615 or later (the state's ``"driver"``; ``"memory_limits"`` overrides) offers
``nvmlDeviceSetMemoryLimits_v1``, which records each call in ``FAKE_NVML_LIMITS_LOG``; an
older one lacks the function, as the real binding reports it.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    value = 999


NVML_ERROR_LIBRARY_NOT_FOUND = 12
_MiB = 1024 * 1024


def _state() -> dict[str, Any]:
    with open(os.environ["FAKE_NVML_FILE"]) as f:
        return dict(json.load(f))


def nvmlInit() -> None:
    _state()


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return str(_state().get("driver", "550.54.15"))


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError("Invalid Argument")
    return index


def _gpu(handle: int) -> dict[str, Any]:
    return dict(_state()["gpus"][handle])


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_gpu(handle)["uuid"])


def nvmlDeviceGetName(handle: int) -> str:
    return str(_gpu(handle)["name"])


def nvmlDeviceGetMemoryInfo(handle: int) -> Any:
    """``used`` is what the GPU's listed processes hold (a CHECKPOINTED one holds none,
    as below), ``free`` the rest: what the node agent checks before it restores a kernel."""
    total = int(_gpu(handle)["memory_mb"]) * _MiB
    used = sum(p.usedGpuMemory for p in nvmlDeviceGetComputeRunningProcesses(handle))
    return SimpleNamespace(total=total, free=max(0, total - used), used=used)


def _checkpointed(pid: int) -> bool:
    driver = os.environ.get("STANDIN_LIBCUDA_DIR")
    if not driver:
        return False
    try:
        with open(os.path.join(driver, f"{pid}.state")) as f:
            return f.read().strip() == "2"  # CU_PROCESS_STATE_CHECKPOINTED
    except OSError:
        return False


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[Any]:
    uuid = nvmlDeviceGetUUID(handle)
    procs = _state().get("processes", {}).get(uuid, [])
    return [
        SimpleNamespace(
            pid=p["pid"], usedGpuMemory=0 if _checkpointed(p["pid"]) else p["used_mb"] * _MiB
        )
        for p in procs
    ]


def _nvmlGetFunctionPointer(name: str) -> object:
    """Like the binding's: a driver without the symbol raises FUNCTION_NOT_FOUND (13).
    The state's ``"memory_limits": false`` (or a driver below 615) has none."""
    if name == "nvmlDeviceSetMemoryLimits_v1":
        state = _state()
        major = int(str(state.get("driver", "550.54.15")).split(".")[0])
        if not state.get("memory_limits", major >= 615):
            err = NVMLError("Function Not Found")
            err.value = 13
            raise err
    return name


def nvmlDeviceSetMemoryLimits_v1(handle: int, limits: Any) -> None:
    """Appends ``{uuid, nameSpace, softLimit, hardLimit}`` to ``FAKE_NVML_LIMITS_LOG``."""
    _nvmlGetFunctionPointer("nvmlDeviceSetMemoryLimits_v1")
    entry = {"uuid": nvmlDeviceGetUUID(handle), **dict(limits)}
    with open(os.environ["FAKE_NVML_LIMITS_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\n")
