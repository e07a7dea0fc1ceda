"""Broker throughput and acquire latency against a REAL broker subprocess.

    python benchmarks/broker_throughput.py                  # full run (~4 min on 2 cores)
    python benchmarks/broker_throughput.py --quick          # short run (~1.5 min)
    python benchmarks/broker_throughput.py --quick --only throughput --json out.json
    python benchmarks/broker_throughput.py --profile /tmp/prof   # cProfile the broker at 64 clients

What it measures (each part can be chosen with ``--only``):

``throughput``  acquire+release pairs/s and acquire p50/p99 with 1, 8 and 64 concurrent
                HTTP clients, on SQLite and on PostgreSQL (a fresh schema of
                ``$GPU_LEASE_TEST_PG_URL``, default ``postgresql://postgres@127.0.0.1:5432/test``,
                dropped afterwards; skipped with the reason if unreachable). Each client is
                closed-loop (no think time): POST /api/v1/leases, then DELETE it, for
                ``--duration`` s after ``--warmup`` s. CPU seconds per pair of the broker
                (its HTTP processes included) and of this load generator are reported
                next to the rate. Each database twice: the broker as it starts by default
                (one process) and with ``--http-processes N`` (rows ``sqlite +N``; N from
                ``--http-processes``, default 1), on which the ceiling aims are judged.
                ``--load-processes L`` drives every load from L processes (clients split
                between them, one shared window) where one cannot keep the server busy.
``scaling``     one client's acquire latency (p50/p99 over ``--probes`` pairs) as the pool
                grows 1 -> 1,000 GPUs and the active leases 0 -> 10,000 (filled through the
                API by 64 concurrent clients; leases get a 1 h TTL so none expires). One
                broker per pool size runs throughout; probes go to them in interleaved
                batches of 50, so bursts of other load hit every pool size alike.
``limits``      the same pair of operations below the broker, on SQLite with the store's
                durability settings (WAL, synchronous=NORMAL, busy_timeout, BEGIN IMMEDIATE):
                raw ``sqlite3`` INSERT+DELETE (one transaction each: the floor
                of any store), raw ``sqlite3`` with the broker's own statements, the ``Store``
                (SQLAlchemy Core), and ``BrokerService`` in process (no HTTP, no auth,
                no log lines): one caller, and 64 at once with the CPU its event loop's
                thread spends per pair (the broker's own work beside the HTTP).

The load generator is lean on purpose (it shares the machine's cores with the broker):
raw asyncio streams, HTTP/1.1 keep-alive, request bytes built once per client, the
response read as status line + headers + Content-Length body. No HTTP library.

A broker is started per configuration with ``--auth static`` (a tokens file of 64 users;
client i is user ``u{i % 64}``), ``--gpus 1x81920:A100`` for throughput and
``--gpus Nx81920:A100`` for scaling, its database in a temporary directory, and its log
there too (INFO, the default level, so every request is logged as in production).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import pstats
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioner.devtools.testing import (  # noqa: E402
    BrokerProcess,
    cpu_seconds,
    free_port,
    stop_process,
    wait_for_http,
)

PG_URL = os.environ.get("GPU_LEASE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
USERS = 64
PPM = 1_000_000
GPU_MB = 81920

#: the aims of the issues
AIM_PAIRS_64 = 500.0
AIM_P99_MS = 50.0
AIM_GPU_GROWTH = 2.0
#: pairs/s at 64 clients / the no-op tornado ceiling in the same run
AIM_CEILING = {"sqlite": 0.8, "postgresql": 0.6}


# --------------------------------------------------------------------------- the broker


def bench_users(n: int) -> dict[str, tuple[list[str], bool]]:
    """``u00`` ... ``u<n-1>``: plain users, no groups."""
    return {f"u{i:02d}": ([], False) for i in range(n)}


def broker_process(
    tmp: Path,
    db_url: str,
    gpus: str,
    extra: tuple[str, ...] = (),
    *,
    profile: Path | None = None,
    users: int = USERS,
) -> BrokerProcess:
    """A broker (not started) for the benchmarks; several may share ``tmp``."""
    return BrokerProcess(
        tmp,
        db_url,
        bench_users(users),
        gpus=gpus,
        extra=extra,
        profile=profile,
        name=f"broker-{uuid.uuid4().hex[:8]}",
    )


class NoopProcess:
    """``benchmarks/noop_broker.py`` as a subprocess: the HTTP ceiling. ``closed_loop``
    drives it exactly as it drives a broker (``port``, ``tokens``, ``cpu()``)."""

    def __init__(self, tmp: Path, users: int = USERS) -> None:
        self.port = free_port()
        self.tokens = {u: f"tok-{u}" for u in bench_users(users)}
        self.log = tmp / f"noop-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "noop_broker.py"),
                    "--port",
                    str(self.port),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for_http(
            f"http://127.0.0.1:{self.port}/api/v1/health",
            self.proc,
            self.log.read_text,
            timeout,
            "the no-op app",
        )

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid if self.proc else None)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@contextmanager
def running_noop(tmp: Path) -> Iterator[NoopProcess]:
    noop = NoopProcess(tmp)
    noop.start()
    try:
        yield noop
    finally:
        noop.stop()


@contextmanager
def running_broker(*args: Any, **kwargs: Any) -> Iterator[BrokerProcess]:
    broker = broker_process(*args, **kwargs)
    broker.start(60.0)
    try:
        yield broker
    finally:
        broker.stop()


@contextmanager
def pg_schema(url: str) -> Iterator[str]:
    """A fresh PostgreSQL schema; yields the SQLAlchemy URL that uses it. Raises ``RuntimeError``
    with a reason when PostgreSQL cannot be used."""
    try:
        import psycopg2
    except ImportError as exc:
        raise RuntimeError("psycopg2 is not installed") from exc
    schema = f"gl_bench_{uuid.uuid4().hex[:12]}"
    try:
        conn = psycopg2.connect(url, connect_timeout=5)
    except psycopg2.OperationalError as exc:
        raise RuntimeError(f"{url} is unreachable: {str(exc).strip().splitlines()[0]}") from exc
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f'CREATE SCHEMA "{schema}"')
        sep = "&" if "?" in url else "?"
        yield f"{url}{sep}options=-csearch_path%3D{schema}"
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.close()


# --------------------------------------------------------------------------- the load generator


class HTTPConn:
    """One keep-alive HTTP/1.1 connection speaking just enough HTTP for this API."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self._head = f"Host: 127.0.0.1:{port}\r\nAuthorization: token {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass

    def post_json(self, path: str, body: bytes) -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\n{self._head}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    def delete(self, path: str) -> bytes:
        return f"DELETE {path} HTTP/1.1\r\n{self._head}Content-Length: 0\r\n\r\n".encode()

    async def send(self, request: bytes) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        i = lower.find(b"\r\ncontent-length:")
        if i < 0:
            if b"\r\ntransfer-encoding:" in lower:
                raise RuntimeError("chunked responses are not supported by this load generator")
            return status, b""
        j = lower.index(b"\r\n", i + 2)
        n = int(lower[i + 17 : j])
        return status, (await self.reader.readexactly(n)) if n else b""


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile of ``values`` (need not be sorted); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))]


@dataclass
class LoadResult:
    db: str
    clients: int
    pairs: int
    seconds: float
    pairs_per_s: float
    acquire_p50_ms: float
    acquire_p99_ms: float
    release_p50_ms: float
    pair_mean_ms: float
    errors: int
    broker_cpu_us_per_pair: float
    loadgen_cpu_us_per_pair: float
    #: load-generator processes (``--load-processes``)
    load_processes: int = 1


def _acquire_body(kernel_id: str, fraction: float) -> bytes:
    return json.dumps({"kernel_id": kernel_id, "fraction": fraction}).encode()


async def _drive(
    port: int,
    tokens: list[str],
    first: int,
    clients: int,
    fraction: float,
    t_window: float,
    t_end: float,
    cpu_marks: Callable[[str], None] | None = None,
) -> tuple[list[float], list[float], int, int]:
    """``clients`` connections (client numbers ``first`` ...), each acquire -> release in a
    loop until ``t_end`` (``time.perf_counter``, the same clock in every process); the pairs
    wholly inside [``t_window``, ``t_end``] count. ``cpu_marks("0")`` is called at
    ``t_window`` and ``cpu_marks("1")`` at ``t_end``. Returns (acquire s, release s,
    errors, pairs)."""
    conns = [HTTPConn(port, tokens[(first + i) % len(tokens)]) for i in range(clients)]
    await asyncio.gather(*(c.open() for c in conns))
    acq: list[float] = []
    rel: list[float] = []
    counts = {"errors": 0, "pairs": 0}
    run = uuid.uuid4().hex[:8]
    perf = time.perf_counter

    async def client(n: int, conn: HTTPConn) -> None:
        i = 0
        while True:
            t0 = perf()
            if t0 >= t_end:
                return
            i += 1
            status, body = await conn.send(
                conn.post_json("/api/v1/leases", _acquire_body(f"k-{run}-{n}-{i}", fraction))
            )
            t1 = perf()
            if status != 201:
                counts["errors"] += 1
                if counts["errors"] > 100:
                    raise RuntimeError(f"acquire answered {status}: {body[:300]!r}")
                continue
            lease_id = json.loads(body)["id"]
            status, body = await conn.send(conn.delete(f"/api/v1/leases/{lease_id}"))
            t2 = perf()
            if status != 204:
                counts["errors"] += 1
                if counts["errors"] > 100:
                    raise RuntimeError(f"release answered {status}: {body[:300]!r}")
            if t0 >= t_window and t2 <= t_end:
                acq.append(t1 - t0)
                rel.append(t2 - t1)
                counts["pairs"] += 1

    async def sample_cpu() -> None:
        if cpu_marks is None:
            return
        await asyncio.sleep(max(0.0, t_window - perf()))
        cpu_marks("0")
        await asyncio.sleep(max(0.0, t_end - perf()))
        cpu_marks("1")

    try:
        await asyncio.gather(sample_cpu(), *(client(first + n, c) for n, c in enumerate(conns)))
    finally:
        await asyncio.gather(*(c.close() for c in conns))
    return acq, rel, counts["errors"], counts["pairs"]


def _load_part(
    port: int,
    tokens: list[str],
    first: int,
    clients: int,
    fraction: float,
    t_window: float,
    t_end: float,
) -> tuple[list[float], list[float], int, int, float]:
    """One process of a ``--load-processes`` load: ``_drive``, plus this process's CPU
    seconds inside the window."""
    marks: dict[str, float] = {}

    def mark(which: str) -> None:
        marks[which] = time.process_time()

    acq, rel, errors, pairs = asyncio.run(
        _drive(port, tokens, first, clients, fraction, t_window, t_end, mark)
    )
    return acq, rel, errors, pairs, marks["1"] - marks["0"]


def _result(
    db: str,
    clients: int,
    duration: float,
    acq: list[float],
    rel: list[float],
    errors: int,
    pairs: int,
    broker_cpu: float,
    loadgen_cpu: float,
    processes: int,
) -> LoadResult:
    per_pair = 1e6 / max(pairs, 1)
    return LoadResult(
        db=db,
        clients=clients,
        pairs=pairs,
        seconds=duration,
        pairs_per_s=pairs / duration,
        acquire_p50_ms=percentile(acq, 50) * 1e3,
        acquire_p99_ms=percentile(acq, 99) * 1e3,
        release_p50_ms=percentile(rel, 50) * 1e3,
        pair_mean_ms=(statistics.fmean(acq) + statistics.fmean(rel)) * 1e3 if acq else math.nan,
        errors=errors,
        broker_cpu_us_per_pair=broker_cpu * per_pair,
        loadgen_cpu_us_per_pair=loadgen_cpu * per_pair,
        load_processes=processes,
    )


async def closed_loop(
    broker: BrokerProcess | NoopProcess,
    clients: int,
    *,
    warmup: float,
    duration: float,
    fraction: float,
    db: str,
) -> LoadResult:
    """``clients`` connections, each acquire -> release in a loop; stats over the window."""
    t_window = time.perf_counter() + warmup
    marks: dict[str, float] = {}

    def mark(which: str) -> None:
        marks["b" + which], marks["l" + which] = broker.cpu(), time.process_time()

    acq, rel, errors, pairs = await _drive(
        broker.port,
        [broker.tokens[u] for u in broker.tokens],
        0,
        clients,
        fraction,
        t_window,
        t_window + duration,
        mark,
    )
    return _result(
        db,
        clients,
        duration,
        acq,
        rel,
        errors,
        pairs,
        marks["b1"] - marks["b0"],
        marks["l1"] - marks["l0"],
        1,
    )


def closed_loop_processes(
    broker: BrokerProcess | NoopProcess,
    clients: int,
    processes: int,
    *,
    warmup: float,
    duration: float,
    fraction: float,
    db: str,
) -> LoadResult:
    """``closed_loop`` from ``processes`` load-generator processes (``clients`` split
    between them), for machines where one load process cannot keep the server busy. They
    share the window (``time.perf_counter`` is the system's monotonic clock); the load
    generator's CPU per pair is theirs together."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tokens = [broker.tokens[u] for u in broker.tokens]
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    firsts = [sum(shares[:i]) for i in range(processes)]
    ctx = multiprocessing.get_context("spawn")
    # the workers' start (a spawn imports this module) must not eat the warm-up: each
    # worker waits at the barrier once it is up, so none can run the others' first tasks
    # and all of them are started (one per task submitted) before the window is set
    started = ctx.Barrier(processes + 1)
    with ProcessPoolExecutor(
        processes, mp_context=ctx, initializer=started.wait, initargs=(60.0,)
    ) as pool:
        ready = [pool.submit(int) for _ in range(processes)]
        started.wait(60.0)
        for f in ready:
            f.result()
        t_window = time.perf_counter() + warmup
        t_end = t_window + duration
        futures = [
            pool.submit(_load_part, broker.port, tokens, f, n, fraction, t_window, t_end)
            for f, n in zip(firsts, shares, strict=True)
            if n
        ]
        time.sleep(max(0.0, t_window - time.perf_counter()))
        b0 = broker.cpu()
        time.sleep(max(0.0, t_end - time.perf_counter()))
        b1 = broker.cpu()
        parts = [f.result() for f in futures]
    acq = [x for p in parts for x in p[0]]
    rel = [x for p in parts for x in p[1]]
    return _result(
        db,
        clients,
        duration,
        acq,
        rel,
        sum(p[2] for p in parts),
        sum(p[3] for p in parts),
        b1 - b0,
        sum(p[4] for p in parts),
        processes,
    )


async def fill(broker: BrokerProcess, target: int, fraction: float, clients: int = 64) -> float:
    """Acquire (and keep) leases until the broker holds ``target``; returns acquires/s."""
    have = int(broker.health()["active_leases"])
    todo = target - have
    if todo <= 0:
        return math.nan
    users = list(broker.tokens)
    conns = [HTTPConn(broker.port, broker.tokens[users[i % len(users)]]) for i in range(clients)]
    await asyncio.gather(*(c.open() for c in conns))
    counter = iter(range(have, target))
    run = uuid.uuid4().hex[:8]

    async def client(conn: HTTPConn) -> None:
        for i in counter:
            status, body = await conn.send(
                conn.post_json("/api/v1/leases", _acquire_body(f"fill-{run}-{i}", fraction))
            )
            if status != 201:
                raise RuntimeError(f"filling: acquire answered {status}: {body[:300]!r}")

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in conns))
    finally:
        await asyncio.gather(*(c.close() for c in conns))
    return todo / (time.perf_counter() - t0)


PROBE_WARMUP = 5


async def probe(
    broker: BrokerProcess, n: int, fraction: float, warm: int = PROBE_WARMUP
) -> tuple[list[float], list[float]]:
    """One client: ``warm`` + ``n`` acquire+release pairs; (acquire, release) seconds of the ``n``."""
    user = next(iter(broker.tokens))
    conn = HTTPConn(broker.port, broker.tokens[user])
    await conn.open()
    acq: list[float] = []
    rel: list[float] = []
    run = uuid.uuid4().hex[:8]
    perf = time.perf_counter
    try:
        for i in range(warm + n):
            t0 = perf()
            status, body = await conn.send(
                conn.post_json("/api/v1/leases", _acquire_body(f"p-{run}-{i}", fraction))
            )
            t1 = perf()
            if status != 201:
                raise RuntimeError(f"probe: acquire answered {status}: {body[:300]!r}")
            status, body = await conn.send(conn.delete(f"/api/v1/leases/{json.loads(body)['id']}"))
            t2 = perf()
            if status != 204:
                raise RuntimeError(f"probe: release answered {status}: {body[:300]!r}")
            if i >= warm:
                acq.append(t1 - t0)
                rel.append(t2 - t1)
    finally:
        await conn.close()
    return acq, rel


# --------------------------------------------------------------------------- parts


def database_url(stack: ExitStack, db: str, tmp: Path, name: str, notes: list[str]) -> str | None:
    """A fresh database for ``db`` (``sqlite``: ``tmp/NAME.sqlite``; ``postgresql``: a schema
    dropped when ``stack`` closes), or None when PostgreSQL cannot be used (said, in ``notes``)."""
    if db == "sqlite":
        return f"sqlite:///{tmp / f'{name}.sqlite'}"
    try:
        return stack.enter_context(pg_schema(PG_URL))
    except RuntimeError as exc:
        notes.append(f"PostgreSQL skipped: {exc}")
        print(f"  {db}: skipped ({exc})", flush=True)
        return None


def run_throughput(args: argparse.Namespace, tmp: Path) -> tuple[list[LoadResult], list[str]]:
    results: list[LoadResult] = []
    notes: list[str] = []
    extra = tuple(args.broker_args.split()) if args.broker_args else ()

    def each_load(server: BrokerProcess | NoopProcess, db: str) -> None:
        for clients in args.clients:
            procs = min(args.load_processes, clients)
            if procs > 1:
                r = closed_loop_processes(
                    server,
                    clients,
                    procs,
                    warmup=args.warmup,
                    duration=args.duration,
                    fraction=0.01,
                    db=db,
                )
            else:
                r = asyncio.run(
                    closed_loop(
                        server,
                        clients,
                        warmup=args.warmup,
                        duration=args.duration,
                        fraction=0.01,
                        db=db,
                    )
                )
            results.append(r)
            print(
                f"  {db:<10} {clients:>3} clients: {r.pairs_per_s:7.0f} pairs/s, "
                f"acquire p50 {r.acquire_p50_ms:6.2f} p99 {r.acquire_p99_ms:6.2f} ms",
                flush=True,
            )

    with running_noop(tmp) as noop:
        each_load(noop, "no-op")
    for db in args.dbs:
        for procs in sorted({0, args.http_processes}):
            name = f"{db} +{procs}" if procs else db
            more = ("--http-processes", str(procs)) if procs else ()
            with ExitStack() as stack:
                url = database_url(stack, db, tmp, f"throughput{procs}", notes)
                if url is not None:
                    broker = running_broker(tmp, url, "1x81920:A100", extra + more)
                    each_load(stack.enter_context(broker), name)
    return results, notes


def fill_fraction(gpus: int, max_leases: int) -> float:
    """The lease size for a pool of ``gpus``: 0.01, or smaller so ``max_leases`` fit with room."""
    ppm = min(10_000, int(0.9 * gpus * PPM / max(max_leases, 1)))
    return ppm / PPM


def run_scaling(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """One broker per pool size, all running at once. For each lease count: fill every
    broker, then probe them in interleaved batches (pool A, B, C, D, A, B, ...), so that a
    burst of other load on the machine hits every pool size alike."""
    rows: list[dict[str, Any]] = []
    extra = (
        "--ttl",
        "3600",
        # 10,000 leases on ONE 80 GiB GPU are 0.00009 each (7 MiB): below the default
        # 512 MiB CUDA context, so the broker would refuse them (422); the overhead is
        # irrelevant to the cost being measured.
        "--GPULeaseBroker.context_overhead_mb=0",
        *(args.broker_args.split() if args.broker_args else ()),
    )
    top = max(args.leases)
    batches = max(1, args.probes // 50)
    with ExitStack() as stack:
        brokers = {
            n: stack.enter_context(
                running_broker(
                    tmp, f"sqlite:///{tmp / f'scaling-{n}.sqlite'}", f"{n}x{GPU_MB}:A100", extra
                )
            )
            for n in args.pools
        }
        for n_leases in sorted(args.leases):
            rates: dict[int, float] = {}
            for n_gpus, broker in brokers.items():
                rates[n_gpus] = asyncio.run(fill(broker, n_leases, fill_fraction(n_gpus, top)))
                held = int(broker.health()["active_leases"])
                assert held == n_leases, (held, n_leases)
            acq: dict[int, list[float]] = {n: [] for n in brokers}
            rel: dict[int, list[float]] = {n: [] for n in brokers}
            cpu: dict[int, float] = dict.fromkeys(brokers, 0.0)
            for _ in range(batches):
                for n_gpus, broker in brokers.items():
                    c0 = broker.cpu()
                    a, r = asyncio.run(
                        probe(broker, args.probes // batches, fill_fraction(n_gpus, top))
                    )
                    cpu[n_gpus] += broker.cpu() - c0
                    acq[n_gpus] += a
                    rel[n_gpus] += r
            for n_gpus in brokers:
                row = {
                    "gpus": n_gpus,
                    "leases": n_leases,
                    "fraction": fill_fraction(n_gpus, top),
                    "acquire_p50_ms": percentile(acq[n_gpus], 50) * 1e3,
                    "acquire_p99_ms": percentile(acq[n_gpus], 99) * 1e3,
                    "release_p50_ms": percentile(rel[n_gpus], 50) * 1e3,
                    # the probe's warm-up pairs included: CPU is sampled around each batch
                    "broker_cpu_ms_per_pair": cpu[n_gpus]
                    * 1e3
                    / (batches * (args.probes // batches + PROBE_WARMUP)),
                }
                if not math.isnan(rates[n_gpus]):
                    row["fill_acquires_per_s"] = rates[n_gpus]
                rows.append(row)
                print(
                    f"  {n_gpus:>5} GPUs {n_leases:>6} leases: acquire p50 "
                    f"{row['acquire_p50_ms']:6.2f} p99 {row['acquire_p99_ms']:6.2f} ms"
                    + (
                        ""
                        if math.isnan(rates[n_gpus])
                        else f"  (filled at {rates[n_gpus]:.0f} acquires/s)"
                    ),
                    flush=True,
                )
    rows.sort(key=lambda r: (r["gpus"], r["leases"]))
    return rows


# -- limits below the broker ----------------------------------------------------------------


def _sqlite_connect(path: Path) -> sqlite3.Connection:
    """A connection set up exactly as ``Store._install_sqlite_hooks`` sets up its connections."""
    conn = sqlite3.connect(str(path), check_same_thread=False)
    conn.isolation_level = None  # we issue BEGIN ourselves, as the store does
    conn.execute("PRAGMA busy_timeout = 30000")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def _timed(duration: float, step: Callable[[int], None]) -> float:
    """Call ``step(i)`` for ``duration`` seconds (after a short warm-up); returns calls/s."""
    for i in range(50):
        step(-1 - i)
    n = 0
    t0 = time.perf_counter()
    end = t0 + duration
    while True:
        step(n)
        n += 1
        if n % 32 == 0 and time.perf_counter() >= end:
            break
    return n / (time.perf_counter() - t0)


def _lease_values(lid: str, kernel: str, gpu: str, now: float) -> tuple[Any, ...]:
    return (lid, "u00", kernel, gpu, 10_000, 307, "active", None, now, now, now + 90.0)


_INSERT = (
    "INSERT INTO leases (id, user, kernel_id, gpu_uuid, fraction_ppm, memory_limit_mb, state, "
    "grp, created_at, renewed_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def run_limits(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """Pairs/s of the layers below the HTTP broker, all on SQLite files in ``tmp``."""
    from provisioner.broker.rules.policy import Ask, Policy
    from provisioner.broker.services.broker_service import BrokerService, new_id
    from provisioner.broker.store.store import Store
    from provisioner.inventory import load_gpus
    from provisioner.model import Identity, Lease

    gpus = load_gpus("1x81920:A100")
    gpu = gpus[0].uuid
    policy = Policy()
    out: dict[str, float] = {}

    def fresh(name: str) -> Path:
        path = tmp / f"limit-{name}.sqlite"
        store = Store(f"sqlite:///{path}")
        store.open()  # the broker's real schema: the leases table with all its indexes
        store.sync_gpus(gpus, policy.capacity_ppm)
        store.close()
        return path

    # 1. raw sqlite3: one INSERT and one DELETE, each in its own transaction
    conn = _sqlite_connect(fresh("raw"))

    def raw_pair(i: int) -> None:
        lid = f"r{i}"
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(_INSERT, _lease_values(lid, f"k{i}", gpu, time.time()))
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM leases WHERE id = ?", (lid,))
        conn.execute("COMMIT")

    out["raw_insert_delete"] = _timed(args.limit_duration, raw_pair)
    conn.close()

    # 2. raw sqlite3 with the statements the store runs for one acquire and one release
    conn = _sqlite_connect(fresh("shaped"))

    def shaped_pair(i: int) -> None:
        lid, kernel, now = f"s{i}", f"k{i}", time.time()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("SELECT uuid, capacity_ppm FROM gpus WHERE uuid IN (?) ORDER BY uuid", (gpu,))
        conn.execute(
            "SELECT gpu_uuid, sum(fraction_ppm) FROM leases WHERE state = 'active' "
            "AND gpu_uuid IN (?) GROUP BY gpu_uuid",
            (gpu,),
        ).fetchall()
        conn.execute(
            "SELECT id FROM leases WHERE state = 'active' AND user = ? AND kernel_id = ?",
            ("u00", kernel),
        ).fetchall()
        conn.execute(_INSERT, _lease_values(lid, kernel, gpu, now))
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "UPDATE leases SET state = ?, ended_at = ?, reason = ? WHERE id = ? AND state = 'active'",
            ("released", now, None, lid),
        )
        conn.execute("COMMIT")

    out["raw_broker_statements"] = _timed(args.limit_duration, shaped_pair)
    conn.close()

    # 3. the Store (SQLAlchemy Core): insert_lease + end_leases
    store = Store(f"sqlite:///{fresh('store')}")
    store.open()

    def store_pair(i: int) -> None:
        now = time.time()
        lease = Lease(f"t{i}", "u00", f"k{i}", gpu, 10_000, 307, "active", now, now, now + 90)
        store.insert_lease(lease, policy.capacity_ppm)
        store.end_leases([(lease.id, "released", now, None)])

    out["store"] = _timed(args.limit_duration, store_pair)
    store.close()

    # 4. BrokerService in process (pure core + store, no HTTP, no auth)
    store = Store(f"sqlite:///{fresh('service')}")
    service = BrokerService(store, gpus, policy, id_factory=new_id)
    service.start()
    ident = Identity("u00")
    import logging

    logging.getLogger("gpu_lease").setLevel(logging.WARNING)  # in-process: no log handler

    async def one(i: int | str) -> None:
        result = await service.leases.acquire(ident, Ask("u00", f"v{i}", 10_000))
        assert result.lease is not None
        await service.leases.release(ident, result.lease.id)

    async def service_pairs() -> float:
        for i in range(50):
            await one(-1 - i)
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.limit_duration:
            await one(n)
            n += 1
        return n / (time.perf_counter() - t0)

    # 5. the same with 64 callers at once, as 64 HTTP clients make it (batches form): the
    # rate, and the CPU of the event loop's thread per pair (the writer's thread apart),
    # which is the broker's own work on the loop beside the HTTP work the no-op also does
    async def service_callers(callers: int) -> tuple[float, float]:
        done = 0
        end = time.perf_counter() + args.limit_duration

        async def caller(c: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < end:
                await one(f"c{c}-{i}")
                i += 1
                done += 1

        t0, c0 = time.perf_counter(), time.thread_time()
        await asyncio.gather(*(caller(c) for c in range(callers)))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return done / wall, cpu / max(done, 1) * 1e6

    async def service_both() -> None:  # one loop: the service's writer answers on it
        out["service"] = await service_pairs()
        out["service_64"], out["service_64_loop_us_per_pair"] = await service_callers(64)

    asyncio.run(service_both())
    service.close()
    for name, rate in out.items():
        unit = "us" if name.endswith("_us_per_pair") else "pairs/s"
        print(f"  {name:<22} {rate:8.0f} {unit}", flush=True)
    return out


# --------------------------------------------------------------------------- profile

#: what ``--profile`` profiles: (GPUs, active leases, clients)
PROFILE_CASES = {
    "throughput": (1, 0, 64),
    "gpus": (1000, 0, 1),
    "leases": (1, 10_000, 1),
}


#: innermost frames that mean the broker is waiting, not working
IDLE_FRAMES = ("Selector.select", "EpollSelector.select")


def _short_frame(frame: str) -> str:
    """``func (/long/path/site-packages/pkg/mod.py:12)`` -> ``pkg/mod.py:func``."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3.", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "lib/python3.":
                path = "stdlib/" + path.split("/", 1)[-1]
            break
    return f"{path}:{name}"


def _category(frame: str) -> str:
    """The layer a sample's innermost frame belongs to."""
    if frame.endswith((".do_execute", ".do_commit", ".do_rollback", ".do_executemany")):
        return "SQLite C library (execute/commit/fetch)"
    for prefix, name in (
        ("sqlalchemy/", "SQLAlchemy Python"),
        ("tornado/", "tornado (HTTP)"),
        ("stdlib/logging/", "logging"),
        ("logging/", "logging"),
        ("stdlib/json/", "json"),
        ("json/", "json"),
        ("stdlib/asyncio/", "asyncio loop"),
        ("asyncio/", "asyncio loop"),
        ("provisioner/broker/store/store.py", "provisioner store"),
        ("provisioner/broker/", "provisioner broker (handlers/service/auth)"),
        ("provisioner/", "provisioner core (scheduling/model)"),
    ):
        if frame.startswith(prefix):
            return name
    return "other (stdlib, ...)"


def summarize_py_spy(raw: Path, top: int = 18) -> list[str]:
    """Self and inclusive sample shares from py-spy's ``--format raw`` (collapsed stacks)."""
    self_n: dict[str, int] = {}
    incl_n: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short_frame(f) for f in stack.split(";")]
        if frames[-1].endswith(IDLE_FRAMES):
            continue  # waiting for the next request: not work
        total += n
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
        for f in set(frames):
            incl_n[f] = incl_n.get(f, 0) + n
    if not total:
        return ["  (no samples)"]
    cats: dict[str, int] = {}
    for f, n in self_n.items():
        cats[_category(f)] = cats.get(_category(f), 0) + n
    out = [f"  {total} samples of the busy broker; self time by layer:"]
    out += [
        f"    {100 * n / total:5.1f} %  {c}" for c, n in sorted(cats.items(), key=lambda x: -x[1])
    ]
    out.append("  self time (innermost Python frame; Python 3.11 may misname a frame):")
    for f, n in sorted(self_n.items(), key=lambda x: -x[1])[:top]:
        out.append(f"    {100 * n / total:5.1f} %  {f}")
    out.append("  inclusive time, this project's functions:")
    ours = [(f, n) for f, n in incl_n.items() if f.startswith("provisioner/")]
    for f, n in sorted(ours, key=lambda x: -x[1])[:top]:
        out.append(f"    {100 * n / total:5.1f} %  {f}")
    return out


def run_profile(args: argparse.Namespace, tmp: Path) -> list[str]:
    """Profile the broker under load (py-spy when found, else cProfile); returns report lines."""
    args.profile.mkdir(parents=True, exist_ok=True)
    py_spy = shutil.which(args.py_spy) if args.py_spy else None
    extra = (
        "--ttl",
        "3600",
        "--GPULeaseBroker.context_overhead_mb=0",
        *(args.broker_args.split() if args.broker_args else ()),
    )
    lines: list[str] = [f"profiler: {py_spy or 'cProfile (py-spy not found)'}"]
    for case in args.profile_cases:
        n_gpus, n_leases, clients = PROFILE_CASES[case]
        frac = fill_fraction(n_gpus, n_leases)
        url = f"sqlite:///{tmp / f'profile-{case}.sqlite'}"
        prof = args.profile / f"{case}.{'txt' if py_spy else 'prof'}"
        gpus = f"{n_gpus}x{GPU_MB}:A100"
        with running_broker(tmp, url, gpus, extra, profile=None if py_spy else prof) as broker:
            asyncio.run(fill(broker, n_leases, frac))
            spy = None
            if py_spy:
                assert broker.proc is not None
                spy = subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--pid",
                        str(broker.proc.pid),
                        "--format",
                        "raw",
                        "--output",
                        str(prof),
                        "--rate",
                        "250",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)  # attach
            r = asyncio.run(
                closed_loop(
                    broker,
                    clients,
                    warmup=args.warmup,
                    duration=args.duration,
                    fraction=frac,
                    db="sqlite",
                )
            )
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
        lines.append(
            f"{case}: {n_gpus} GPU(s), {n_leases} leases, {clients} client(s): "
            f"{r.pairs_per_s:.0f} pairs/s, acquire p50 {r.acquire_p50_ms:.2f} ms, "
            f"release p50 {r.release_p50_ms:.2f} ms while profiled -> {prof}"
        )
        if py_spy:
            lines += summarize_py_spy(prof)
        else:
            out = args.profile / f"{case}-tottime.txt"
            with open(out, "w") as f:
                pstats.Stats(str(prof), stream=f).sort_stats("tottime").print_stats(40)
            lines.append(f"  pstats by tottime: {out}")
    return lines


# --------------------------------------------------------------------------- report


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def report(data: dict[str, Any]) -> str:
    lines: list[str] = []
    tp: list[dict[str, Any]] = data.get("throughput", [])
    limits: dict[str, float] = data.get("limits", {})
    raw = limits.get("raw_insert_delete", math.nan)
    if tp:
        lines += [
            "",
            "Throughput (closed loop, acquire+release pairs, 1 GPU, fraction 0.01)",
            f"{'db':<14}{'clients':>7}{'pairs/s':>9}{'acq p50':>9}{'acq p99':>9}{'rel p50':>9}"
            f"{'broker':>9}{'broker':>8}{'1 core':>8}{'loadgen':>9}{'/ raw':>8}{'/ no-op':>9}",
            f"{'':<14}{'':>7}{'':>9}{'ms':>9}{'ms':>9}{'ms':>9}{'us/pair':>9}{'%CPU':>8}"
            f"{'pairs/s':>8}{'us/pair':>9}{'sqlite':>8}{'same run':>9}",
        ]
        noop = {r["clients"]: r["pairs_per_s"] for r in tp if r["db"] == "no-op"}
        for r in tp:
            lines.append(
                f"{r['db']:<14}{r['clients']:>7}{r['pairs_per_s']:>9.0f}{r['acquire_p50_ms']:>9.2f}"
                f"{r['acquire_p99_ms']:>9.2f}{r['release_p50_ms']:>9.2f}"
                f"{r['broker_cpu_us_per_pair']:>9.0f}"
                f"{r['broker_cpu_us_per_pair'] * r['pairs_per_s'] / 1e4:>8.0f}"
                f"{ratio(1e6, r['broker_cpu_us_per_pair']):>8.0f}"
                f"{r['loadgen_cpu_us_per_pair']:>9.0f}"
                f"{ratio(r['pairs_per_s'], raw):>8.3f}"
                f"{ratio(r['pairs_per_s'], noop.get(r['clients'], math.nan)):>9.2f}"
            )
    if limits:
        lines += ["", "Below the broker (SQLite, WAL, synchronous=NORMAL, one client)"]
        names = {
            "raw_insert_delete": "raw sqlite3 INSERT + DELETE (2 tx)",
            "raw_broker_statements": "raw sqlite3, the store's statements",
            "store": "Store (SQLAlchemy Core)",
            "service": "BrokerService in process",
            "service_64": "BrokerService, 64 callers at once",
        }
        for key, rate in limits.items():
            if key.endswith("_us_per_pair"):
                continue
            lines.append(
                f"  {names.get(key, key):<38}{rate:>9.0f} pairs/s  ({1e6 / rate:>6.0f} us)"
            )
        loop_us = limits.get("service_64_loop_us_per_pair")
        if loop_us is not None:
            lines.append(
                f"  (64 callers: the event loop's thread spent {loop_us:.0f} us of CPU per pair; "
                "the writer's thread apart)"
            )
    sc: list[dict[str, Any]] = data.get("scaling", [])
    if sc:
        lines += [
            "",
            "Scaling (one client, acquire latency in ms; leases pre-filled through the API;"
            " CPU/pair = broker CPU ms per acquire+release pair, robust to other load)",
            f"{'GPUs':>6}{'leases':>8}{'fraction':>10}{'acq p50':>9}{'acq p99':>9}{'rel p50':>9}"
            f"{'p50 / 1 GPU':>13}{'p50 / 0 ls':>12}{'CPU/pair':>10}{'/ 1 GPU':>9}{'/ 0 ls':>8}",
        ]
        base_gpu = {r["leases"]: r for r in sc if r["gpus"] == min(x["gpus"] for x in sc)}

        def cpu(row: dict[str, Any] | None) -> float:
            return row.get("broker_cpu_ms_per_pair", math.nan) if row else math.nan

        def p50(row: dict[str, Any] | None) -> float:
            return row["acquire_p50_ms"] if row else math.nan

        for r in sc:
            zero = next(x for x in sc if x["gpus"] == r["gpus"] and x["leases"] == 0)
            g0 = base_gpu.get(r["leases"])
            lines.append(
                f"{r['gpus']:>6}{r['leases']:>8}{r['fraction']:>10g}{r['acquire_p50_ms']:>9.2f}"
                f"{r['acquire_p99_ms']:>9.2f}{r['release_p50_ms']:>9.2f}"
                f"{ratio(p50(r), p50(g0)):>13.2f}{ratio(p50(r), p50(zero)):>12.2f}"
                f"{cpu(r):>10.2f}{ratio(cpu(r), cpu(g0)):>9.2f}{ratio(cpu(r), cpu(zero)):>8.2f}"
            )
    m = data.get("machine", {})
    if "loadavg_at_start" in m:
        lines += [
            "",
            f"{m['cpus']} CPUs; load average {m['loadavg_at_start'][0]:.2f} at start, "
            f"{m.get('loadavg_at_end', [math.nan])[0]:.2f} at end.",
        ]
        if tp:
            lines.append(
                "Broker %CPU well below 100 at 64 clients means other processes took the CPU; "
                "'1 core pairs/s' = 1e6 / broker CPU us per pair, the rate the broker's CPU "
                "cost allows on one whole core."
            )
    aims = data.get("aims")
    if aims:
        lines += ["", "Aims"]
        lines += [f"  {a['aim']:<48} {a['value']:<24} {a['verdict']}" for a in aims]
    return "\n".join(lines)


def judge(data: dict[str, Any]) -> list[dict[str, str]]:
    aims: list[dict[str, str]] = []
    tp = {(r["db"], r["clients"]): r for r in data.get("throughput", [])}
    r64 = tp.get(("sqlite", 64))
    if r64:
        aims.append(
            {
                "aim": f">= {AIM_PAIRS_64:.0f} pairs/s at 64 clients on SQLite",
                "value": f"{r64['pairs_per_s']:.0f} pairs/s",
                "verdict": "met" if r64["pairs_per_s"] >= AIM_PAIRS_64 else "NOT met",
            }
        )
    ceiling = tp.get(("no-op", 64))
    for (db, clients), r in sorted(tp.items()):
        aim = AIM_CEILING.get(db.split(" +")[0])
        if clients != 64 or aim is None or not ceiling:
            continue
        share = ratio(r["pairs_per_s"], ceiling["pairs_per_s"])
        split = " +" in db  # the aim is for the broker with its HTTP processes
        aims.append(
            {
                "aim": f">= {aim:g} of the no-op ceiling at 64 clients ({db})"
                if split
                else f"(one process, no aim) share of the ceiling ({db})",
                "value": f"{share:.2f} ({r['pairs_per_s']:.0f} / {ceiling['pairs_per_s']:.0f})",
                "verdict": ("met" if share >= aim else "NOT met") if split else "-",
            }
        )
    for (db, clients), r in sorted(tp.items()):
        if db == "no-op":
            continue
        aims.append(
            {
                "aim": f"p99 acquire < {AIM_P99_MS:.0f} ms ({db}, {clients} clients)",
                "value": f"{r['acquire_p99_ms']:.1f} ms",
                "verdict": "met" if r["acquire_p99_ms"] < AIM_P99_MS else "NOT met",
            }
        )
    sc = data.get("scaling", [])
    zero = {r["gpus"]: r for r in sc if r["leases"] == 0}
    if len(zero) >= 2:
        lo, hi = zero[min(zero)], zero[max(zero)]
        growth = ratio(hi["acquire_p50_ms"], lo["acquire_p50_ms"])
        aims.append(
            {
                "aim": f"< {AIM_GPU_GROWTH:g}x acquire p50 from {min(zero)} to {max(zero)} GPUs",
                "value": f"{growth:.2f}x",
                "verdict": "met" if growth < AIM_GPU_GROWTH else "NOT met",
            }
        )
        cpu_growth = ratio(
            hi.get("broker_cpu_ms_per_pair", math.nan), lo.get("broker_cpu_ms_per_pair", math.nan)
        )
        aims.append(
            {
                "aim": f"(same, on broker CPU per pair: less noisy) {min(zero)} -> {max(zero)} GPUs",
                "value": f"{cpu_growth:.2f}x",
                "verdict": "met" if cpu_growth < AIM_GPU_GROWTH else "NOT met",
            }
        )
    with_leases = [r for r in sc if r["leases"] > 0 and r["gpus"] == max(x["gpus"] for x in sc)]
    if with_leases and len(zero) >= 1:
        hi = max(with_leases, key=lambda r: r["leases"])
        growth = ratio(hi["acquire_p50_ms"], zero[hi["gpus"]]["acquire_p50_ms"])
        aims.append(
            {
                "aim": f"(no aim) acquire p50 {hi['leases']} / 0 leases, {hi['gpus']} GPUs",
                "value": f"{growth:.2f}x",
                "verdict": "-",
            }
        )
    return aims


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run: 2 s windows, fewer sizes")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=("throughput", "scaling", "limits"),
        default=["limits", "throughput", "scaling"],
    )
    ap.add_argument(
        "--dbs", nargs="+", choices=("sqlite", "postgresql"), default=["sqlite", "postgresql"]
    )
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--duration", type=float, help="measured seconds per load (5; quick 2)")
    ap.add_argument("--warmup", type=float, help="warm-up seconds per load (1; quick 0.5)")
    ap.add_argument("--pools", nargs="+", type=int, help="GPU counts (1 10 100 1000; quick 1 1000)")
    ap.add_argument(
        "--leases", nargs="+", type=int, help="active leases (0 1000 10000; quick 0 10000)"
    )
    ap.add_argument("--probes", type=int, help="pairs per scaling probe (500; quick 200)")
    ap.add_argument(
        "--broker-args", default="", help="extra broker options, e.g. '--log-level=WARN'"
    )
    ap.add_argument(
        "--http-processes",
        type=int,
        default=1,
        help="throughput: each database also with the broker's --http-processes N "
        "(rows 'sqlite +N'; the ceiling aims are judged on those); 0: only one process",
    )
    ap.add_argument(
        "--load-processes",
        type=int,
        default=1,
        help="throughput: the load generator's processes (1); more where one process "
        "cannot keep the servers busy (many cores)",
    )
    ap.add_argument(
        "--profile", type=Path, help="profile the broker under load instead; write into DIR"
    )
    ap.add_argument(
        "--profile-cases",
        nargs="+",
        choices=tuple(PROFILE_CASES),
        default=list(PROFILE_CASES),
        help="throughput: 64 clients, 1 GPU; gpus: 1 client, 1000 GPUs; "
        "leases: 1 client, 1 GPU holding 10,000 leases",
    )
    ap.add_argument("--py-spy", default="py-spy", help="py-spy executable (else cProfile)")
    ap.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C, so the brokers and temporary files are cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    q = args.quick
    args.duration = args.duration or (2.0 if q else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if q else 1.0)
    args.pools = args.pools or ([1, 1000] if q else [1, 10, 100, 1000])
    args.leases = args.leases or ([0, 10_000] if q else [0, 1000, 10_000])
    if 0 not in args.leases:
        args.leases = [0, *args.leases]
    args.probes = args.probes or (200 if q else 500)
    args.limit_duration = 1.0 if q else 3.0

    data: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "notes": [],
    }
    print(
        f"{data['date']}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gl-bench-") as d:
        tmp = Path(d)
        if args.profile:
            for line in run_profile(args, tmp):
                print(line)
            return 0
        if "limits" in args.only:
            print("limits below the broker:", flush=True)
            data["limits"] = run_limits(args, tmp)
        if "throughput" in args.only:
            print("throughput:", flush=True)
            results, notes = run_throughput(args, tmp)
            data["throughput"] = [asdict(r) for r in results]
            data["notes"] += notes
        if "scaling" in args.only:
            print("scaling:", flush=True)
            data["scaling"] = run_scaling(args, tmp)
    data["machine"]["loadavg_at_end"] = os.getloadavg()
    data["aims"] = judge(data)
    print(report(data))
    for note in data["notes"]:
        print(f"note: {note}")
    if args.json:
        args.json.write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
