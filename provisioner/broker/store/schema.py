"""The lease database's schema: tables, migrations, and the statements and row
conversions the store runs (``store.py``, ``store_engine.py``, ``store_writes.py``).

The tables and what each column holds: see ``store.py``'s docstring.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection

from ...errors import (
    StoreError,
)
from ...model import (
    PPM,
    Lease,
    Quota,
    Request,
)

# --------------------------------------------------------------------------- schema

metadata = sa.MetaData()

schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.String(255), nullable=False),
    sa.Column("applied_at", sa.Double, nullable=False),
)

_STATE_IN = "state IN ('active', 'revoked', 'released', 'expired')"


#: the partial indexes on active leases (schema version 1), created with the table
_PARTIAL_INDEXES = (
    "CREATE INDEX ix_leases_active_gpu ON leases (gpu_uuid) WHERE state = 'active'",
    'CREATE UNIQUE INDEX uq_leases_active_kernel ON leases ("user", kernel_id) '
    "WHERE state = 'active'",
)


def _define_v1(md: sa.MetaData) -> tuple[sa.Table, sa.Table, sa.Table, sa.Table]:
    """The tables and indexes exactly as schema version 1 created them (frozen: never edit).

    Later versions change the module's tables after this (``append_column``, new
    tables) and say so in their migration, so that an old database is always built the
    way version 1 built it and then upgraded step by step.
    """
    gpus = sa.Table(
        "gpus",
        md,
        sa.Column("uuid", sa.String(128), primary_key=True),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("memory_mb", sa.BigInteger, nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("capacity_ppm", sa.BigInteger, nullable=False),
    )

    leases = sa.Table(
        "leases",
        md,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("kernel_id", sa.String(255), nullable=False),
        sa.Column("gpu_uuid", sa.String(128), nullable=False),
        sa.Column("fraction_ppm", sa.BigInteger, nullable=False),
        sa.Column("memory_limit_mb", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("grp", sa.String(255), nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("renewed_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Column("ended_at", sa.Double, nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("pid", sa.BigInteger, nullable=True),
        sa.Column("execution_state", sa.String(32), nullable=True),
        sa.Column("last_activity", sa.Double, nullable=True),
        sa.CheckConstraint(_STATE_IN, name="ck_leases_state"),
        sa.CheckConstraint("fraction_ppm > 0", name="ck_leases_fraction"),
        sa.CheckConstraint("state = 'active' OR ended_at IS NOT NULL", name="ck_leases_ended"),
    )
    sa.Index("ix_leases_state", leases.c.state)
    sa.Index("ix_leases_user", leases.c.user)
    # The partial indexes, as DDL both SQLite and PostgreSQL read the same way: the
    # ``postgresql_where=`` keyword would import SQLAlchemy's PostgreSQL dialect (~60 ms
    # of every broker's start) even on SQLite.
    for ddl in _PARTIAL_INDEXES:
        event.listen(leases, "after_create", sa.DDL(ddl))

    requests = sa.Table(
        "requests",
        md,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("kernel_id", sa.String(255), nullable=False),
        sa.Column("fraction_ppm", sa.BigInteger, nullable=False),
        sa.Column("groups", sa.Text, nullable=False),
        sa.Column("grp", sa.String(255), nullable=True),
        sa.Column("node", sa.String(255), nullable=True),
        sa.Column("gpu_uuids", sa.Text, nullable=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("arrived_at", sa.Double, nullable=False),
        sa.Column("last_polled_at", sa.Double, nullable=False),
        sa.UniqueConstraint("user", "kernel_id", name="uq_requests_kernel"),
    )

    quotas = sa.Table(
        "quotas",
        md,
        sa.Column("level", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("max_fraction_ppm", sa.BigInteger, nullable=True),
        sa.Column("max_leases", sa.Integer, nullable=True),
        sa.Column("max_lease_fraction_ppm", sa.BigInteger, nullable=True),
        sa.Column("budget_fraction_hours", sa.Double, nullable=True),
        sa.Column("budget_window_s", sa.BigInteger, nullable=True),
        sa.Column("priority", sa.Integer, nullable=True),
        sa.CheckConstraint("level IN ('default', 'group', 'user')", name="ck_quotas_level"),
    )
    return gpus, leases, requests, quotas


gpus, leases, requests, quotas = _define_v1(metadata)
_gpu_table = gpus  # for methods whose parameter is named ``gpus``
# version 2: the user's groups (courses) when the lease was granted, a JSON list (NULL:
# granted before version 2); ``usage --by group`` attributes leases without a course
# kernel's group to them (model.attribution)
leases.append_column(sa.Column("user_groups", sa.Text, nullable=True))

# version 3: every request's stay in the queue, for the history of queue length and
# waits (``requests`` holds only those waiting now); leases by end time for the same
_OUTCOME_IN = "outcome IS NULL OR outcome IN ('granted', 'cancelled', 'dropped')"
queue_log = sa.Table(
    "queue_log",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("user", sa.String(255), nullable=False),
    sa.Column("kernel_id", sa.String(255), nullable=False),
    sa.Column("fraction_ppm", sa.BigInteger, nullable=False),
    sa.Column("grp", sa.String(255), nullable=True),
    sa.Column("user_groups", sa.Text, nullable=False),
    sa.Column("arrived_at", sa.Double, nullable=False),
    sa.Column("left_at", sa.Double, nullable=True),
    sa.Column("outcome", sa.String(16), nullable=True),
    sa.CheckConstraint(_OUTCOME_IN, name="ck_queue_log_outcome"),
)
_ix_queue_log_arrived = sa.Index("ix_queue_log_arrived", queue_log.c.arrived_at)
_ix_leases_ended = sa.Index("ix_leases_ended", leases.c.ended_at)


def _define_nodes(md: sa.MetaData) -> sa.Table:
    """Version 4: the nodes node agents registered (frozen: never edit)."""
    return sa.Table(
        "nodes",
        md,
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("gpus", sa.Text, nullable=False),  # JSON [{uuid, name, memory_mb, index}]
        sa.Column("agent_version", sa.String(64), nullable=False),
        sa.Column("registered_at", sa.Double, nullable=False),
        sa.Column("drained", sa.Boolean, nullable=False),
    )


nodes = _define_nodes(metadata)
# version 5: the agent's --enforce mode (NULL: registered before version 5, 'report')
nodes.append_column(sa.Column("enforce", sa.String(8), nullable=True))


def _define_v6_leadership(md: sa.MetaData) -> sa.Table:
    """The leadership table as schema version 6 created it (frozen: never edit)."""
    return sa.Table(
        "leadership",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("holder", sa.String(255), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("acquired_at", sa.Double, nullable=True),
        sa.Column("renewed_at", sa.Double, nullable=True),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.CheckConstraint("id = 1", name="ck_leadership_one_row"),
    )


# version 6: fenced leadership of active/standby brokers (one row, see the module docstring)
leadership = _define_v6_leadership(metadata)

# version 7: parking. A live lease's park state (NULL | 'parking' | 'parked' |
# 'resuming'; ``state`` stays 'active') and when parking began; a parked lease holds no
# capacity (every capacity sum skips it). A queued resume request names its parked lease.
leases.append_column(sa.Column("park_state", sa.String(16), nullable=True))
leases.append_column(sa.Column("parked_at", sa.Double, nullable=True))
requests.append_column(sa.Column("resume_of", sa.String(64), nullable=True))

# --------------------------------------------------------------------------- migrations


@dataclass(frozen=True)
class Migration:
    """One schema step: ``apply(conn)`` runs inside the upgrade transaction."""

    version: int
    description: str
    apply: Callable[[Connection], None]


def _v1_initial(conn: Connection) -> None:
    md = sa.MetaData()
    md.create_all(conn, tables=list(_define_v1(md)), checkfirst=True)


def _v2_lease_groups(conn: Connection) -> None:
    conn.execute(sa.text("ALTER TABLE leases ADD COLUMN user_groups TEXT"))


def _v3_queue_log(conn: Connection) -> None:
    queue_log.create(conn)  # with its index
    _ix_leases_ended.create(conn)
    # the requests waiting now arrived before the log existed: log them too
    cols = ("id", "user", "kernel_id", "fraction_ppm", "grp", "arrived_at")
    conn.execute(
        queue_log.insert().from_select(
            [*cols, "user_groups"],
            sa.select(*(requests.c[c] for c in cols), requests.c.groups),
        )
    )


def _v5_node_enforce(conn: Connection) -> None:
    conn.execute(sa.text("ALTER TABLE nodes ADD COLUMN enforce VARCHAR(8)"))


def _v4_nodes(conn: Connection) -> None:
    md = sa.MetaData()
    md.create_all(conn, tables=[_define_nodes(md)], checkfirst=True)


def _v6_leadership(conn: Connection) -> None:
    table = _define_v6_leadership(sa.MetaData())
    table.create(conn, checkfirst=True)
    conn.execute(table.insert().values(id=1, holder=None, epoch=0, expires_at=0.0))


def _v7_parking(conn: Connection) -> None:
    # ADD COLUMN only: no constraint is rebuilt (SQLite could not without copying tables)
    conn.execute(sa.text("ALTER TABLE leases ADD COLUMN park_state VARCHAR(16)"))
    conn.execute(sa.text("ALTER TABLE leases ADD COLUMN parked_at DOUBLE PRECISION"))
    conn.execute(sa.text("ALTER TABLE requests ADD COLUMN resume_of VARCHAR(64)"))


#: Ordered schema steps; append ``Migration(N + 1, ...)`` to change the schema (and change
#: the module's tables after ``_define_v1`` to match).
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema", _v1_initial),
    Migration(2, "leases record their user's groups", _v2_lease_groups),
    Migration(3, "the queue's history", _v3_queue_log),
    Migration(4, "nodes registered by node agents", _v4_nodes),
    Migration(5, "nodes record their agent's enforcement mode", _v5_node_enforce),
    Migration(6, "fenced leadership of active/standby brokers", _v6_leadership),
    Migration(7, "parked leases and resume requests", _v7_parking),
)

_PG_UPGRADE_LOCK = 0x67_6C_5F_73_74_6F_72  # pg_advisory_xact_lock key ("gl_stor")


def upgrade_schema(
    conn: Connection, migrations: Sequence[Migration] = MIGRATIONS, *, now: float | None = None
) -> int:
    """Apply the migrations the database lacks, inside the caller's transaction.

    Called from :meth:`Store.upgrade` on every start; safe to repeat and safe when two
    processes start at once (SQLite: the write lock; PostgreSQL: an advisory lock).
    Returns the schema version the database has afterwards.
    """
    if conn.dialect.name == "postgresql":
        # a migration may take longer than the broker's statement timeout, and may wait
        # for another process's migration
        conn.execute(sa.text("SET LOCAL statement_timeout = 0"))
        conn.execute(sa.text("SET LOCAL lock_timeout = 0"))
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_UPGRADE_LOCK)))
    schema_version.create(conn, checkfirst=True)
    current = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar() or 0
    known = max((m.version for m in migrations), default=0)
    if current > known:
        raise StoreError(
            f"The lease database has schema version {current}, newer than the {known} this "
            "version of jupyter-gpu-lease understands; upgrade jupyter-gpu-lease on this host."
        )
    stamp = time.time() if now is None else now
    for migration in sorted(migrations, key=lambda m: m.version):
        if migration.version <= current:
            continue
        migration.apply(conn)
        conn.execute(
            schema_version.insert().values(
                version=migration.version, description=migration.description, applied_at=stamp
            )
        )
        current = migration.version
    return current


# --------------------------------------------------------------------------- statements
# Built once; SQLAlchemy caches their compiled form per dialect.

_LEASE_COLS = (
    # in the order of Lease's fields, so that ``_lease_from_row(row)`` builds one
    leases.c.id,
    leases.c.user,
    leases.c.kernel_id,
    leases.c.gpu_uuid,
    leases.c.fraction_ppm,
    leases.c.memory_limit_mb,
    leases.c.state,
    leases.c.created_at,
    leases.c.renewed_at,
    leases.c.expires_at,
    leases.c.grp,
    leases.c.ended_at,
    leases.c.reason,
    leases.c.pid,
    leases.c.execution_state,
    leases.c.last_activity,
    leases.c.user_groups,  # a JSON list: see _lease_from_row
    leases.c.park_state,  # v7, then parked_at: see _lease_from_row
    leases.c.parked_at,
)
_SELECT_LEASES = sa.select(*_LEASE_COLS)
_SELECT_ACTIVE = _SELECT_LEASES.where(leases.c.state == "active").order_by(
    leases.c.created_at, leases.c.id
)
_GET_LEASE = _SELECT_LEASES.where(leases.c.id == sa.bindparam("lid"))
_LOCK_GPUS = (
    sa.select(gpus.c.uuid, gpus.c.capacity_ppm)
    .where(gpus.c.uuid.in_(sa.bindparam("uuids", expanding=True)))
    .order_by(gpus.c.uuid)
    .with_for_update()
)
#: a live lease that holds its capacity: active and not parked (schema version 7)
_HOLDS = sa.and_(
    leases.c.state == "active",
    sa.or_(leases.c.park_state.is_(None), leases.c.park_state != "parked"),
)
_HELD_ON_GPUS = (
    sa.select(leases.c.gpu_uuid, sa.func.sum(leases.c.fraction_ppm))
    .where(_HOLDS, leases.c.gpu_uuid.in_(sa.bindparam("uuids", expanding=True)))
    .group_by(leases.c.gpu_uuid)
)
# The same on SQLite, pinned to the partial per-GPU index: without statistics SQLite's
# planner prefers ix_leases_state for a one-GPU IN list and reads every active lease
# (3-6 ms per grant at 10,000 leases instead of microseconds).
_HELD_ON_GPUS_SQLITE = sa.text(
    "SELECT gpu_uuid, sum(fraction_ppm) FROM leases INDEXED BY ix_leases_active_gpu "
    "WHERE state = 'active' AND (park_state IS NULL OR park_state <> 'parked') "
    "AND gpu_uuid IN :uuids GROUP BY gpu_uuid"
).bindparams(sa.bindparam("uuids", expanding=True))
_ACTIVE_FOR_KERNEL = sa.select(leases.c.id).where(
    leases.c.state == "active",
    leases.c.user == sa.bindparam("b_user"),
    leases.c.kernel_id == sa.bindparam("b_kernel"),
)
_INSERT_LEASE = leases.insert()
_DELETE_REQUEST = requests.delete().where(requests.c.id == sa.bindparam("b_id"))
_RENEW = (
    leases.update()
    .where(leases.c.id == sa.bindparam("b_id"), leases.c.state == "active")
    .values(
        renewed_at=sa.bindparam("b_renewed_at"),
        expires_at=sa.bindparam("b_expires_at"),
        pid=sa.bindparam("b_pid"),
        execution_state=sa.bindparam("b_execution_state"),
        last_activity=sa.bindparam("b_last_activity"),
    )
)
_END = (
    leases.update()
    .where(leases.c.id == sa.bindparam("b_id"), leases.c.state == "active")
    .values(
        state=sa.bindparam("b_state"),
        ended_at=sa.bindparam("b_ended_at"),
        reason=sa.bindparam("b_reason"),
    )
)
#: a live lease's park state changed (``Changes.parks``)
_PARK = (
    leases.update()
    .where(leases.c.id == sa.bindparam("b_id"), leases.c.state == "active")
    .values(park_state=sa.bindparam("b_park_state"), parked_at=sa.bindparam("b_parked_at"))
)
_ENDED_AMONG = sa.select(leases.c.id, leases.c.state, leases.c.reason).where(
    leases.c.id.in_(sa.bindparam("ids", expanding=True)), leases.c.state != "active"
)
_EXTEND = (
    leases.update()
    .where(leases.c.state == "active", leases.c.expires_at < sa.bindparam("b_min"))
    .values(expires_at=sa.bindparam("b_min"))
)
_REQUEST_COLS = (
    requests.c.id,
    requests.c.user,
    requests.c.kernel_id,
    requests.c.fraction_ppm,
    requests.c.arrived_at,
    requests.c.last_polled_at,
    requests.c.groups,
    requests.c.grp,
    requests.c.node,
    requests.c.gpu_uuids,
    requests.c.priority,
    requests.c.resume_of,  # v7
)
_SELECT_REQUESTS = sa.select(*_REQUEST_COLS).order_by(requests.c.arrived_at, requests.c.id)
_TOUCH_REQUEST = (
    requests.update()
    .where(requests.c.id == sa.bindparam("b_id"))
    .values(last_polled_at=sa.bindparam("b_last_polled_at"))
)
_UPDATE_GPU = (
    gpus.update()
    .where(gpus.c.uuid == sa.bindparam("b_uuid"))
    .values(
        node=sa.bindparam("node"),
        name=sa.bindparam("name"),
        memory_mb=sa.bindparam("memory_mb"),
        idx=sa.bindparam("idx"),
        capacity_ppm=sa.bindparam("capacity_ppm"),
    )
)
_QUOTA_COLS = tuple(quotas.c[f] for f in Quota.FIELDS)
_UPDATE_QUOTA = (
    quotas.update()
    .where(quotas.c.level == sa.bindparam("b_level"), quotas.c.name == sa.bindparam("b_name"))
    .values({f: sa.bindparam(f) for f in Quota.FIELDS})
)
_COUNTS = sa.select(leases.c.state, leases.c.park_state, sa.func.count()).group_by(
    leases.c.state, leases.c.park_state
)
_LEAVE_QUEUE = (
    queue_log.update()
    .where(queue_log.c.id == sa.bindparam("b_id"), queue_log.c.left_at.is_(None))
    .values(left_at=sa.bindparam("b_left_at"), outcome=sa.bindparam("b_outcome"))
)
_QUEUE_LOG_COLS = (
    # in the order of QueueRecord's fields
    queue_log.c.id,
    queue_log.c.user,
    queue_log.c.kernel_id,
    queue_log.c.fraction_ppm,
    queue_log.c.arrived_at,
    queue_log.c.grp,
    queue_log.c.user_groups,
    queue_log.c.left_at,
    queue_log.c.outcome,
)

# usage: fraction x overlap of [created_at, end) with [since, until), end = until while active
_SINCE: sa.BindParameter[float] = sa.bindparam("since", type_=sa.Double())
_UNTIL: sa.BindParameter[float] = sa.bindparam("until", type_=sa.Double())
_END_AT = sa.case(
    (leases.c.state == "active", _UNTIL), else_=sa.func.coalesce(leases.c.ended_at, _UNTIL)
)
_OVERLAP = sa.case((_END_AT < _UNTIL, _END_AT), else_=_UNTIL) - sa.case(
    (leases.c.created_at > _SINCE, leases.c.created_at), else_=_SINCE
)
_PPM_SECONDS = sa.func.sum(leases.c.fraction_ppm * _OVERLAP)
# the leases active now or ended after ``since``: through the state and ``ended_at`` indexes,
# not a scan of every lease ever recorded (``_END_AT > _SINCE`` alone is no index's)
_IN_WINDOW = (
    leases.c.created_at < _UNTIL,
    sa.or_(leases.c.state == "active", leases.c.ended_at > _SINCE),
    _END_AT > _SINCE,
)
_USAGE_BY_USER = sa.select(leases.c.user, _PPM_SECONDS).where(*_IN_WINDOW).group_by(leases.c.user)
# per (course kernel's group, user's groups): few rows, split by model.attribution
_USAGE_BY_GROUP = (
    sa.select(leases.c.grp, leases.c.user_groups, _PPM_SECONDS)
    .where(*_IN_WINDOW)
    .group_by(leases.c.grp, leases.c.user_groups)
)
_USER_USAGE = sa.select(_PPM_SECONDS).where(*_IN_WINDOW, leases.c.user == sa.bindparam("b_user"))
_PPM_HOURS = PPM * 3600.0


def _renew_params(
    lease_id: str,
    renewed_at: float,
    expires_at: float,
    pid: int | None,
    execution_state: str | None,
    last_activity: float | None,
) -> dict[str, Any]:
    """A heartbeat's bind parameters for ``_RENEW``."""
    return {
        "b_id": lease_id,
        "b_renewed_at": renewed_at,
        "b_expires_at": expires_at,
        "b_pid": pid,
        "b_execution_state": execution_state,
        "b_last_activity": last_activity,
    }


def _request_row(req: Request) -> dict[str, Any]:
    return {
        "id": req.id,
        "user": req.user,
        "kernel_id": req.kernel_id,
        "fraction_ppm": req.fraction_ppm,
        "groups": json.dumps(sorted(req.groups)),
        "grp": req.group,
        "node": req.node,
        "gpu_uuids": None if req.gpu_uuids is None else json.dumps(list(req.gpu_uuids)),
        "priority": req.priority,
        "arrived_at": req.arrived_at,
        "last_polled_at": req.last_polled_at,
        "resume_of": req.resume_of,
    }


def _queue_log_row(req: Request) -> dict[str, Any]:
    """The queue log's row of a request that joined the queue (it has not left yet)."""
    row = _request_row(req)
    logged = {k: row[k] for k in ("id", "user", "kernel_id", "fraction_ppm", "grp", "arrived_at")}
    return {**logged, "user_groups": row["groups"]}


def _lease_row(lease: Lease) -> dict[str, Any]:
    return {
        "id": lease.id,
        "user": lease.user,
        "kernel_id": lease.kernel_id,
        "gpu_uuid": lease.gpu_uuid,
        "fraction_ppm": lease.fraction_ppm,
        "memory_limit_mb": lease.memory_limit_mb,
        "state": lease.state,
        "grp": lease.group,
        "created_at": lease.created_at,
        "renewed_at": lease.renewed_at,
        "expires_at": lease.expires_at,
        "ended_at": lease.ended_at,
        "reason": lease.reason,
        "pid": lease.pid,
        "execution_state": lease.execution_state,
        "last_activity": lease.last_activity,
        "user_groups": json.dumps(list(lease.groups)),
        "park_state": lease.park,
        "parked_at": lease.parked_at,
    }


def _lease_from_row(row: Sequence[Any]) -> Lease:
    *fields, user_groups, park_state, parked_at = row
    lease = Lease(*fields)
    if user_groups:  # NULL: granted before schema version 2
        lease.groups = tuple(json.loads(user_groups))
    lease.park = park_state
    lease.parked_at = parked_at
    return lease


def _park_params(lease: Lease) -> dict[str, Any]:
    """A park state change's bind parameters for ``_PARK``."""
    return {"b_id": lease.id, "b_park_state": lease.park, "b_parked_at": lease.parked_at}


def _request_from_row(row: Sequence[Any]) -> Request:
    (rid, user, kernel_id, ppm, arrived, polled, groups, grp, node, uuids, prio, resume_of) = row
    return Request(
        id=rid,
        user=user,
        kernel_id=kernel_id,
        fraction_ppm=ppm,
        arrived_at=arrived,
        last_polled_at=polled,
        groups=frozenset(json.loads(groups)),
        group=grp,
        node=node,
        gpu_uuids=None if uuids is None else tuple(json.loads(uuids)),
        priority=prio,
        resume_of=resume_of,
    )
