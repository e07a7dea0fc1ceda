"""Fenced leadership (PostgreSQL, ``--ha-lock``): the SQL of the leadership row and of the
fence on every write, as ``store.fencing`` (``broker/store/leadership.py`` keeps the time).

The one ``leadership`` row names the
active broker (``holder``), its ``epoch`` (raised by every takeover) and when its
leadership ends (``expires_at``, by the database's clock, ``now()``). A standby takes
the row only when it is free or expired (:meth:`Fencing.take`), the active
extends it while the row still names it (:meth:`Fencing.renew`), and once
:meth:`Fencing.set` is called every write transaction first locks the row
``FOR SHARE`` and checks holder, epoch and expiry: a deposed broker can never commit
(:class:`~provisioner.errors.NotActive`, nothing written), and a takeover waits until
the writes in flight have committed. The fence also stamps the transaction with its
epoch (``current_setting('gpu_lease.epoch')``) for audit triggers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...errors import (
    NotActive,
    StoreError,
)

# leadership (PostgreSQL): every time by the database's clock
_DB_NOW = "CAST(EXTRACT(EPOCH FROM now()) AS DOUBLE PRECISION)"
_TAKE_LEADERSHIP = sa.text(
    f"UPDATE leadership SET holder = :holder, epoch = epoch + 1, acquired_at = {_DB_NOW}, "
    f"renewed_at = {_DB_NOW}, expires_at = {_DB_NOW} + :ttl "
    f"WHERE id = 1 AND (holder IS NULL OR expires_at <= {_DB_NOW}) RETURNING epoch"
)
_LEADER = sa.text(
    f"SELECT holder, epoch, expires_at - {_DB_NOW} AS remaining FROM leadership WHERE id = 1"
)
_RENEW_LEADERSHIP = sa.text(
    f"UPDATE leadership SET renewed_at = {_DB_NOW}, expires_at = {_DB_NOW} + :ttl "
    "WHERE id = 1 AND holder = :holder AND epoch = :epoch"
)
_RELEASE_LEADERSHIP = sa.text(
    f"UPDATE leadership SET holder = NULL, expires_at = {_DB_NOW} "
    "WHERE id = 1 AND holder = :holder AND epoch = :epoch"
)
# the fence: first statement of every write transaction of an active broker
_FENCE = sa.text(
    f"SELECT holder, epoch, expires_at > {_DB_NOW} AS live, "
    "set_config('gpu_lease.epoch', CAST(epoch AS TEXT), true) AS epoch_set "
    "FROM leadership WHERE id = 1 FOR SHARE"
)


@dataclass(frozen=True)
class Fence:
    """Who may write: the leadership's ``holder`` and ``epoch`` (see :meth:`Fencing.set`)."""

    holder: str
    epoch: int


#: ``on_refused(why, deposed)``: the fence refused a write; ``deposed`` when another
#: broker holds the leadership now (for good), else it merely expired (renewable)
FenceRefused = Callable[[str, bool], None]

#: PostgreSQL's SQLSTATE for a lock wait cut by ``lock_timeout``
_LOCK_NOT_AVAILABLE = "55P03"


class Fencing:
    """The leadership row of active/standby brokers (PostgreSQL, ``--ha-lock``), and the
    fence every write transaction of the store passes once :meth:`set` (``store.fencing``).

    ``tx`` is the store's transaction factory; ``supported``: whether the database is
    PostgreSQL.
    """

    def __init__(
        self, tx: Callable[..., AbstractContextManager[Connection]], supported: bool
    ) -> None:
        self._tx = tx
        self._supported = supported
        #: who may write (``None``: every write may)
        self.fence: Fence | None = None
        self._on_refused: FenceRefused | None = None

    @property
    def supported(self) -> bool:
        """Whether leadership (``--ha-lock``) works here: PostgreSQL only."""
        return self._supported

    def _require_pg(self) -> None:
        if not self.supported:
            raise StoreError(
                "Broker leadership needs a PostgreSQL database (postgresql://USER@HOST/DB); "
                "with SQLite run one broker only."
            )

    def take(
        self, holder: str, ttl: float, *, lock_wait: float = 0.5
    ) -> tuple[int | None, str | None, float]:
        """Try once to become the active broker for ``ttl`` seconds (database clock).

        Called by a standby (``broker/store/leadership.py``) until it succeeds. The row is taken
        only when it is free or its leadership has expired; the epoch goes up by one.
        Returns ``(epoch or None, the holder now, seconds until its leadership expires)``.
        A takeover waits at most ``lock_wait`` s for write transactions in flight (their
        fence holds the row ``FOR SHARE``); then it is "not yet", not an error.
        """
        self._require_pg()
        try:
            with self._tx("take the broker leadership", fenced=False) as conn:
                conn.execute(sa.text(f"SET LOCAL lock_timeout = {max(1, int(lock_wait * 1000))}"))
                epoch = conn.execute(_TAKE_LEADERSHIP, {"holder": holder, "ttl": ttl}).scalar()
                now = conn.execute(_LEADER).one()
        except StoreError as exc:
            if getattr(getattr(exc.__cause__, "orig", None), "pgcode", "") == _LOCK_NOT_AVAILABLE:
                return None, None, lock_wait  # a write in flight: try again soon
            raise
        return (None if epoch is None else int(epoch)), now.holder, max(0.0, float(now.remaining))

    def renew(self, holder: str, epoch: int, ttl: float) -> bool:
        """Extend this broker's leadership to ``ttl`` s from now (database clock).

        Called by the active broker every ``ttl / 3`` seconds. False when the row no
        longer names ``holder`` with ``epoch``: another broker took over (for good).
        Renewing after an expiry nobody used is allowed: no other broker has written.
        """
        self._require_pg()
        params = {"holder": holder, "epoch": epoch, "ttl": ttl}
        with self._tx("renew the broker leadership", fenced=False) as conn:
            return bool(conn.execute(_RENEW_LEADERSHIP, params).rowcount)

    def release(self, holder: str, epoch: int) -> None:
        """Give the leadership up now (clean shutdown): a standby takes it at once."""
        self._require_pg()
        params = {"holder": holder, "epoch": epoch}
        with self._tx("give up the broker leadership", fenced=False) as conn:
            conn.execute(_RELEASE_LEADERSHIP, params)

    def read(self) -> tuple[str | None, int, float]:
        """``(holder, epoch, seconds until it expires)`` as the database has it now."""
        self._require_pg()
        with self._tx("read the broker leadership", write=False) as conn:
            row = conn.execute(_LEADER).one()
        return row.holder, int(row.epoch), float(row.remaining)

    def set(self, fence: Fence | None, on_refused: FenceRefused | None = None) -> None:
        """From now on every write transaction checks ``fence`` first (``None``: stop).

        Called by the broker right after it took the leadership, before it loads or
        writes anything. ``on_refused(why, deposed)`` is told about every refusal.
        """
        if fence is not None:
            self._require_pg()
        self.fence, self._on_refused = fence, on_refused

    def check(self, conn: Connection, fence: Fence) -> None:
        """(in a write transaction) :class:`NotActive` unless ``fence`` still holds."""
        row = conn.execute(_FENCE).first()
        if row is None or row.holder != fence.holder or int(row.epoch) != fence.epoch:
            who = "nobody" if row is None or row.holder is None else "another broker"
            why = f"{who} holds the leadership now (this broker had epoch {fence.epoch})"
            deposed = True
        elif not row.live:
            why = "its leadership expired before it could renew it"
            deposed = False
        else:
            return
        if self._on_refused is not None:
            self._on_refused(why, deposed)
        raise NotActive(
            f"This broker is not the active one now: {why}. Nothing was changed; "
            "retry, and the active broker will answer."
        )


__all__ = ["Fence", "FenceRefused", "Fencing"]
