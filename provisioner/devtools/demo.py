"""``make demo`` (``python -m provisioner.devtools.demo``): a GPU classroom on this machine.

Prepares a state directory (``.demo/``: hub and broker databases, secrets, student
homes), installs the ready GPU kernelspecs and the course kernel ``ml101-gpu-0.05``,
starts ``jupyterhub -f hub_config/jupyterhub_config.py`` (which starts
configurable-http-proxy and the broker as the hub-managed service ``gpu-lease``),
waits until the hub and the broker answer, then prints where to log in, the
passwords, the dashboard and an operator token for the ``gpu-lease`` CLI. It also
writes them to ``<state>/demo.json`` for scripts (``examples/classroom.py``, tests).

Ctrl-C (or SIGTERM) first asks the hub to stop every server at once (each shuts its
kernels down, releasing their leases while the broker still runs), then stops the hub,
which stops the broker and the proxy. The demo registers itself as the *child
subreaper* (Linux), so a process that outlives its parent is re-parented here rather
than to init; once the hub has exited, anything still running below the demo is
terminated, then killed: no orphan survives the demo.

Everything the demo writes stays in the state directory: the servers' runtime files
(cookie secrets, kernels' connection files and sockets: ``<state>/rt``, removed at the
end) and every process's temporary files (``TMPDIR=<state>/tmp``, emptied at the end).
Only a state directory whose path is too long for a kernel's Unix socket paths moves
the runtime files to the system's temporary folder (and removes them at the end too).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ..errors import GPULeaseError
from ..kernel import kernelspecs as ks
from .testing import write_private

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "hub_config" / "jupyterhub_config.py"
READY_SPECS = ROOT / "kernelspecs"
COURSE_KERNEL = ("ml101-gpu-0.05", 0.05, "ml101")
USER_PASSWORD = "gpu-lease-demo"
PR_SET_CHILD_SUBREAPER = 36


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m provisioner.devtools.demo",
        description="Run JupyterHub with the GPU lease broker on this machine (Ctrl-C stops all).",
    )
    p.add_argument("--state-dir", default=str(ROOT / ".demo"), help="default: .demo/")
    p.add_argument("--port", type=int, default=8000, help="the hub's public port (8000)")
    p.add_argument("--hub-api-port", type=int, default=8081, help="the hub's API port (8081)")
    p.add_argument("--proxy-api-port", type=int, default=8001, help="the proxy's API port (8001)")
    p.add_argument("--broker-port", type=int, default=10101, help="the broker's port (10101)")
    p.add_argument(
        "--server-port-base",
        type=int,
        default=21000,
        help="servers listen on a free port in BASE..BASE+7999 (21000; 0: random ephemeral ports)",
    )
    p.add_argument("--gpus", default="", help="GPU pool (default: nvml, else 1x32768:V100)")
    p.add_argument("--ttl", type=float, default=90.0, help="lease TTL in seconds (90)")
    p.add_argument("--reap-interval", type=float, default=5.0, help="reaper period, s (5)")
    p.add_argument(
        "--kernels-prefix",
        default="",
        help="install kernelspecs under PREFIX/share/jupyter/kernels instead of this "
        "Python's sys.prefix (the servers then get JUPYTER_PATH)",
    )
    p.add_argument("--courses", default="", help="courses file (hub_config/courses.toml)")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait (120)")
    return p.parse_args(argv)


# -- preparation -----------------------------------------------------------------------
def install_kernelspecs(prefix: str = "") -> list[str]:
    """The six ready specs from ``kernelspecs/`` and the course kernel ``ml101-gpu-0.05``.

    Into ``prefix`` (``PREFIX/share/jupyter/kernels``), else this Python's sys.prefix,
    where every single-user server started with this Python finds them.
    """
    where: dict[str, Any] = {"prefix": prefix} if prefix else {"sys_prefix": True}
    names = []
    for spec_dir in sorted(READY_SPECS.iterdir()):
        spec = json.loads((spec_dir / "kernel.json").read_text(encoding="utf-8"))
        ks.install(spec, spec_dir.name, **where)
        names.append(spec_dir.name)
    name, fraction, group = COURSE_KERNEL
    # what an instructor runs: gpu-lease kernelspec install --fraction 0.05 --group ml101
    ks.install(ks.build_kernelspec(fraction, group=group), name, **where)
    names.append(name)
    return names


def _secret_file(path: Path, nbytes: int) -> str:
    if not path.exists():
        write_private(path, os.urandom(nbytes).hex())
    return path.read_text(encoding="utf-8").strip()


#: a kernel's Unix sockets are <runtime dir>/<user id>/kernel-<uuid>-ipc-N: 50 bytes after the
#: runtime directory and a few for the user id, within Linux's 107
MAX_RUNTIME_DIR = 50


def runtime_dir(state: Path, port: int) -> Path:
    """Where the servers' runtime files go: ``<state>/rt`` unless that path is too long for
    a kernel's Unix sockets; then ``gpu-lease-rt-PORT`` in the system's temporary folder
    (``TMPDIR``), or in ``/tmp`` when that is too long as well (a long ``TMPDIR``: the
    ten-server demo's kernel start answered 500, "File name too long", under pytest-xdist's
    longer folders)."""
    for where in (state / "rt", Path(tempfile.gettempdir()) / f"gpu-lease-rt-{port}"):
        if len(str(where)) <= MAX_RUNTIME_DIR:
            return where
    return Path("/tmp") / f"gpu-lease-rt-{port}"


def hub_environment(args: argparse.Namespace, state: Path) -> dict[str, str]:
    """The environment ``hub_config/jupyterhub_config.py`` reads (``GPU_LEASE_*``)."""
    env = dict(os.environ)
    env.pop("JUPYTERHUB_API_TOKEN", None)  # never hand a caller's token to the hub
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(
        GPU_LEASE_STATE_DIR=str(state),
        GPU_LEASE_HUB_PORT=str(args.port),
        GPU_LEASE_HUB_API_PORT=str(args.hub_api_port),
        GPU_LEASE_PROXY_API_PORT=str(args.proxy_api_port),
        GPU_LEASE_BROKER_PORT=str(args.broker_port),
        GPU_LEASE_TTL=str(args.ttl),
        GPU_LEASE_REAP_INTERVAL=str(args.reap_interval),
        GPU_LEASE_SERVER_PORT_BASE=str(args.server_port_base),
        GPU_LEASE_USER_PASSWORD=env.get("GPU_LEASE_USER_PASSWORD") or USER_PASSWORD,
        GPU_LEASE_ADMIN_PASSWORD=_secret_file(state / "admin-password", 16),
        GPU_LEASE_ADMIN_TOKEN=_secret_file(state / "admin-token", 32),
        GPU_LEASE_RUNTIME_DIR=str(runtime_dir(state, args.port)),
        TMPDIR=str(state / "tmp"),  # the hub's, the proxy's and the broker's temporary files
        GPU_LEASE_FAST_EXIT="1",  # see provisioner/devtools/fastexit.py
    )
    if args.gpus:
        env["GPU_LEASE_GPUS"] = args.gpus
    if args.kernels_prefix:
        env["GPU_LEASE_KERNELS_PREFIX"] = str(Path(args.kernels_prefix).resolve())
    if args.courses:
        env["GPU_LEASE_COURSES"] = str(Path(args.courses).resolve())
    return env


# -- processes -------------------------------------------------------------------------
def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def descendants() -> list[Any]:
    """Every process below this one (psutil ``Process`` objects)."""
    import psutil

    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def _runs(proc: Any, module: str) -> bool:
    import psutil

    try:
        return module in proc.cmdline()
    except psutil.Error:
        return False


def stop_brokers(grace: float = 5.0) -> None:
    """SIGTERM the broker (the hub's managed service) and wait until it has exited."""
    import psutil

    brokers = [p for p in descendants() if _runs(p, "provisioner.broker.app")]
    for proc in brokers:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    # not wait_procs: the broker is the hub's child, a zombie until the hub reaps it
    while any(_running(p) for p in brokers) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(proc: Any) -> bool:
    import psutil

    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def sweep(grace: float = 5.0) -> int:
    """Terminate, then kill, whatever still runs below the demo; returns how many ran.

    Exited processes the demo adopted (zombies) are only collected, not counted.
    """
    import psutil

    procs = descendants()
    running = [p for p in procs if _running(p)]
    for proc in running:
        try:
            print(f"[demo] ending leftover process {proc.pid}: {' '.join(proc.cmdline())[:100]}")
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return len(running)


def reap_adopted(keep: int) -> None:
    """Collect adopted orphans that exited (zombies), except ``keep`` (the hub: Popen's)."""
    import psutil

    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for proc in children:
        try:
            if proc.pid != keep and proc.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass


def wait_ready(
    url: str, proc: subprocess.Popen[bytes], timeout: float, what: str, expect: int = 200
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GPULeaseError(f"JupyterHub exited with status {proc.returncode}; see its log.")
        try:
            if httpx.get(url, timeout=2.0).status_code == expect:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise GPULeaseError(f"{what} did not answer {url} within {timeout:.0f} s; see the log.")


def banner(info: dict[str, Any]) -> str:
    url = info["url"]
    return f"""
================ jupyter-gpu-lease demo ================
JupyterHub      {url}/
  log in as     student01 ... student60 (course ml101), guest01 (no course), instructor
  password      {info["user_password"]}
  admin         user 'admin', password {info["admin_password"]}
GPU dashboard   {url}/services/gpu-lease/
broker API      {info["broker_url"]}/api/v1/health
operator token  {info["admin_token"]}   (also in {info["state_dir"]}/admin-token)
CLI             GPU_LEASE_URL={info["broker_url"]} GPU_LEASE_TOKEN={info["admin_token"]} {Path(sys.executable).parent}/gpu-lease top
classroom       {Path(sys.executable)} examples/classroom.py --hub-url {url} --token-file {info["state_dir"]}/admin-token -n 10
Kernels "Python 3 (GPU 0.02)" ... "(GPU 1)" and "Python 3 (GPU 0.05, ml101)" are installed.
Press Ctrl-C to stop the hub, the broker, every server and every kernel.
========================================================
"""


def run(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve()
    for sub in ("home", "tmp"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    # importing IPython (for ipykernel's logos, below) creates ~/.ipython: keep it here too
    os.environ["IPYTHONDIR"] = str(state / "ipython")
    env = hub_environment(args, state)
    names = install_kernelspecs(args.kernels_prefix)
    print(f"[demo] installed kernelspecs: {', '.join(names)}", flush=True)
    if not shutil.which("configurable-http-proxy", path=str(ROOT / "node_modules" / ".bin")):
        print("[demo] configurable-http-proxy is missing: run `npm install` (or `make install`).")
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():  # a second Ctrl-C: no more patience
            sweep(grace=0.5)
            os._exit(130)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    subreaper = become_subreaper()
    hub = subprocess.Popen(
        [sys.executable, "-m", "provisioner.devtools.fastexit", "jupyterhub", "-f", str(CONFIG)],
        cwd=state,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the demo only; the demo stops the hub in order
    )
    url = f"http://127.0.0.1:{args.port}"
    info = {
        "url": url,
        "hub_api": f"{url}/hub/api",
        "broker_url": f"{url}/services/gpu-lease",
        "broker_direct_url": f"http://127.0.0.1:{args.broker_port}/services/gpu-lease",
        "admin_token": env["GPU_LEASE_ADMIN_TOKEN"],
        "user_password": env["GPU_LEASE_USER_PASSWORD"],
        "admin_password": env["GPU_LEASE_ADMIN_PASSWORD"],
        "state_dir": str(state),
        "runtime_dir": env["GPU_LEASE_RUNTIME_DIR"],
        "pid": os.getpid(),
        "hub_pid": hub.pid,
    }
    status = 0
    try:
        hub_direct = f"http://127.0.0.1:{args.hub_api_port}/hub/api/"
        wait_ready(hub_direct, hub, args.ready_timeout, "JupyterHub")
        wait_ready(f"{url}/hub/api/", hub, args.ready_timeout, "The proxy")
        wait_ready(
            f"{info['broker_url']}/api/v1/health", hub, args.ready_timeout, "The GPU lease broker"
        )
        # the operator token and the admin password: the demo's owner's alone
        write_private(state / "demo.json", json.dumps(info, indent=1))
        print(banner(info), flush=True)
        while not stop.is_set() and hub.poll() is None:
            stop.wait(0.5)
            if subreaper:
                reap_adopted(hub.pid)
        if hub.poll() is not None:
            print(f"[demo] JupyterHub exited with status {hub.returncode}", flush=True)
            status = hub.returncode or 1
    except GPULeaseError as exc:
        print(f"[demo] {exc.message}", flush=True)
        status = 1
    finally:
        (state / "demo.json").unlink(missing_ok=True)
        status = shutdown(hub, subreaper, info) or status
    return status


def stop_servers(hub_api: str, token: str, timeout: float = 60.0) -> int:
    """Stop every running server through the hub API, all at once; returns how many ran.

    JupyterHub's own shutdown stops its managed services (the broker) *before* the
    servers, so kernels stopped then could not release their leases (they would expire
    only after the next broker start). Stopping the servers first, while the broker is
    up, releases every lease at once. The requests go out together: the hub answers each
    only once its server stopped (or after 10 s), so one at a time took minutes with 60.
    """
    try:
        return asyncio.run(_stop_servers(hub_api, token, timeout))
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        print(f"[demo] could not stop the servers through the hub API: {exc}", flush=True)
        return 0


async def _active_servers(client: httpx.AsyncClient) -> list[str]:
    """API paths of every active server (the user list is paged: 50 a page by default)."""
    paths: list[str] = []
    offset = 0
    while True:
        r = await client.get("/users", params={"state": "active", "offset": offset, "limit": 200})
        r.raise_for_status()
        body = r.json()
        users = body["items"] if isinstance(body, dict) else body
        for user in users:
            for name in user.get("servers") or {}:
                base = f"/users/{user['name']}"
                paths.append(f"{base}/servers/{name}" if name else f"{base}/server")
        if len(users) < 200 or not isinstance(body, dict):
            return paths
        offset += len(users)


async def _stop_servers(hub_api: str, token: str, timeout: float) -> int:
    headers = {
        "Authorization": f"token {token}",
        "Accept": "application/jupyterhub-pagination+json",
    }
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=hub_api, headers=headers, timeout=timeout) as client:
        running = await _active_servers(client)
        await asyncio.gather(*(client.delete(path) for path in running), return_exceptions=True)
        while time.monotonic() < deadline:
            if not await _active_servers(client):
                break
            await asyncio.sleep(0.2)
    return len(running)


def remove_runtime_files(state: Path, runtime: Path) -> None:
    """The servers' runtime files (cookie secrets, connection files) and temporary files."""
    shutil.rmtree(runtime, ignore_errors=True)
    tmp = state / "tmp"
    if tmp.is_dir():
        for entry in tmp.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def shutdown(
    hub: subprocess.Popen[bytes], subreaper: bool, info: dict[str, Any], timeout: float = 60.0
) -> int:
    """Stop the servers, then the broker and the hub (and its proxy), then sweep what is left."""
    t0 = time.monotonic()
    steps: list[str] = []

    def step(what: str, since: float) -> float:
        now = time.monotonic()
        steps.append(f"{what} {now - since:.1f} s")
        return now

    t = t0
    if hub.poll() is None:
        print("[demo] stopping the servers (their kernels release their GPU leases)", flush=True)
        n = stop_servers(info["hub_api"], info["admin_token"])
        t = step(f"{n} server(s)", t)
        print("[demo] stopping the broker, JupyterHub and the proxy", flush=True)
        # the broker first: JupyterHub stops its services by SIGINT, then polls at growing
        # intervals (0.1, 0.3, 0.7, 1.5, 3.1, 6.3 s), which cost seconds after a quick exit
        stop_brokers()
        t = step("broker", t)
        hub.send_signal(signal.SIGTERM)
        try:
            hub.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"[demo] JupyterHub did not stop within {timeout:.0f} s; killing it", flush=True)
            hub.kill()
            hub.wait()
        t = step("hub and proxy", t)
    left = sweep()
    state = Path(info["state_dir"])
    remove_runtime_files(state, Path(info["runtime_dir"]))
    step("clean-up", t)
    how = "" if subreaper else " (no subreaper on this system: orphans may survive)"
    print(
        f"[demo] stopped in {time.monotonic() - t0:.1f} s ({', '.join(steps)}); "
        f"{left} leftover process(es) ended{how}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
