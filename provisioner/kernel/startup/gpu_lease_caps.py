"""Apply the GPU lease's memory cap to a framework just imported (runs inside the kernel).

Called by ``gpu_lease_launcher``'s import hook, once per framework, right after the
framework's top-level module has executed: ``apply("tensorflow", module)``. Reads only
environment variables set by the kernel provisioner (``GPU_LEASE_MEMORY_MB``, ...);
imports nothing from the ``provisioner`` package (the kernel's Python may be another
environment). Never raises into user code: a failure is recorded in :data:`REPORT`
and written to stderr as a warning.

- TensorFlow: one logical device with ``memory_limit=<cap MiB>`` on each visible GPU,
  before the GPU initialises (too late once it has: recorded, not raised).
- PyTorch: ``torch.cuda.set_per_process_memory_fraction(cap / total memory of device 0)``
  queued with ``torch.cuda._lazy_call`` so that no CUDA context is created before user
  code touches the GPU.
- JAX and CuPy: capped by environment variables read by the frameworks themselves
  (``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``CUPY_GPU_MEMORY_LIMIT``); recorded only.
"""

from __future__ import annotations

import os
import sys

MIB = 1024 * 1024

#: framework -> what was applied ("memory_limit=143 MiB on 1 GPU", "no GPU visible; ...", an error)
REPORT: dict[str, str] = {}

_applied: set[str] = set()


def cap_mb():
    """The lease's framework cap in MiB, or None without a lease."""
    try:
        value = int(os.environ.get("GPU_LEASE_MEMORY_MB", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def apply(name, module):
    """Apply the cap for framework ``name`` (once); record the outcome in REPORT; never raise."""
    if name in _applied:
        return REPORT.get(name)
    _applied.add(name)
    applier = _APPLIERS.get(name)
    if applier is None:
        return None
    cap = cap_mb()
    if cap is None:
        REPORT[name] = "no GPU lease in this kernel (GPU_LEASE_MEMORY_MB unset); nothing to cap"
        return REPORT[name]
    try:
        REPORT[name] = applier(module, cap)
    except Exception as exc:
        REPORT[name] = f"error: {type(exc).__name__}: {exc}"
        _warn(f"could not cap {name}'s GPU memory to {cap} MiB: {exc}")
    return REPORT[name]


def _warn(message):
    try:
        sys.stderr.write(f"gpu-lease warning: {message}\n")
    except Exception:
        pass


def _tensorflow(tf, cap):
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "no GPU visible; nothing to cap"
    try:
        for gpu in gpus:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=cap)]
            )
    except RuntimeError as exc:
        _warn(
            f"TensorFlow's GPU was initialised before the cap of {cap} MiB could be set ({exc}); "
            "restart the kernel and import tensorflow before using the GPU."
        )
        return f"not applied: the GPU was already initialised ({exc})"
    plural = "" if len(gpus) == 1 else "s"
    return f"memory_limit={cap} MiB on {len(gpus)} GPU{plural}"


def _torch(torch, cap):
    version = getattr(torch, "version", None)
    if getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None:
        return "torch built without CUDA (CPU build); nothing to cap"
    cuda = torch.cuda
    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is None:
        raise RuntimeError("this torch has no torch.cuda._lazy_call to queue the cap with")

    def set_fraction():
        # runs inside torch.cuda._lazy_init (or at once if CUDA is already initialised);
        # an exception here would surface as DeferredCudaCallError in user code: catch it
        try:
            total = cuda.get_device_properties(0).total_memory
            fraction = min(1.0, float(cap * MIB) / float(total))
            cuda.set_per_process_memory_fraction(fraction, 0)
            REPORT["torch"] = (
                f"per_process_memory_fraction={fraction:.6f} ({cap} MiB of {total // MIB} MiB) "
                "on GPU 0"
            )
        except Exception as exc:
            REPORT["torch"] = f"error: {type(exc).__name__}: {exc}"
            _warn(f"could not cap torch's GPU memory to {cap} MiB: {exc}")

    initialised = cuda.is_initialized()
    lazy_call(set_fraction)
    if initialised:
        return REPORT.get("torch", "applied")
    return f"per_process_memory_fraction for {cap} MiB queued until CUDA initialises"


def _jax(jax, cap):
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if not value:
        return "not capped: XLA_PYTHON_CLIENT_MEM_FRACTION is unset"
    text = f"XLA_PYTHON_CLIENT_MEM_FRACTION={value} ({cap} MiB; environment)"
    if os.environ.get("XLA_CLIENT_MEM_FRACTION"):
        # set after the kernel started (by the user's code): jaxlib then refuses the GPU
        _warn(
            "XLA_CLIENT_MEM_FRACTION is set together with XLA_PYTHON_CLIENT_MEM_FRACTION: "
            "jaxlib refuses its GPU backend then and JAX runs on the CPU. Unset it."
        )
        text += "; XLA_CLIENT_MEM_FRACTION is set too: jaxlib refuses the GPU"
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        _warn(
            "XLA_PYTHON_CLIENT_ALLOCATOR=platform ignores the memory fraction: JAX is not capped."
        )
        text += "; ignored: XLA_PYTHON_CLIENT_ALLOCATOR=platform"
    return text


def _cupy(cupy, cap):
    value = os.environ.get("CUPY_GPU_MEMORY_LIMIT")
    if not value:
        return "not capped: CUPY_GPU_MEMORY_LIMIT is unset"
    return f"CUPY_GPU_MEMORY_LIMIT={value} ({cap} MiB; environment)"


_APPLIERS = {"tensorflow": _tensorflow, "torch": _torch, "jax": _jax, "cupy": _cupy}
