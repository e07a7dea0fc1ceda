"""The CUDA driver's process checkpoint API, through one long-lived ``libcuda.so.1`` handle.

Called by the node agent to *park* an idle kernel (its GPU memory copied into the kernel's
own host memory and freed on the GPU) and to *resume* it later, and by ``gpu-lease doctor``
to say whether this node can park at all. Since driver 570 (CUDA 12.8) the driver API
checkpoints another process by pid::

    cuCheckpointProcessLock(pid)        RUNNING      -> LOCKED       (new CUDA calls block)
    cuCheckpointProcessCheckpoint(pid)  LOCKED       -> CHECKPOINTED (GPU memory now in host RAM)
    cuCheckpointProcessRestore(pid)     CHECKPOINTED -> LOCKED       (same device addresses)
    cuCheckpointProcessUnlock(pid)      LOCKED       -> RUNNING

The library is loaded by its soname, ``libcuda.so.1``, as the dynamic linker finds it, so a
stand-in library first on ``LD_LIBRARY_PATH`` replaces the driver (the tests build one,
``tests/standin_libcuda/libcuda.c``). We never run the ``cuda-checkpoint`` utility: each of
its runs pays the driver's attach (about 2.7 s); this handle pays it once.

Known limits of the driver (NVIDIA/cuda-checkpoint): x86-64 only; no UVM, CUDA IPC, MIG or
NCCL; a restore that finds too little free GPU memory leaves the process stuck for good, so
the broker re-reserves the lease's memory *before* the agent restores.

Errors here are the node's own (they never cross the wire): :class:`CheckpointUnavailable`
when this node cannot park at all, :class:`CheckpointFailed` when one step failed for one
process (the caller then falls back to reclaiming the kernel, or reports the failure).
"""

from __future__ import annotations

import ctypes
import enum
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "LIBRARY",
    "CheckpointFailed",
    "CheckpointUnavailable",
    "CudaCheckpoint",
    "ProcessState",
    "Support",
    "open_checkpoint",
    "support",
]

#: the driver library's soname (the dynamic linker's search path decides which file)
LIBRARY = "libcuda.so.1"
#: the first driver with the checkpoint entry points in the driver API (CUDA 12.8)
MIN_DRIVER_API = 12080
#: how long a lock waits for the process's running CUDA work (ms; 0 would wait for ever)
DEFAULT_LOCK_TIMEOUT_MS = 10_000

_FUNCTIONS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process stands in the checkpoint cycle."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CheckpointUnavailable(RuntimeError):
    """This node cannot checkpoint CUDA processes (no driver, too old, or not x86-64)."""


class CheckpointFailed(RuntimeError):
    """One step of parking or resuming one process failed; ``state`` is where it stands."""

    def __init__(self, message: str, *, pid: int, step: str, state: ProcessState | None) -> None:
        super().__init__(message)
        self.pid = pid
        self.step = step
        self.state = state


class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs: 64 bytes, the reserved fields zeroed
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class _ReservedArgs(ctypes.Structure):
    # CUcheckpointCheckpointArgs and CUcheckpointUnlockArgs: 64 reserved bytes
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _RestoreArgs(ctypes.Structure):
    # CUcheckpointRestoreArgs (driver 580): gpuPairs remap a restore onto another GPU of the
    # same chip; we restore in place, so no pairs
    _fields_ = [
        ("gpuPairs", ctypes.c_void_p),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * 44),
        ("reserved1", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class Support:
    """Whether this node can park kernels, and why not (``gpu-lease doctor`` prints it)."""

    works: bool
    reason: str
    driver_api: int | None = None


class CudaCheckpoint:
    """One handle on the driver's checkpoint API, kept for the agent's life.

    ``library`` is a soname or a path; the default lets ``LD_LIBRARY_PATH`` choose (the
    tests' stand-in). Raises :class:`CheckpointUnavailable` when the library is missing,
    cannot initialise, or lacks the checkpoint entry points (a driver older than 570).
    """

    def __init__(self, library: str = LIBRARY, *, machine: str | None = None) -> None:
        machine = machine or platform.machine()
        if machine not in ("x86_64", "AMD64"):
            raise CheckpointUnavailable(
                f"CUDA checkpointing runs on x86-64 only; this node is {machine}: "
                "idle kernels here are reclaimed, not parked."
            )
        try:
            lib = ctypes.CDLL(library)
        except OSError as exc:
            raise CheckpointUnavailable(
                f"{library} could not be loaded ({exc}): no NVIDIA driver here, so idle "
                "kernels are reclaimed, not parked."
            ) from exc
        missing = [name for name in _FUNCTIONS if not hasattr(lib, name)]
        if missing:
            raise CheckpointUnavailable(
                f"this NVIDIA driver lacks {', '.join(missing)} (driver 570 or later has "
                "them): upgrade the driver to park idle kernels; until then they are "
                "reclaimed."
            )
        self._lib = lib
        for name in _FUNCTIONS:
            getattr(lib, name).restype = ctypes.c_int
        self._error_name = getattr(lib, "cuGetErrorName", None)
        self._call("cuInit", lib.cuInit, ctypes.c_uint(0), pid=0, unavailable=True)
        version = ctypes.c_int(0)
        get_version = getattr(lib, "cuDriverGetVersion", None)
        if get_version is not None:
            self._call("cuDriverGetVersion", get_version, ctypes.byref(version), pid=0)
        self.driver_api = version.value or None

    # -- one call, its error named --------------------------------------------------
    def _name(self, code: int) -> str:
        if self._error_name is None:
            return f"CUresult {code}"
        text = ctypes.c_char_p()
        if self._error_name(ctypes.c_int(code), ctypes.byref(text)) != 0 or not text.value:
            return f"CUresult {code}"
        return text.value.decode(errors="replace")

    def _call(
        self, step: str, fn: Callable[..., int], *args: object, pid: int, unavailable: bool = False
    ) -> None:
        code = int(fn(*args))
        if code == 0:
            return
        name = self._name(code)
        if unavailable:
            raise CheckpointUnavailable(
                f"the CUDA driver did not initialise ({step}: {name}): idle kernels here "
                "are reclaimed, not parked."
            )
        state = self._state_or_none(pid) if pid else None
        where = f" (the process is now {state.name})" if state is not None else ""
        raise CheckpointFailed(
            f"{step} of process {pid} failed with {name}{where}.", pid=pid, step=step, state=state
        )

    def _state_or_none(self, pid: int) -> ProcessState | None:
        value = ctypes.c_int(-1)
        if self._lib.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(value)) != 0:
            return None
        try:
            return ProcessState(value.value)
        except ValueError:
            return None

    # -- the four steps and the state -------------------------------------------------
    def state(self, pid: int) -> ProcessState:
        """The process's checkpoint state (``RUNNING`` for a CUDA process never parked)."""
        value = ctypes.c_int(-1)
        self._call(
            "cuCheckpointProcessGetState",
            self._lib.cuCheckpointProcessGetState,
            ctypes.c_int(pid),
            ctypes.byref(value),
            pid=pid,
        )
        return ProcessState(value.value)

    def lock(self, pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
        """RUNNING → LOCKED: waits up to ``timeout_ms`` for the process's CUDA work."""
        args = _LockArgs(timeoutMs=max(1, int(timeout_ms)))
        self._call(
            "cuCheckpointProcessLock",
            self._lib.cuCheckpointProcessLock,
            ctypes.c_int(pid),
            ctypes.byref(args),
            pid=pid,
        )

    def checkpoint(self, pid: int) -> None:
        """LOCKED → CHECKPOINTED: GPU memory copied into the process's host memory, freed."""
        args = _ReservedArgs()
        self._call(
            "cuCheckpointProcessCheckpoint",
            self._lib.cuCheckpointProcessCheckpoint,
            ctypes.c_int(pid),
            ctypes.byref(args),
            pid=pid,
        )

    def restore(self, pid: int) -> None:
        """CHECKPOINTED → LOCKED: GPU memory back at the same addresses (reserve it first)."""
        args = _RestoreArgs()
        self._call(
            "cuCheckpointProcessRestore",
            self._lib.cuCheckpointProcessRestore,
            ctypes.c_int(pid),
            ctypes.byref(args),
            pid=pid,
        )

    def unlock(self, pid: int) -> None:
        """LOCKED → RUNNING: the process's blocked CUDA calls go on."""
        args = _ReservedArgs()
        self._call(
            "cuCheckpointProcessUnlock",
            self._lib.cuCheckpointProcessUnlock,
            ctypes.c_int(pid),
            ctypes.byref(args),
            pid=pid,
        )

    # -- what the agent asks for --------------------------------------------------------
    def park(self, pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> float:
        """Lock and checkpoint ``pid``; returns the seconds it took.

        A checkpoint that fails after the lock unlocks again, so the kernel runs on as it
        was (the broker then reclaims it instead); :class:`CheckpointFailed` says which step.
        """
        started = time.perf_counter()
        self.lock(pid, timeout_ms)
        try:
            self.checkpoint(pid)
        except CheckpointFailed:
            if self._state_or_none(pid) is ProcessState.LOCKED:
                self.unlock(pid)
            raise
        return time.perf_counter() - started

    def resume(self, pid: int) -> float:
        """Restore and unlock ``pid`` (its memory must already be reserved); seconds taken.

        A process that is already running (resumed before an agent restart) is left as it is.
        """
        started = time.perf_counter()
        state = self.state(pid)
        if state is ProcessState.CHECKPOINTED:
            self.restore(pid)
            state = ProcessState.LOCKED
        if state is ProcessState.LOCKED:
            self.unlock(pid)
        elif state is not ProcessState.RUNNING:
            raise CheckpointFailed(
                f"process {pid} is {state.name} and cannot be resumed: end the kernel.",
                pid=pid,
                step="resume",
                state=state,
            )
        return time.perf_counter() - started


def open_checkpoint(
    library: str = LIBRARY, *, machine: str | None = None
) -> tuple[CudaCheckpoint | None, Support]:
    """The agent's one long-lived handle and whether it may park with it (None: it may not).

    Called once at agent start (node/parking.py ``Parker.open``): the library is loaded and
    initialised once, and a driver whose CUDA API is older than 12.8 gives no handle.
    """
    try:
        handle = CudaCheckpoint(library, machine=machine)
    except CheckpointUnavailable as exc:
        return None, Support(works=False, reason=str(exc))
    api = handle.driver_api
    if api is not None and api < MIN_DRIVER_API:
        return None, Support(
            works=False,
            reason=(
                f"the driver's CUDA API is {api // 1000}.{api % 1000 // 10}; checkpointing "
                "needs 12.8 (driver 570) or later: idle kernels here are reclaimed."
            ),
            driver_api=api,
        )
    return handle, Support(
        works=True, reason="the driver offers process checkpointing", driver_api=api
    )


def support(library: str = LIBRARY, *, machine: str | None = None) -> Support:
    """Whether this node can park kernels: loads the library once and reports why not."""
    return open_checkpoint(library, machine=machine)[1]
