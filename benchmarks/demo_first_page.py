"""A fresh clone to the demo's first page: ``git clone`` then ``make demo`` until the hub answers.

    .venv/bin/python benchmarks/demo_first_page.py [--source .] [--dest /tmp/demo-fresh]

Does what a newcomer does (``git clone -q SOURCE DEST && cd DEST && make demo``) with
free ports (``DEMO_ARGS``), in an environment without this checkout's ``PYTHONPATH`` or
virtual environment, and times it until ``/hub/login`` answers 200 (the first page), with
the install's part (until ``.venv/.demo-stamp`` exists). Then Ctrl-C (SIGINT to the
process group, as a terminal sends it), the time until ``make`` has exited, and the clone
is deleted (``--keep`` keeps it). The clone has its own ``.venv`` and ``node_modules``:
pip and npm download (or take from their caches) what the demo needs. The load average
is printed with the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provisioner.devtools.testing import free_port  # noqa: E402


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def clean_env() -> dict[str, str]:
    """This process's environment without the checkout's Python settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
        and not k.startswith(("JUPYTERHUB_", "GPU_LEASE_"))
    }
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=str(ROOT), help="the repository to clone (this one)")
    p.add_argument("--dest", default="/tmp/demo-fresh", help="where (/tmp/demo-fresh)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--keep", action="store_true", help="keep the clone")
    args = p.parse_args()
    dest = Path(args.dest)
    if dest.exists():
        sys.exit(f"{dest} exists; remove it first")
    port = free_port()
    demo_args = (
        f"--port {port} --hub-api-port {free_port()} --proxy-api-port {free_port()} "
        f"--broker-port {free_port()} --server-port-base {random.randrange(10000, 24000)}"
    )
    print(f"start ({load()})", flush=True)
    t0 = time.monotonic()
    subprocess.run(["git", "clone", "-q", args.source, str(dest)], check=True)
    log = open(dest.parent / f"{dest.name}.log", "wb")  # noqa: SIM115 - open while make runs
    make = subprocess.Popen(
        ["make", "demo", f"DEMO_ARGS={demo_args}"],
        cwd=dest,
        env=clean_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    installed = None
    first_page = None
    try:
        while first_page is None:
            if make.poll() is not None:
                sys.exit(f"make demo exited with {make.returncode}; see {log.name}")
            if time.monotonic() - t0 > args.timeout:
                sys.exit(f"no first page within {args.timeout:.0f} s; see {log.name}")
            if installed is None and (dest / ".venv" / ".demo-stamp").exists():
                installed = time.monotonic() - t0
                print(f"installed in {installed:.1f} s ({load()})", flush=True)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/hub/login", timeout=2).status_code == 200:
                    first_page = time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        print(f"first page in {first_page:.1f} s ({load()})", flush=True)
        t1 = time.monotonic()
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C
        make.wait(120)
        print(f"Ctrl-C: make exited in {time.monotonic() - t1:.1f} s ({load()})", flush=True)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        log.close()
        if not args.keep:
            shutil.rmtree(dest, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
