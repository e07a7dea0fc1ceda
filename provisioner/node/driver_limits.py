"""Driver-enforced GPU memory limits per kernel cgroup (NVML ``nvmlDeviceSetMemoryLimits_v1``).

Drivers R615 and newer let a root process set, per GPU, a soft and a hard memory limit for
a cgroup v2 (``{nameSpace, softLimit, hardLimit}``); nvidia-ml-py 13.615 binds it as
``pynvml.nvmlDeviceSetMemoryLimits_v1(handle, c_nvmlSetMemoryLimits_v1_t(...))``. Older
drivers lack the symbol: the binding raises ``NVMLError`` with
``NVML_ERROR_FUNCTION_NOT_FOUND`` (13). Older bindings lack the function itself.

The node agent (root) calls :func:`set_limit` for each kernel cgroup its broker names
(heartbeat answer ``limits``), with the lease's memory (cap + context) as the hard limit,
and reports the cgroups it holds (``driver_limits``) so the lease's ``enforcement`` names
``driver``. ``nameSpace`` is the cgroup's path from the v2 root as ``/proc/<pid>/cgroup``
shows it; the limits are passed in bytes. Both are how the binding's structure reads, not
yet checked against an R615 driver (none was available; tests use ``tests/fake_nvml``).

The agent sets limits only on the cgroups of kernels it has *proven*
(:mod:`.proof`: read from ``/proc/<pid>/cgroup``, under the accepted parents), never on a
cgroup a renewal names. NVML documents no call that removes a limit, so a limit the agent
no longer wants (its lease ended, or its kernel is no longer proven) is *lifted* by setting
it to the GPU's whole memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..node_report import DriverLimitsReport
from .feature import Beat, Proven

log = logging.getLogger("gpu_lease.agent")

FUNCTION = "nvmlDeviceSetMemoryLimits_v1"
#: NVML_ERROR_FUNCTION_NOT_FOUND: the driver has no such symbol
FUNCTION_NOT_FOUND = 13
_MiB = 1024 * 1024


def _driver(nvml: Any) -> str:
    try:
        version = nvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - only for the message
        return "this driver"
    return f"driver {version.decode() if isinstance(version, bytes) else version}"


def offered(nvml: Any) -> tuple[bool, str]:
    """Whether this node's NVML (initialized) sets memory limits per cgroup, and a sentence
    that says so (and, when not, why and what it would take)."""
    if not hasattr(nvml, FUNCTION):
        return False, (
            f"the installed nvidia-ml-py has no {FUNCTION}: kernels get no driver-enforced "
            "memory cap (install nvidia-ml-py 13.615 or newer, and a driver R615+)"
        )
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if lookup is not None:
        try:
            lookup(FUNCTION)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == FUNCTION_NOT_FOUND:
                return False, (
                    f"{_driver(nvml)} has no {FUNCTION} (it needs R615 or newer): kernels "
                    "get no driver-enforced memory cap; the agent's --enforce and the "
                    "framework caps still apply"
                )
            return False, f"NVML cannot look {FUNCTION} up: {exc}"
    return True, f"{_driver(nvml)} offers {FUNCTION}: each kernel's cgroup gets a hard limit"


def set_limit(nvml: Any, handle: Any, cgroup: str, memory_mb: int) -> None:
    """Set the hard (and soft) limit of ``cgroup`` on the GPU ``handle`` to ``memory_mb``
    MiB. Raises ``nvml.NVMLError``."""
    limit = int(memory_mb) * _MiB
    struct = getattr(nvml, "c_nvmlSetMemoryLimits_v1_t", None)
    if struct is not None:
        limits = struct()
        limits.nameSpace = cgroup.encode()
        limits.softLimit = limit
        limits.hardLimit = limit
    else:  # a binding without the ctypes structure (the tests' stand-in)
        limits = {"nameSpace": cgroup, "softLimit": limit, "hardLimit": limit}
    getattr(nvml, FUNCTION)(handle, limits)


class DriverLimits:
    """The agent's limits in force: ``(cgroup, gpu uuid) -> MiB``; sets each once."""

    def __init__(
        self, nvml: Any, handles: dict[str, Any], whole_mb: dict[str, int] | None = None
    ) -> None:
        self.nvml = nvml
        self.handles = handles
        #: GPU uuid -> its memory (MiB): what a lifted limit is set to
        self.whole_mb = dict(whole_mb or {})
        self.held: dict[tuple[str, str], int] = {}
        self.failed: set[tuple[str, str, int]] = set()

    def apply(self, wanted: list[dict[str, Any]], log: Any) -> list[str]:
        """Set the limits wanted (``{cgroup, gpu_uuid, memory_mb}``, the proven kernels')
        not yet set; lift those no longer wanted. Returns the cgroups whose limit is in
        force."""
        keep: dict[tuple[str, str], int] = {}
        for entry in wanted:
            key = (str(entry["cgroup"]), str(entry["gpu_uuid"]))
            mb = int(entry["memory_mb"])
            if self.held.get(key) == mb:
                keep[key] = mb
                continue
            handle = self.handles.get(key[1])
            if handle is None or (key[0], key[1], mb) in self.failed:
                continue
            try:
                set_limit(self.nvml, handle, key[0], mb)
            except self.nvml.NVMLError as exc:
                self.failed.add((key[0], key[1], mb))
                log.warning("Cannot set a %d MiB driver limit on cgroup %s: %s", mb, key[0], exc)
                continue
            log.info("Driver memory limit %d MiB on cgroup %s (GPU %s)", mb, key[0], key[1])
            keep[key] = mb
        for key in [k for k in self.held if k not in keep]:
            self._lift(key, log)
        self.held = keep
        return sorted({c for c, _ in keep})

    def _lift(self, key: tuple[str, str], log: Any) -> None:
        """Lift the limit on ``key`` (cgroup, GPU): the GPU's whole memory (NVML documents
        no removal)."""
        handle, whole = self.handles.get(key[1]), self.whole_mb.get(key[1])
        if handle is None or not whole:
            return
        try:
            set_limit(self.nvml, handle, key[0], whole)
        except self.nvml.NVMLError as exc:
            log.warning("Cannot lift the driver limit on cgroup %s: %s", key[0], exc)
            return
        log.info("Driver memory limit on cgroup %s lifted (GPU %s)", key[0], key[1])


def wanted_limits(proven: dict[str, Proven]) -> list[dict[str, Any]]:
    """The driver limits the proven kernels get: on their own (accepted) cgroup, the lease's
    memory (cap + context) on the lease's GPU."""
    return [
        {"cgroup": p.cgroup, "gpu_uuid": p.claim.gpu_uuid, "memory_mb": p.claim.memory_mb}
        for p in proven.values()
        if p.cgroup_ok and p.cgroup and p.claim.gpu_uuid and p.claim.memory_mb > 0
    ]


class DriverLimitsFeature:
    """Driver memory limits as a node feature: after each answer the proven kernels'
    cgroups get their lease's memory as a hard limit (an older broker's claimed cgroups
    get none), and each heartbeat says which cgroups hold one (``driver_limits``, even
    empty), so that the broker shows ``driver`` in their leases' enforcement."""

    ready: asyncio.Event | None = None

    def __init__(self, limits: DriverLimits) -> None:
        self.limits = limits
        #: the cgroups whose limit is in force
        self.limited: list[str] = []

    async def observe(self, beat: Beat) -> None:
        beat.limited = set(self.limited)

    def report(self, beat: Beat) -> DriverLimitsReport:
        return DriverLimitsReport(tuple(self.limited))

    async def answer(self, beat: Beat, answer: dict[str, Any]) -> None:
        self.limited = self.limits.apply(wanted_limits(beat.proven), log)

    def offered(self) -> frozenset[str]:
        return frozenset()

    def refused(self, fields: set[str], node: str) -> None:
        pass
