"""Failover time of active/standby brokers (``--ha-lock``, PostgreSQL), as a client sees it.

    python benchmarks/failover.py                              # 15 cycles of each, TTL 6 s
    python benchmarks/failover.py --cycles 20 --leadership-ttl 2 --json out.json

Two brokers share a fresh schema of the PostgreSQL database ``--pg-url`` (dropped
afterwards), with ``--leadership-ttl`` and one GPU holding a few leases. A client polls
``GET /api/v1/gpus`` (state, gated on leadership: a broker that cannot confirm its
leadership answers 503) on both brokers every 10 ms, one thread per broker. A cycle
breaks the active broker and measures **the failover time: the last 200 from the old
active to the first 200 from the new one**, then restarts the old one as the standby:

- ``kill -9``: the active process is killed;
- ``SIGSTOP``: the active process is paused until the standby answers, then resumed
  (it must answer nothing with state after that and exit with status 1).

The cycles alternate (kill, pause, kill, ...), so background load hits both alike;
min / median / max of each kind are printed. The bound the design states (see
``provisioner/broker/store/leadership.py``): a standby takes over between 2/3 of the TTL and
the whole TTL (plus its poll, at most 1 s) after the active's last renewal, then loads
the state and listens; the client adds up to its poll interval.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioner.devtools.testing import BrokerProcess  # noqa: E402

USERS = {"bench": ([], True)}
POLL = 0.01


def pg_engine(url: str) -> sa.Engine:
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg2://" + url[len("postgresql://") :]
    return sa.create_engine(url, poolclass=NullPool)


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL)


class Poller(threading.Thread):
    """Polls one broker's ``GET /api/v1/gpus``; ``oks``: when each 200 arrived."""

    def __init__(self, b: BrokerProcess, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.b, self.stop = b, stop
        self.oks: list[float] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        headers = {"Authorization": f"token {self.b.tokens['bench']}"}
        with httpx.Client(timeout=0.5) as http:
            while not self.stop.is_set():
                try:
                    r = http.get(f"{self.b.url}/api/v1/gpus", headers=headers)
                    if r.status_code == 200:
                        with self.lock:
                            self.oks.append(time.monotonic())
                except httpx.TransportError:
                    pass
                time.sleep(POLL)

    def after(self, t: float) -> list[float]:
        with self.lock:
            return [x for x in self.oks if x > t]

    def before(self, t: float) -> list[float]:
        with self.lock:
            return [x for x in self.oks if x <= t]


def one_cycle(
    kind: str, old: BrokerProcess, new: BrokerProcess, polls: dict[str, Poller], timeout: float
) -> float:
    """Break ``old`` (the active) one way; seconds from its last 200 to ``new``'s first."""
    assert old.proc is not None
    mark = time.monotonic()
    wait_for(lambda: polls[old.name].after(mark), timeout, "the active to answer")
    wait_for(lambda: "standby:" in new.log(), timeout, "the standby to stand by")
    t_break = time.monotonic()
    if kind == "kill":
        old.kill9()
    else:
        os.kill(old.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: polls[new.name].after(t_break), timeout, "the standby to take over")
    finally:
        if kind == "pause":
            os.kill(old.proc.pid, signal.SIGCONT)
    if kind == "pause":
        code = old.proc.wait(timeout)
        if code != 1:
            raise RuntimeError(f"the paused broker exited with {code}, not 1:\n{old.log()}")
    first_new = polls[new.name].after(t_break)[0]
    late = polls[old.name].after(first_new)
    if late:
        raise RuntimeError(f"the old active answered 200 after the new one did: {late}")
    gap = first_new - polls[old.name].before(first_new)[-1]
    old.launch()  # back as the standby
    return gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=15, help="cycles of each kind (default 15)")
    ap.add_argument("--leadership-ttl", type=float, default=6.0, help="seconds (default 6)")
    ap.add_argument(
        "--pg-url",
        default=os.environ.get(
            "GPU_LEASE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    schema = f"gl_failover_{uuid.uuid4().hex[:12]}"
    admin = pg_engine(args.pg_url)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    db_url = f"{args.pg_url}?options=-csearch_path%3D{schema}"
    extra = (
        "--ha-lock",
        "--gpus",
        "1x32768:V100",
        f"--GPULeaseBroker.leadership_ttl={args.leadership_ttl}",
    )
    timeout = 4 * args.leadership_ttl + 30
    stop = threading.Event()
    times: dict[str, list[float]] = {"kill": [], "pause": []}
    with tempfile.TemporaryDirectory(prefix="failover-bench-") as tmp:
        a = BrokerProcess(Path(tmp), db_url, USERS, extra=extra, name="a")
        b = BrokerProcess(Path(tmp), db_url, USERS, extra=extra, name="b")
        b.tokens, b.tokens_file = a.tokens, a.tokens_file
        polls = {x.name: Poller(x, stop) for x in (a, b)}
        try:
            a.start(timeout)
            headers = {"Authorization": f"token {a.tokens['bench']}"}
            for n in range(4):  # a little state for each takeover to load
                body = {"kernel_id": f"k{n}", "fraction": 0.25}
                r = httpx.post(f"{a.url}/api/v1/leases", json=body, headers=headers)
                r.raise_for_status()
            b.launch()
            for p in polls.values():
                p.start()
            old, new = a, b
            for i in range(2 * args.cycles):
                kind = ("kill", "pause")[i % 2]
                gap = one_cycle(kind, old, new, polls, timeout)
                times[kind].append(gap)
                print(f"cycle {i + 1:2d} {kind:5s} {gap:6.2f} s", flush=True)
                old, new = new, old
        finally:
            stop.set()
            for x in (a, b):
                if x.proc is not None and x.proc.poll() is None:
                    os.kill(x.proc.pid, signal.SIGCONT)
                x.stop()
                x.kill9()
            with admin.begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            admin.dispose()
    out = {
        "leadership_ttl_s": args.leadership_ttl,
        "cycles": args.cycles,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    print(
        f"\nfailover time (s), leadership TTL {args.leadership_ttl:g} s, {args.cycles} cycles each"
    )
    print(f"{'':8s} {'min':>6s} {'median':>7s} {'max':>6s}")
    for kind, label in (("kill", "kill -9"), ("pause", "SIGSTOP")):
        xs = times[kind]
        out[kind] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}
        print(f"{label:8s} {min(xs):6.2f} {statistics.median(xs):7.2f} {max(xs):6.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
