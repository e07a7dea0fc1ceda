"""The store's connections: the engine (SQLite or PostgreSQL), its settings, one
transaction at a time, the schema upgrade at open, SQLite's checkpoints off the loop.

:class:`Database` is the base of :class:`~provisioner.broker.store.store.Store`; every error of the
driver becomes :class:`~provisioner.errors.StoreError` here (``_tx``).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import StaticPool

from ...errors import (
    StoreError,
)
from .fencing import Fencing
from .migrate import upgrade_schema

SQLITE_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")
#: the store's defaults (the broker's traits of the same names start from these)
DEFAULT_SQLITE_SYNCHRONOUS = "NORMAL"
DEFAULT_SQLITE_BUSY_TIMEOUT = 5.0
DEFAULT_PG_TIMEOUT = 5.0
#: seconds between two WAL checkpoints of a SQLite file, made by a thread of the store's
#: own (0: SQLite's automatic checkpoints, inside whichever commit crosses 1,000 pages)
DEFAULT_SQLITE_CHECKPOINT_INTERVAL = 0.5


log = logging.getLogger("gpu_lease.store")


class _Checkpointer:
    """Copies a SQLite file's write-ahead log into the database every ``interval`` seconds,
    on a connection and a thread of its own (``PRAGMA wal_checkpoint(PASSIVE)``).

    SQLite otherwise checkpoints inside the commit that crosses 1,000 WAL pages: that
    commit then writes those pages and fsyncs the file (about 4 ms here, every 40 or so
    acquire+release pairs), and the broker's event loop, which runs the commit, answers
    nothing meanwhile. A PASSIVE checkpoint never blocks writers or readers; the thread
    releases the GIL while SQLite works. Durability is unchanged (WAL with the broker's
    ``synchronous``): a checkpoint only moves committed pages.
    """

    def __init__(self, path: str, interval: float) -> None:
        self.path, self.interval = path, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-lease-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        failing = False
        try:
            while True:
                stopping = self._stop.wait(self.interval)
                try:  # auto-checkpoints are off: keep trying, or the log only grows
                    if conn is None:
                        conn = sqlite3.connect(self.path, timeout=1.0, check_same_thread=False)
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    failing = False
                except sqlite3.Error as exc:
                    if not failing:  # once per run of failures
                        log.warning("WAL checkpoint of %s failed (retrying): %s", self.path, exc)
                    failing = True
                    if conn is not None:
                        conn.close()
                        conn = None
                if stopping:  # that was the last one, at close
                    return
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


class Database:
    """The lease database. Created by the broker at start; every method is one transaction.

    ``url`` is a SQLAlchemy URL (``sqlite:///gpu-lease.sqlite``,
    ``postgresql://user@host/db``). The engine is built here but nothing connects
    until :meth:`open`. Methods are synchronous and thread-safe (a connection pool).

    PostgreSQL connections are bounded by ``pg_timeout`` seconds: the connect timeout,
    ``statement_timeout``, ``idle_in_transaction_session_timeout`` (a paused broker's
    open transaction, and its locks, end after it), TCP keepalives that notice a dead
    server within about that time, and ``tcp_user_timeout`` (a write into a cut network
    fails after it). Settings given in the URL's query win. ``application_name`` names
    the sessions in ``pg_stat_activity``.
    """

    def __init__(
        self,
        url: str,
        *,
        sqlite_synchronous: str = DEFAULT_SQLITE_SYNCHRONOUS,
        sqlite_busy_timeout: float = DEFAULT_SQLITE_BUSY_TIMEOUT,
        pg_timeout: float = DEFAULT_PG_TIMEOUT,
        application_name: str = "gpu-lease",
        echo: bool = False,
        sqlite_checkpoint_interval: float = DEFAULT_SQLITE_CHECKPOINT_INTERVAL,
    ) -> None:
        sync = sqlite_synchronous.upper()
        if sync not in SQLITE_SYNCHRONOUS:
            raise StoreError(
                f"sqlite_synchronous must be one of {', '.join(SQLITE_SYNCHRONOUS)}, "
                f"not {sqlite_synchronous!r}; fix the broker's configuration."
            )
        if not 0 <= sqlite_busy_timeout < 86400:
            raise StoreError(
                f"sqlite_busy_timeout must be 0 or more seconds (below a day), not "
                f"{sqlite_busy_timeout!r}; fix the broker's configuration."
            )
        if not 0.1 <= pg_timeout < 86400:
            raise StoreError(
                f"pg_timeout must be at least 0.1 seconds (below a day), not {pg_timeout!r}; "
                "fix the broker's configuration."
            )
        try:
            self._url = sa.make_url(url)
        except SQLAlchemyError as exc:
            # not echoed: an unparseable URL may still hold a password
            raise StoreError(
                "The database URL cannot be parsed; give it as sqlite:///FILE or "
                "postgresql://USER@HOST/DB."
            ) from exc
        try:
            if self._url.drivername == "postgresql":
                # SQLAlchemy 2.1 defaults to psycopg 3; the project depends on psycopg2
                self._url = self._url.set(drivername="postgresql+psycopg2")
            self._is_sqlite = self._url.get_backend_name() == "sqlite"
            kwargs: dict[str, Any] = {"echo": echo}
            if self._is_sqlite:
                kwargs["connect_args"] = {"check_same_thread": False}
                if self._url.database in (None, "", ":memory:"):
                    kwargs["poolclass"] = StaticPool  # one shared in-memory database
            else:
                kwargs["pool_pre_ping"] = True
                # a group commit's UPDATEs and DELETEs of many rows: a few round trips, not
                # one per row (psycopg2's executemany loops; INSERTs are batched anyway)
                kwargs["executemany_mode"] = "values_plus_batch"
                kwargs["connect_args"] = self._pg_connect_args(pg_timeout, application_name)
            self._engine: Engine = sa.create_engine(self._url, **kwargs)
        except (SQLAlchemyError, ImportError) as exc:
            raise StoreError(
                f"Cannot use the database URL {self.url_for_logs!r}: {exc}. "
                "Give it as sqlite:///FILE or postgresql://USER@HOST/DB."
            ) from exc
        self._dbapi_error: type[Exception] = getattr(
            self._engine.dialect.loaded_dbapi, "Error", SQLAlchemyError
        )
        self._opened = False
        #: the leadership row and the fence on writes (``store_fencing.py``)
        self.fencing = Fencing(self._tx, self._url.get_backend_name() == "postgresql")
        #: a SQLite file's background WAL checkpoints (while the store is open)
        self._checkpoints: tuple[str, float] | None = None
        self._checkpointer: _Checkpointer | None = None
        file = self._url.database if self._is_sqlite else None
        if file not in (None, "", ":memory:") and sqlite_checkpoint_interval > 0:
            self._checkpoints = (str(file), sqlite_checkpoint_interval)
        if self._is_sqlite:
            self._install_sqlite_hooks(sync, int(sqlite_busy_timeout * 1000))
        else:
            self._install_pg_hooks(pg_timeout)

    def _pg_connect_args(self, timeout: float, application_name: str) -> dict[str, Any]:
        """libpq connection parameters bounding every wait on the server (URL query wins)."""
        wanted: dict[str, Any] = {
            "connect_timeout": max(2, math.ceil(timeout)),  # libpq: whole seconds, >= 2
            "keepalives": 1,
            "keepalives_idle": max(1, int(timeout / 2)),
            "keepalives_interval": 1,
            "keepalives_count": 3,
            "tcp_user_timeout": int(timeout * 1000),
            "application_name": application_name,
        }
        return {k: v for k, v in wanted.items() if k not in self._url.query}

    def _install_pg_hooks(self, timeout: float) -> None:
        ms = int(timeout * 1000)

        @event.listens_for(self._engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            autocommit = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"SET statement_timeout = {ms}")
                cur.execute(f"SET idle_in_transaction_session_timeout = {ms}")
            finally:
                cur.close()
                dbapi_conn.autocommit = autocommit

    def _install_sqlite_hooks(self, synchronous: str, busy_timeout_ms: int) -> None:
        # pysqlite's own transaction control neither emits BEGIN for reads nor lets us
        # choose BEGIN IMMEDIATE; take it over as SQLAlchemy's SQLite docs describe.
        @event.listens_for(self._engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
                cur.execute("PRAGMA journal_mode = WAL")
                cur.execute(f"PRAGMA synchronous = {synchronous}")
                if self._checkpointer is not None:  # its thread checkpoints, off the loop
                    cur.execute("PRAGMA wal_autocheckpoint = 0")
            finally:
                cur.close()

        @event.listens_for(self._engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # writes take the database write lock up front, so that the checks they
            # make before writing still hold when they write
            write = conn.get_execution_options().get("gpu_lease_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    @property
    def url_for_logs(self) -> str:
        """The database URL with any password masked."""
        return self._url.render_as_string(hide_password=True)

    @contextmanager
    def _tx(self, what: str, *, write: bool = True, fenced: bool = True) -> Iterator[Connection]:
        """One transaction; foreign errors become :class:`StoreError` naming ``what``.

        A write transaction (unless ``fenced=False``) first passes the fence, if one is
        set: :class:`NotActive` when this broker may not write any more.
        """
        try:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(gpu_lease_write=True)
                with conn.begin():
                    fence = self.fencing.fence
                    if write and fenced and fence is not None:
                        self.fencing.check(conn, fence)
                    yield conn
        except (SQLAlchemyError, self._dbapi_error) as exc:
            raise StoreError(
                f"The lease database at {self.url_for_logs} failed while trying to {what} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "nothing was changed. Check that the database is reachable and writable, then retry."
            ) from exc

    def open(self) -> None:
        """Connect and bring the schema up to date. Called once at broker start; idempotent."""
        if self._opened:
            return
        self._create_private_file()
        self.upgrade()
        if self._checkpoints is not None:
            # connections made from now on leave checkpoints to it (upgrade's kept SQLite's)
            self._engine.dispose()
            self._checkpointer = _Checkpointer(*self._checkpoints)
            self._checkpointer.start()
        self._opened = True

    def _create_private_file(self) -> None:
        """A new SQLite file is made here, mode 0600 whatever the umask (its journal and
        WAL files take the database's mode): leases, users and tokens' names are the
        broker's alone. An existing file keeps the mode its admin gave it."""
        file = self._url.database if self._is_sqlite else None
        if file in (None, "", ":memory:") or str(file).startswith("file:"):
            return
        try:
            os.close(os.open(str(file), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:  # there already, or no such directory: opening it says why, as before
            pass

    def close(self) -> None:
        """Close every pooled connection. Called at broker shutdown."""
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.stop()
        try:
            self._engine.dispose()
        except (SQLAlchemyError, self._dbapi_error) as exc:
            raise StoreError(f"Closing the lease database failed: {exc}") from exc
        self._opened = False

    def upgrade(self, version_locations: Sequence[str | Path] = ()) -> str:
        """Bring the schema to Alembic's head in one transaction (``migrate.py``); returns
        the revision now. ``version_locations``: directories of revisions besides ours."""
        with self._tx("open it and bring its schema up to date") as conn:
            return upgrade_schema(conn, version_locations)


__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "DEFAULT_SQLITE_BUSY_TIMEOUT",
    "DEFAULT_SQLITE_CHECKPOINT_INTERVAL",
    "DEFAULT_SQLITE_SYNCHRONOUS",
    "SQLITE_SYNCHRONOUS",
    "Database",
]
