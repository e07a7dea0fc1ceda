"""Tests of provisioner.broker.store.store against real databases: an SQLite file and PostgreSQL.

Every test that takes ``store`` (or ``db_url``) runs twice: on a fresh SQLite file and
on a fresh, uniquely named PostgreSQL schema of the ``test`` database (skipped, with
the reason, when the server cannot be reached). Nothing is mocked: concurrency is
real processes racing on one database, and the crash test kills a writer with SIGKILL.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import provisioner
from provisioner.broker.rules import scheduling
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.broker.store.store import (
    MIGRATIONS,
    Fence,
    Migration,
    Store,
    upgrade_schema,
)
from provisioner.devtools.testing import wait_for
from provisioner.errors import (
    CapacityConflict,
    Conflict,
    DuplicateLease,
    DuplicateRequest,
    NotActive,
    StoreError,
)
from provisioner.model import (
    GPU,
    PPM,
    Changes,
    Grant,
    Lease,
    PoolState,
    Quota,
    QuotaBook,
    Request,
)

PG_URL = os.environ.get("GPU_LEASE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REPO_ROOT = Path(provisioner.__file__).resolve().parent.parent
GPU0 = GPU("GPU-0", "node-a", "V100", 32768, 0)
GPU1 = GPU("GPU-1", "node-a", "V100", 32768, 1)


# --------------------------------------------------------------------------- helpers


def _raw_engine(url: str) -> sa.Engine:
    """A plain engine on the same database, to look behind the store's back."""
    u = sa.make_url(url)
    if u.drivername == "postgresql":
        u = u.set(drivername="postgresql+psycopg2")
    return sa.create_engine(u)


def _lease(
    lid: str,
    *,
    user: str = "alice",
    kernel: str | None = None,
    gpu: str = "GPU-0",
    ppm: int = 20_000,
    created: float = 1000.0,
    group: str | None = None,
    state: str = "active",
    groups: tuple[str, ...] = (),
) -> Lease:
    return Lease(
        id=lid,
        user=user,
        kernel_id=kernel or f"k-{lid}",
        gpu_uuid=gpu,
        fraction_ppm=ppm,
        memory_limit_mb=ppm * 32768 // PPM - 512,
        state=state,
        created_at=created,
        renewed_at=created,
        expires_at=created + 90.0,
        group=group,
        groups=groups,
    )


def _request(rid: str, *, user: str = "bob", kernel: str | None = None, **kw: Any) -> Request:
    base: dict[str, Any] = {
        "fraction_ppm": 500_000,
        "arrived_at": 1000.0,
        "last_polled_at": 1000.0,
    }
    base.update(kw)
    return Request(id=rid, user=user, kernel_id=kernel or f"k-{rid}", **base)


def _active_sum(store: Store, gpu: str = "GPU-0") -> int:
    return sum(
        lease.fraction_ppm
        for lease in store.list_leases(states=("active",), limit=100_000)
        if lease.gpu_uuid == gpu
    )


# --------------------------------------------------------------------------- fixtures


def _pg_admin() -> sa.Engine:
    url = sa.make_url(PG_URL).set(drivername="postgresql+psycopg2")
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: an SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'gpu-lease.sqlite'}"
        return
    admin = _pg_admin()
    schema = f"gl_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    except sa.exc.OperationalError as exc:
        admin.dispose()
        reason = f"PostgreSQL at {PG_URL} is unreachable: {str(exc).splitlines()[0]}"
        print(reason)
        pytest.skip(reason)
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """An opened store with two GPUs of capacity 1.0."""
    s = Store(db_url)
    s.open()
    s.sync_gpus([GPU0, GPU1], PPM)
    try:
        yield s
    finally:
        s.close()


# --------------------------------------------------------------------------- opening


def test_open_is_idempotent_and_records_the_version(db_url: str) -> None:
    s = Store(db_url)
    try:
        s.open()
        s.open()
        assert s.upgrade() == MIGRATIONS[-1].version
        assert Store(db_url).upgrade() == MIGRATIONS[-1].version  # a second process, same DB
    finally:
        s.close()
    eng = _raw_engine(db_url)
    with eng.connect() as conn:
        rows = conn.exec_driver_sql("SELECT version, description FROM schema_version").all()
    eng.dispose()
    assert [tuple(r) for r in rows] == [(m.version, m.description) for m in MIGRATIONS]
    assert tuple(rows[0]) == (1, "initial schema")


@pytest.mark.parametrize(
    ("url", "shown", "hidden"),
    [
        ("postgresql://gl:s3cret@db.example:5432/gl", "gl:***@db.example", "s3cret"),
        ("sqlite:///gpu-lease.sqlite", "sqlite:///gpu-lease.sqlite", None),
    ],
)
def test_url_for_logs_masks_the_password(url: str, shown: str, hidden: str | None) -> None:
    s = Store(url)  # nothing connects before open()
    assert shown in s.url_for_logs
    if hidden:
        assert hidden not in s.url_for_logs
    s.close()


@pytest.mark.parametrize(
    ("url", "kwargs", "error"),
    [
        ("sqlite:///x.sqlite", {"sqlite_synchronous": "SOMETIMES"}, StoreError),
        ("nosuchdb://host/db", {}, StoreError),
        ("not a url", {}, StoreError),
    ],
)
def test_bad_configuration_is_refused(url: str, kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        Store(url, **kwargs)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////nonexistent-dir/gpu-lease.sqlite",
        pytest.param("postgresql://postgres@127.0.0.1:1/test", marks=pytest.mark.postgres),
    ],
)
def test_unreachable_database_raises_store_error(url: str) -> None:
    s = Store(url)
    with pytest.raises(StoreError, match="nothing was changed") as info:
        s.open()
    assert isinstance(info.value.__cause__, sa.exc.SQLAlchemyError)
    assert info.value.status == 503
    s.close()


@pytest.mark.parametrize(("synchronous", "code"), [("NORMAL", 1), ("FULL", 2), ("off", 0)])
def test_sqlite_pragmas(tmp_path: Path, synchronous: str, code: int) -> None:
    s = Store(f"sqlite:///{tmp_path / 'p.sqlite'}", sqlite_synchronous=synchronous)
    s.open()
    with s._engine.connect() as conn:  # the store's own pooled connection
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == code
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    s.close()


def test_in_memory_sqlite_works(tmp_path: Path) -> None:
    s = Store("sqlite://")
    s.open()
    s.sync_gpus([GPU0], PPM)
    s.insert_lease(_lease("a"), PPM)
    assert s.get_lease("a") == _lease("a")
    s.close()


def test_sql_errors_become_store_errors(store: Store, db_url: str) -> None:
    eng = _raw_engine(db_url)
    with eng.begin() as conn:
        conn.exec_driver_sql("DROP TABLE leases")
    eng.dispose()
    with pytest.raises(StoreError, match="list leases") as info:
        store.list_leases()
    assert isinstance(info.value.__cause__, sa.exc.SQLAlchemyError)


# --------------------------------------------------------------------------- inventory


def test_sync_gpus_upserts_and_keeps_busy_gpus(store: Store) -> None:
    assert store.list_gpus() == [(GPU0, PPM), (GPU1, PPM)]
    store.insert_lease(_lease("a", gpu="GPU-1"), PPM)
    renamed = GPU("GPU-0", "node-a", "V100-SXM2", 32768, 0)
    gpu2 = GPU("GPU-2", "node-b", "T4", 16384, 0)
    store.sync_gpus([renamed, gpu2], 900_000)
    # GPU-1 has an active lease: it stays (with its old capacity) until the lease ends
    assert store.list_gpus() == [(renamed, 900_000), (GPU1, PPM), (gpu2, 900_000)]
    store.end_leases([("a", "released", 1001.0, None)])
    store.sync_gpus([renamed, gpu2], 900_000)
    assert store.list_gpus() == [(renamed, 900_000), (gpu2, 900_000)]
    assert store.get_lease("a") is not None  # history stays


# --------------------------------------------------------------------------- leases


def test_lease_round_trip(store: Store) -> None:
    lease = _lease("a", group="ml101")
    store.insert_lease(lease, PPM)
    assert store.get_lease("a") == lease
    assert store.get_lease("missing") is None
    both = _lease("b", kernel="k-b", groups=("cs50", "ml101"))
    store.insert_lease(both, PPM)
    assert store.get_lease("b") == both
    assert store.get_lease("b").groups == ("cs50", "ml101")  # type: ignore[union-attr]
    assert [x.groups for x in store.load_active()[0]] == [(), ("cs50", "ml101")]


def test_insert_lease_drops_the_request_it_serves(store: Store) -> None:
    store.insert_request(_request("r1", user="alice", kernel="k-a"))
    store.insert_lease(_lease("a", kernel="k-a"), PPM, drop_request_id="r1")
    leases, queue = store.load_active()
    assert [lease.id for lease in leases] == ["a"]
    assert queue == []


@pytest.mark.parametrize(
    ("held", "new", "capacity", "fits"),
    [
        ([500_000, 500_000], 20_000, PPM, False),
        ([500_000, 480_000], 20_000, PPM, True),  # exactly full
        ([20_000] * 49, 20_000, PPM, True),  # 50 x 0.02 fill a GPU exactly
        ([20_000] * 50, 20_000, PPM, False),
        ([], PPM, PPM, True),
        ([], PPM, 900_000, False),  # the broker's capacity (reserve) is stricter
        ([800_000], 100_000, 900_000, True),
    ],
)
def test_capacity_is_checked_in_the_database(
    store: Store, held: list[int], new: int, capacity: int, fits: bool
) -> None:
    store.insert_leases([_lease(f"h{i}", ppm=p) for i, p in enumerate(held)], PPM, [])
    store.insert_request(_request("r1", user="alice", kernel="k-new"))
    before = store.counts()
    attempt = _lease("new", kernel="k-new", ppm=new)
    if fits:
        store.insert_lease(attempt, capacity, drop_request_id="r1")
        assert store.get_lease("new") == attempt
    else:
        with pytest.raises(CapacityConflict, match="GPU-0") as info:
            store.insert_lease(attempt, capacity, drop_request_id="r1")
        assert isinstance(info.value, Conflict) and info.value.status == 409
        assert store.get_lease("new") is None
        assert store.counts() == before
        assert [r.id for r in store.load_active()[1]] == ["r1"]  # rolled back too
    assert _active_sum(store) <= capacity


def test_the_gpu_row_capacity_also_limits(store: Store) -> None:
    store.sync_gpus([GPU0, GPU1], 500_000)
    with pytest.raises(CapacityConflict):
        store.insert_lease(_lease("a", ppm=600_000), PPM)


def test_unknown_gpu_is_refused(store: Store) -> None:
    with pytest.raises(CapacityConflict, match="GPU-X"):
        store.insert_lease(_lease("a", gpu="GPU-X"), PPM)


def test_second_active_lease_for_a_kernel_is_refused(store: Store) -> None:
    store.insert_lease(_lease("a", kernel="k1"), PPM)
    with pytest.raises(DuplicateLease, match="k1") as info:
        store.insert_lease(_lease("b", kernel="k1", gpu="GPU-1"), PPM)
    assert isinstance(info.value, CapacityConflict)  # the broker catches both as one
    assert store.get_lease("b") is None
    assert store.counts()["active"] == 1
    # another user's kernel of the same id is another kernel
    store.insert_lease(_lease("c", user="bob", kernel="k1"), PPM)
    # once released, the kernel may lease again
    store.end_leases([("a", "released", 1001.0, None)])
    store.insert_lease(_lease("d", kernel="k1"), PPM)
    assert {lease.id for lease in store.load_active()[0]} == {"c", "d"}


def test_partial_unique_index_refuses_behind_the_stores_back(store: Store, db_url: str) -> None:
    store.insert_lease(_lease("a", kernel="k1"), PPM)
    store.end_leases([("a", "released", 1001.0, None)])
    store.insert_lease(_lease("b", kernel="k1"), PPM)  # ended leases do not count
    eng = _raw_engine(db_url)
    row = {
        "id": "c",
        "user": "alice",
        "kernel_id": "k1",
        "gpu_uuid": "GPU-1",
        "fraction_ppm": 1,
        "memory_limit_mb": 1,
        "state": "active",
        "created_at": 1.0,
        "renewed_at": 1.0,
        "expires_at": 2.0,
    }
    cols = ", ".join(f'"{k}"' for k in row)
    sql = sa.text(f"INSERT INTO leases ({cols}) VALUES ({', '.join(':' + k for k in row)})")
    with pytest.raises(sa.exc.IntegrityError), eng.begin() as conn:
        conn.execute(sql, row)
    eng.dispose()
    assert store.counts()["active"] == 1


@pytest.mark.parametrize(
    ("batch", "error"),
    [
        ([("a", "GPU-0", 600_000, "k1"), ("b", "GPU-1", 600_000, "k2")], None),
        ([("a", "GPU-0", 600_000, "k1"), ("b", "GPU-0", 600_000, "k2")], CapacityConflict),
        ([("a", "GPU-0", 100_000, "k1"), ("b", "GPU-1", 100_000, "k1")], DuplicateLease),
        ([("a", "GPU-0", 100_000, "k1"), ("b", "GPU-1", 100_000, "held")], DuplicateLease),
    ],
)
def test_insert_leases_is_all_or_nothing(
    store: Store, batch: list[tuple[str, str, int, str]], error: type | None
) -> None:
    store.insert_lease(_lease("h", gpu="GPU-1", kernel="held", ppm=100_000), PPM)
    store.insert_request(_request("r1"))
    store.insert_request(_request("r2"))
    new = [_lease(lid, gpu=g, ppm=p, kernel=k) for lid, g, p, k in batch]
    if error is None:
        store.insert_leases(new, PPM, ["r1", "r2"])
        assert {lease.id for lease in store.load_active()[0]} == {"h", "a", "b"}
        assert store.load_active()[1] == []
    else:
        with pytest.raises(error):
            store.insert_leases(new, PPM, ["r1", "r2"])
        assert [lease.id for lease in store.load_active()[0]] == ["h"]
        assert [r.id for r in store.load_active()[1]] == ["r1", "r2"]


def test_a_heartbeat_is_written_whole(store: Store) -> None:
    """The reaper persists heartbeats through ``write_changes``: every field of one."""
    store.insert_lease(_lease("a"), PPM)
    beat = replace(
        _lease("a"),
        renewed_at=1030.0,
        expires_at=1120.0,
        pid=4242,
        execution_state="busy",
        last_activity=1029.5,
    )
    assert store.write_changes([Changes(1030.0, renewed=[beat])], PPM) == {}
    got = store.get_lease("a")
    assert got is not None
    assert (got.renewed_at, got.expires_at, got.pid, got.execution_state, got.last_activity) == (
        1030.0,
        1120.0,
        4242,
        "busy",
        1029.5,
    )
    assert got.created_at == 1000.0 and got.state == "active"


@pytest.mark.parametrize("state", ["released", "revoked", "expired"])
def test_a_heartbeat_of_an_ended_lease_says_how_it_ended(store: Store, state: str) -> None:
    """Another writer ended the lease: its heartbeat changes nothing and is reported."""
    store.insert_lease(_lease("a"), PPM)
    store.insert_lease(_lease("b", kernel="k-b"), PPM)
    store.end_leases([("a", state, 1010.0, "idle for 2 h")])
    beats = [replace(_lease(x, kernel=f"k-{x}"), renewed_at=1030.0) for x in ("a", "b")]
    gone = store.write_changes([Changes(1030.0, renewed=beats)], PPM)
    assert gone == {"a": (state, "idle for 2 h")}
    got = store.get_lease("a")
    assert got is not None and got.renewed_at == 1000.0 and got.state == state  # unchanged
    assert store.get_lease("b").renewed_at == 1030.0  # type: ignore[union-attr]


def test_a_heartbeat_of_an_unknown_lease_writes_nothing(store: Store) -> None:
    gone = store.write_changes([Changes(1030.0, renewed=[_lease("nope")])], PPM)
    assert gone == {} and store.get_lease("nope") is None


def test_end_leases_changes_only_active_rows(store: Store) -> None:
    store.insert_leases([_lease("a"), _lease("b"), _lease("c")], PPM, [])
    store.end_leases([("a", "revoked", 1010.0, "admin"), ("b", "expired", 1011.0, None)])
    store.end_leases([("a", "released", 1020.0, None), ("missing", "released", 1.0, None)])
    a, b, c = (store.get_lease(x) for x in "abc")
    assert a is not None and (a.state, a.ended_at, a.reason) == ("revoked", 1010.0, "admin")
    assert b is not None and (b.state, b.ended_at, b.reason) == ("expired", 1011.0, None)
    assert c is not None and (c.state, c.ended_at) == ("active", None)
    store.end_leases([])
    with pytest.raises(ValueError):
        store.end_leases([("c", "active", 1.0, None)])


def test_extend_active(store: Store) -> None:
    store.insert_leases(
        [_lease("a", created=1000.0), _lease("b", created=2000.0), _lease("c")], PPM, []
    )
    store.end_leases([("c", "released", 1010.0, None)])
    assert store.extend_active(1500.0) == 1  # a: 1090 -> 1500; b: 2090 stays
    expiries = {lid: store.get_lease(lid).expires_at for lid in "abc"}  # type: ignore[union-attr]
    assert expiries == {"a": 1500.0, "b": 2090.0, "c": 1090.0}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, ["e", "d", "c", "b", "a"]),
        ({"user": "bob"}, ["d", "b"]),
        ({"states": ("active",)}, ["e", "c", "b"]),
        ({"states": ("released", "revoked")}, ["d", "a"]),
        ({"user": "alice", "states": ("active",)}, ["e", "c"]),
        ({"limit": 2}, ["e", "d"]),
        ({"user": "nobody"}, []),
    ],
)
def test_list_leases(store: Store, kwargs: dict[str, Any], expected: list[str]) -> None:
    users = {"a": "alice", "b": "bob", "c": "alice", "d": "bob", "e": "alice"}
    store.insert_leases(
        [_lease(lid, user=u, created=1000.0 + i) for i, (lid, u) in enumerate(users.items())],
        PPM,
        [],
    )
    store.end_leases([("a", "released", 1100.0, None), ("d", "revoked", 1100.0, "admin")])
    assert [lease.id for lease in store.list_leases(**kwargs)] == expected


def test_load_active(store: Store) -> None:
    store.insert_leases([_lease("a"), _lease("b", created=999.0)], PPM, [])
    store.end_leases([("a", "expired", 1090.0, None)])
    r1 = _request(
        "r1",
        groups=frozenset({"ml101", "cs50"}),
        group="ml101",
        node="node-a",
        gpu_uuids=("GPU-0", "GPU-1"),
        priority=5,
        arrived_at=5.0,
    )
    r2 = _request("r2", arrived_at=4.0)
    store.insert_request(r1)
    store.insert_request(r2)
    active, queue = store.load_active()
    assert active == [_lease("b", created=999.0)]
    assert queue == [r2, r1]  # arrival order, every field intact


# --------------------------------------------------------------------------- queue


def test_requests(store: Store) -> None:
    store.insert_request(_request("r1", kernel="k1"))
    with pytest.raises(DuplicateRequest):
        store.insert_request(_request("r2", kernel="k1"))
    store.touch_request("r1", 1234.5)
    store.touch_request("missing", 1.0)
    assert [(r.id, r.last_polled_at) for r in store.load_active()[1]] == [("r1", 1234.5)]
    store.delete_requests(["r1", "missing"])
    store.delete_requests([])
    assert store.load_active()[1] == []
    store.insert_request(_request("r2", kernel="k1"))  # the place is free again


# --------------------------------------------------------------------------- group commit


def test_write_changes_persists_a_batchs_net_effect(store: Store) -> None:
    """One transaction for several mutations made in order: a lease granted and released
    within the batch is recorded released, a request queued and granted within it only
    in the queue log, an older lease ended, heartbeats of active leases recorded, and the
    renewed lease that another writer ended is reported."""
    store.insert_lease(_lease("old", kernel="k-old"), PPM)
    store.insert_lease(_lease("beat", kernel="k-beat"), PPM)
    store.insert_lease(_lease("theirs", kernel="k-theirs"), PPM)
    store.end_leases([("theirs", "revoked", 1001.0, "by another broker")])
    store.insert_request(_request("waited", kernel="k-w", arrived_at=900.0))
    r_new = _request("fast", kernel="k-fast", arrived_at=1002.0)
    beat = replace(_lease("beat", kernel="k-beat"), renewed_at=1050.0, expires_at=1140.0, pid=42)
    gone = store.write_changes(
        [
            Changes(
                1002.0,
                granted=[Grant(_lease("brief", kernel="k-brief", created=1002.0))],
                queued=[r_new],
            ),
            Changes(
                1003.0,
                ended=[(_lease("old", kernel="k-old"), "released", None)],
                granted=[
                    Grant(_lease("fast", kernel="k-fast", created=1003.0), r_new),
                    Grant(
                        _lease("waited", kernel="k-w", created=1003.0),
                        _request("waited", kernel="k-w"),
                    ),
                ],
            ),
            Changes(1004.0, ended=[(_lease("brief", kernel="k-brief"), "released", None)]),
            Changes(1005.0, renewed=[beat, replace(_lease("theirs"), renewed_at=1050.0)]),
        ],
        PPM,
    )
    assert gone == {"theirs": ("revoked", "by another broker")}
    active, queue = store.load_active()
    assert sorted(x.id for x in active) == ["beat", "fast", "waited"]
    assert queue == []
    assert store.get_lease("brief").state == "released"  # type: ignore[union-attr]
    assert store.get_lease("brief").ended_at == 1004.0  # type: ignore[union-attr]
    assert store.get_lease("old").state == "released"  # type: ignore[union-attr]
    got = store.get_lease("beat")
    assert got is not None and (got.renewed_at, got.expires_at, got.pid) == (1050.0, 1140.0, 42)
    _, log = store.history(0, 2000)
    assert {(q.id, q.left_at, q.outcome) for q in log} == {
        ("fast", 1003.0, "granted"),
        ("waited", 1003.0, "granted"),
    }


def test_write_changes_is_all_or_nothing(store: Store) -> None:
    """A batch whose grants overfill a GPU is refused whole: its release is not written either."""
    store.insert_lease(_lease("held", kernel="k-held", ppm=900_000), PPM)
    store.insert_lease(_lease("other", kernel="k-other", gpu="GPU-1"), PPM)
    with pytest.raises(CapacityConflict):
        store.write_changes(
            [
                Changes(1.0, ended=[(_lease("other", gpu="GPU-1"), "released", None)]),
                Changes(2.0, granted=[Grant(_lease("big", kernel="k-big", ppm=200_000))]),
            ],
            PPM,
        )
    assert sorted(x.id for x in store.load_active()[0]) == ["held", "other"]
    assert store.get_lease("big") is None


def test_queue_log_records_each_stay_in_the_queue(store: Store) -> None:
    store.insert_request(
        _request("r1", user="alice", kernel="k-a", arrived_at=1000.0, groups=frozenset({"ml101"}))
    )
    store.insert_request(_request("r2", kernel="k-b", arrived_at=1001.0, group="ml101"))
    store.insert_request(_request("r3", kernel="k-c", arrived_at=1002.0))
    with pytest.raises(DuplicateRequest):  # refused: logged neither
        store.insert_request(_request("r4", kernel="k-c", arrived_at=1003.0))
    # a grant from the queue keeps the request's id; withdrawn and abandoned ones
    store.insert_lease(_lease("r1", kernel="k-a", created=1010.0), PPM, drop_request_id="r1")
    store.delete_requests(["r2"], outcome="cancelled", at=1020.0)
    store.delete_requests(["r3"], outcome="dropped", at=1030.0)
    store.delete_requests(["r2"], outcome="dropped", at=1100.0)  # again: nothing changes
    with pytest.raises(ValueError):
        store.delete_requests(["r3"], outcome="granted")
    held, queued = store.history(0, 2000)
    assert [x.id for x in held] == ["r1"]
    by_id = {q.id: q for q in queued}
    assert sorted(by_id) == ["r1", "r2", "r3"]
    assert [(by_id[i].arrived_at, by_id[i].left_at, by_id[i].outcome) for i in sorted(by_id)] == [
        (1000.0, 1010.0, "granted"),
        (1001.0, 1020.0, "cancelled"),
        (1002.0, 1030.0, "dropped"),
    ]
    assert by_id["r1"].groups == ("ml101",) and by_id["r1"].user == "alice"
    assert by_id["r2"].group == "ml101" and by_id["r2"].fraction_ppm == 500_000
    # the period: arrived before until, left (or still waiting) at or after since
    assert sorted(q.id for q in store.history(1025, 2000)[1]) == ["r3"]
    assert sorted(q.id for q in store.history(0, 1000.5)[1]) == ["r1"]
    store.insert_request(_request("r5", kernel="k-d", arrived_at=1500.0))
    assert sorted(q.id for q in store.history(1900, 2000)[1]) == ["r5"]  # still waiting
    assert [q.id for q in store.history(0, 2000, user="alice")[1]] == ["r1"]
    assert [x.id for x in store.history(0, 2000, user="bob")[0]] == []


def test_history_leases_in_the_period(store: Store) -> None:
    store.insert_leases(
        [
            _lease("old", created=0.0),
            _lease("mid", kernel="k2", created=100.0),
            _lease("live", kernel="k3", created=200.0),
            _lease("late", kernel="k4", user="bob", created=900.0),
        ],
        PPM,
        [],
    )
    store.end_leases([("old", "released", 50.0, None), ("mid", "expired", 300.0, "ttl")])
    assert sorted(x.id for x in store.history(60, 800)[0]) == ["live", "mid"]
    assert sorted(x.id for x in store.history(0, 1000)[0]) == ["late", "live", "mid", "old"]
    assert sorted(x.id for x in store.history(0, 1000, user="bob")[0]) == ["late"]


# --------------------------------------------------------------------------- quotas


def test_quotas(store: Store) -> None:
    assert store.load_quotas() == QuotaBook()
    default = Quota(max_fraction_ppm=500_000, max_leases=2)
    course = Quota(
        max_fraction_ppm=PPM,
        max_leases=4,
        max_lease_fraction_ppm=250_000,
        budget_fraction_hours=12.5,
        budget_window_s=7 * 86400,
        priority=10,
    )
    store.put_quota("default", "", default)
    store.put_quota("group", "ml101", course)
    store.put_quota("user", "alice", Quota(max_leases=1))
    store.put_quota("user", "alice", Quota(max_leases=3))  # replaces
    assert store.load_quotas() == QuotaBook(
        default=default, groups={"ml101": course}, users={"alice": Quota(max_leases=3)}
    )
    assert store.delete_quota("user", "alice") is True
    assert store.delete_quota("user", "alice") is False
    assert store.load_quotas().users == {}


@pytest.mark.parametrize(
    ("level", "name"), [("course", "ml101"), ("default", "x"), ("user", ""), ("group", "")]
)
def test_quota_levels_are_checked(store: Store, level: str, name: str) -> None:
    with pytest.raises(ValueError):
        store.put_quota(level, name, Quota())
    with pytest.raises(ValueError):
        store.delete_quota(level, name)


# --------------------------------------------------------------------------- accounting


@pytest.fixture
def history(store: Store) -> Store:
    """alice: 0.5 for 1 h (ended, ml101) and 0.25 active since t=3600 (no group); bob: 1.0 for 2 h."""
    store.insert_leases(
        [
            _lease("a1", user="alice", ppm=500_000, created=0.0, group="ml101"),
            _lease("a2", user="alice", ppm=250_000, created=3600.0, gpu="GPU-1"),
        ],
        PPM,
        [],
    )
    store.end_leases([("a1", "released", 3600.0, None)])
    store.insert_lease(_lease("b1", user="bob", ppm=PPM, created=3600.0, group="ml101"), PPM)
    store.end_leases([("b1", "expired", 3 * 3600.0, None)])
    return store


@pytest.mark.parametrize(
    ("since", "until", "by", "expected"),
    [
        (0, 4 * 3600, "user", {"alice": 0.5 + 0.75, "bob": 2.0}),
        (0, 4 * 3600, "group", {"ml101": 2.5, "": 0.75}),
        (0, 1800, "user", {"alice": 0.25}),  # window cuts the first lease
        (1800, 7200, "user", {"alice": 0.25 + 0.25, "bob": 1.0}),  # active counts to until
        (5 * 3600, 6 * 3600, "user", {"alice": 0.25}),  # only the active lease
        (-3600, 0, "user", {}),
    ],
)
def test_usage(
    history: Store, since: float, until: float, by: str, expected: dict[str, float]
) -> None:
    got = history.usage(since, until, by=by)
    assert got == pytest.approx(expected)
    assert set(got) == set(expected)


def test_user_usage_and_counts(history: Store) -> None:
    assert history.user_usage("alice", 0, 4 * 3600) == pytest.approx(1.25)
    assert history.user_usage("nobody", 0, 4 * 3600) == 0.0
    with pytest.raises(ValueError):
        history.usage(0, 1, by="kernel")
    assert history.counts() == {
        "active": 1,
        "parking": 0,
        "parked": 0,
        "resuming": 0,
        "revoked": 0,
        "released": 1,
        "expired": 1,
    }


@pytest.fixture
def courses(store: Store) -> Store:
    """One hour each: dan (ml101) 0.5 and eve (cs50 + ml101) 0.4 on generic kernels, eve 0.1
    on a cs50 course kernel, frank (no course) 0.3; a lease from before v2 (no groups)."""
    store.insert_leases(
        [
            _lease("d", user="dan", ppm=500_000, created=0.0, groups=("ml101",)),
            _lease("e", user="eve", ppm=400_000, created=0.0, groups=("cs50", "ml101")),
            _lease("ec", user="eve", ppm=100_000, group="cs50", groups=("cs50", "ml101")),
            _lease("f", user="frank", ppm=300_000, created=0.0, gpu="GPU-1"),
        ],
        PPM,
        [],
    )
    store.end_leases([(x, "released", 3600.0, None) for x in ("d", "e", "f")])
    store.end_leases([("ec", "released", 1000.0 + 3600.0, None)])
    return store


@pytest.mark.parametrize(
    ("by", "expected"),
    [
        # a student in two courses is split equally; a course kernel counts for its course
        ("group", {"ml101": 0.5 + 0.2, "cs50": 0.2 + 0.1, "": 0.3}),
        ("user", {"dan": 0.5, "eve": 0.5, "frank": 0.3}),
    ],
)
def test_usage_by_group_attributes_to_the_users_courses(
    courses: Store, by: str, expected: dict[str, float]
) -> None:
    got = courses.usage(0, 10 * 3600, by=by)
    assert got == pytest.approx(expected)
    assert set(got) == set(expected)
    assert sum(got.values()) == pytest.approx(1.3)  # splitting creates no usage


# --------------------------------------------------------------------------- parking (v7)

PARK_POLICY = Policy(ttl=10_000, idle_reclaim_after=600, queue_poll_grace=10_000)


def _memory_of(store: Store, gpus: list[GPU]) -> PoolState:
    """The pool state a (re)started broker builds from the database."""
    leases, queue = store.load_active()
    return PoolState.build(gpus, leases, queue)


def _same(store: Store, st: PoolState) -> None:
    """The database holds what memory holds: live leases with their park states, parked
    ones apart, the queue with its resume requests, the same capacity."""
    back = _memory_of(store, list(st.gpus.values()))
    scheduling.check_invariants(back, PARK_POLICY)

    def parks(leases: dict[str, Lease]) -> dict[str, tuple[str | None, float | None]]:
        return {i: (x.park, x.parked_at) for i, x in leases.items()}

    assert parks(back.leases) == parks(st.leases)
    assert parks(back.parked) == parks(st.parked)
    assert {k: (r.id, r.resume_of, r.arrived_at) for k, r in back.queue.items()} == {
        k: (r.id, r.resume_of, r.arrived_at) for k, r in st.queue.items()
    }
    assert back.allocated == st.allocated and back.held_by_user == st.held_by_user


def test_parking_round_trips_through_the_database(store: Store) -> None:
    """Each step of a park and a resume, made by the core and written as its Changes,
    reloads as memory holds it: a restarted (or failed-over) broker keeps a parked lease
    parked, holding no capacity, and its resume request waiting with ``resume_of``; a
    granted resume creates no lease."""
    st = PoolState.build([GPU0])
    ids = iter(f"id{i}" for i in range(100))

    def new_id() -> str:
        return next(ids)

    def write(changes: Changes) -> None:
        assert not store.write_changes([changes], PPM)
        _same(store, st)

    for user, now in (("ann", 0.0), ("bob", 1.0), ("cyd", 900.0)):
        _, ch = scheduling.acquire(st, Ask(user, "k", 500_000), Quota(), now, PARK_POLICY, new_id)
        write(ch)
    ann = st.lease_for_kernel("ann", "k")
    bob = st.lease_for_kernel("bob", "k")
    assert ann is not None and bob is not None and ("cyd", "k") in st.queue
    st.update_lease(replace(bob, execution_state="busy"))
    reaped = scheduling.reap(st, 1000.0, PARK_POLICY, can_park=lambda lease: None)
    assert [x.id for x in reaped.parking] == [ann.id]
    write(reaped.changes)  # parking: it still holds its share in the database
    assert store.get_lease(ann.id).park == "parking"  # type: ignore[union-attr]
    assert store.counts()["parking"] == 1
    write(scheduling.park_done(st, ann.id, 1005.0, PARK_POLICY))  # parked; cyd granted its share
    assert st.lease_for_kernel("cyd", "k") is not None
    got = store.get_lease(ann.id)
    assert got is not None and (got.state, got.park, got.parked_at) == ("active", "parked", 1000.0)
    assert got.wire_state == "parked"
    assert store.counts()["parked"] == 1 and store.counts()["active"] == 2
    decision, ch = scheduling.resume(st, ann.id, 1100.0, PARK_POLICY, new_id)
    assert decision.state == "parked"
    write(ch)  # the resume request waits, keeping the place of the moment it was parked
    (req,) = store.load_active()[1]
    assert (req.resume_of, req.arrived_at, req.gpu_uuids) == (ann.id, 1000.0, ("GPU-0",))
    cyd = st.lease_for_kernel("cyd", "k")
    assert cyd is not None
    ch = scheduling.end(st, [(cyd, "released", None)], 1200.0, PARK_POLICY)
    assert ch.resumed and not ch.granted
    write(ch)  # resuming: the share taken again, the request left as granted, no new lease
    assert len(store.list_leases()) == 3
    _, log = store.history(0, 2000)
    assert ("granted", 1200.0) in {(q.outcome, q.left_at) for q in log if q.id == req.id}
    write(scheduling.resume_done(st, ann.id, 1300.0))
    got = store.get_lease(ann.id)
    assert got is not None and (got.park, got.parked_at, got.wire_state) == (None, None, "active")


def test_a_parked_leases_share_is_free_in_the_databases_capacity_check(store: Store) -> None:
    store.insert_leases([_lease("a", ppm=500_000), _lease("b", ppm=500_000)], PPM, [])
    waiter = _lease("c", ppm=500_000, created=1010.0)
    with pytest.raises(CapacityConflict):
        store.write_changes([Changes(1010.0, granted=[Grant(waiter)])], PPM)
    parked = replace(_lease("a", ppm=500_000), park="parked", parked_at=1005.0)
    # parked and the waiter granted in its place, in one batch
    store.write_changes(
        [Changes(1005.0, parks=[parked]), Changes(1010.0, granted=[Grant(waiter)])], PPM
    )
    assert _active_sum(store) == 1_500_000  # the rows: a is still active (parked)
    back = _memory_of(store, [GPU0, GPU1])
    assert set(back.parked) == {"a"} and back.allocated["GPU-0"] == 1_000_000
    # its resume cannot be granted while the GPU is full: refused whole
    req = _request("r", user="alice", kernel="k-a", resume_of="a", gpu_uuids=("GPU-0",))
    resuming = replace(parked, park="resuming")
    with pytest.raises(CapacityConflict, match="resume a parked lease"):
        store.write_changes(
            [Changes(1020.0, queued=[req], parks=[resuming], resumed=[(req, resuming)])], PPM
        )
    assert store.get_lease("a").park == "parked"  # type: ignore[union-attr]
    assert store.load_active()[1] == []
    # b leaves: now it fits
    store.write_changes(
        [
            Changes(1030.0, ended=[(_lease("b"), "released", None)]),
            Changes(1030.0, queued=[req], parks=[resuming], resumed=[(req, resuming)]),
        ],
        PPM,
    )
    assert store.get_lease("a").park == "resuming"  # type: ignore[union-attr]
    assert store.load_active()[1] == []


def test_a_restarted_kernel_of_a_parked_lease_waits_anew_in_one_batch(store: Store) -> None:
    """The acquire of a kernel whose parked lease has a resume request waiting ends the
    lease, drops the request and queues the new one for the same kernel: one batch,
    which the unique (user, kernel) of waiting requests must not refuse."""
    st = PoolState.build([GPU0])
    ids = iter(f"id{i}" for i in range(100))
    ann = Lease("L", "ann", "k", "GPU-0", 500_000, 15872, "active", 0.0, 0.0, 10_000.0)
    ann = replace(ann, park="parked", parked_at=10.0)
    store.insert_lease(replace(ann, park=None, parked_at=None), PPM)
    batch = [Changes(10.0, parks=[ann])]
    st._add_parked(ann)
    _, ch = scheduling.acquire(
        st, Ask("bob", "k", PPM), Quota(), 11.0, PARK_POLICY, lambda: next(ids)
    )
    batch.append(ch)
    _, ch = scheduling.resume(st, "L", 12.0, PARK_POLICY, lambda: next(ids))
    batch.append(ch)
    assert ("ann", "k") in st.queue and ch.queued
    store.write_changes(batch, PPM)
    _same(store, st)
    _, ch = scheduling.acquire(
        st, Ask("ann", "k", 200_000), Quota(), 13.0, PARK_POLICY, lambda: next(ids)
    )
    assert ch.ended and ch.dropped and ch.queued
    store.write_changes([ch], PPM)
    _same(store, st)
    got = store.get_lease("L")
    assert got is not None and got.state == "released"
    assert got.reason == "the kernel restarted while its GPU state was parked"


# --------------------------------------------------------------------------- migrations


def _add_note_column(conn: sa.Connection) -> None:
    conn.exec_driver_sql("ALTER TABLE leases ADD COLUMN note VARCHAR(64)")
    conn.exec_driver_sql("UPDATE leases SET note = 'migrated'")


def _broken_migration(conn: sa.Connection) -> None:
    conn.exec_driver_sql("ALTER TABLE leases ADD COLUMN note VARCHAR(64)")
    conn.exec_driver_sql("SELECT no_such_column FROM leases")


def _columns(db_url: str) -> set[str]:
    eng = _raw_engine(db_url)
    cols = {c["name"] for c in sa.inspect(eng).get_columns("leases")}
    eng.dispose()
    return cols


LATEST = MIGRATIONS[-1].version
NEXT = LATEST + 1  # a version this code does not know


def test_upgrade_keeps_leases_and_quotas(store: Store, db_url: str) -> None:
    store.insert_leases([_lease("a"), _lease("b", user="bob")], PPM, [])
    store.end_leases([("b", "released", 1010.0, None)])
    store.put_quota("group", "ml101", Quota(max_leases=4))
    store.insert_request(_request("r1"))
    before = (store.list_leases(), store.load_quotas(), store.load_active())
    v2 = (*MIGRATIONS, Migration(NEXT, "lease notes", _add_note_column))
    assert store.upgrade(v2) == NEXT
    assert store.upgrade(v2) == NEXT  # safe to repeat
    assert "note" in _columns(db_url)
    assert (store.list_leases(), store.load_quotas(), store.load_active()) == before
    eng = _raw_engine(db_url)
    with eng.connect() as conn:
        assert conn.exec_driver_sql("SELECT DISTINCT note FROM leases").scalars().all() == [
            "migrated"
        ]
    with eng.begin() as conn:  # the module-level function works in a caller's transaction
        assert upgrade_schema(conn, v2) == NEXT
    eng.dispose()
    # code that knows only the older versions refuses a newer database rather than damage it
    with pytest.raises(StoreError, match="newer"):
        store.upgrade()


def test_version_1_database_upgrades_and_old_leases_have_no_groups(db_url: str) -> None:
    old = Store(db_url)
    assert old.upgrade(MIGRATIONS[:1]) == 1
    old.sync_gpus([GPU0], PPM)
    assert "user_groups" not in _columns(db_url)
    eng = _raw_engine(db_url)
    with eng.begin() as conn:  # a lease as version 1 wrote it
        conn.execute(
            sa.text(
                'INSERT INTO leases (id, "user", kernel_id, gpu_uuid, fraction_ppm, '
                "memory_limit_mb, state, grp, created_at, renewed_at, expires_at, ended_at) "
                "VALUES ('v1', 'dan', 'k', 'GPU-0', 500000, 15872, 'released', NULL, "
                "0, 0, 90, 3600)"
            )
        )
    eng.dispose()
    old.close()
    store = Store(db_url)
    store.open()
    try:
        assert store.upgrade() == LATEST
        assert "user_groups" in _columns(db_url)
        lease = store.get_lease("v1")
        assert lease is not None and lease.groups == () and lease.user == "dan"
        assert store.usage(0, 3600, by="group") == pytest.approx({"": 0.5})
        store.insert_lease(_lease("new", user="dan", groups=("ml101",), created=0.0), PPM)
        assert store.usage(0, 3600, by="group") == pytest.approx({"": 0.5, "ml101": 0.02})
    finally:
        store.close()


def test_version_2_database_logs_the_requests_waiting_at_the_upgrade(db_url: str) -> None:
    old = Store(db_url)
    assert old.upgrade(MIGRATIONS[:2]) == 2
    eng = _raw_engine(db_url)
    with eng.begin() as conn:  # a request waiting, as version 2 wrote it
        conn.execute(
            sa.text(
                'INSERT INTO requests (id, "user", kernel_id, fraction_ppm, groups, grp, node, '
                "gpu_uuids, priority, arrived_at, last_polled_at) VALUES ('w', 'dan', 'k', "
                """500000, '["ml101"]', NULL, NULL, NULL, 0, 100, 100)"""
            )
        )
    eng.dispose()
    old.close()
    store = Store(db_url)
    store.open()
    try:
        assert store.upgrade() == LATEST
        (rec,) = store.history(0, 200)[1]
        assert (rec.id, rec.user, rec.arrived_at, rec.groups) == ("w", "dan", 100, ("ml101",))
        assert rec.left_at is None and rec.outcome is None
        store.delete_requests(["w"], outcome="cancelled", at=150.0)
        assert store.history(0, 200)[1][0].left_at == 150.0
    finally:
        store.close()


def test_version_6_database_upgrades_to_parking(db_url: str) -> None:
    """Version 7 adds the park columns: a lease and a request written by version 6 load
    unparked, and the new columns work after the upgrade."""
    old = Store(db_url)
    assert old.upgrade(MIGRATIONS[:6]) == 6
    old.sync_gpus([GPU0], PPM)
    assert "park_state" not in _columns(db_url)
    eng = _raw_engine(db_url)
    with eng.begin() as conn:  # as version 6 wrote them
        conn.execute(
            sa.text(
                'INSERT INTO leases (id, "user", kernel_id, gpu_uuid, fraction_ppm, '
                "memory_limit_mb, state, grp, created_at, renewed_at, expires_at, user_groups) "
                "VALUES ('v6', 'dan', 'k', 'GPU-0', 500000, 15872, 'active', NULL, "
                "0, 0, 90, '[]')"
            )
        )
        conn.execute(
            sa.text(
                'INSERT INTO requests (id, "user", kernel_id, fraction_ppm, groups, grp, node, '
                "gpu_uuids, priority, arrived_at, last_polled_at) VALUES ('w', 'eve', 'k', "
                "500000, '[]', NULL, NULL, NULL, 0, 100, 100)"
            )
        )
    eng.dispose()
    old.close()
    store = Store(db_url)
    store.open()
    try:
        assert store.upgrade() == LATEST >= 7
        assert {"park_state", "parked_at"} <= _columns(db_url)
        (lease,), (req,) = store.load_active()
        assert (lease.id, lease.park, lease.parked_at) == ("v6", None, None)
        assert (req.id, req.resume_of) == ("w", None)
        parked = replace(lease, park="parked", parked_at=50.0)
        store.write_changes([Changes(50.0, parks=[parked])], PPM)
        assert store.load_active()[0] == [parked]
        store.insert_lease(_lease("new", user="eve", kernel="k", ppm=PPM, created=60.0), PPM)
    finally:
        store.close()


def test_failed_migration_changes_nothing(store: Store, db_url: str) -> None:
    store.insert_lease(_lease("a"), PPM)
    with pytest.raises(StoreError, match="schema up to date"):
        store.upgrade((*MIGRATIONS, Migration(NEXT, "broken", _broken_migration)))
    assert store.upgrade() == LATEST
    assert "note" not in _columns(db_url)  # DDL rolled back with the transaction
    assert store.get_lease("a") == _lease("a")


# --------------------------------------------------------------------------- processes


def _race_worker(url: str, wid: int, barrier: Any, churn: int, out: Any) -> None:
    """Child process: churn (acquire+release), then grab and keep as many 0.3 as fit."""
    try:
        store = Store(url)
        store.open()
        granted = refused = 0
        barrier.wait(timeout=60)
        for i in range(churn):
            lease = _lease(f"w{wid}-c{i}", user=f"u{wid}", kernel=f"c{i}", ppm=300_000)
            try:
                store.insert_lease(lease, PPM)
            except CapacityConflict:
                continue
            store.end_leases([(lease.id, "released", time.time(), None)])
        barrier.wait(timeout=60)
        for i in range(3):
            try:
                store.insert_lease(_lease(f"w{wid}-k{i}", user=f"u{wid}", ppm=300_000), PPM)
                granted += 1
            except CapacityConflict:
                refused += 1
        store.close()
        out.put((wid, granted, refused))
    except BaseException as exc:  # tell the parent, and free the others from the barrier
        barrier.abort()
        out.put((wid, -1, repr(exc)))
        raise


@pytest.mark.slow
def test_processes_racing_never_overallocate(store: Store, db_url: str) -> None:
    ctx = mp.get_context("spawn")
    n = 4
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(db_url, w, barrier, 25, out)) for w in range(n)]
    for p in procs:
        p.start()
    peak = 0
    deadline = time.monotonic() + 90
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        peak = max(peak, _active_sum(store))
        time.sleep(0.005)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    results: list[tuple[int, int, Any]] = []
    while not out.empty() or len(results) < n:
        try:
            results.append(out.get(timeout=5))
        except Exception:
            break
    out.close()
    out.join_thread()
    peak = max(peak, _active_sum(store))
    assert [r for r in results if r[1] < 0] == [], "a worker failed"
    assert [p.exitcode for p in procs] == [0] * n
    assert peak <= PPM, f"{peak / PPM} of a GPU was leased at once"
    assert len(store.list_leases(states=("active",))) == 3
    assert sum(g for _, g, _ in results) == 3 and sum(r for _, _, r in results) == 9
    assert _active_sum(store) == 900_000


_CRASH_CHILD = """
import sys, time
from provisioner.model import Lease
from provisioner.broker.store.store import Store
store = Store(sys.argv[1])
store.open()
i = 0
while True:
    t = time.time()
    store.insert_lease(Lease(f"c{i}", "u", f"k{i}", "GPU-0", 250000, 100, "active", t, t, t + 90), 1000000)
    if i >= 3:
        store.end_leases([(f"c{i - 3}", "released", t, None)])
    print(i, flush=True)
    i += 1
"""


@pytest.mark.slow
def test_killed_writer_leaves_a_consistent_database(store: Store, db_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASH_CHILD, db_url], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    last = -1
    with contextlib.closing(proc.stdout):
        while last < 150:
            line = proc.stdout.readline()
            assert line, f"the writer died on its own (exit {proc.poll()})"
            last = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    store.close()

    if db_url.startswith("sqlite"):
        path = sa.make_url(db_url).database
        assert path is not None
        with contextlib.closing(sqlite3.connect(path)) as raw:
            assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    reopened = Store(db_url)
    reopened.open()
    try:
        every = reopened.list_leases(limit=1_000_000)
        by_id = {lease.id: lease for lease in every}
        # every acknowledged write is there, and nothing half-written is
        top = max(int(lid[1:]) for lid in by_id)
        assert top >= last
        assert set(by_id) == {f"c{i}" for i in range(top + 1)}
        for i in range(top + 1):
            state = by_id[f"c{i}"].state
            assert state == ("released" if i < top - 3 else "active") or i == top - 3
        for lease in every:
            assert lease.user == "u" and lease.fraction_ppm == 250_000
            assert lease.created_at <= lease.expires_at
            assert (lease.state == "active") == (lease.ended_at is None)
        assert 1 <= reopened.counts()["active"] <= 4
        assert _active_sum(reopened) <= PPM
        # and the database still takes writes
        reopened.end_leases([(lid, "expired", time.time(), None) for lid in by_id])
        reopened.insert_lease(_lease("after", ppm=PPM), PPM)
    finally:
        reopened.close()


# --------------------------------------------------------------------------- leadership

PG_ONLY = pytest.mark.parametrize(
    "db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)


@contextlib.contextmanager
def _two_brokers(db_url: str, **kw: Any) -> Iterator[tuple[Store, Store]]:
    a, b = Store(db_url, **kw), Store(db_url, **kw)
    a.open()
    b.open()
    a.sync_gpus([GPU0, GPU1], PPM)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@PG_ONLY
def test_leadership_is_taken_once_and_fences_a_deposed_writer(db_url: str) -> None:
    """One holder at a time; once its leadership expires another takes it with the next
    epoch; the deposed one can neither renew nor write (its fence says why), and its
    refused write left nothing behind."""
    refused: list[tuple[str, bool]] = []
    with _two_brokers(db_url) as (a, b):
        epoch, holder, remaining = a.fencing.take("a", 0.6)
        assert epoch is not None and holder == "a" and 0 < remaining <= 0.6
        a.fencing.set(Fence("a", epoch), lambda why, deposed: refused.append((why, deposed)))
        assert b.fencing.take("b", 0.6)[:2] == (None, "a")
        a.insert_lease(_lease("by-a"), PPM)
        wait_for(lambda: b.fencing.take("b", 30.0)[0] is not None, 10, "the takeover")
        assert b.fencing.read()[:2] == ("b", epoch + 1)
        assert not a.fencing.renew("a", epoch, 0.6)
        with pytest.raises(NotActive, match="another broker holds the leadership"):
            a.insert_lease(_lease("late", user="bob"), PPM)
        with pytest.raises(NotActive):
            a.end_leases([("by-a", "released", 2000.0, None)])
        assert refused and all(deposed for _, deposed in refused)
        assert b.get_lease("late") is None and b.get_lease("by-a").state == "active"  # type: ignore[union-attr]
        b.fencing.set(Fence("b", epoch + 1))
        b.end_leases([("by-a", "released", 2000.0, None)])
        assert b.get_lease("by-a").state == "released"  # type: ignore[union-attr]


@PG_ONLY
def test_a_lapsed_leadership_nobody_took_is_renewed(db_url: str) -> None:
    """Expired but not taken over: writes are refused as lapsed (not deposed) until the
    holder renews, which it may: nobody else has written."""
    refused: list[bool] = []
    with _two_brokers(db_url) as (a, _):
        epoch, _, _ = a.fencing.take("a", 0.3)
        assert epoch is not None
        a.fencing.set(Fence("a", epoch), lambda why, deposed: refused.append(deposed))
        wait_for(lambda: a.fencing.read()[2] < 0, 10, "the leadership to lapse")
        with pytest.raises(NotActive, match="expired"):
            a.insert_lease(_lease("x"), PPM)
        assert refused == [False] and a.get_lease("x") is None
        assert a.fencing.renew("a", epoch, 30.0)
        a.insert_lease(_lease("x"), PPM)
        assert a.fencing.read()[:2] == ("a", epoch)


@PG_ONLY
def test_a_takeover_waits_for_a_write_in_flight_but_not_for_a_paused_one(db_url: str) -> None:
    """A takeover does not overtake a write transaction that passed the fence (it holds
    the row FOR SHARE): it returns "not yet" after its short lock wait, never an error.
    A writer that stops mid-transaction (SIGSTOP) is ended by the server's
    idle-in-transaction timeout, so the takeover happens soon after."""
    with _two_brokers(db_url, pg_timeout=1.0) as (a, b):
        epoch, _, _ = a.fencing.take("a", 0.3)
        assert epoch is not None
        with a._engine.connect() as raw:  # a write of "a" between its fence and its commit
            raw.begin()
            raw.execute(sa.text("SELECT epoch FROM leadership WHERE id = 1 FOR SHARE"))
            wait_for(lambda: a.fencing.read()[2] < 0, 10, "the leadership to expire")
            t0 = time.monotonic()
            assert b.fencing.take("b", 30.0, lock_wait=0.2) == (None, None, 0.2)
            assert time.monotonic() - t0 < 5
            # "a" is paused here: the server ends its transaction after pg_timeout
            wait_for(lambda: b.fencing.take("b", 30.0)[0] == epoch + 1, 20, "takeover")
            with pytest.raises(sa.exc.OperationalError):
                raw.execute(sa.text("SELECT 1"))


@PG_ONLY
def test_a_released_leadership_is_taken_at_once(db_url: str) -> None:
    with _two_brokers(db_url) as (a, b):
        epoch, _, _ = a.fencing.take("a", 60.0)
        assert epoch is not None
        a.fencing.set(Fence("a", epoch))
        a.fencing.release("a", epoch)
        assert b.fencing.take("b", 60.0)[0] == epoch + 1
        with pytest.raises(NotActive):
            a.put_quota("default", "", Quota(max_leases=1))


@PG_ONLY
def test_postgres_sessions_are_bounded(db_url: str) -> None:
    """Connect timeout, TCP keepalives and user timeout, statement and idle-in-transaction
    timeouts on every connection; the URL's own settings win."""
    store = Store(db_url, pg_timeout=1.5, application_name="gl-test-bounded")
    try:
        with store._engine.connect() as conn:
            params = conn.connection.dbapi_connection.get_dsn_parameters()  # type: ignore[union-attr]
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "1500ms"
            assert (
                conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
                == "1500ms"
            )
            assert conn.exec_driver_sql("SHOW application_name").scalar() == "gl-test-bounded"
        assert params["keepalives"] == "1" and params["tcp_user_timeout"] == "1500"
        assert params["connect_timeout"] == "2" and params["keepalives_count"] == "3"
    finally:
        store.close()
    store = Store(f"{db_url}&connect_timeout=7")
    try:
        with store._engine.connect() as conn:
            params = conn.connection.dbapi_connection.get_dsn_parameters()  # type: ignore[union-attr]
        assert params["connect_timeout"] == "7"
    finally:
        store.close()


def test_leadership_needs_postgres(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'x.sqlite'}")
    assert not store.fencing.supported
    with pytest.raises(StoreError, match="PostgreSQL"):
        store.fencing.take("a", 1.0)
    with pytest.raises(StoreError, match="PostgreSQL"):
        store.fencing.set(Fence("a", 1))


def test_usage_reads_through_the_indexes_not_every_lease(tmp_path: Path) -> None:
    """``usage?by=group`` (any student's) reads the leases active now or ended in
    the window through ``ix_leases_state`` and ``ix_leases_ended``: no scan of the table."""
    import sqlalchemy as sa

    from provisioner.broker.store import schema as store_schema

    url = f"sqlite:///{tmp_path / 'plan.sqlite'}"
    Store(url).upgrade()
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            query = store_schema._USAGE_BY_GROUP.params(since=0.0, until=1e9)
            sql = str(query.compile(engine, compile_kwargs={"literal_binds": True}))
            plan = " / ".join(r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
    finally:
        engine.dispose()
    assert "ix_leases_ended" in plan and "SCAN leases" not in plan, plan
