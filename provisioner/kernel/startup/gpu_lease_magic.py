"""The ``%gpu`` IPython magic: what GPU lease this kernel holds (runs inside the kernel).

Loaded by IPython at kernel start through ``--ext=gpu_lease_magic`` (added to the
kernel's argv by the provisioner; served by the launcher's import hook). Also by hand:
``%load_ext gpu_lease_magic``. Imports nothing from the ``provisioner`` package.

``%gpu`` prints the lease; ``%gpu --json`` returns it as a dict. Sources: the
environment set by the provisioner (``GPU_LEASE_*``), the JSON state file it rewrites
on each renewal (``GPU_LEASE_STATE_FILE``: ``state``, ``expires_at``, ``reason``),
``gpu_lease_caps.REPORT`` (caps applied to imported frameworks), and NVML for the
memory this process uses on the GPU.

Parking: while others wait, the broker may park this kernel's GPU memory in
host RAM (the lease's state ``parking``/``parked``; ``resuming`` while it comes back). The
extension's ``pre_run_cell`` hook (:class:`ParkedCellHook`) then makes a cell wait for its
GPU memory: it creates ``<state file>.resume`` (the provisioner's lease keeper sees it and
asks the broker to resume), prints the place in the queue as it changes, and lets the cell
run once the state file says ``active``. Interrupting the kernel stops the wait (the cell
does not run; the resume goes on). When the kernel is not parked the hook costs one read of
the small state file per cell (measured ~15 us; see tests/test_parking_kernel.py).
"""

import ast
import json
import os
import time

MIB = 1024 * 1024
FRAMEWORKS = ("tensorflow", "torch", "jax", "cupy")
#: a parked lease's states (alive; its GPU memory in host RAM, or on its way there or back)
PARK_STATES = ("parking", "parked", "resuming")
#: how often a cell that waits for its parked GPU memory reads the state file (s)
RESUME_POLL = 0.2


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
        "parked_at": (state or {}).get("parked_at"),
        "position": (state or {}).get("position"),
        "eta_seconds": (state or {}).get("eta_seconds"),
        "expires_at": (state or {}).get("expires_at"),
        "reason": (state or {}).get("reason"),
        "session": (state or {}).get("session"),
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
        if state in PARK_STATES:
            state = parked_text(info, now)
        if info.get("reason"):
            state += f" ({info['reason']})"
        lines.append(f"  state:      {state}")
        if info.get("session"):
            lines.append(f"  class:      {info['session']}")
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


def ordinal(n):
    """1 -> "1st", 2 -> "2nd", 11 -> "11th", 22 -> "22nd" (as JupyterLab's status bar)."""
    if 11 <= n % 100 <= 13:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def about(seconds):
    """An estimated wait in words: "about 40 s", "about 4 min", "about 1 h 20 min"."""
    seconds = max(0, round(seconds))
    if seconds < 90:
        return f"about {seconds} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min"
    hours, rest = divmod(minutes, 60)
    return f"about {hours} h {rest} min" if rest else f"about {hours} h"


def _when(stamp, now):
    """A time of day with how long ago: "14:02:11, 12 min ago"."""
    ago = max(0, now - stamp)
    ago_text = f"{round(ago)} s ago" if ago < 90 else f"{round(ago / 60)} min ago"
    return f"{time.strftime('%H:%M:%S', time.localtime(stamp))}, {ago_text}"


def resume_line(state):
    """What a waiting cell prints for one state-file reading of a parked lease, or None."""
    if not isinstance(state, dict) or state.get("state") not in PARK_STATES:
        return None
    position = state.get("position")
    eta = state.get("eta_seconds")
    if isinstance(position, int) and not isinstance(position, bool) and position > 0:
        line = f"resuming: {ordinal(position)} in queue"
        if isinstance(eta, (int, float)) and not isinstance(eta, bool):
            line += f" ({about(eta)})"
        return line
    if state.get("state") == "resuming":
        return "resuming: restoring the GPU memory…"
    if state.get("state") == "parking":
        return "resuming: the GPU memory is still being parked; it comes back right after…"
    return None  # parked, no place in the queue yet


def parked_text(info, now):
    """``%gpu``'s state line for a parked lease: since when, and the resume's place."""
    state = info.get("state")
    parked_at = info.get("parked_at")
    text = {"parking": "parking (its GPU memory is being moved to host RAM)"}.get(
        state, "parked (its GPU memory is in host RAM)" if state == "parked" else "resuming"
    )
    if isinstance(parked_at, (int, float)) and not isinstance(parked_at, bool):
        text += f" since {_when(parked_at, now)}"
    line = resume_line(info) if info.get("position") else None
    if line:
        text += f"; {line}"
    elif state != "resuming":
        text += "; running a cell resumes it, variables are kept"
    return text


def wait_for_resume(path, *, out=print, poll=RESUME_POLL, clock=time.monotonic, sleep=time.sleep):
    """Make the cell about to run wait for its parked GPU memory (``path``: the state file).

    Asks the lease keeper for the resume (creates ``<path>.resume``), says so, prints each
    change of the place in the queue, and returns ``("active", seconds)`` once the state
    file says ``active``, or ``("ended", reason)`` when the lease ended instead (the file
    says revoked/expired/released, or is gone). ``KeyboardInterrupt`` (the kernel
    interrupted) is not caught here: the caller stops waiting.
    """
    started = clock()
    try:
        fd = os.open(f"{path}.resume", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
    except OSError as exc:
        return "ended", (
            f"this kernel's GPU memory is parked, and the request to resume it could not be "
            f"made ({exc}); restart the kernel"
        )
    out("GPU parked: resuming before this cell runs…")
    last = None
    while True:
        data, note = read_state(path)
        state = (data or {}).get("state")
        if state == "active":
            return "active", clock() - started
        if state not in PARK_STATES:
            if data is None and "has not been written" not in note:
                reason = note  # unreadable: say so rather than wait for ever
            elif data is None:
                reason = "the GPU lease was released"
            else:
                reason = f"the GPU lease was {state}"
                if data.get("reason"):
                    reason += f": {data['reason']}"
            return "ended", reason
        line = resume_line(data)
        if line and line != last:
            out(line)
            last = line
        sleep(poll)


#: set by the node agent for a remote kernel: where it runs and in which folder; the first
#: cell prints it once (``provisioner/node/launcher.py``)
REMOTE_NOTE = "GPU_LEASE_REMOTE_NOTE"


class ParkedCellHook:
    """The ``pre_run_cell`` hook: a cell run while the kernel is parked waits for its GPU.

    Registered by :func:`load_ipython_extension`. When the state file says the lease is
    not parked (nearly always) the hook costs one small file read. Otherwise it waits
    (:func:`wait_for_resume`) and prints how it ended; when the wait was interrupted or the
    lease ended, the cell does not run: :meth:`visit` (an IPython AST transformer) turns
    that cell into the ``KeyboardInterrupt`` or the error, so queued cells stop too.
    """

    def __init__(self, path=None, *, out=print, poll=RESUME_POLL):
        self._path = path
        self.out = out
        self.poll = poll
        #: what the next cell raises instead of running (set by an interrupted or failed wait)
        self.pending = None

    @property
    def path(self):
        return self._path if self._path is not None else os.environ.get("GPU_LEASE_STATE_FILE")

    def __call__(self, info=None):
        self.pending = None
        note = os.environ.pop(REMOTE_NOTE, None)  # once: the first cell's output says it
        if note:
            self.out(note)
        path = self.path
        if not path or quick_state(path) not in PARK_STATES:
            return
        if _only_gpu_magic(getattr(info, "raw_cell", None)):
            return  # %gpu shows the parked state (and the resume's place) without waiting
        try:
            how, detail = wait_for_resume(path, out=self.out, poll=self.poll)
        except KeyboardInterrupt:
            self.out(
                "Stopped waiting for the GPU: this cell did not run. The GPU memory keeps "
                "coming back meanwhile; run the cell again to wait for it."
            )
            self.pending = ("interrupt", None)
            return
        if how == "active":
            self.out(f"GPU resumed in {detail:.1f} s; your variables are intact.")
            return
        message = (
            f"This cell did not run: {str(detail).rstrip('.')}. The kernel's GPU memory "
            "cannot come back; restart the kernel and run your notebook again."
        )
        self.out(message)
        self.pending = ("ended", message)

    def visit(self, node):
        """IPython's AST transformer hook: the cell's code, or its replacement."""
        pending, self.pending = self.pending, None
        if pending is None:
            return node
        if pending[0] == "interrupt":
            code = "raise KeyboardInterrupt"
        else:
            code = f"raise RuntimeError({pending[1]!r})"
        return ast.parse(code)


def _only_gpu_magic(cell):
    """A cell that is just ``%gpu ...``: it may run while parked (it uses no GPU)."""
    lines = [x.strip() for x in (cell or "").splitlines() if x.strip()]
    return len(lines) == 1 and lines[0].split()[0] == "%gpu"


def quick_state(path):
    """The ``state`` in the state file at ``path``, or None: one small read per cell.

    The keeper writes it with ``json.dump``'s separators, so an active lease is found
    without parsing; anything else is parsed.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if b'"state": "active"' in raw:
        return "active"
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data.get("state") if isinstance(data, dict) else None


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
    """``%gpu``, and the hook that makes a cell in a parked kernel wait for its GPU memory."""
    ipython.register_magic_function(gpu, magic_kind="line", magic_name="gpu")
    for old in [h for h in ipython.ast_transformers if isinstance(h, ParkedCellHook)]:
        ipython.ast_transformers.remove(old)  # loaded twice (%load_ext, %reload_ext)
        ipython.events.unregister("pre_run_cell", old)
    hook = ParkedCellHook()
    ipython.events.register("pre_run_cell", hook)
    ipython.ast_transformers.append(hook)
