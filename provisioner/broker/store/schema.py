"""The lease database's schema: the tables at Alembic's head, and the statements and row
conversions the store runs (``store.py``, ``engine.py``, ``writes.py``).

These tables are what the revisions in ``migrations/versions/`` build (a test compares
them with a migrated database); changing one needs a revision. The tables and what each
column holds: see ``store.py``'s docstring. Rows become objects by column name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Row

from ...model import (
    PPM,
    Lease,
    QueueRecord,
    Quota,
    Request,
)

# --------------------------------------------------------------------------- schema

metadata = sa.MetaData()

#: the schema versions before Alembic, 1 to 7 (``legacy.py``); no new rows
schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.String(255), nullable=False),
    sa.Column("applied_at", sa.Double, nullable=False),
)

gpus = sa.Table(
    "gpus",
    metadata,
    sa.Column("uuid", sa.String(128), primary_key=True),
    sa.Column("node", sa.String(255), nullable=False),
    sa.Column("name", sa.String(255), nullable=False),
    sa.Column("memory_mb", sa.BigInteger, nullable=False),
    sa.Column("idx", sa.Integer, nullable=False),
    sa.Column("capacity_ppm", sa.BigInteger, nullable=False),
)

leases = sa.Table(
    "leases",
    metadata,
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
    # the user's groups (courses) when the lease was granted, a JSON list (NULL: granted
    # before schema version 2); ``usage --by group`` attributes leases by them
    sa.Column("user_groups", sa.Text, nullable=True),
    # parking: NULL | 'parking' | 'parked' | 'resuming' (``state`` stays 'active'), and
    # when parking began; a parked lease holds no capacity (every capacity sum skips it)
    sa.Column("park_state", sa.String(16), nullable=True),
    # (added as DOUBLE PRECISION by ALTER TABLE, which SQLite reads back as REAL)
    sa.Column("parked_at", sa.Double().with_variant(sa.REAL(), "sqlite"), nullable=True),
    sa.CheckConstraint(
        "state IN ('active', 'revoked', 'released', 'expired')", name="ck_leases_state"
    ),
    sa.CheckConstraint("fraction_ppm > 0", name="ck_leases_fraction"),
    sa.CheckConstraint("state = 'active' OR ended_at IS NOT NULL", name="ck_leases_ended"),
)
sa.Index("ix_leases_state", leases.c.state)
sa.Index("ix_leases_user", leases.c.user)
sa.Index("ix_leases_ended", leases.c.ended_at)
_ACTIVE_ONLY = sa.text("state = 'active'")
#: the partial indexes on active leases. Their ``postgresql_where`` is added by
#: :func:`complete_metadata`, not here: naming it imports SQLAlchemy's PostgreSQL dialect
#: (a tenth of a second or more of every broker's start, on SQLite too)
_PARTIAL_INDEXES = (
    sa.Index("ix_leases_active_gpu", leases.c.gpu_uuid, sqlite_where=_ACTIVE_ONLY),
    sa.Index(
        "uq_leases_active_kernel",
        leases.c.user,
        leases.c.kernel_id,
        unique=True,
        sqlite_where=_ACTIVE_ONLY,
    ),
)

requests = sa.Table(
    "requests",
    metadata,
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
    # a queued resume request names its parked lease
    sa.Column("resume_of", sa.String(64), nullable=True),
    sa.UniqueConstraint("user", "kernel_id", name="uq_requests_kernel"),
)

quotas = sa.Table(
    "quotas",
    metadata,
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
_gpu_table = gpus  # for methods whose parameter is named ``gpus``

# every request's stay in the queue, for the history of queue length and waits
# (``requests`` holds only those waiting now)
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
    sa.CheckConstraint(
        "outcome IS NULL OR outcome IN ('granted', 'cancelled', 'dropped')",
        name="ck_queue_log_outcome",
    ),
)
sa.Index("ix_queue_log_arrived", queue_log.c.arrived_at)

# the nodes node agents registered
nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("gpus", sa.Text, nullable=False),  # JSON [{uuid, name, memory_mb, index}]
    sa.Column("agent_version", sa.String(64), nullable=False),
    sa.Column("registered_at", sa.Double, nullable=False),
    sa.Column("drained", sa.Boolean, nullable=False),
    # the agent's --enforce mode (NULL: registered before schema version 5: 'report')
    sa.Column("enforce", sa.String(8), nullable=True),
)

# fenced leadership of active/standby brokers (one row, see ``fencing.py``)
leadership = sa.Table(
    "leadership",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("holder", sa.String(255), nullable=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("acquired_at", sa.Double, nullable=True),
    sa.Column("renewed_at", sa.Double, nullable=True),
    sa.Column("expires_at", sa.Double, nullable=False),
    sa.CheckConstraint("id = 1", name="ck_leadership_one_row"),
)


def complete_metadata() -> sa.MetaData:
    """:data:`metadata` with the partial indexes' PostgreSQL condition too: for Alembic
    (``migrations/env.py``, the schema tests), which loads that dialect anyway."""
    for index in _PARTIAL_INDEXES:
        index.dialect_kwargs["postgresql_where"] = _ACTIVE_ONLY
    return metadata


# --------------------------------------------------------------------------- rows
# A row becomes an object by its columns' names (``row._mapping``), never by position.

#: each ``leases`` column and the :class:`Lease` field it stores, but ``user_groups``
#: (``Lease.groups`` as JSON: see _lease_row); ``Lease.mps_uid`` is not stored
_LEASE_FIELD_OF: Mapping[str, str] = {
    "id": "id",
    "user": "user",
    "kernel_id": "kernel_id",
    "gpu_uuid": "gpu_uuid",
    "fraction_ppm": "fraction_ppm",
    "memory_limit_mb": "memory_limit_mb",
    "state": "state",
    "grp": "group",
    "created_at": "created_at",
    "renewed_at": "renewed_at",
    "expires_at": "expires_at",
    "ended_at": "ended_at",
    "reason": "reason",
    "pid": "pid",
    "execution_state": "execution_state",
    "last_activity": "last_activity",
    "park_state": "park",
    "parked_at": "parked_at",
}
#: each ``requests`` column and the :class:`Request` field it stores, but ``groups`` and
#: ``gpu_uuids`` (JSON: see _request_row)
_REQUEST_FIELD_OF: Mapping[str, str] = {
    "id": "id",
    "user": "user",
    "kernel_id": "kernel_id",
    "fraction_ppm": "fraction_ppm",
    "grp": "group",
    "node": "node",
    "priority": "priority",
    "arrived_at": "arrived_at",
    "last_polled_at": "last_polled_at",
    "resume_of": "resume_of",
}
#: each ``queue_log`` column and the :class:`QueueRecord` field it stores, but
#: ``user_groups`` (``QueueRecord.groups`` as JSON)
_QUEUE_RECORD_FIELD_OF: Mapping[str, str] = {
    "id": "id",
    "user": "user",
    "kernel_id": "kernel_id",
    "fraction_ppm": "fraction_ppm",
    "arrived_at": "arrived_at",
    "grp": "group",
    "left_at": "left_at",
    "outcome": "outcome",
}


def _lease_row(lease: Lease) -> dict[str, Any]:
    row = {col: getattr(lease, field) for col, field in _LEASE_FIELD_OF.items()}
    row["user_groups"] = json.dumps(list(lease.groups))
    return row


def _lease_from_row(row: Row[Any]) -> Lease:
    m = row._mapping
    user_groups = m["user_groups"]  # NULL: granted before schema version 2
    return Lease(
        **{field: m[col] for col, field in _LEASE_FIELD_OF.items()},
        groups=tuple(json.loads(user_groups)) if user_groups else (),
    )


def _request_row(req: Request) -> dict[str, Any]:
    row = {col: getattr(req, field) for col, field in _REQUEST_FIELD_OF.items()}
    row["groups"] = json.dumps(sorted(req.groups))
    row["gpu_uuids"] = None if req.gpu_uuids is None else json.dumps(list(req.gpu_uuids))
    return row


def _request_from_row(row: Row[Any]) -> Request:
    m = row._mapping
    uuids = m["gpu_uuids"]
    return Request(
        **{field: m[col] for col, field in _REQUEST_FIELD_OF.items()},
        groups=frozenset(json.loads(m["groups"])),
        gpu_uuids=None if uuids is None else tuple(json.loads(uuids)),
    )


def _queue_log_row(req: Request) -> dict[str, Any]:
    """The queue log's row of a request that joined the queue (it has not left yet)."""
    row = _request_row(req)
    logged = {k: row[k] for k in ("id", "user", "kernel_id", "fraction_ppm", "grp", "arrived_at")}
    return {**logged, "user_groups": row["groups"]}


def _queue_record_from_row(row: Row[Any]) -> QueueRecord:
    m = row._mapping
    return QueueRecord(
        **{field: m[col] for col, field in _QUEUE_RECORD_FIELD_OF.items()},
        groups=tuple(json.loads(m["user_groups"])),
    )


def _quota_from_row(row: Row[Any]) -> Quota:
    m = row._mapping
    return Quota(**{field: m[field] for field in Quota.FIELDS})


def _park_params(lease: Lease) -> dict[str, Any]:
    """A park state change's bind parameters for ``_PARK``."""
    return {"b_id": lease.id, "b_park_state": lease.park, "b_parked_at": lease.parked_at}


# --------------------------------------------------------------------------- statements
# Built once; SQLAlchemy caches their compiled form per dialect.

_SELECT_LEASES = sa.select(leases)
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
_SELECT_REQUESTS = sa.select(requests).order_by(requests.c.arrived_at, requests.c.id)
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
