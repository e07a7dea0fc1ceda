"""The ``%gpu`` IPython magic: what GPU lease this kernel holds (runs inside the kernel).

Loaded by IPython at kernel start through ``--ext=gpu_lease_magic`` (added to the
kernel's argv by the provisioner; served by the launcher's import hook). Also by hand:
``%load_ext gpu_lease_magic``. Imports nothing from the ``provisioner`` package.

``%gpu`` prints the lease; ``%gpu --json`` returns it as a dict. Sources: the
environment set by the provisioner (``GPU_LEASE_*``), the JSON state file it rewrites
on each renewal (``GPU_LEASE_STATE_FILE``: ``state``, ``expires_at``, ``reason``),
``gpu_lease_caps.REPORT`` (caps applied to imported frameworks), and NVML for the
memory this process uses on the GPU.
"""

import json
import os
import time

MIB = 1024 * 1024
FRAMEWORKS = ("tensorflow", "torch", "jax", "cupy")


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def read_state(path):
    """The lease state the provisioner last wrote, or ``(None, why not)``."""
    if not path:
        return None, "state unknown (no state file)"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, "state unknown (the state file has not been written)"
    except (OSError, ValueError) as exc:
        return None, f"state unknown (cannot read {path}: {exc})"
    if not isinstance(data, dict):
        return None, "state unknown (the state file holds no JSON object)"
    return data, ""


def caps_report():
    """framework -> what was applied, from ``gpu_lease_caps.REPORT`` (if the launcher ran)."""
    try:
        import gpu_lease_caps
    except ImportError:
        return None
    return dict(gpu_lease_caps.REPORT)


def process_gpu_memory(uuid, pid=None):
    """MiB this process uses on the GPU ``uuid`` according to NVML, or ``(None, why not)``."""
    pid = os.getpid() if pid is None else pid
    try:
        import pynvml
    except ImportError:
        return None, "pynvml (nvidia-ml-py) is not installed in this kernel's environment"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return None, f"NVML is not available ({exc})"
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        processes = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        for process in processes:
            if process.pid == pid:
                used = process.usedGpuMemory
                if used is None:
                    return None, "the driver does not report per-process memory here"
                return used // MIB, ""
        return None, (
            "NVML lists no GPU memory for this process (no CUDA context yet, "
            "or a container's PID namespace hides it)"
        )
    except Exception as exc:
        return None, f"NVML cannot tell ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def lease_info():
    """Everything ``%gpu`` shows, as a JSON-able dict."""
    env = os.environ
    lease_id = env.get("GPU_LEASE_ID")
    if not lease_id:
        return {"lease": None, "message": "This kernel has no GPU lease."}
    uuid = env.get("GPU_LEASE_GPU_UUID") or env.get("CUDA_VISIBLE_DEVICES", "")
    state, state_note = read_state(env.get("GPU_LEASE_STATE_FILE"))
    used_mb, used_note = process_gpu_memory(uuid) if uuid else (None, "no GPU UUID")
    return {
        "lease": lease_id,
        "gpu": {
            "uuid": uuid,
            "name": env.get("GPU_LEASE_GPU_NAME"),
            "memory_mb": _int(env.get("GPU_LEASE_GPU_MEMORY_MB")),
        },
        "fraction": env.get("GPU_LEASE_FRACTION"),
        "memory_limit_mb": _int(env.get("GPU_LEASE_MEMORY_MB")),
        "enforcement": env.get("GPU_LEASE_ENFORCEMENT", "cooperative"),
        "state": (state or {}).get("state"),
        "expires_at": (state or {}).get("expires_at"),
        "reason": (state or {}).get("reason"),
        "state_note": state_note,
        "enforced_by": enforced_by(env.get("GPU_LEASE_ENFORCEMENT", "cooperative"), state),
        "mps_server": mps_server(env.get("GPU_LEASE_ENFORCEMENT", "cooperative"), state),
        "agent_used_mb": (state or {}).get("used_mb"),
        "caps": caps_report(),
        "process_memory_mb": used_mb,
        "process_memory_note": used_note,
    }


def enforced_by(enforcement, state):
    """Which layers hold this kernel's memory cap, in words (``%gpu`` and ``--json``)."""
    state = state or {}
    layers = ["framework caps (cooperative: code can lift them)"]
    if enforcement == "mps":
        mps = state.get("mps")
        if mps == "running":
            layers.insert(0, "MPS (the driver refuses allocations past the cap)")
        elif mps == "down":
            layers.append("MPS requested, but the GPU's MPS daemon is down: not enforced")
        else:
            layers.append("MPS requested; no node agent reports an MPS daemon on this GPU")
    node = state.get("node_enforcement")
    if node and node.startswith("driver+"):  # the node's driver caps the kernel's cgroup
        layers.insert(0, "the driver's memory limit on this kernel's cgroup (hard)")
        node = node[len("driver+") :]
    if node and node.startswith("agent-"):
        mode = node[len("agent-") :]
        what = {
            "off": "measures usage only",
            "report": "reports use past the cap to admins",
            "revoke": "revokes the lease when use stays past the cap",
            "kill": "revokes the lease and kills its GPU processes when use stays past the cap",
        }.get(mode, mode)
        layers.append(f"node agent ({mode}: {what})")
    return layers


def mps_server(enforcement, state, uid=None):
    """Whom the GPU's MPS server serves, for an enforcement=mps kernel (else None).

    MPS serves one Unix user per GPU at a time: the broker places an MPS kernel only where
    it serves the kernel's user or nobody, but a process outside any lease can still take
    it, and then this kernel's CUDA calls wait until that user's processes end.
    """
    if enforcement != "mps":
        return None
    state = state or {}
    uid = os.getuid() if uid is None else uid
    server = state.get("mps_server_uid")
    if server is None:
        if state.get("mps") != "running":
            return None
        return "serves no one yet (it starts for your user at your first CUDA call)"
    if server == uid:
        return f"serves your user (uid {server})"
    return (
        f"serves another user (uid {server}): MPS serves one user per GPU at a time, so "
        "this kernel's CUDA calls wait until that user's GPU processes end"
    )


def format_info(info, now=None):
    """The text ``%gpu`` prints for ``info`` (from :func:`lease_info`)."""
    if not info.get("lease"):
        return info.get("message", "This kernel has no GPU lease.")
    now = time.time() if now is None else now
    gpu = info["gpu"]
    total = f", {gpu['memory_mb']} MiB" if gpu.get("memory_mb") else ""
    lines = [
        f"GPU lease {info['lease']}",
        f"  GPU:        {gpu.get('name') or 'unknown'} ({gpu['uuid']}{total})",
        f"  fraction:   {info.get('fraction') or 'unknown'}",
        f"  memory cap: {info.get('memory_limit_mb')} MiB ({info['enforcement']})",
    ]
    for n, layer in enumerate(info.get("enforced_by") or []):
        lines.append(f"  {'held by:' if n == 0 else '':<11} {layer}")
    if info.get("mps_server"):
        lines.append(f"  MPS server: {info['mps_server']}")
    if info.get("agent_used_mb") is not None:
        lines.append(f"  in use:     {info['agent_used_mb']} MiB (the node agent's last sample)")
    if info.get("state"):
        state = str(info["state"])
        expires = info.get("expires_at")
        if isinstance(expires, (int, float)) and state == "active":
            state += f", expires in {max(0, round(expires - now))} s unless renewed"
        if info.get("reason"):
            state += f" ({info['reason']})"
        lines.append(f"  state:      {state}")
    else:
        lines.append(f"  state:      {info.get('state_note') or 'state unknown'}")
    caps = info.get("caps")
    if caps is None:
        lines.append("  caps:       unknown (the kernel was not started by the GPU lease launcher)")
    else:
        lines.append("  caps:")
        for name in FRAMEWORKS:
            lines.append(f"    {name + ':':<11} {caps.get(name, 'not imported yet')}")
    if info.get("process_memory_mb") is not None:
        lines.append(f"  this process uses {info['process_memory_mb']} MiB on the GPU")
    else:
        lines.append(f"  GPU memory of this process: unknown: {info.get('process_memory_note')}")
    return "\n".join(lines)


def gpu(line=""):
    """Show this kernel's GPU lease. ``%gpu --json`` returns it as a dict."""
    args = line.split()
    unknown = [a for a in args if a != "--json"]
    if unknown:
        print(f"usage: %gpu [--json]  (unknown: {' '.join(unknown)})")
        return None
    info = lease_info()
    if "--json" in args:
        return info
    print(format_info(info))
    return None


def load_ipython_extension(ipython):
    ipython.register_magic_function(gpu, magic_kind="line", magic_name="gpu")
