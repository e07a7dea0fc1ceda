"""Ctrl-C of ``make demo`` with many servers running: how long until everything is gone.

    .venv/bin/python benchmarks/demo_stop.py [-n 60] [--kernels 0] [--repeat 1]

Starts the demo (``provisioner.devtools.demohub.DemoHub``: free ports, a fresh state
directory, its own empty TMPDIR and HOME), starts ``-n`` students' servers at once
through the hub API, optionally a 0.02 GPU kernel in the first ``--kernels`` of them,
then sends SIGINT as Ctrl-C does and measures the seconds until the demo has exited and
until every process it had started is gone; it also checks that the hub's port is free
and that nothing was left in the TMPDIR or HOME. The load average (``uptime``) is
printed with every figure: the machine is shared, so compare runs taken at similar load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from provisioner.devtools.demohub import DemoHub  # noqa: E402


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


async def start_kernels(hub: DemoHub, users: list[str]) -> int:
    headers = {"Authorization": f"token {hub.info['admin_token']}"}
    async with httpx.AsyncClient(headers=headers, timeout=600) as c:
        answers = await asyncio.gather(
            *(
                c.post(f"{hub.url}/user/{u}/api/kernels", json={"name": "python3-gpu-0.02"})
                for u in users
            )
        )
    return sum(r.status_code == 201 for r in answers)


def one_run(n: int, kernels: int, gpus: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="gl-") as tmp:
        hub = DemoHub(Path(tmp), gpus=gpus)
        try:
            started = hub.start()
            print(f"demo ready in {started:.1f} s ({load()})", flush=True)
            users = [f"student{i:02d}" for i in range(1, n + 1)]
            ready = hub.spawn(users, timeout=1800)
            print(f"{n} servers ready in {ready:.1f} s ({load()})", flush=True)
            if kernels:
                t0 = time.monotonic()
                ok = asyncio.run(start_kernels(hub, users[:kernels]))
                print(f"{ok} GPU kernels started in {time.monotonic() - t0:.1f} s", flush=True)
            time.sleep(5)  # let the servers settle (their first activity reports)
            before = load()
            stopped = hub.interrupt(timeout=300)
            result = {
                "servers": n,
                "kernels": kernels,
                "processes": stopped.processes,
                "demo_exit_s": round(stopped.exit_s, 1),
                "all_gone_s": round(stopped.all_gone_s, 1),
                "exit_code": stopped.exit_code,
                "survivors": stopped.survivors,
                "port_free": stopped.port_free,
                "left_outside": stopped.left_outside,
                "load_before": before,
                "load_after": load(),
                "demo_says": [x for x in stopped.log_tail.splitlines() if "stopped in" in x],
            }
            return result
        finally:
            hub.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=60, help="servers (60)")
    p.add_argument("--kernels", type=int, default=0, help="servers that run a GPU kernel (0)")
    p.add_argument("--gpus", default="2x32768:V100", help="the pool (2x32768:V100)")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    for _ in range(args.repeat):
        result = one_run(args.n, args.kernels, args.gpus)
        for key, value in result.items():
            print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
