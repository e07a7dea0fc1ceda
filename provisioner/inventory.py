"""The GPU inventory: which GPUs the broker shares out.

Two sources, chosen by the broker's ``--gpus`` option (see :func:`load_gpus`):

* ``nvml`` (the default): discover the NVIDIA GPUs of this machine with NVML
  (the ``pynvml`` module of nvidia-ml-py). Called once by the broker at start.
* a static declaration ``COUNTxMEMORY[:NAME]``, comma-separated, memory in MiB,
  optionally per node: ``1x32768:V100``, ``2x81920:H100,4x16384:T4`` or
  ``gpu-a/2x81920:H100,gpu-b/4x16384:T4``. Entries without a node belong to the
  node ``local``. Static pools are a real feature, for machines without NVIDIA
  GPUs, for tests, and for admins who declare capacity by hand.

Declared GPUs get stable UUIDs (``GPU-`` + a UUID derived from node, index, name
and memory), formatted like NVIDIA's, so a broker restarted with the same ``--gpus``
finds the same GPUs and the leases persisted on them.

NVML errors are translated here, once, into :class:`InventoryError` /
:class:`NoGPUFound`; nothing above this module sees a ``pynvml`` exception.
"""

from __future__ import annotations

import importlib
import re
import uuid
from types import ModuleType
from typing import Any

from .errors import InventoryError, NoGPUFound
from .model import GPU
from .wire import this_node

#: the node of static entries that do not name one
DEFAULT_NODE = "local"
#: the name of static entries that do not name one
DEFAULT_NAME = "GPU"
#: at most this many GPUs in one declaration (a typo such as 100000x… is caught)
MAX_GPUS = 10_000
#: the largest memory one GPU may declare: 16 TiB, in MiB (catches memory given in bytes)
MAX_MEMORY_MB = 16 * 1024 * 1024
#: fixed namespace of declared GPU UUIDs; never change it, or restarts lose their GPUs
GPU_UUID_NAMESPACE = uuid.UUID("5b0f6c1e-7d1c-4c55-9a43-6a1f0e3d2b7a")
#: the NVML binding of nvidia-ml-py, imported only when NVML is asked
NVML_MODULE = "pynvml"

EXAMPLE = "--gpus 1x32768:V100 or --gpus gpu-a/2x81920:H100,gpu-b/4x16384:T4"

_ENTRY = re.compile(
    r"""^(?:(?P<node>[^/\s]+)/)?
        (?P<count>[^xX:/]*)[xX](?P<memory>[^:/]*)
        (?::(?P<name>.*))?$""",
    re.VERBOSE,
)
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._+()-]{0,63}$")


def declared_uuid(node: str, index: int, name: str, memory_mb: int) -> str:
    """The stable UUID of a declared GPU: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    return f"GPU-{uuid.uuid5(GPU_UUID_NAMESPACE, f'{node}/{index}/{name}/{memory_mb}')}"


def _bad(spec: str, part: str, why: str) -> InventoryError:
    return InventoryError(
        f"Invalid GPU declaration {part!r} in --gpus {spec!r}: {why}. "
        f"Write COUNTxMEMORY[:NAME] entries, memory in MiB, comma-separated and "
        f"optionally prefixed by NODE/, for example {EXAMPLE}.",
        part=part,
    )


def _positive_int(spec: str, part: str, text: str, what: str) -> int:
    text = text.strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise _bad(spec, part, f"{what} {text!r} is not a whole positive number")
    value = int(text)
    if value <= 0:
        raise _bad(spec, part, f"{what} must be at least 1, not {value}")
    return value


def parse_gpu_spec(spec: str) -> list[GPU]:
    """Parse a static ``--gpus`` declaration into GPUs; raise :class:`InventoryError`.

    ``COUNTxMEMORY[:NAME]`` entries, comma-separated; ``MEMORY`` in MiB; ``NAME``
    defaults to ``"GPU"``; an optional ``NODE/`` prefix places the entry's GPUs on
    that node (default node: ``"local"``). Device indices count up per node across
    all entries on that node: ``a/1x16384:T4,a/1x16384:T4`` declares ``a`` index 0
    and index 1. Called by :func:`load_gpus` when the broker starts.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InventoryError(
            f"The GPU declaration (--gpus) is empty. Use 'nvml' to discover NVIDIA GPUs, "
            f"or declare them by hand, for example {EXAMPLE}."
        )
    gpus: list[GPU] = []
    next_index: dict[str, int] = {}
    seen: set[str] = set()
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            raise _bad(spec, raw, "an entry is empty (two commas in a row, or a trailing comma)")
        m = _ENTRY.match(part)
        if m is None:
            raise _bad(spec, part, "it does not have the form [NODE/]COUNTxMEMORY[:NAME]")
        node = m["node"] if m["node"] is not None else DEFAULT_NODE
        if not _NODE.match(node):
            raise _bad(spec, part, f"node {node!r} is not a host name (letters, digits, . _ -)")
        count = _positive_int(spec, part, m["count"], "COUNT")
        memory = _positive_int(spec, part, m["memory"], "MEMORY")
        if memory > MAX_MEMORY_MB:
            raise _bad(spec, part, f"MEMORY {memory} MiB is more than 16 TiB (give MiB, not bytes)")
        name = DEFAULT_NAME if m["name"] is None else m["name"].strip()
        if not _NAME.match(name):
            raise _bad(
                spec, part, f"NAME {name!r} must be 1-64 letters, digits, spaces or . _ + - ( )"
            )
        if len(gpus) + count > MAX_GPUS:
            raise _bad(spec, part, f"it would declare more than {MAX_GPUS} GPUs in all")
        for _ in range(count):
            index = next_index.get(node, 0)
            next_index[node] = index + 1
            gpu = GPU(
                uuid=declared_uuid(node, index, name, memory),
                node=node,
                name=name,
                memory_mb=memory,
                index=index,
            )
            if gpu.uuid in seen:  # pragma: no cover - (node, index) is unique by construction
                raise _bad(spec, part, f"GPU {gpu.uuid} is declared twice")
            seen.add(gpu.uuid)
            gpus.append(gpu)
    return gpus


# -- NVML -------------------------------------------------------------------------------


def _nvml_module(nvml: ModuleType | Any) -> ModuleType | Any:
    """``nvml`` itself, or the module of that name (:data:`NVML_MODULE`) imported now."""
    return importlib.import_module(nvml) if isinstance(nvml, str) else nvml


def _text(value: Any) -> str:
    """NVML returns ``bytes`` in older nvidia-ml-py releases, ``str`` in newer ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _error_types(nvml: Any) -> tuple[type[BaseException], ...]:
    """The exceptions an NVML call may raise: the module's ``NVMLError`` and ``OSError``."""
    nvml_error = getattr(nvml, "NVMLError", None)
    if isinstance(nvml_error, type) and issubclass(nvml_error, BaseException):
        return (nvml_error, OSError)
    return (OSError,)


def _nvml_reason(nvml: ModuleType, exc: BaseException) -> str:
    not_found = getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", None)
    if not_found is not None and getattr(exc, "value", None) == not_found:
        return "libnvidia-ml.so: not found"
    return str(exc) or type(exc).__name__


def _no_gpu(reason: str) -> NoGPUFound:
    return NoGPUFound(
        f"No NVIDIA GPU was found with NVML ({reason}). On a machine without NVIDIA GPUs, "
        f"declare the pool by hand: --gpus 1x32768:V100",
        reason=reason,
    )


def discover_nvml(node: str | None = None, *, nvml: ModuleType | Any = NVML_MODULE) -> list[GPU]:
    """The NVIDIA GPUs of this machine, by NVML; raise :class:`NoGPUFound` if there are none.

    Called by :func:`load_gpus` for ``--gpus nvml`` when the broker starts. ``node``
    defaults to this host's name. ``nvml`` is the NVML binding or its module name
    (``pynvml``, imported here, not at import); a test may pass another object with
    the same functions, or the name of a module that is not installed.
    """
    try:
        nvml = _nvml_module(nvml)
    except ImportError as exc:
        raise _no_gpu("nvidia-ml-py is not installed") from exc
    error_types = _error_types(nvml)
    host = node or this_node()
    try:
        nvml.nvmlInit()
    except error_types as exc:
        raise _no_gpu(_nvml_reason(nvml, exc)) from exc
    try:
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                GPU(
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    node=host,
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_mb=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024),
                    index=i,
                )
            )
    except error_types as exc:
        raise _no_gpu(_nvml_reason(nvml, exc)) from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except error_types:
            pass
    if not gpus:
        raise _no_gpu("the driver reports 0 GPUs")
    return gpus


def load_gpus(spec: str, *, nvml: ModuleType | Any = NVML_MODULE) -> list[GPU]:
    """The broker's pool for ``--gpus SPEC``: ``nvml`` discovers, anything else is declared.

    Called once when the broker starts; raises :class:`InventoryError` (or its
    subclass :class:`NoGPUFound`) with a message that names ``--gpus``.
    """
    if isinstance(spec, str) and spec.strip().lower() == "nvml":
        return discover_nvml(nvml=nvml)
    return parse_gpu_spec(spec)


def process_memory_mb(pid: int, *, nvml: ModuleType | Any = NVML_MODULE) -> int | None:
    """GPU memory (MiB) the process ``pid`` uses on all GPUs, or None if NVML cannot say.

    Used by ``gpu-lease top`` and the kernel's ``%gpu`` magic. Returns 0 when NVML
    works and the process holds no GPU memory; None when NVML is unavailable or the
    driver does not report per-process memory (e.g. without the right permissions).
    ``nvml`` as in :func:`discover_nvml`.
    """
    try:
        nvml = _nvml_module(nvml)
    except ImportError:
        return None
    error_types = _error_types(nvml)
    try:
        nvml.nvmlInit()
    except error_types:
        return None
    total = 0
    unreported = False
    try:
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid != pid:
                    continue
                used = getattr(proc, "usedGpuMemory", None)
                if used is None:
                    unreported = True
                else:
                    total += int(used)
    except error_types:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except error_types:
            pass
    if unreported and not total:
        return None
    return total // (1024 * 1024)


def running_processes(nvml: ModuleType | Any) -> list[tuple[int, str, int]]:
    """``(pid, gpu_uuid, used_mb)`` of every compute process on every GPU NVML sees.

    ``nvml`` is an initialized NVML binding (the node agent keeps one open while it
    runs). A process whose memory the driver does not report (no permission) counts
    0 MiB. Raises :class:`InventoryError` when NVML fails.
    """
    error_types = _error_types(nvml)
    out: list[tuple[int, str, int]] = []
    try:
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = getattr(proc, "usedGpuMemory", None)
                out.append((int(proc.pid), uuid, int(used or 0) // (1024 * 1024)))
    except error_types as exc:
        raise InventoryError(
            f"NVML could not list the GPU processes ({_nvml_reason(nvml, exc)}); check the "
            "driver with nvidia-smi."
        ) from exc
    return out


__all__ = [
    "DEFAULT_NAME",
    "DEFAULT_NODE",
    "EXAMPLE",
    "MAX_GPUS",
    "NVML_MODULE",
    "declared_uuid",
    "discover_nvml",
    "load_gpus",
    "parse_gpu_spec",
    "process_memory_mb",
    "running_processes",
]
