"""A granted lease -> the kernel's environment and command line (pure, no I/O).

Called by ``GPULeaseProvisioner.pre_launch`` once the broker has granted a lease (a
:class:`provisioner.client.GrantedLease`): :func:`lease_environment` gives the variables to
add to the kernel's environment, :func:`kernel_argv` rewrites the kernelspec's argv so the
kernel starts under ``startup/gpu_lease_launcher.py`` (which applies the caps that need
code, when a framework is imported) with the ``%gpu`` extension loaded.

How each framework's GPU memory is capped, and why here or in the launcher:

- **CUDA_VISIBLE_DEVICES** holds the leased GPU's UUID, so the kernel sees exactly
  one device, index 0.
- **JAX** reads ``XLA_PYTHON_CLIENT_MEM_FRACTION`` as a fraction of the *whole device*:
  cap / device memory, rounded down so the cap is never exceeded. Only that name: recent
  jaxlib (0.11.2, seen on an H200) refuses to start its GPU backend when the newer name
  ``XLA_CLIENT_MEM_FRACTION`` is set *as well* ("specified together with ... Remove the
  latter one") and JAX then falls back to the CPU without the user noticing; it still
  reads the older name alone, which every release reads. So the kernel gets the older
  name, and the newer one is removed from the kernel's environment
  (:data:`REMOVE_FROM_KERNEL`) should the server's environment carry it.
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: XLA's BFC allocator is sized to the fraction
  either way (preallocation only decides whether it grabs it all up front), so the cap
  holds (on the H200: ``bytes_limit`` was the cap, and a larger block was refused), and
  without preallocation a kernel that uses JAX *and* another framework does not hand
  all of its lease to JAX at the first ``jnp`` call, and the memory shown by ``%gpu`` /
  ``gpu-lease top`` is what the kernel really uses. A value the server environment
  already sets wins.
- **CuPy** reads ``CUPY_GPU_MEMORY_LIMIT`` (bytes) when its memory pool is created.
- **PyTorch**: capped by the launcher with ``torch.cuda.set_per_process_memory_fraction``
  queued through ``torch.cuda._lazy_call`` (no CUDA context before user code touches
  the GPU). The allocator-config key ``per_process_memory_fraction`` exists in recent
  releases (2.13 has it in ``c10/cuda/CUDAAllocatorConfig.h``), but older releases
  reject unknown ``PYTORCH_CUDA_ALLOC_CONF`` keys with an error at the first CUDA
  allocation, and the server cannot know which torch the kernel's environment has;
  so ``PYTORCH_CUDA_ALLOC_CONF`` is left exactly as the server environment has it.
- **TensorFlow**: capped by the launcher (a logical device with ``memory_limit``),
  because TensorFlow has no environment variable for a hard cap.
- ``enforcement="mps"`` adds ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<cap>M``, which the
  MPS server enforces for every framework, including code that calls CUDA directly, and
  ``CUDA_MPS_PIPE_DIRECTORY`` of the GPU's daemon, which the node agent runs (``--mps``;
  :func:`provisioner.wire.pipe_directory` under ``mps_dir``). The variable is the
  kernel's own: it holds a careless kernel to its cap, not a hostile one (a cell can
  unset it before CUDA starts). What holds against that is the limit the agent sets in
  the daemon itself (:mod:`provisioner.node.mps`, "Daemon-side memory limits").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from ..client.answers import GrantedLease
from ..errors import InvalidRequest
from ..wire import COOPERATIVE, DEFAULT_MPS_DIR, ENFORCEMENTS, pipe_directory
from .kernelspecs import format_fraction

#: the folder of files that run inside the kernel (never imports this package)
STARTUP_DIR = Path(__file__).resolve().parent / "startup"
#: the script the kernel is started under
LAUNCHER = STARTUP_DIR / "gpu_lease_launcher.py"
#: the IPython extension that adds ``%gpu``
EXTENSION = "gpu_lease_magic"
#: the modules whose kernels understand IPython's ``--ext`` option
IPYTHON_KERNEL_MODULES = frozenset({"ipykernel_launcher", "ipykernel"})

MIB = 1024 * 1024

#: variables a leased kernel must not inherit from the server: with
#: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set as well, jaxlib refuses its GPU backend (above)
REMOVE_FROM_KERNEL = ("XLA_CLIENT_MEM_FRACTION",)


def lease_environment(
    lease: GrantedLease,
    *,
    enforcement: str = COOPERATIVE,
    state_file: str | None = None,
    base_env: Mapping[str, str] | None = None,
    mps_dir: str = DEFAULT_MPS_DIR,
) -> dict[str, str]:
    """The variables to add to the kernel's environment for ``lease``.

    ``base_env`` is the environment the kernel would otherwise get (the server's); it
    is read, never returned whole, so that a user's own setting of a non-cap variable
    (``XLA_PYTHON_CLIENT_PREALLOCATE``) is kept. Raises :class:`InvalidRequest` when the
    lease lacks what the kernel needs (a GPU UUID, a positive memory cap).
    """
    if enforcement not in ENFORCEMENTS:
        raise InvalidRequest(
            f"Unknown GPU enforcement {enforcement!r}; use one of: {', '.join(ENFORCEMENTS)}."
        )
    base = base_env or {}
    gpu = lease.gpu
    if not gpu.uuid:
        raise InvalidRequest(
            f"Lease {lease.id} names no GPU UUID; the kernel cannot be given its GPU."
        )
    cap_mb = lease.memory_limit_mb
    if cap_mb is None or cap_mb <= 0:
        raise InvalidRequest(
            f"Lease {lease.id} has no positive memory limit (memory_limit_mb="
            f"{cap_mb!r}); ask for a larger fraction."
        )

    env: dict[str, str] = {
        "CUDA_VISIBLE_DEVICES": gpu.uuid,
        "GPU_LEASE_ID": lease.id,
        "GPU_LEASE_GPU_UUID": gpu.uuid,
        "GPU_LEASE_MEMORY_MB": str(cap_mb),
        "GPU_LEASE_ENFORCEMENT": enforcement,
        "CUPY_GPU_MEMORY_LIMIT": str(cap_mb * MIB),
    }
    if lease.fraction is not None:
        env["GPU_LEASE_FRACTION"] = format_fraction(lease.fraction)
    if gpu.name is not None:
        env["GPU_LEASE_GPU_NAME"] = gpu.name
    if gpu.memory_mb is not None and gpu.memory_mb > 0:
        env["GPU_LEASE_GPU_MEMORY_MB"] = str(gpu.memory_mb)
        mem_fraction = xla_mem_fraction(cap_mb, gpu.memory_mb)
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = mem_fraction
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in base:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if state_file:
        env["GPU_LEASE_STATE_FILE"] = state_file
    if enforcement == "mps":
        # device 0 as the kernel sees it: CUDA_VISIBLE_DEVICES holds one GPU
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={cap_mb}M"
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_directory(mps_dir, gpu.uuid)
    return env


def xla_mem_fraction(cap_mb: int, total_mb: int) -> str:
    """``cap_mb`` as a fraction of the whole device, rounded *down* to 6 digits ("%.6f")."""
    if cap_mb <= 0 or total_mb <= 0:
        raise InvalidRequest("GPU memory sizes must be positive.")
    micro = math.floor(min(cap_mb, total_mb) * 1_000_000 / total_mb)
    return f"{micro / 1_000_000:.6f}"


class KernelArgv(NamedTuple):
    """The result of :func:`kernel_argv`.

    ``wrapped`` is False when the argv was returned unchanged because its shape is not
    understood (the caller logs ``reason`` as a warning: the kernel then runs with the
    environment caps only, without TensorFlow/PyTorch caps nor ``%gpu``).
    ``extension`` says whether the ``%gpu`` extension is loaded through ``--ext``.
    """

    argv: list[str]
    wrapped: bool
    extension: bool
    reason: str = ""


#: interpreter options that take their value as the next argument
_OPTIONS_WITH_VALUE = frozenset({"-X", "-W"})


def kernel_argv(argv: Sequence[str], *, launcher: str | None = None) -> KernelArgv:
    """Rewrite a kernelspec argv to start the kernel under the launcher.

    ``[python, *python_options, -m, module, *args]`` becomes
    ``[python, *python_options, <launcher>, -m, module, *args, --ext=gpu_lease_magic]``
    (``--ext`` only when the module is an IPython kernel). Any other shape (a script,
    ``-c``, a non-Python kernel) comes back unchanged with ``wrapped=False``.
    """
    argv = list(argv)
    launcher = launcher or str(LAUNCHER)
    if launcher in argv:
        return KernelArgv(argv, True, f"--ext={EXTENSION}" in argv, "already wrapped")
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            module, rest = argv[i + 1], argv[i + 2 :]
            break
        if arg.startswith("-m") and len(arg) > 2 and not arg.startswith("--"):
            module, rest = arg[2:], argv[i + 1 :]
            break
        if arg in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if not arg.startswith("-") or arg in ("-", "-c", "--"):
            return KernelArgv(argv, False, False, _unrecognised(argv))
        i += 1
    else:
        return KernelArgv(argv, False, False, _unrecognised(argv))
    if not argv or not module:
        return KernelArgv(argv, False, False, _unrecognised(argv))
    new = [*argv[:i], launcher, "-m", module, *rest]
    extension = module in IPYTHON_KERNEL_MODULES
    if extension:
        new.append(f"--ext={EXTENSION}")
    return KernelArgv(new, True, extension)


def _unrecognised(argv: Sequence[str]) -> str:
    return (
        f"The kernel command {list(argv)!r} is not of the form 'python -m MODULE ...'; it is "
        "started unchanged: GPU memory caps that need code (TensorFlow, PyTorch) and the "
        "%gpu magic are not applied, only the environment caps (JAX, CuPy, MPS)."
    )
