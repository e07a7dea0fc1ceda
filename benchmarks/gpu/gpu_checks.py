"""The checks that need a real NVIDIA GPU, in one run: results for ``benchmarks/gpu/README.md``.

Run on a GPU node, from a checkout (or with the package installed)::

    python benchmarks/gpu/gpu_checks.py --out /tmp/gpu-checks      # about 3-5 minutes

What it does, each step on its own (a step that fails is recorded, the next one runs):

1. facts: ``nvidia-smi``'s GPU, driver and memory, Python, the frameworks' versions;
2. ``gpu-lease doctor --json`` (NVML, MPS, frameworks, the CUDA context of each framework and
   capped processes allocating past their caps), with its exit status;
3. a real broker (``--gpus agents``, SQLite, static tokens) and a real node agent
   (``--gpus nvml --enforce report``): the GPUs it registers from NVML;
4. for each framework and fraction: a real ipykernel started through ``GPULeaseProvisioner``
   (``AsyncKernelManager``), which imports the framework and creates its CUDA context
   (:class:`provisioner.node.probe.Probe`), then asks for more than its cap: one block, then
   chunks. NVML's memory for the kernel's pid is read when idle and at the peak, beside what
   the agent reported to the broker for the lease (``GET /leases/{id}``'s ``used_mb``);
5. escape: in a PyTorch kernel at the smallest fraction the user's code lifts the
   cooperative cap (``set_per_process_memory_fraction(1.0)``) and allocates past it: the
   agent must report the over-use to the broker; then with the agent's ``--enforce revoke``
   and ``--enforce kill``, the lease must end and the kernel stop;
6. with ``--mps`` and ``nvidia-cuda-mps-control`` on PATH: the same escape in a kernel with
   ``enforcement=mps`` under the agent's MPS daemon, where the driver must refuse it;
7. with ``--park``: a PyTorch kernel holding 1 GiB and 8 GiB is parked and resumed through
   the driver's checkpoint API (``park_density.park_check``);
8. with ``--density``: 50 kernels at 0.02 train a small CNN at once, against one exclusive
   kernel, without and (with ``--mps``) with MPS (``park_density.density_check``).

``--device cpu`` runs steps 7-8 with no GPU, against the stand-in NVML and libcuda
(``tests/test_gpu_checks.py``), so the script is known to run before a device call.

Writes ``gpu_checks.json`` (everything) and ``gpu_checks.txt`` (a summary) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

from provisioner import inventory  # noqa: E402
from provisioner.devtools.testing import (  # noqa: E402
    BrokerProcess,
    execute,
    stop_process,
    wait_for,
)
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import park_density  # noqa: E402

NODE = "gpu-node"
FRAMEWORK_DISTS = {
    "torch": ["torch"],
    "jax": ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"],
    "cupy": ["cupy-cuda13x", "cupy-cuda12x", "cupy"],
    "tensorflow": ["tensorflow"],
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def step(results: dict[str, Any], name: str):  # type: ignore[no-untyped-def]
    """Decorator-free guard: ``with step(results, "x") as rec:`` records errors and time."""

    class _Step:
        def __enter__(self) -> dict[str, Any]:
            self.t0 = time.monotonic()
            self.rec: dict[str, Any] = results.setdefault(name, {})
            log(f"{name} ...")
            return self.rec

        def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
            self.rec["seconds"] = round(time.monotonic() - self.t0, 1)
            if exc is not None:
                self.rec["error"] = f"{type(exc).__name__}: {exc}"
                self.rec["traceback"] = traceback.format_exc()[-3000:]
                log(f"{name} FAILED: {self.rec['error']}")
            else:
                log(f"{name} done in {self.rec['seconds']} s")
            return True

    return _Step()


# -- 1. facts -----------------------------------------------------------------------------------
def facts() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    versions = {}
    for dists in FRAMEWORK_DISTS.values():
        for dist in dists:
            try:
                versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    for dist in ("nvidia-ml-py", "jupyter_client", "ipykernel", "tornado", "jupyter-gpu-lease"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    out["versions"] = versions
    out["mps_control"] = shutil.which("nvidia-cuda-mps-control")
    return out


# -- 2. doctor ------------------------------------------------------------------------------------
def doctor(rec: dict[str, Any], env: dict[str, str]) -> None:
    for fmt in ("--json", None):
        args = [sys.executable, "-m", "provisioner", "doctor", *([fmt] if fmt else [])]
        p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
        if fmt:
            rec["exit_status"] = p.returncode
            rec["stderr"] = p.stderr[-3000:]
            rec["checks"] = json.loads(p.stdout)["checks"] if p.stdout.strip() else None
        else:
            rec["text"] = p.stdout


# -- 3. broker and agent ------------------------------------------------------------------------
class Site:
    """A broker (agents' GPUs only) and one node agent on this machine's GPUs."""

    def __init__(self, tmp: Path, env: dict[str, str], context_overhead_mb: int = 512) -> None:
        self.tmp = tmp
        self.env = env
        self.broker = BrokerProcess(
            tmp,
            f"sqlite:///{tmp / 'broker.sqlite'}",
            {"alice": ([], False), "admin": ([], True)},
            gpus="agents",
            extra=(
                "--GPULeaseBroker.overuse_grace=2",
                f"--GPULeaseBroker.context_overhead_mb={context_overhead_mb}",
                "--GPULeaseBroker.node_grace=15",
                "--GPULeaseBroker.reap_interval=0.5",
            ),
            env=env,
        )
        data = json.loads(self.broker.tokens_file.read_text())
        self.agent_token = f"agent-{uuid.uuid4().hex}"
        data[self.agent_token] = {"agent": True, "node": NODE}
        self.broker.tokens_file.write_text(json.dumps(data))
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_logs: list[Path] = []

    def headers(self, user: str) -> dict[str, str]:
        return {"Authorization": f"token {self.broker.tokens[user]}"}

    def get(self, path: str, user: str = "admin") -> Any:
        r = httpx.get(f"{self.broker.url}/api/v1{path}", headers=self.headers(user), timeout=30)
        r.raise_for_status()
        return r.json()

    def start_agent(self, *extra: str) -> None:
        self.stop_agent()
        env = dict(self.env)
        env["GPU_LEASE_AGENT_TOKEN"] = self.agent_token
        path = self.tmp / f"agent-{len(self.agent_logs)}.log"
        self.agent_logs.append(path)
        cmd = [sys.executable, "-m", "provisioner.node.agent", "--broker-url", self.broker.url]
        cmd += ["--node", NODE, "--interval", "1", "--gpus", "nvml", *extra]
        with open(path, "ab") as f:
            self.agent = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

        def up() -> bool:
            assert self.agent is not None
            if self.agent.poll() is not None:
                raise RuntimeError(f"the agent exited: {path.read_text()[-2000:]}")
            nodes = {n["node"]: n for n in self.get("/nodes")["nodes"]}
            return nodes.get(NODE, {}).get("state") == "up"

        wait_for(up, timeout=60)

    def stop_agent(self) -> None:
        if self.agent is not None:
            stop_process(self.agent, 30)
        self.agent = None

    def agent_log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.agent_logs)


def nvml_used(pid: int) -> int | None:
    """NVML's memory (MiB) for ``pid`` on every GPU, or None when NVML lists no such process."""
    nvml = inventory._nvml_module(inventory.NVML_MODULE)
    nvml.nvmlInit()
    try:
        found = [mb for p, _u, mb in inventory.running_processes(nvml) if p == pid]
    finally:
        nvml.nvmlShutdown()
    return sum(found) if found else None


def nvml_free_mb() -> int | None:
    """NVML's free memory (MiB) on the first GPU, or None where NVML has no GPU."""
    nvml = inventory._nvml_module(inventory.NVML_MODULE)
    nvml.nvmlInit()
    try:
        if nvml.nvmlDeviceGetCount() < 1:
            return None
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
        return int(info.free) // 2**20
    finally:
        nvml.nvmlShutdown()


# -- 4. kernels -------------------------------------------------------------------------------
class Kernels:
    def __init__(self, tmp: Path, site: Site) -> None:
        self.tmp = tmp
        self.site = site
        self.specs = tmp / "jupyter" / "kernels"
        os.environ["JUPYTER_PATH"] = str(tmp / "jupyter")
        os.environ["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
        os.environ["GPU_LEASE_URL"] = site.broker.url
        os.environ["GPU_LEASE_TOKEN"] = site.broker.tokens["alice"]
        os.environ["GPU_LEASE_NODE"] = NODE
        (tmp / "runtime").mkdir(exist_ok=True)

    def spec(self, fraction: float, enforcement: str = "cooperative", **config: Any) -> str:
        name = f"gpu-{fraction:g}-{enforcement}{'-' + str(len(config)) if config else ''}"
        spec = build_kernelspec(fraction, python=sys.executable)
        spec["metadata"]["kernel_provisioner"]["config"].update(
            {"renew_interval": 1.0, "enforcement": enforcement, **config}
        )
        folder = self.specs / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.json").write_text(spec_json(spec))
        return name

    async def start(self, name: str) -> AsyncKernelManager:
        km = AsyncKernelManager(
            kernel_name=name,
            connection_file=str(self.tmp / "runtime" / f"kernel-{uuid.uuid4()}.json"),
        )
        await km.start_kernel()
        return km


async def run(
    km: AsyncKernelManager, code: str, timeout: float = 300
) -> tuple[str, dict[str, Any]]:
    """Execute ``code``; (its stdout + stderr, the reply's content)."""
    return await execute(km, code, ready_timeout=120, timeout=timeout)


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise ValueError(f"no JSON line in the kernel's output: {text[-1500:]}")


def kernel_pid(km: AsyncKernelManager) -> int:
    pid = getattr(km.provisioner, "pid", None)
    if pid is None:
        raise RuntimeError("the provisioner has no pid")
    return int(pid)


def lease_of(site: Site, kernel_id: str) -> dict[str, Any]:
    found = [
        x
        for x in site.get("/leases?all=1")["leases"]
        if x["kernel_id"] == kernel_id and x["state"] == "active"
    ]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} active leases for kernel {kernel_id}")
    return found[0]


async def reported_used(site: Site, lease_id: str, at_least: int, timeout: float = 8) -> Any:
    """The lease's ``used_mb`` once the agent reported ``at_least`` MiB (or what it says at the end)."""
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = site.get(f"/leases/{lease_id}")
        if (body.get("used_mb") or 0) >= at_least:
            break
        await asyncio.sleep(0.5)
    return {"used_mb": body.get("used_mb"), "enforcement": body.get("enforcement")}


async def probe_init(km: AsyncKernelManager, framework: str, rec: dict[str, Any]) -> bool:
    """Start the probe in the kernel (import, CUDA context); its event in ``rec["init"]``, or
    the error in ``rec["init_error"]`` (then False)."""
    out, reply = await run(
        km,
        "import json, os\nfrom provisioner.node.probe import Probe\n"
        f"_probe = Probe({framework!r})\nprint(json.dumps(_probe.init()))",
    )
    if reply["status"] != "ok":
        rec["init_error"] = out[-2000:] or reply
        return False
    rec["init"] = last_json(out)
    return True


async def framework_check(kernels: Kernels, framework: str, fraction: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"framework": framework, "fraction": fraction}
    t0 = time.monotonic()
    km = await kernels.start(kernels.spec(fraction))
    rec["kernel_start_s"] = round(time.monotonic() - t0, 2)
    try:
        pid = kernel_pid(km)
        lease = lease_of(kernels.site, km.kernel_id)
        rec["lease"] = {k: lease.get(k) for k in ("id", "fraction", "memory_limit_mb", "gpu")}
        if not await probe_init(km, framework, rec):
            return rec
        await asyncio.sleep(1.0)
        rec["idle_nvml_mb"] = nvml_used(pid)
        out, reply = await run(km, "print(json.dumps(_probe.warm()))")
        if reply["status"] != "ok":
            rec["warm_error"] = out[-2000:] or reply
            return rec
        rec["warm"] = last_json(out)
        await asyncio.sleep(1.0)
        rec["warm_nvml_mb"] = nvml_used(pid)
        if rec["warm_nvml_mb"] is not None:
            rec["context_mb"] = rec["warm_nvml_mb"] - (rec["warm"].get("reserved_mb") or 0)
        rec["warm_reported"] = await reported_used(
            kernels.site, lease["id"], rec["idle_nvml_mb"] or 1
        )
        out, reply = await run(
            km, "print(json.dumps(_probe.push_past(int(os.environ['GPU_LEASE_MEMORY_MB']))))"
        )
        if reply["status"] != "ok":
            rec["push_error"] = out[-2000:] or reply
            return rec
        rec["push"] = last_json(out)
        rec["peak_nvml_mb"] = nvml_used(pid)
        rec["peak_reported"] = await reported_used(
            kernels.site, lease["id"], rec["peak_nvml_mb"] or 1
        )
        await run(km, "_probe.free()")
        cap = int(lease["memory_limit_mb"])
        context = rec.get("context_mb") or rec["idle_nvml_mb"] or 0
        peak = rec["peak_nvml_mb"]
        rec["nvml_within_cap_plus_context"] = None if peak is None else peak <= cap + context + 64
        rec["held"] = (
            bool(rec["push"].get("held")) and rec["nvml_within_cap_plus_context"] is not False
        )
    finally:
        kid = km.kernel_id
        await km.shutdown_kernel(now=True)
        await asyncio.sleep(0.5)
        left = [
            x
            for x in kernels.site.get("/leases?all=1")["leases"]
            if x["kernel_id"] == kid and x["state"] == "active"
        ]
        rec["lease_released_on_shutdown"] = not left
        rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


ESCAPE = """
import json, torch
cap = int(os.environ['GPU_LEASE_MEMORY_MB'])
torch.cuda.set_per_process_memory_fraction(1.0, 0)
_escape = {{"asked_mb": cap + {extra}}}
try:
    _big = torch.empty((cap + {extra}) * 2**20, dtype=torch.uint8, device='cuda')
    torch.cuda.synchronize()
    _escape["granted"] = True
except Exception as exc:
    _escape["granted"] = False
    _escape["error"] = type(exc).__name__ + ': ' + str(exc).splitlines()[0][:300]
print(json.dumps(_escape))
"""


async def escape_check(
    kernels: Kernels, fraction: float, enforcement: str, extra_mb: int = 2048
) -> dict[str, Any]:
    """A torch kernel lifts its own cap and allocates past it: who notices, who refuses."""
    rec: dict[str, Any] = {"fraction": fraction, "enforcement": enforcement}
    km = await kernels.start(kernels.spec(fraction, enforcement))
    try:
        pid = kernel_pid(km)
        lease = lease_of(kernels.site, km.kernel_id)
        rec["lease_id"] = lease["id"][:8]
        rec["cap_mb"] = lease["memory_limit_mb"]
        if not await probe_init(km, "torch", rec):
            return rec
        await asyncio.sleep(2.5)  # a renewal and a heartbeat: the state file has the node's view
        out, _ = await run(km, "%gpu")
        rec["gpu_magic_text"] = out
        out, _ = await run(
            km, "print(json.dumps(get_ipython().run_line_magic('gpu', '--json'), default=str))"
        )
        rec["gpu_magic"] = last_json(out)
        env_out, _ = await run(
            km,
            "print(json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith(('CUDA_MPS', 'GPU_LEASE_ENF'))}))",
        )
        rec["kernel_env"] = last_json(env_out)
        out, reply = await run(km, ESCAPE.format(extra=extra_mb))
        rec["escape"] = last_json(out) if reply["status"] == "ok" else out[-2000:]
        rec["peak_nvml_mb"] = nvml_used(pid)
        smi = shutil.which("nvidia-smi")
        if smi:  # the process type: C, or M+C under MPS
            q = subprocess.run([smi], capture_output=True, text=True, timeout=60)  # noqa: ASYNC221
            rec["nvidia_smi_processes"] = q.stdout[q.stdout.find("Processes:") :][-2500:]
        pipe = Path(rec["kernel_env"].get("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent/pipe"))
        if enforcement == "mps" and pipe.parent.is_dir():
            rec["mps_files"] = sorted(
                str(x.relative_to(pipe.parent)) for x in pipe.parent.rglob("*")
            )
            for name in ("control.log", "server.log"):
                f = pipe.parent / "log" / name
                if f.exists():
                    rec[f"mps_{name}"] = f.read_text(errors="replace")[-2500:]
        held_mb = int(lease["memory_limit_mb"]) + (rec["peak_nvml_mb"] or 0)
        rec["reported"] = await reported_used(kernels.site, lease["id"], held_mb // 2, timeout=10)
        await asyncio.sleep(4)  # overuse_grace=2 and a heartbeat each second
        rec["broker_flagged_overuse"] = (
            f"Lease {lease['id'][:6]}… of alice" in kernels.site.broker.log()
        )
    finally:
        await km.shutdown_kernel(now=True)
    return rec


async def enforce_check(kernels: Kernels, fraction: float, mode: str) -> dict[str, Any]:
    """The agent with ``--enforce revoke|kill``: a kernel that lifts its cap loses its lease
    (and, with kill, its GPU processes at once); its provisioner stops it."""
    site = kernels.site
    site.start_agent("--enforce", mode)
    rec: dict[str, Any] = {"enforce": mode, "fraction": fraction}
    km = await kernels.start(kernels.spec(fraction))
    try:
        lease = lease_of(site, km.kernel_id)
        rec["cap_mb"] = lease["memory_limit_mb"]
        if not await probe_init(km, "torch", rec):
            return rec
        t0 = time.monotonic()
        out, reply = await run(km, ESCAPE.format(extra=2048))
        rec["escape"] = last_json(out) if reply["status"] == "ok" else out[-2000:]
        body: dict[str, Any] = {}
        while time.monotonic() - t0 < 30:
            body = site.get(f"/leases/{lease['id']}")
            if body.get("state") != "active":
                break
            await asyncio.sleep(0.25)
        rec["lease_state"] = body.get("state")
        rec["reason"] = body.get("reason")
        rec["seconds_to_end"] = round(time.monotonic() - t0, 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and await km.is_alive():  # noqa: ASYNC110
            await asyncio.sleep(0.25)
        rec["kernel_alive_after"] = await km.is_alive()
        rec["seconds_to_kernel_gone"] = round(time.monotonic() - t0, 1)
        rec["nvml_mb_after"] = nvml_used(kernel_pid(km))
    finally:
        if km.has_kernel:
            await km.shutdown_kernel(now=True)
    return rec


async def mps_missing_check(kernels: Kernels, fraction: float, tmp: Path) -> dict[str, Any]:
    """An enforcement=mps kernel whose GPU has no MPS daemon where it looks: refused, no lease."""
    empty = tmp / "no-mps-here"
    empty.mkdir(exist_ok=True)
    rec: dict[str, Any] = {"mps_dir": str(empty)}
    try:
        km = await kernels.start(kernels.spec(fraction, "mps", mps_dir=str(empty)))
    except Exception as exc:
        rec["refused"] = True
        rec["error"] = f"{type(exc).__name__}: {exc}"
    else:
        rec["refused"] = False
        await km.shutdown_kernel(now=True)
    active = [x for x in kernels.site.get("/leases?all=1")["leases"] if x["state"] == "active"]
    rec["active_leases_after"] = len(active)
    return rec


# -- main -----------------------------------------------------------------------------------------
def summary(results: dict[str, Any]) -> str:
    lines = [f"gpu_checks {results['started']} on {results['facts'].get('nvidia_smi')}"]
    for key in ("doctor", "doctor_broker"):
        d = results.get(key, {})
        if d:
            lines.append(
                f"\n## {key} (exit status {d.get('exit_status')})\n{d.get('text', d.get('error'))}"
            )
    lines.append("## kernels: framework, fraction, cap, idle NVML, block, chunks, peak NVML, held")
    for r in results.get("kernels", {}).get("runs", []):
        push = r.get("push", {})
        block = push.get("block", {})
        chunks = push.get("chunks", {})
        lines.append(
            f"- {r.get('framework')} {r.get('fraction')}: cap {r.get('lease', {}).get('memory_limit_mb')}"
            f" MiB, idle {r.get('idle_nvml_mb')} MiB, warm {r.get('warm_nvml_mb')} MiB (context"
            f" {r.get('context_mb')}; agent {r.get('warm_reported', {}).get('used_mb')}),"
            f" block {block.get('asked_mb')} MiB {'refused' if block.get('refused') else 'GRANTED'}"
            f" ({block.get('error', '')[:80]}), chunks granted {chunks.get('granted_mb')} MiB then"
            f" {(chunks.get('refused') or 'none refused')[:80]}, peak {r.get('peak_nvml_mb')} MiB"
            f" (agent {r.get('peak_reported', {}).get('used_mb')}), held={r.get('held')},"
            f" released={r.get('lease_released_on_shutdown')}"
            + (
                f" ERROR {r.get('error') or r.get('init_error') or r.get('push_error')}"
                if r.get("error") or r.get("init_error") or r.get("push_error")
                else ""
            )
        )
    lines += park_density.summary_lines(results)
    for key in (
        "escape_cooperative",
        "enforce_revoke",
        "enforce_kill",
        "escape_mps",
        "mps_missing",
    ):
        if key in results:
            lines.append(f"## {key}\n{json.dumps(results[key], indent=1)[:3000]}")
    return "\n".join(lines) + "\n"


async def kernels_step(
    rec: dict[str, Any], kernels: Kernels, frameworks: list[str], fractions: list[float]
) -> None:
    rec["runs"] = []
    for fw in frameworks:
        for fraction in fractions:
            log(f"kernel {fw} at {fraction}")
            try:
                r = await framework_check(kernels, fw, fraction)
            except Exception as exc:
                r = {"framework": fw, "fraction": fraction, "error": f"{type(exc).__name__}: {exc}"}
                r["traceback"] = traceback.format_exc()[-3000:]
            log(f"  -> held={r.get('held')} {r.get('error', '')}")
            rec["runs"].append(r)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.25])
    parser.add_argument("--frameworks", nargs="+", default=None)
    parser.add_argument("--mps", action="store_true", help="also the MPS escape check")
    steps = ("doctor", "doctor-broker", "kernels", "escape", "enforce", "mps", "park", "density")
    parser.add_argument("--steps", nargs="+", choices=steps, default=list(steps[:6]))
    parser.add_argument("--park", action="store_true", help="also park/resume (step 7)")
    parser.add_argument("--density", action="store_true", help="also density (step 8)")
    parser.add_argument("--park-gib", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--density-fraction", type=float, default=0.02)
    parser.add_argument("--density-kernels", type=int, default=None, help="default: 1/fraction")
    parser.add_argument("--density-seconds", type=float, default=30.0)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: steps 7-8 on stand-ins"
    )
    parser.add_argument(
        "--context-overhead-mb", type=int, default=512, help="the broker's (default 512)"
    )
    args = parser.parse_args()
    args.steps += [s for s, on in (("park", args.park), ("density", args.density)) if on]
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-checks-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    def save() -> None:
        (args.out / "gpu_checks.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "gpu_checks.txt").write_text(summary(results))

    with step(results, "facts") as rec:
        rec.update(facts())
    if "doctor" in args.steps:
        with step(results, "doctor") as rec:
            doctor(rec, env)
        save()
    frameworks = args.frameworks or [
        fw
        for fw in ("torch", "jax", "cupy", "tensorflow")
        if any(d in results["facts"].get("versions", {}) for d in FRAMEWORK_DISTS[fw])
    ]
    site = Site(tmp, env, args.context_overhead_mb)
    try:
        with step(results, "site") as rec:
            site.broker.start(timeout=60)
            site.start_agent("--enforce", "report")
            rec["gpus"] = site.get("/gpus", "alice")["gpus"]
            rec["nodes"] = site.get("/nodes")["nodes"]
        if "doctor-broker" in args.steps:
            # doctor on the node, comparing with the broker's own context_overhead_mb
            with step(results, "doctor_broker") as rec:
                asked = dict(env, GPU_LEASE_URL=site.broker.url)
                asked["GPU_LEASE_TOKEN"] = site.broker.tokens["admin"]
                doctor(rec, asked)
            save()
        kernels = Kernels(tmp, site)
        if "kernels" in args.steps:
            with step(results, "kernels") as rec:
                asyncio.run(kernels_step(rec, kernels, frameworks, args.fractions))
            save()
        if "torch" in frameworks and "escape" in args.steps:
            with step(results, "escape_cooperative") as rec:
                rec.update(asyncio.run(escape_check(kernels, min(args.fractions), "cooperative")))
            save()
        if "torch" in frameworks and "enforce" in args.steps:
            for mode in ("revoke", "kill"):
                with step(results, f"enforce_{mode}") as rec:
                    rec.update(asyncio.run(enforce_check(kernels, min(args.fractions), mode)))
                save()
        if args.mps and "mps" in args.steps and shutil.which("nvidia-cuda-mps-control"):
            with step(results, "escape_mps") as rec:
                # the agent's default --mps-dir, which is the provisioners' default mps_dir too
                site.start_agent("--enforce", "report", "--mps")
                rec["nodes"] = site.get("/nodes")["nodes"]
                rec.update(asyncio.run(escape_check(kernels, min(args.fractions), "mps")))
            save()
            with step(results, "mps_missing") as rec:
                rec.update(asyncio.run(mps_missing_check(kernels, min(args.fractions), tmp)))
            save()
        if "park" in args.steps:
            g = sys.modules[__name__]
            memory_mb = int(site.get("/gpus", "alice")["gpus"][0]["memory_mb"])
            with step(results, "park") as rec:
                rec["runs"] = []
                for gib in args.park_gib:
                    try:
                        r = asyncio.run(
                            park_density.park_check(
                                g,
                                kernels,
                                gib,
                                device=args.device,
                                memory_mb=memory_mb,
                                overhead_mb=args.context_overhead_mb,
                            )
                        )
                    except Exception as exc:
                        r = {"gib": gib, "error": f"{type(exc).__name__}: {exc}"}
                        r["traceback"] = traceback.format_exc()[-3000:]
                    rec["runs"].append(r)
            save()
        if "density" in args.steps:
            g = sys.modules[__name__]
            n = args.density_kernels or int(round(1 / args.density_fraction))
            variants = [("density", "cooperative")]
            if args.mps and shutil.which("nvidia-cuda-mps-control"):
                variants.append(("density_mps", "mps"))
            for key, enforcement in variants:
                if enforcement == "mps":
                    site.start_agent("--enforce", "report", "--mps")
                with step(results, key) as rec:
                    rec.update(
                        asyncio.run(
                            park_density.density_check(
                                g,
                                kernels,
                                fraction=args.density_fraction,
                                n=n,
                                seconds=args.density_seconds,
                                device=args.device,
                                enforcement=enforcement,
                            )
                        )
                    )
                save()
    finally:
        site.stop_agent()
        results["broker_log_tail"] = site.broker.log(8000)
        results["agent_log_tail"] = site.agent_log()[-8000:]
        site.broker.stop()
        save()
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
