"""A 50-student classroom through a real JupyterHub: GPU kernels vs plain kernels.

Starts ``python -m provisioner.devtools.demo`` on free ports with a fresh state directory (a
declared 1x32768:V100 pool unless ``--gpus`` says otherwise), then runs
``examples/classroom.py``'s :func:`run_classroom`: N students log in through the hub
API, spawn servers, and each starts a "Python 3 (GPU 0.02)" and a plain "Python 3"
kernel together (alternating whose request leaves first) and runs a cell in each; then
all kernels stop and start again (``--rounds``, 3). While all kernels are
up, a 51st student's 0.02 request must *queue* (202, position 1) with the GPU exactly
full (50 x 0.02 = 1, exact ppm arithmetic), never over-allocate. Then every server
stops and no lease may remain::

    .venv/bin/python benchmarks/classroom.py            # N=50 (several minutes on 2 cores)
    .venv/bin/python benchmarks/classroom.py -n 20 --json
    GPU_LEASE_TOKEN=T .venv/bin/python benchmarks/classroom.py --hub-url http://127.0.0.1:8000
    .venv/bin/python benchmarks/classroom.py --slurm -n 20   # servers as Slurm jobs

``--slurm``: the Slurm variant (hub_config ``GPU_LEASE_SPAWNER=slurm``) on a Slurm cluster
on this machine (``provisioner/devtools/slurmcluster.py``: slurmctld, two slurmd, two CPUs
each, up to 16 jobs a CPU), every server a job, the pool the two nodes' agents register
(a declared V100 each), each kernel leasing on its own server's node.

Reported: time from the first login to the last kernel ready, median server start,
median GPU and plain kernel start (POST /api/kernels to the first cell's reply) and
their ratio: the median over students and rounds of GPU/plain of the student's own
pair, started together in the same server (aim <= 1.10); the ratio of medians too, leases held, queue waits, the 51st request's answer, the
pool's allocated fraction, leaks after stop (must be 0). Exit status 1 if an aim fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioner.devtools import slurmcluster  # noqa: E402
from provisioner.devtools.testing import free_port, load_example, wait_for  # noqa: E402


def start_demo(
    state: Path, gpus: str, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    args = [sys.executable, "-m", "provisioner.devtools.demo", "--state-dir", str(state)]
    args += ["--kernels-prefix", str(state / "prefix"), "--gpus", gpus]
    args += ["--server-port-base", str(random.randrange(10000, 24000))]
    for flag in ("--port", "--hub-api-port", "--proxy-api-port", "--broker-port"):
        args += [flag, str(free_port())]
    env = {
        k: v for k, v in os.environ.items() if k not in ("JUPYTERHUB_API_TOKEN", "GPU_LEASE_TOKEN")
    }
    env.update(extra_env or {})
    log = open(state / "demo.log", "wb")  # noqa: SIM115 - lives as long as the demo
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    info_file = state / "demo.json"
    deadline = time.monotonic() + 300
    while not info_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the demo did not start; see {state / 'demo.log'}")
        time.sleep(0.25)
    return proc, json.loads(info_file.read_text())


async def check_51st(room: Any, name: str, out: dict[str, Any]) -> None:
    """With every GPU kernel up, one more 0.02 request must queue, not over-allocate."""
    token, token_id = await room.login(name)
    r = await room.call(
        "POST",
        f"{room.broker_url}/api/v1/leases",
        token,
        json={"kernel_id": "benchmark-51st", "fraction": 0.02, "wait": 0},
        ok=(403,),
    )
    body = r.json()
    out["status_51st"] = r.status_code
    out["answer_51st"] = {k: body.get(k) for k in ("queued", "position", "message")}
    gpus = (await room.call("GET", f"{room.broker_url}/api/v1/gpus")).json()["gpus"]
    out["allocated"] = [g["allocated_fraction"] for g in gpus]
    out["leases_on_gpus"] = [g["leases"] for g in gpus]
    # the broker's own share of a GPU kernel start: acquire answers (hub identity included)
    text = (await room.call("GET", f"{room.broker_url}/metrics")).text
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith("gpu_lease_acquire_seconds_count"):
            count += float(line.split()[-1])
        elif line.startswith("gpu_lease_acquire_seconds_sum"):
            total += float(line.split()[-1])
    out["broker_acquire_mean_s"] = round(total / count, 4) if count else None
    if body.get("id"):  # withdraw it, so it is not granted once the class stops
        await room.call(
            "DELETE", f"{room.broker_url}/api/v1/leases/{body['id']}", token, ok=(404, 410)
        )
    await room.logout(name, token_id)


class SlurmSite:
    """A Slurm cluster on this machine, and the environment of its hub (see ``--slurm``)."""

    def __init__(self, tmp: Path) -> None:
        why = slurmcluster.available()
        if why:
            raise SystemExit(f"--slurm: {why}")
        self.cluster = slurmcluster.SlurmCluster(tmp / "slurm", cpus=2, oversubscribe="FORCE:16")
        self.tokens_file = tmp / "agents.json"
        self.tokens = slurmcluster.agent_tokens(self.tokens_file, self.cluster.nodes)
        self.agents: list[subprocess.Popen[bytes]] = []
        self.tmp = tmp

    def env(self) -> dict[str, str]:
        # the class's students have no Unix accounts: their jobs run as the hub's user
        return self.cluster.hub_env(self.tokens_file, submit_as_hub=True)

    def start_agents(self, broker_url: str, admin_token: str) -> None:
        for node, token in self.tokens.items():
            log = self.tmp / f"agent-{node}.log"
            self.agents.append(
                slurmcluster.start_agent(broker_url, node, token, "1x32768:V100", log, 2.0)
            )
        headers = {"Authorization": f"token {admin_token}"}
        try:
            wait_for(
                lambda: (
                    len(httpx.get(f"{broker_url}/api/v1/gpus", headers=headers).json()["gpus"]) >= 2
                ),
                60,
                "the node agents' registration",
                0.2,
            )
        except AssertionError as exc:
            raise SystemExit(f"{exc}; see agent-*.log") from None

    def stop(self) -> None:
        for agent in self.agents:
            agent.send_signal(signal.SIGTERM)
            agent.wait(30)
        self.cluster.stop()


async def bench(
    hub_url: str, token: str, n: int, extra_student: str, rounds: int
) -> tuple[Any, dict[str, Any]]:
    classroom = load_example("classroom")
    extra: dict[str, Any] = {}

    async def before_stop(room: Any) -> None:
        await check_51st(room, extra_student, extra)

    report = await classroom.run_classroom(
        hub_url, token, n, before_stop=before_stop, timeout=600, rounds=rounds
    )
    return report, extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=50, help="students (50)")
    p.add_argument("--gpus", default="1x32768:V100", help="the pool (1x32768:V100)")
    p.add_argument("--hub-url", default="", help="use a running demo instead of starting one")
    p.add_argument(
        "--token-file",
        help="with --hub-url: a file (mode 0600) holding its operator token; default: "
        "$GPU_LEASE_TOKEN (never on the command line: every account's ps shows it)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="kernel rounds per run: all stop, all start again (3; each adds ~40 s at N=50)",
    )
    p.add_argument("--slurm", action="store_true", help="servers as Slurm jobs (see above)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the demo's state directory (its demo.log) for a look",
    )
    args = p.parse_args(argv)
    demo = None
    tmp = None
    site = None
    if args.hub_url:
        try:
            token = load_example("classroom").operator_token(args.token_file, os.environ, {})
        except ValueError as exc:
            p.error(str(exc))
        if not token:
            p.error("--hub-url needs its operator token: set GPU_LEASE_TOKEN or give --token-file")
        hub_url = args.hub_url
    else:
        tmp = tempfile.mkdtemp(prefix="gpu-lease-classroom-")
        if args.slurm:
            site = SlurmSite(Path(tmp))
            site.cluster.start()
            demo, info = start_demo(Path(tmp), "agents", site.env())
            site.start_agents(info["broker_url"], info["admin_token"])
        else:
            demo, info = start_demo(Path(tmp), args.gpus)
        hub_url, token = info["url"], info["admin_token"]
    try:
        with httpx.Client() as http:
            load = os.getloadavg()
            t0 = time.monotonic()
            report, extra = asyncio.run(
                bench(hub_url, token, args.n, f"student{args.n + 1:02d}", args.rounds)
            )
            wall = time.monotonic() - t0
            version = http.get(f"{hub_url}/hub/api/").json().get("version")
    finally:
        if demo is not None:
            demo.send_signal(signal.SIGINT)
            demo.wait(120)
        if site is not None:
            site.stop()
        if tmp is not None and args.keep:
            print(f"kept {tmp} (demo.log: hub, proxy, broker and server logs)", file=sys.stderr)
        elif tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    aims = {
        "no errors": not report.errors,
        "every GPU kernel held a lease": report.leases_held == args.n,
        "GPU/plain start <= 1.10 (median of pairs)": (report.gpu_over_plain or 99) <= 1.10,
        # with fewer students than the pool seats, the extra request must simply be granted
        "extra request queued iff the pool is full": (
            extra.get("status_51st") == 202 and bool(extra.get("answer_51st", {}).get("queued"))
            if report.leases_held * 0.02 >= len(extra.get("allocated", [1])) - 1e-9
            else extra.get("status_51st") == 201
        ),
        "never over-allocated": all(a <= 1.0 for a in extra.get("allocated", [2.0])),
        "zero leaks": report.leaks == 0,
    }
    result = {
        "n": args.n,
        "slurm": args.slurm,
        "jupyterhub": version,
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load],
        "wall_s": round(wall, 1),
        **{k: v for k, v in asdict(report).items() if k != "students"},
        "rounds": args.rounds,
        "kernels": [
            {"gpu_first": first, "gpu_s": round(gpu, 3), "plain_s": plain}
            for st in report.students
            if not st.error
            for first, gpu, plain in st.samples
        ],
        **extra,
        "aims": aims,
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(report.summary())
        print(
            f"51st request: HTTP {extra.get('status_51st')} {extra.get('answer_51st')}; "
            f"pool allocated {extra.get('allocated')} with {extra.get('leases_on_gpus')} leases; "
            f"broker acquire mean {extra.get('broker_acquire_mean_s')} s"
        )
        print(f"{os.cpu_count()} CPUs, load before {result['load_before']}, wall {wall:.0f} s")
        for aim, ok in aims.items():
            print(f"  [{'ok' if ok else 'MISSED'}] {aim}")
        for err in report.errors[:10]:
            print("  error:", err)
    return 0 if all(aims.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
