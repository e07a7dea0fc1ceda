"""Soak: a simulated semester hour against a real broker; nothing may leak.

    python benchmarks/soak.py                      # ~2 minutes (default)
    python benchmarks/soak.py --minutes 10         # at most 10
    python benchmarks/soak.py --seconds 20 --json  # what tests/test_soak.py runs

A real broker subprocess (SQLite in a temporary directory, or ``--db-url``) with a short
TTL serves ``--students`` concurrent students through the real ``BrokerClient``, each
acting as a kernel provisioner over and over: acquire with long-poll (queueing when the
pool is full, giving up after ``--queue-timeout``), renew every TTL/3 reporting
``execution_state`` idle/busy, sometimes restart the kernel (acquire again with the same
kernel id: must get the SAME lease back), then either shut down cleanly (release) or
die (stop renewing, never release: the broker must expire it).

At the end every student stops (half release, half die), the run waits 2 x TTL plus a
reaper pass, and checks: no active lease, empty queue, every restart got its lease back,
no GPU ever over-allocated (sampled from /api/v1/gpus), no client error. The broker's
resident memory (VmRSS of /proc/<pid>/status) is sampled every second and reported as
start / peak / end; it is reported, not judged. Exit status 1 if anything leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioner.client import BrokerClient, Renewal  # noqa: E402
from provisioner.devtools.testing import BrokerProcess  # noqa: E402
from provisioner.errors import LeaseExpired, NoCapacity  # noqa: E402

FRACTIONS = (0.02, 0.02, 0.02, 0.05, 0.1)


@dataclass
class Tally:
    acquired: int = 0
    queued: int = 0
    queued_gave_up: int = 0
    restarts: int = 0
    expired_alive: int = 0
    max_renew_gap_s: float = 0.0
    restart_mismatches: int = 0
    renewals: int = 0
    released: int = 0
    died: int = 0
    errors: list[str] = field(default_factory=list)
    overallocated: int = 0
    gpu_samples: int = 0
    rss_kib: list[int] = field(default_factory=list)
    #: ids of the leases this driver was granted (others were granted as it gave up waiting)
    seen: set[str] = field(default_factory=set)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def lease_states(db_url: str) -> dict[str, str]:
    """Every lease's state by id, read from the database itself."""
    import sqlalchemy as sa

    if db_url.startswith("postgresql://"):
        db_url = "postgresql+psycopg2://" + db_url[len("postgresql://") :]
    eng = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, state FROM leases"))
            return {str(k): str(v) for k, v in rows}
    finally:
        eng.dispose()


def _count_queued(t: Tally) -> None:
    t.queued += 1


async def release(client: BrokerClient, lease_id: str, t: Tally) -> None:
    """Release, and count what the lease became: released, or expired before the release
    came (this driver renewed too late on an overloaded machine; ``release`` is idempotent
    and does not say which)."""
    await client.leases.release(lease_id)
    state = (await client.leases.get(lease_id)).state
    if state == "expired":
        t.expired_alive += 1
    else:
        t.released += 1


async def student(
    url: str, token: str, ttl: float, queue_timeout: float, stop: asyncio.Event, t: Tally
) -> None:
    """One student's kernels, one after another, until ``stop``."""
    rng = random.Random()
    async with BrokerClient(url, token, timeout=10.0) as client:
        while not stop.is_set():
            kernel_id = str(uuid.uuid4())
            fraction = rng.choice(FRACTIONS)
            try:
                lease = await client.leases.acquire(
                    kernel_id,
                    fraction,
                    wait=2.0,
                    queue_timeout=queue_timeout,
                    on_queued=lambda _answer: _count_queued(t),
                )
            except NoCapacity:
                t.queued_gave_up += 1
                await asyncio.sleep(rng.uniform(0.5, 2.0))
                continue
            t.acquired += 1
            t.seen.add(lease.id)
            life = rng.expovariate(1 / (4 * ttl))
            end = last_ok = time.monotonic()
            end += life
            gone = False
            while time.monotonic() < end and not stop.is_set():
                await asyncio.sleep(min(ttl / 3, max(0.0, end - time.monotonic())))
                state = rng.choice(("idle", "busy"))
                try:
                    await client.leases.renew(
                        lease.id, Renewal(pid=os.getpid(), execution_state=state)
                    )
                except LeaseExpired:
                    # this driver renewed too late (an overloaded box): like the provisioner,
                    # try once to get the same fraction back, else the kernel stops
                    t.expired_alive += 1
                    t.max_renew_gap_s = max(t.max_renew_gap_s, time.monotonic() - last_ok)
                    try:
                        lease = await client.leases.acquire(
                            kernel_id, fraction, wait=2.0, queue_timeout=0
                        )
                    except NoCapacity:
                        gone = True  # the kernel stops; its lease is already counted (expired)
                        break
                    t.acquired += 1
                    t.seen.add(lease.id)
                    last_ok = time.monotonic()
                    continue
                t.max_renew_gap_s = max(t.max_renew_gap_s, time.monotonic() - last_ok)
                last_ok = time.monotonic()
                t.renewals += 1
                if rng.random() < 0.05:  # kernel restart: same kernel id, same lease
                    again = await client.leases.acquire(kernel_id, fraction, wait=2.0)
                    t.restarts += 1
                    if again.id != lease.id:
                        # a new lease is right only if the old one expired meanwhile
                        if (await client.leases.get(lease.id)).state == "expired":
                            t.expired_alive += 1
                            t.acquired += 1
                            lease = again
                            t.seen.add(lease.id)
                        else:
                            t.restart_mismatches += 1
            if gone:
                if stop.is_set():
                    return
                await asyncio.sleep(rng.uniform(0.0, ttl))
                continue
            if stop.is_set():
                # the end of the hour: half shut down cleanly, half just die
                if rng.random() < 0.5:
                    await release(client, lease.id, t)
                else:
                    t.died += 1
                return
            if rng.random() < 0.2:
                t.died += 1  # the kernel's server was killed: no release, no renewals
            else:
                await release(client, lease.id, t)
            await asyncio.sleep(rng.uniform(0.0, ttl))


async def watch(url: str, admin: str, pid: int, stop: asyncio.Event, t: Tally) -> None:
    async with httpx.AsyncClient(headers={"Authorization": f"token {admin}"}) as http:
        while not stop.is_set():
            kib = rss_kib(pid)
            if kib is not None:
                t.rss_kib.append(kib)
            try:
                r = await http.get(f"{url}/api/v1/gpus", timeout=10)
                for g in r.json()["gpus"]:
                    t.gpu_samples += 1
                    if g["allocated_fraction"] > 1.0:
                        t.overallocated += 1
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                t.errors.append(f"watch: {exc!r}")
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


def start_broker(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """The broker subprocess on a free port, and what the drivers need to talk to it."""
    tmp = Path(tempfile.mkdtemp(prefix="gpu-lease-soak-"))
    users = [f"s{n:03d}" for n in range(args.students)]
    db_url = args.db_url or f"sqlite:///{tmp / 'soak.sqlite'}"
    broker = BrokerProcess(
        tmp,
        db_url,
        {**{u: ([], False) for u in users}, "admin": ([], True)},
        gpus=args.gpus,
        extra=(
            "--ttl",
            str(args.ttl),
            "--GPULeaseBroker.reap_interval=0.5",
            "--GPULeaseBroker.queue_poll_grace=5",
            "--log-level=WARN",
        ),
    )
    broker.start(60.0)
    assert broker.proc is not None
    info = {"url": broker.url, "db_url": db_url, "users": users, "tokens": broker.tokens}
    return broker.proc, {**info, "tmp": tmp}


def stop_broker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def soak(
    args: argparse.Namespace, proc: subprocess.Popen[bytes], b: dict[str, Any]
) -> dict[str, Any]:
    url, db_url, users, tokens = b["url"], b["db_url"], b["users"], b["tokens"]
    t = Tally()
    stop = asyncio.Event()
    try:
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(student(url, tokens[u], args.ttl, args.queue_timeout, stop, t))
            for u in users
        ]
        watcher = asyncio.create_task(watch(url, tokens["admin"], proc.pid, stop, t))
        await asyncio.sleep(args.duration)
        stop.set()
        for res in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(res, BaseException):
                t.errors.append(f"student: {res!r}")
        await watcher
        ran = time.monotonic() - t0
        # dead kernels' leases expire one TTL after their last renewal; give it two
        await asyncio.sleep(2 * args.ttl + 1.0)
        admin = {"Authorization": f"token {tokens['admin']}"}
        async with httpx.AsyncClient(base_url=f"{url}/api/v1", headers=admin) as http:
            leases = (await http.get("/leases", params={"all": "1"})).json()["leases"]
            queue = (await http.get("/queue")).json()["queue"]
        end_kib = rss_kib(proc.pid)
        if end_kib is not None:
            t.rss_kib.append(end_kib)
        by_id = lease_states(db_url)
        states: dict[str, int] = {}
        for lease_id, state in by_id.items():
            if lease_id in t.seen:
                states[state] = states.get(state, 0) + 1
        # granted while their student was giving up waiting: the client's withdrawal (DELETE
        # of the request's id, which the lease keeps) must have released every one of them
        withdrawn = [state for lease_id, state in by_id.items() if lease_id not in t.seen]
        leaked = [x for x in leases if x["state"] == "active"]
        rss = t.rss_kib or [0]
        report = {
            "seconds": round(ran, 1),
            "students": args.students,
            "ttl": args.ttl,
            "gpus": args.gpus,
            **{k: v for k, v in asdict(t).items() if k not in ("rss_kib", "errors", "seen")},
            "errors": t.errors[:10],
            "lease_states": states,
            "granted_as_given_up": len(withdrawn),
            "leaked_leases": len(leaked),
            "queued_at_end": len(queue),
            "rss_mib": {
                "start": round(rss[0] / 1024, 1),
                "peak": round(max(rss) / 1024, 1),
                "end": round(rss[-1] / 1024, 1),
                "samples": len(rss),
            },
            "requests_per_s": round((t.acquired + t.renewals + t.released + t.restarts) / ran, 1),
            "broker_alive": proc.poll() is None,
        }
        report["max_renew_gap_s"] = round(t.max_renew_gap_s, 2)
        # every lease ended the way its kernel did: died -> expired, shut down -> released
        report["accounted"] = (
            states.get("expired", 0) == t.died + t.expired_alive
            and states.get("released", 0) == t.released
            and sum(states.values()) == len(t.seen)
            and all(state == "released" for state in withdrawn)
        )
        report["ok"] = (
            report["accounted"]
            and not leaked
            and not queue
            and not t.errors
            and t.overallocated == 0
            and t.restart_mismatches == 0
            and report["broker_alive"]
        )
        return report
    finally:
        stop.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0, help="run length (max 10; default 2)")
    ap.add_argument("--seconds", type=float, help="run length in seconds (overrides --minutes)")
    ap.add_argument("--students", type=int, default=60, help="concurrent students (default 60)")
    ap.add_argument("--ttl", type=float, default=6.0, help="broker lease TTL in s (default 6)")
    ap.add_argument("--gpus", default="2x32768:V100", help="broker --gpus (default 2x32768:V100)")
    ap.add_argument("--queue-timeout", type=float, default=8.0, help="s a kernel waits (8)")
    ap.add_argument("--db-url", help="broker --db-url (default: SQLite in a temporary dir)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    args.duration = min(600.0, args.seconds if args.seconds is not None else args.minutes * 60)
    proc, broker = start_broker(args)
    try:
        report = asyncio.run(soak(args, proc, broker))
    finally:
        stop_broker(proc)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>20}: {value}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
