"""A stand-in CuPy on a stand-in GPU, for ``gpu-lease doctor``'s probes (no GPU here).

It plays the framework *and* the driver: every allocation and free rewrites this process's
memory in the stand-in NVML's state file (``FAKE_NVML_FILE``, ``tests/fake_nvml``) as
``STANDIN_CONTEXT_MB`` (its CUDA context) plus what its pool holds. It honours
``CUPY_GPU_MEMORY_LIMIT`` as the real CuPy does, unless ``STANDIN_IGNORE_LIMIT=1`` (a
framework whose cap does not hold, which the doctor must catch).

Without ``FAKE_NVML_FILE`` nothing is reported. With ``CUDA_MPS_PIPE_DIRECTORY`` naming a
pipe directory where the stand-in MPS control daemon runs (``tests/fake_mps``), the first
allocation connects to it as the real CUDA context creation does, and **waits** there
while the GPU's MPS server serves another Unix user's clients (the hang MPS is known for).
A pipe directory without a daemon is ignored, as the real driver runs without MPS then.
Once admitted, allocations past the pinned device memory limit the daemon gave this
client (its ``<pid>.ok``: the lower of its server's limit and this process's own
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) fail as the MPS server makes them fail.
"""

import json
import os
import time

__version__ = "0.0-standin"
MiB = 1024 * 1024
uint8 = "uint8"
float32 = "float32"

_limit = (
    0
    if os.environ.get("STANDIN_IGNORE_LIMIT") == "1"
    else int(os.environ.get("CUPY_GPU_MEMORY_LIMIT", "0"))
)
_held = 0
_connected = False
_mps_limit = 0  # bytes; 0: none


def _mps_connect():
    """Become a client of the GPU's MPS server (once); block until the daemon admits us."""
    global _connected
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    clients = os.path.join(pipe, "clients") if pipe else ""
    if _connected or not pipe or not os.path.isdir(clients):
        return
    knock = os.path.join(clients, f"{os.getpid()}.wait")
    with open(knock + ".tmp", "w") as f:  # what the client asks for, as CUDA sends it
        f.write(os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""))
    os.replace(knock + ".tmp", knock)
    admitted = os.path.join(clients, f"{os.getpid()}.ok")
    while not os.path.exists(admitted):
        time.sleep(0.05)
    global _mps_limit
    with open(admitted) as f:
        text = f.read().strip()
    _mps_limit = int(text) * MiB if text else 0
    _connected = True


class OutOfMemoryError(MemoryError):
    pass


def _report():
    path = os.environ.get("FAKE_NVML_FILE")
    if not path:
        return
    uuid = os.environ["CUDA_VISIBLE_DEVICES"]
    with open(path) as f:
        state = json.load(f)
    procs = state.setdefault("processes", {}).setdefault(uuid, [])
    procs[:] = [p for p in procs if p["pid"] != os.getpid()]
    used = int(os.environ.get("STANDIN_CONTEXT_MB", "300")) + _held // MiB
    procs.append({"pid": os.getpid(), "used_mb": used})
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


class ndarray:
    def __init__(self, nbytes):
        global _held
        self.nbytes = 0  # until allocated: a refused one frees nothing
        if _limit and _held + nbytes > _limit:
            raise OutOfMemoryError(
                f"Out of memory allocating {nbytes:,} bytes (allocated so far: {_held:,} bytes, "
                f"limit set to: {_limit:,} bytes)."
            )
        _mps_connect()
        if _mps_limit and _held + nbytes > _mps_limit:
            raise OutOfMemoryError(
                f"Out of memory allocating {nbytes:,} bytes: the MPS server's pinned device "
                f"memory limit for this client is {_mps_limit:,} bytes."
            )
        _held += nbytes
        self.nbytes = nbytes
        _report()

    def __del__(self):
        global _held
        _held -= self.nbytes
        _report()

    def __matmul__(self, other):
        return ndarray(self.nbytes)

    def sum(self):
        return 0.0

    def __float__(self):
        return 0.0


def empty(nbytes, dtype=uint8):
    return ndarray(nbytes)


class random:
    @staticmethod
    def standard_normal(shape, dtype=float32):
        rows, cols = shape
        return ndarray(rows * cols * 4)


class _Pool:
    def total_bytes(self):
        return _held

    def free_all_blocks(self):
        pass


def get_default_memory_pool():
    return _Pool()


class cuda:
    class runtime:
        @staticmethod
        def getDeviceCount():
            return 1

        @staticmethod
        def getDeviceProperties(index):
            return {"name": b"Stand-in GPU"}

    class Device:
        def synchronize(self):
            pass
