"""A process that tries to use more GPU memory than its lease: ``gpu-lease doctor``'s probe.

Runs on a GPU node, started the way a kernel is (under ``kernel/startup/gpu_lease_launcher.py``,
with a lease's environment from :func:`provisioner.kernel.env.lease_environment`), so each
framework is capped exactly as in a kernel::

    python .../gpu_lease_launcher.py -m provisioner.node.probe torch

It speaks JSON lines on stdout and waits for a line on stdin between the steps, so that its
parent can read the process's GPU memory from NVML at each step:

1. imports the framework, creates its CUDA context with a 1-byte allocation and does some
   real work (a matrix product, which loads the math libraries), then prints
   ``{"event": "ready", "reserved_mb": ...}`` and waits: the parent reads the process's
   memory from NVML, and that minus what the framework's allocator holds is the context;
2. asks for one block of the cap plus a margin, then for chunks until one is refused or it
   holds well past the cap, prints ``{"event": "holding", ...}`` and waits, holding them
   (the parent reads the peak);
3. frees everything and exits.

Kernels can run the same steps (:class:`Probe`): ``benchmarks/gpu/gpu_checks.py`` does. The
module imports only the standard library until a framework is named.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

MIB = 1024 * 1024

#: frameworks the probe knows, by import name
FRAMEWORKS = ("torch", "jax", "cupy", "tensorflow")


class NoGPU(RuntimeError):
    """The framework sees no GPU here: nothing to measure (not a failed cap)."""


class Probe:
    """One framework's allocations in this process: :meth:`init`, :meth:`push_past`, :meth:`free`."""

    def __init__(self, framework: str) -> None:
        if framework not in FRAMEWORKS:
            raise ValueError(f"unknown framework {framework!r}; one of {', '.join(FRAMEWORKS)}")
        self.framework = framework
        self.held: list[Any] = []
        self.mod: Any = None

    # -- per framework -------------------------------------------------------------------
    def _import(self) -> Any:
        if self.framework == "jax":
            import jax
            import jax.numpy

            return jax
        if self.framework == "tensorflow":
            import tensorflow

            return tensorflow
        if self.framework == "cupy":
            import cupy

            return cupy
        import torch

        return torch

    def _alloc(self, nbytes: int) -> Any:
        m, f = self.mod, self.framework
        if f == "torch":
            x = m.empty(nbytes, dtype=m.uint8, device="cuda")
            m.cuda.synchronize()
            return x
        if f == "cupy":
            x = m.empty(nbytes, dtype=m.uint8)
            m.cuda.Device().synchronize()
            return x
        if f == "jax":
            x = m.numpy.zeros((nbytes,), dtype=m.numpy.uint8)
            x.block_until_ready()
            return x
        with m.device("/GPU:0"):
            return m.zeros((nbytes,), dtype=m.uint8)

    def _check_gpu(self) -> None:
        """Raise :class:`NoGPU` when the framework sees no GPU (a CPU build, no driver)."""
        m, f = self.mod, self.framework
        if f == "torch" and not m.cuda.is_available():
            raise NoGPU(f"torch {m.__version__} sees no GPU (CUDA build: {m.version.cuda})")
        if f == "tensorflow" and not m.config.list_physical_devices("GPU"):
            raise NoGPU(f"tensorflow {m.__version__} sees no GPU")
        if f == "jax":
            try:
                m.devices("gpu")
            except RuntimeError as exc:
                raise NoGPU(f"jax {m.__version__} sees no GPU ({_error(exc)})") from exc
        if f == "cupy":
            try:
                count = m.cuda.runtime.getDeviceCount()
            except Exception as exc:
                raise NoGPU(f"cupy {m.__version__} sees no GPU ({_error(exc)})") from exc
            if not count:
                raise NoGPU(f"cupy {m.__version__} sees no GPU")

    def _release_cache(self) -> None:
        try:
            if self.framework == "torch":
                self.mod.cuda.empty_cache()
            elif self.framework == "cupy":
                self.mod.get_default_memory_pool().free_all_blocks()
        except Exception:
            pass

    def reserved_mb(self) -> int | None:
        """What the framework's allocator holds from the GPU (MiB): NVML's figure minus this is
        the CUDA context and libraries, the part outside every framework cap."""
        m, f = self.mod, self.framework
        try:
            if f == "torch":
                return int(m.cuda.memory_reserved(0)) // MIB
            if f == "cupy":
                return int(m.get_default_memory_pool().total_bytes()) // MIB
            if f == "jax":
                stats = m.devices()[0].memory_stats() or {}
                for key in ("pool_bytes", "bytes_reserved", "bytes_in_use"):
                    if key in stats:
                        return int(stats[key]) // MIB
            return None
        except Exception:
            return None

    def warm(self) -> dict[str, Any]:
        """Real work: a matrix product (and a convolution in PyTorch) loads the math libraries'
        kernels, which grows the CUDA context past its size after the first allocation."""
        m, f = self.mod, self.framework
        t0 = time.perf_counter()
        if f == "torch":
            a = m.randn(1024, 1024, device="cuda")
            (a @ a).sum().item()
            x = m.randn(8, 3, 64, 64, device="cuda")
            w = m.randn(16, 3, 3, 3, device="cuda")
            m.nn.functional.conv2d(x, w).sum().item()
            del a, x, w
        elif f == "cupy":
            a = m.random.standard_normal((1024, 1024), dtype=m.float32)
            float((a @ a).sum())
            del a
        elif f == "jax":
            a = m.numpy.ones((1024, 1024), dtype=m.numpy.float32)
            float((a @ a).sum())
            del a
        else:
            with m.device("/GPU:0"):
                a = m.random.normal((1024, 1024))
                float(m.reduce_sum(m.matmul(a, a)))
        return {
            "event": "warm",
            "reserved_mb": self.reserved_mb(),
            "warm_s": round(time.perf_counter() - t0, 3),
            **({"memory_stats": self._jax_stats()} if f == "jax" else {}),
        }

    def _jax_stats(self) -> dict[str, Any]:
        try:
            return {k: int(v) for k, v in (self.mod.devices()[0].memory_stats() or {}).items()}
        except Exception as exc:
            return {"error": _error(exc)}

    def _device(self) -> str:
        m, f = self.mod, self.framework
        try:
            if f == "torch":
                return str(m.cuda.get_device_name(0))
            if f == "jax":
                return str(m.devices()[0])
            if f == "cupy":
                props = m.cuda.runtime.getDeviceProperties(0)
                name = props.get("name", b"")
                return name.decode() if isinstance(name, bytes) else str(name)
            return str(m.config.list_logical_devices("GPU"))
        except Exception as exc:
            return f"unknown ({type(exc).__name__}: {exc})"

    # -- the steps -----------------------------------------------------------------------
    def init(self, warm: bool = False) -> dict[str, Any]:
        """Import the framework (the launcher caps it) and create its CUDA context; with
        ``warm``, do some real work too (:meth:`warm`)."""
        t0 = time.perf_counter()
        self.mod = self._import()
        self._check_gpu()
        self.held.append(self._alloc(1))
        caps = sys.modules.get("gpu_lease_caps")
        report = getattr(caps, "REPORT", {}).get(self.framework) if caps else None
        return {
            "event": "ready",
            "framework": self.framework,
            "version": str(getattr(self.mod, "__version__", "?")),
            "device": self._device(),
            "cap_mb": cap_mb(),
            "cap_report": report,
            "pid": os.getpid(),
            "init_s": round(time.perf_counter() - t0, 3),
            "reserved_mb": self.reserved_mb(),
            **({"warm": self.warm()} if warm else {}),
        }

    def push_past(self, cap: int, margin_mb: int | None = None) -> dict[str, Any]:
        """Ask for more than ``cap`` MiB: one block, then chunks; keep what was granted."""
        margin = margin_mb if margin_mb is not None else max(256, cap // 8)
        out: dict[str, Any] = {"event": "holding", "framework": self.framework, "cap_mb": cap}
        try:
            block = self._alloc((cap + margin) * MIB)
            out["block"] = {"asked_mb": cap + margin, "refused": False}
            del block
            self._release_cache()
        except Exception as exc:
            out["block"] = {"asked_mb": cap + margin, "refused": True, "error": _error(exc)}
        chunk = max(64, math.ceil(cap / 32))
        limit = cap + margin + chunk
        got = 0
        refusal = None
        while got < limit:
            try:
                self.held.append(self._alloc(chunk * MIB))
            except Exception as exc:
                refusal = _error(exc)
                break
            got += chunk
        out["chunks"] = {"chunk_mb": chunk, "granted_mb": got, "refused": refusal}
        out["held"] = bool(out["block"]["refused"]) and refusal is not None and got <= cap
        return out

    def free(self) -> None:
        self.held.clear()
        self._release_cache()


def cap_mb() -> int | None:
    try:
        value = int(os.environ.get("GPU_LEASE_MEMORY_MB", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _say(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] not in FRAMEWORKS:
        sys.stderr.write(f"usage: python -m provisioner.node.probe {{{','.join(FRAMEWORKS)}}}\n")
        return 2
    cap = cap_mb()
    if cap is None:
        sys.stderr.write("GPU_LEASE_MEMORY_MB is not set: the probe needs a lease's cap\n")
        return 2
    probe = Probe(args[0])
    try:
        _say(probe.init(warm=True))
    except NoGPU as exc:
        _say({"event": "error", "step": "init", "no_gpu": True, "error": str(exc)})
        return 1
    except Exception as exc:
        _say({"event": "error", "step": "init", "error": _error(exc)})
        return 1
    if not sys.stdin.readline():
        return 0
    try:
        _say(probe.push_past(cap))
    except Exception as exc:
        _say({"event": "error", "step": "allocate", "error": _error(exc)})
        return 1
    sys.stdin.readline()
    probe.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
