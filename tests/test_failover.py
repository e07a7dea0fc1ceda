"""Failover: fenced leadership, one source of truth, and a chaos run.

Each failure once found is reproduced first, with real broker processes on a real
database, and each of these tests failed on the broker before fenced leadership:

- a paused (SIGSTOP) active broker was never replaced (``test_a_paused_active_is_replaced``);
- after SIGCONT the old active served its backlog and wrote after the standby had
  taken over (``test_the_old_active_answers_and_writes_nothing_after_sigcont``);
- memory and database disagreed, and clients saw it: a lease active in the database but
  unknown in memory answered 410, a DELETE of it 204 while nothing was released, a lease
  ended in the database kept its capacity in memory, a conflict found at commit answered
  409 for someone else's lease, a queued request unknown in memory answered 404, and a
  long-poll cut by a shutdown got no answer (``test_*_database*``, ``test_conflicts_*``,
  ``test_a_long_poll_cut_by_a_shutdown_answers_503``).

"Behind the broker's back" writes go straight into the database with SQL, standing in
for the writer a deposed broker used to be. The chaos test runs two brokers behind a
health-checked TCP front (as a load balancer would) under concurrent clients, and after
every ``kill -9``, pause and cut database session checks the database itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import sqlalchemy as sa

from provisioner.broker.store.store import leases as leases_table
from provisioner.broker.store.store import requests as requests_table
from provisioner.devtools.testing import wait_for, wait_for_async

from .conftest import Broker
from .test_faults import (
    PPM,
    acquire,
    answers,
    api,
    check_invariants,
    db_facts,
    engine,
)

#: kill -9, SIGSTOP, SIGTERM and exit codes of brokers: the broker fixture runs as a subprocess here
pytestmark = pytest.mark.broker_process

PG_ONLY = pytest.mark.parametrize(
    "broker_db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
#: the leadership TTL of these tests' brokers (s): short, so that takeovers are quick
TTL = 2.0
HA_ARGS = (
    "--ha-lock",
    "--gpus",
    "2x32768:V100",
    "--ttl",
    "30",
    f"--GPULeaseBroker.leadership_ttl={TTL}",
    "--GPULeaseBroker.reap_interval=0.5",
)
#: a busy shared 2-core box starts a broker process in 1-10 s
SLACK = 20.0


# -- helpers -----------------------------------------------------------------------------------
async def start_standby(active: Broker, tmp_path: Path, name: str = "standby") -> Broker:
    """A second broker on the active one's database, tokens and options, standing by."""
    (tmp_path / name).mkdir()
    standby = Broker(tmp_path / name, active.db_url, active.extra)
    standby.tokens, standby.tokens_file = active.tokens, active.tokens_file
    standby.launch()
    await wait_for_async(lambda: "standby:" in standby.log(), SLACK, "the standby to stand by")
    assert not answers(standby)
    return standby


def pause(b: Broker) -> None:
    assert b.proc is not None
    os.kill(b.proc.pid, signal.SIGSTOP)


def resume(b: Broker) -> None:
    if b.proc is not None and b.proc.poll() is None:
        os.kill(b.proc.pid, signal.SIGCONT)


def cut_sessions(b: Broker) -> int:
    """End every database session of broker ``b`` (``pg_terminate_backend``), as the
    server does to a partitioned client; returns how many were ended."""
    assert b.proc is not None
    ports = [
        c.laddr.port
        for c in psutil.Process(b.proc.pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == 5432
    ]
    if not ports:
        return 0
    eng = engine(b.db_url)
    try:
        with eng.begin() as conn:
            ended = conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE client_port = ANY(:ports) AND client_addr = '127.0.0.1'"
                ),
                {"ports": ports},
            ).all()
    finally:
        eng.dispose()
    return len(ended)


def db_lease(db_url: str, lease_id: str) -> dict[str, Any] | None:
    eng = engine(db_url)
    try:
        with eng.connect() as conn:
            row = conn.execute(sa.select(leases_table).where(leases_table.c.id == lease_id)).first()
    finally:
        eng.dispose()
    return None if row is None else dict(row._mapping)


def db_rows_of_kernels(db_url: str, kernel_ids: list[str]) -> list[tuple[str, str]]:
    """(table, kernel_id) of every lease or queued request of these kernels."""
    eng = engine(db_url)
    try:
        with eng.connect() as conn:
            out = [
                ("leases", k)
                for k in conn.execute(
                    sa.select(leases_table.c.kernel_id).where(
                        leases_table.c.kernel_id.in_(kernel_ids)
                    )
                ).scalars()
            ]
            out += [
                ("requests", k)
                for k in conn.execute(
                    sa.select(requests_table.c.kernel_id).where(
                        requests_table.c.kernel_id.in_(kernel_ids)
                    )
                ).scalars()
            ]
    finally:
        eng.dispose()
    return out


def behind_the_back(db_url: str, *statements: Any) -> None:
    """Write straight into the broker's database, as another writer would."""
    eng = engine(db_url)
    try:
        with eng.begin() as conn:
            for stmt in statements:
                conn.execute(stmt)
    finally:
        eng.dispose()


def sneaked_lease(
    user: str, gpu_uuid: str, fraction: float, kernel_id: str | None = None
) -> tuple[str, Any]:
    """(id, INSERT) of an active lease the broker did not grant."""
    lid = f"sneak-{uuid.uuid4().hex[:12]}"
    now = time.time()
    return lid, leases_table.insert().values(
        id=lid,
        user=user,
        kernel_id=kernel_id or f"k-{lid}",
        gpu_uuid=gpu_uuid,
        fraction_ppm=int(fraction * PPM),
        memory_limit_mb=1024,
        state="active",
        created_at=now,
        renewed_at=now,
        expires_at=now + 600,
    )


def gpu_uuids(b: Broker) -> list[str]:
    return [g["uuid"] for g in api(b, "GET", "/gpus").json()["gpus"]]


def allocated(b: Broker) -> dict[str, float]:
    return {g["uuid"]: g["allocated_fraction"] for g in api(b, "GET", "/gpus").json()["gpus"]}


@contextlib.contextmanager
def stopped_at_the_end(*brokers: Broker) -> Iterator[None]:
    try:
        yield
    finally:
        for b in brokers:
            resume(b)
            b.stop()
            b.kill9()


# -- finding 1: a frozen active is never replaced ------------------------------------------------
@pytest.mark.slow
@PG_ONLY
@pytest.mark.broker_args(*HA_ARGS)
async def test_a_paused_active_is_replaced(broker: Broker, tmp_path: Path) -> None:
    """SIGSTOP of the active broker for longer than the leadership TTL: the standby takes
    over once the leadership expires (the old advisory lock never expired, so nothing
    answered), with every lease; after SIGCONT the old active exits 1."""
    standby = await start_standby(broker, tmp_path)
    with stopped_at_the_end(standby):
        ids = {acquire(broker, f"u{n:02d}", 0.25).json()["id"] for n in range(4)}
        assert len(ids) == 4
        pause(broker)
        t0 = time.monotonic()
        try:
            await wait_for_async(lambda: answers(standby), 2 * TTL + SLACK, "a takeover")
            took = time.monotonic() - t0
            assert check_invariants(standby) == ids
            for lid in ids:
                r = api(standby, "POST", f"/leases/{lid}/renew", "admin", json={})
                assert r.status_code == 200 and r.json()["id"] == lid
        finally:
            resume(broker)
        assert broker.proc is not None
        assert await asyncio.to_thread(broker.proc.wait, SLACK) == 1
        assert "Lost the leadership" in broker.log()
        print(f"takeover {took:.2f} s after SIGSTOP (leadership TTL {TTL} s)")
    assert not standby.problems(), standby.problems()


# -- finding 2: the old active writes after losing leadership ----------------------------------
@pytest.mark.slow
@PG_ONLY
@pytest.mark.broker_args(*HA_ARGS)
async def test_the_old_active_answers_and_writes_nothing_after_sigcont(
    broker: Broker, tmp_path: Path
) -> None:
    """Requests pile up in the paused active's backlog while the standby takes over (its
    database sessions are cut too, as a server does to a partitioned client). After
    SIGCONT the old active answers none of them with state (503 or no answer at all) and
    writes nothing: no lease or queued request for the kernels only it was asked about,
    the lease it was asked to release is still active, the quota it was asked to set is
    not set, and the new active's view is the database's."""
    standby = await start_standby(broker, tmp_path)
    with stopped_at_the_end(standby):
        held = {
            user: acquire(broker, user, fraction).json()["id"]
            for user, fraction in (("u00", 0.5), ("u01", 0.5), ("u02", 1.0))
        }
        async with httpx.AsyncClient(timeout=60.0) as http:

            def send(method: str, path: str, user: str, **kw: Any) -> asyncio.Task[Any]:
                return asyncio.create_task(
                    http.request(
                        method, f"{broker.url}/api/v1{path}", headers=broker.headers(user), **kw
                    )
                )

            # a long-poll in flight before the pause (nothing fits a 0.5 now)
            waiting = send(
                "POST",
                "/leases",
                "carol",
                json={"kernel_id": "k-wait", "fraction": 0.5, "wait": 40},
            )
            await wait_for_async(
                lambda: bool(api(broker, "GET", "/queue").json()["queue"]), 10, "queue"
            )
            pause(broker)
            backlog_kernels = [f"k-backlog-{n}" for n in range(3)]
            backlog = [
                send("POST", "/leases", f"u1{n}", json={"kernel_id": k, "fraction": 0.1})
                for n, k in enumerate(backlog_kernels)
            ]
            backlog += [
                send("DELETE", f"/leases/{held['u00']}", "u00"),
                send("POST", f"/leases/{held['u01']}/renew", "u01", json={}),
                send("PUT", "/quotas/users/u05", "admin", json={"max_leases": 1}),
                send("GET", "/gpus", "u00"),
            ]
            await asyncio.sleep(0.5)  # the requests reach the paused broker's socket
            cut_sessions(broker)
            try:
                await wait_for_async(lambda: answers(standby), 2 * TTL + SLACK, "a takeover")
                # the new active moves on: releases u02's lease, grants a new one
                r = api(standby, "DELETE", f"/leases/{held['u02']}", "u02")
                assert r.status_code == 204
            finally:
                resume(broker)
            answers_of_old = await asyncio.gather(waiting, *backlog, return_exceptions=True)
        statuses = [
            a.status_code if isinstance(a, httpx.Response) else type(a).__name__
            for a in answers_of_old
        ]
        assert all(s == 503 or isinstance(s, str) for s in statuses), statuses
        for a in answers_of_old:
            if isinstance(a, httpx.Response):
                assert a.json()["error"] == "not_active", a.text
                assert float(a.headers["Retry-After"]) <= 5
        assert broker.proc is not None
        assert await asyncio.to_thread(broker.proc.wait, SLACK) == 1
        assert db_rows_of_kernels(broker.db_url, backlog_kernels) == []
        assert db_lease(broker.db_url, held["u00"])["state"] == "active"  # type: ignore[index]
        assert api(standby, "GET", "/quotas/users/u05").status_code == 404
        active = check_invariants(standby)
        assert held["u00"] in active and held["u01"] in active and held["u02"] not in active
    assert not standby.problems(), standby.problems()


# -- finding 3: memory and database disagree ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.broker_args("--gpus", "2x32768:V100", "--GPULeaseBroker.reap_interval=0.5")
async def test_a_lease_the_broker_does_not_hold_is_looked_up_in_the_database(
    broker: Broker,
) -> None:
    """A lease active in the database but unknown in memory: its renewal renews it (was
    410 "released" with state "active", and it never expired), and its DELETE really
    releases it in the database (was 204 with nothing released)."""
    g0, _ = gpu_uuids(broker)
    mine, insert_mine = sneaked_lease("alice", g0, 0.25)
    theirs, insert_theirs = sneaked_lease("bob", g0, 0.25)
    behind_the_back(broker.db_url, insert_mine, insert_theirs)
    r = api(broker, "POST", f"/leases/{mine}/renew", "alice", json={})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == mine and r.json()["state"] == "active"
    assert allocated(broker)[g0] == 0.5
    r = api(broker, "DELETE", f"/leases/{theirs}", "bob")
    assert r.status_code == 204
    assert db_lease(broker.db_url, theirs)["state"] == "released"  # type: ignore[index]
    assert api(broker, "GET", f"/leases/{theirs}", "bob").json()["state"] == "released"
    assert allocated(broker)[g0] == 0.25
    assert check_invariants(broker) == {mine}
    assert api(broker, "DELETE", "/leases/no-such-lease", "bob").status_code == 404


@pytest.mark.slow
@pytest.mark.broker_args("--gpus", "2x32768:V100", "--GPULeaseBroker.reap_interval=0.5")
async def test_a_lease_ended_in_the_database_frees_its_capacity(broker: Broker) -> None:
    """A lease the database says has ended is dropped from memory at the reaper pass after
    its next renewal, which persists the heartbeat (it used to keep its GPU capacity in
    memory as a phantom until its TTL ran out); from then on its renewal answers 410."""
    r = acquire(broker, "alice", 0.5)
    assert r.status_code == 201
    lid, gpu = r.json()["id"], r.json()["gpu"]["uuid"]
    behind_the_back(
        broker.db_url,
        leases_table.update()
        .where(leases_table.c.id == lid)
        .values(state="released", ended_at=time.time()),
    )
    r = api(broker, "POST", f"/leases/{lid}/renew", "alice", json={})
    assert r.status_code == 200, r.text  # a heartbeat is memory: the reaper persists it
    wait_for(lambda: allocated(broker)[gpu] == 0, 10, "the reaper drops the ended lease")
    r = api(broker, "POST", f"/leases/{lid}/renew", "alice", json={})
    assert r.status_code == 410 and r.json()["state"] == "released", r.text
    assert check_invariants(broker) == set()


@pytest.mark.slow
@pytest.mark.broker_args("--gpus", "2x32768:V100", "--GPULeaseBroker.reap_interval=0.5")
async def test_conflicts_at_commit_reload_and_retry(broker: Broker) -> None:
    """The database refuses what memory allowed: the broker reloads and answers as the
    database is (queued), never 409 for someone else's lease; a DELETE whose queue drain
    conflicts still releases (it answered 409 ``duplicate_lease`` naming another lease)."""
    g0, g1 = gpu_uuids(broker)
    full, fill_g0 = sneaked_lease("u10", g0, 1.0)
    _, half_g1 = sneaked_lease("u11", g1, 0.5)
    behind_the_back(broker.db_url, fill_g0, half_g1)
    r = acquire(broker, "alice", 1.0)
    assert r.status_code == 202, r.text  # was 409 capacity_conflict
    kernel = r.json()["kernel_id"]
    assert allocated(broker) == {g0: 1.0, g1: 0.5}
    # alice's waiting kernel gets a lease behind the broker's back, then the GPU it
    # waits for is released: the drain's grant is refused as a duplicate
    _, dup = sneaked_lease("alice", g1, 0.5, kernel_id=kernel)
    behind_the_back(broker.db_url, dup)
    r = api(broker, "DELETE", f"/leases/{full}", "u10")
    assert r.status_code == 204, r.text  # was 409 duplicate_lease
    assert db_lease(broker.db_url, full)["state"] == "released"  # type: ignore[index]
    assert api(broker, "GET", "/queue", "admin").json()["queue"] == []
    assert len(check_invariants(broker)) == 2


@pytest.mark.slow
@pytest.mark.broker_args("--GPULeaseBroker.reap_interval=0.5")
async def test_a_queued_request_the_broker_does_not_hold_is_cancelled_in_the_database(
    broker: Broker,
) -> None:
    """DELETE of a queued request that is in the database but not in memory deletes it
    there (it answered 404, and the client took that for "already gone")."""
    rid = f"req-{uuid.uuid4().hex[:12]}"
    now = time.time()
    behind_the_back(
        broker.db_url,
        requests_table.insert().values(
            id=rid,
            user="bob",
            kernel_id="k-queued",
            fraction_ppm=500_000,
            groups="[]",
            priority=0,
            arrived_at=now,
            last_polled_at=now,
        ),
    )
    # another user's request is answered as one that does not exist (no oracle), and stays
    theirs = api(broker, "DELETE", f"/leases/{rid}", "alice")
    assert theirs.status_code == 404
    assert (
        theirs.json()["error"] == api(broker, "DELETE", "/leases/req-none", "alice").json()["error"]
    )
    assert db_rows_of_kernels(broker.db_url, ["k-queued"]) != []
    assert api(broker, "DELETE", f"/leases/{rid}", "bob").status_code == 204
    assert db_rows_of_kernels(broker.db_url, ["k-queued"]) == []
    assert api(broker, "DELETE", f"/leases/{rid}", "bob").status_code == 404


@pytest.mark.slow
async def test_a_long_poll_cut_by_a_shutdown_answers_503(broker: Broker) -> None:
    """SIGTERM while a client long-polls: it gets 503 with Retry-After (which clients
    retry), never a 500 or a connection closed without an answer."""
    assert acquire(broker, "alice", 1.0).status_code == 201
    async with httpx.AsyncClient(timeout=30.0) as http:
        poll = asyncio.create_task(
            http.post(
                f"{broker.url}/api/v1/leases",
                headers=broker.headers("bob"),
                json={"kernel_id": "k-poll", "fraction": 0.5, "wait": 20},
            )
        )
        await wait_for_async(
            lambda: bool(api(broker, "GET", "/queue").json()["queue"]), 10, "queue"
        )
        assert broker.proc is not None
        broker.proc.send_signal(signal.SIGTERM)
        r = await poll
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "not_active" and "Retry-After" in r.headers
    assert await asyncio.to_thread(broker.proc.wait, 10) == 0


# -- the chaos run: two brokers, concurrent clients, kill -9, pause, cut sessions ---------------
#: every write to these tables is recorded by a trigger with the epoch its transaction was
#: stamped with by the fence and the leadership row as the writer saw it
AUDITED = ("leases", "requests", "queue_log", "quotas")
AUDIT_SQL = [
    "CREATE TABLE chaos_audit (id BIGSERIAL PRIMARY KEY, tbl TEXT NOT NULL, op TEXT NOT NULL, "
    "stamped TEXT, epoch BIGINT, holder TEXT, at DOUBLE PRECISION NOT NULL)",
    """CREATE FUNCTION chaos_audit_write() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      INSERT INTO chaos_audit (tbl, op, stamped, epoch, holder, at)
      SELECT TG_TABLE_NAME, TG_OP, NULLIF(current_setting('gpu_lease.epoch', true), ''),
             epoch, holder, EXTRACT(EPOCH FROM clock_timestamp())
      FROM leadership WHERE id = 1;
      RETURN NULL;
    END $$""",
    *(
        f"CREATE TRIGGER chaos_audit_{t} AFTER INSERT OR UPDATE OR DELETE ON {t} "
        "FOR EACH ROW EXECUTE FUNCTION chaos_audit_write()"
        for t in AUDITED
    ),
]
#: a client's read timeout (s): a paused broker holds a request this long
CLIENT_TIMEOUT = 1.5


class Ledger:
    """What the brokers acknowledged to the chaos clients."""

    def __init__(self) -> None:
        #: lease id -> (user, kernel_id, GPU uuid) of every 201/200 to an acquire
        self.granted: dict[str, tuple[str, str, str]] = {}
        #: lease ids whose DELETE was answered 204
        self.released: set[str] = set()
        self.renewed = 0
        self.errors: list[str] = []

    @property
    def progress(self) -> int:
        return len(self.granted) + len(self.released) + self.renewed


class ChaosClient:
    """A kernel's provisioner in miniature, knowing both brokers' addresses: it acquires
    (idempotent per kernel), renews twice and releases, over and over, retrying 503s and
    connection errors on whichever broker answers."""

    def __init__(self, brokers: list[Broker], user: str, ledger: Ledger) -> None:
        self.brokers, self.user, self.ledger = brokers, user, ledger
        self.at = 0

    async def call(
        self, http: httpx.AsyncClient, method: str, path: str, **kw: Any
    ) -> httpx.Response:
        deadline = time.monotonic() + 60
        while True:
            b = self.brokers[self.at]
            try:
                r = await http.request(
                    method, f"{b.url}/api/v1{path}", headers=b.headers(self.user), **kw
                )
                if r.status_code != 503:
                    return r
                # the two 503s a broker gives in a failover, both retried by BrokerClient:
                # a standby's "not_active", and "store_unavailable" from an active whose
                # database session was cut mid-request (it changed nothing)
                assert r.json()["error"] in ("not_active", "store_unavailable"), r.text
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"no broker answered {method} {path} for 60 s")
            self.at = 1 - self.at
            await asyncio.sleep(0.05)

    async def run(self, stop: asyncio.Event) -> None:
        led = self.ledger
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as http:
            n = 0
            while not stop.is_set():
                n += 1
                kernel = f"chaos-{self.user}-{n}"
                body = {"kernel_id": kernel, "fraction": 0.25 + 0.25 * (n % 2)}
                r = await self.call(http, "POST", "/leases", json=body)
                while r.status_code == 202 and not stop.is_set():
                    await asyncio.sleep(0.1)
                    r = await self.call(http, "POST", "/leases", json=body)
                if r.status_code == 202:
                    return
                if r.status_code not in (200, 201):
                    led.errors.append(f"acquire {kernel}: {r.status_code} {r.text}")
                    return
                lease = r.json()
                lid, gpu = lease["id"], lease["gpu"]["uuid"]
                if led.granted.setdefault(lid, (self.user, kernel, gpu)) != (
                    self.user,
                    kernel,
                    gpu,
                ):
                    led.errors.append(f"{lid} granted twice: {led.granted[lid]}, {lease}")
                for _ in range(2):
                    r = await self.call(http, "POST", f"/leases/{lid}/renew", json={})
                    fresh = r.json()
                    if r.status_code != 200 or (fresh["id"], fresh["gpu"]["uuid"]) != (lid, gpu):
                        led.errors.append(f"renew {lid} on {gpu}: {r.status_code} {r.text}")
                        return
                    led.renewed += 1
                r = await self.call(http, "DELETE", f"/leases/{lid}")
                if r.status_code != 204:
                    led.errors.append(f"release {lid}: {r.status_code} {r.text}")
                    return
                led.released.add(lid)


def check_database(db_url: str, ledger: Ledger, seen: dict[int, str]) -> int:
    """After a step of the chaos run, from the database itself: no GPU over-allocated, no
    two active leases for one kernel, every acknowledged lease there with its id and GPU
    (released when its release was acknowledged), and every write since the last check
    stamped by the fence with the epoch of the leadership it was made under, epochs never
    going back (a deposed broker committed nothing after a takeover). ``seen`` maps every
    epoch that wrote to its holder. Returns the last audit id checked."""
    granted, released = dict(ledger.granted), set(ledger.released)  # before reading
    sums, dupes, _ = db_facts(db_url)
    assert all(ppm <= PPM for ppm in sums.values()), sums
    assert not dupes, dupes
    eng = engine(db_url)
    try:
        with eng.connect() as conn:
            rows = {
                r.id: r
                for r in conn.execute(
                    sa.select(
                        leases_table.c.id,
                        leases_table.c.user,
                        leases_table.c.kernel_id,
                        leases_table.c.gpu_uuid,
                        leases_table.c.state,
                    ).where(leases_table.c.id.in_(list(granted)))
                )
            }
            audit = conn.execute(
                sa.text("SELECT id, tbl, op, stamped, epoch, holder FROM chaos_audit ORDER BY id")
            ).all()
    finally:
        eng.dispose()
    for lid, (user, kernel, gpu) in granted.items():
        row = rows.get(lid)
        assert row is not None, f"acknowledged lease {lid} is not in the database"
        assert (row.user, row.kernel_id, row.gpu_uuid) == (user, kernel, gpu), row
        assert row.state in ("active", "released"), row
        if lid in released:
            assert row.state == "released", row
    last = 0
    for a in audit:
        assert a.stamped is not None, f"a write no fence checked: {a}"
        assert int(a.stamped) == a.epoch, f"a write stamped with another epoch: {a}"
        assert a.epoch >= last, f"epoch {a.epoch} wrote after epoch {last} took over: {a}"
        assert seen.setdefault(a.epoch, a.holder) == a.holder, (a, seen)
        last = a.epoch
    return last


def leader_pid(db_url: str) -> int | None:
    eng = engine(db_url)
    try:
        with eng.connect() as conn:
            holder = conn.execute(sa.text("SELECT holder FROM leadership WHERE id = 1")).scalar()
    finally:
        eng.dispose()
    return None if holder is None else int(holder.split(":")[-2])


@pytest.mark.slow
@PG_ONLY
@pytest.mark.broker_args(*HA_ARGS)
async def test_chaos_two_brokers_under_load(broker: Broker, tmp_path: Path) -> None:
    """Two brokers on PostgreSQL, six clients acquiring, renewing and releasing through
    whichever answers; then ``kill -9`` of the active (restarted as the standby), SIGSTOP
    of the active for longer than the leadership TTL then SIGCONT (it exits; restarted as
    the standby), its database sessions cut while it serves, and ``kill -9`` again. After
    each step the clients make progress on the broker now active, and the database shows
    no over-allocation, no kernel with two leases, every acknowledged grant and release,
    and no write committed by a deposed broker (an audit trigger records the epoch the
    fence stamped on every write)."""
    eng = engine(broker.db_url)
    try:
        with eng.begin() as conn:
            for stmt in AUDIT_SQL:
                conn.execute(sa.text(stmt))
    finally:
        eng.dispose()
    standby = await start_standby(broker, tmp_path)
    brokers = [broker, standby]
    ledger = Ledger()
    stop = asyncio.Event()
    clients = [
        asyncio.create_task(ChaosClient(brokers, f"u{n:02d}", ledger).run(stop)) for n in range(6)
    ]
    seen: dict[int, str] = {}
    epochs: list[int] = []

    def active() -> Broker:
        pid = leader_pid(broker.db_url)
        (b,) = [b for b in brokers if b.proc is not None and b.proc.pid == pid]
        return b

    async def progress(what: str, n: int = 12) -> None:
        start = ledger.progress
        await wait_for_async(
            lambda: ledger.progress >= start + n or bool(ledger.errors), SLACK, what
        )
        assert not ledger.errors, ledger.errors

    async def check(step: str, new_epoch: bool) -> None:
        await progress(f"the clients to make progress after {step}")
        last = await asyncio.to_thread(check_database, broker.db_url, ledger, seen)
        if new_epoch:
            assert epochs and last > epochs[-1], (step, last, epochs)
        epochs.append(last)

    async def restart_as_standby(b: Broker) -> None:
        b.launch()
        await wait_for_async(
            lambda: "standby:" in b.log(), SLACK, "the restarted broker to stand by"
        )

    with stopped_at_the_end(*brokers):
        try:
            await check("the start", False)
            for step in ("kill -9", "SIGSTOP", "cut sessions", "kill -9 again"):
                old = active()
                other = brokers[1 - brokers.index(old)]
                if step.startswith("kill -9"):
                    old.kill9()
                    await wait_for_async(lambda o=other: answers(o), SLACK, step)  # type: ignore[misc]
                    await restart_as_standby(old)
                elif step == "SIGSTOP":
                    pause(old)
                    try:
                        await asyncio.sleep(TTL + 1.0)  # longer than the leadership TTL
                        await wait_for_async(lambda o=other: answers(o), SLACK, step)  # type: ignore[misc]
                    finally:
                        resume(old)
                    assert old.proc is not None
                    assert await asyncio.to_thread(old.proc.wait, SLACK) == 1
                    assert "Lost the leadership" in old.log()
                    await restart_as_standby(old)
                else:
                    await progress("load on the active before its sessions are cut", 4)
                    assert cut_sessions(old) > 0
                await check(step, step != "cut sessions")
                for b in brokers:  # a broker deposed by the cut exits: it comes back as standby
                    if b.proc is not None and b.proc.poll() is not None:
                        await restart_as_standby(b)
        finally:
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
    for c in clients:
        if not c.cancelled() and c.exception() is not None:
            raise c.exception()  # type: ignore[misc]
    assert not ledger.errors, ledger.errors
    print(
        f"chaos: {len(ledger.granted)} grants, {ledger.renewed} renewals, "
        f"{len(ledger.released)} releases acknowledged; epochs {sorted(seen)}"
    )
    for b in brokers:
        assert not b.problems(), b.problems()
