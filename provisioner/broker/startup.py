"""The steps of a broker's run, as plain functions of the option values.

:meth:`GPULeaseBroker.serve <provisioner.broker.app.GPULeaseBroker.serve>` calls them in
order with its traits' values (as jupyterhub-idle-culler's ``start`` passes its options
into plain functions): open the store, stand by until it leads (``--ha-lock``), listen
(here, or in the HTTP processes of ``--http-processes``: :func:`start_fronts`), run the
reaper and keep the leadership, and on SIGTERM/SIGINT :func:`shut_down`. An HTTP process
runs :func:`serve_front`. Each takes the logger to report to; none reads an option itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Union, cast

from tornado.httpserver import HTTPServer
from tornado.ioloop import PeriodicCallback
from tornado.netutil import bind_sockets
from tornado.web import Application as WebApplication

from ..errors import GPULeaseError, NotActive, StoreError
from ..listeners import account, listening_on
from ..model import GPU
from .fronts.processes import COOKIE_SECRET_ENV, Fronts
from .fronts.service_channel import RemoteMetrics, RemoteService
from .rules.policy import Policy
from .services.broker_service import BrokerService, ParkSettings
from .store.leadership import Leadership
from .store.store import Store
from .web.auth import Authenticator
from .web.handlers import DRAIN_LIMIT
from .web.metrics import BrokerMetrics
from .web.routes import make_app

if TYPE_CHECKING:
    from .courses import Courses

#: the logger a step reports to (the Application's)
Log = Union[logging.Logger, "logging.LoggerAdapter[Any]"]

#: the signals that stop the broker
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: seconds a shutdown waits for open connections to close
CLOSE_CONNECTIONS_TIMEOUT = 0.5
#: seconds a shutdown waits for waiting long-polls to answer 503
LONG_POLLS_TIMEOUT = 0.5
#: seconds an HTTP process (``--http-processes``) waits after SIGTERM for its broker's answers
FRONT_FINISH_TIMEOUT = 3.0


@contextlib.contextmanager
def stop_on_signals(
    stop: asyncio.Event, signals: tuple[signal.Signals, ...] = STOP_SIGNALS
) -> Iterator[None]:
    """Set ``stop`` on SIGTERM/SIGINT (``signals``) while the block runs (in the event loop).

    Only a broker on its process's main thread takes signals (Python runs signal handlers
    there); one embedded on another thread is stopped by setting ``stop``."""
    if not on_main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def collect_from_now_on() -> None:
    """Freeze what start-up built and turn the garbage collector (back) on.

    Everything loaded so far (the imports, the pool state) lives as long as the process:
    the collector need not scan it again, neither in every full collection nor in the
    interpreter's teardown after SIGTERM (~0.35 s of CPU without the freeze, ~0.03 s with
    it: seconds of exit on a loaded machine). ``main()`` and ``python -m`` keep the
    collector off while start-up builds it (a sixth of the start's CPU otherwise).
    """
    if not on_main_thread():  # embedded in another program: its collector is its own
        return
    gc.freeze()
    gc.enable()


def on_main_thread() -> bool:
    """Whether this runs on the process's main thread (``gpu-lease broker``, ``python -m``),
    not embedded on a thread of another program (the tests' in-process broker)."""
    return threading.current_thread() is threading.main_thread()


# -- start-up ----------------------------------------------------------------------------
def open_store(
    db_url: str,
    *,
    sqlite_synchronous: str,
    sqlite_busy_timeout: float,
    pg_timeout: float,
    ha_lock: bool,
    leadership_ttl: float,
) -> Store:
    """The store of ``db_url`` (not connected yet: ``service.start()`` opens it)."""
    if ha_lock:  # a paused broker's open transaction must end well within a TTL
        pg_timeout = min(pg_timeout, leadership_ttl / 2)
    return Store(
        db_url,
        sqlite_synchronous=sqlite_synchronous,
        sqlite_busy_timeout=sqlite_busy_timeout,
        pg_timeout=pg_timeout,
        application_name=f"gpu-lease broker {os.getpid()}",
    )


def build_service(
    store: Store,
    gpus: list[GPU],
    policy: Policy,
    *,
    metrics_per_user: bool,
    reap_interval: float,
    park: ParkSettings | None = None,
) -> tuple[BrokerService, BrokerMetrics]:
    """The service over ``store`` and ``gpus``, and the metrics that read it."""
    service: BrokerService | None = None
    metrics = BrokerMetrics(lambda: service, per_user=metrics_per_user)
    service = BrokerService(
        store, gpus, policy, metrics=metrics, reap_interval=reap_interval, park=park
    )
    return service, metrics


async def stand_by(store: Store, leadership_ttl: float, log: Log) -> Leadership | None:
    """``--ha-lock``: wait, listening on nothing, until this broker leads.

    Opens the store first (the leadership row is part of the schema). Returns the
    leadership (the store's fence is set), or None if SIGTERM/SIGINT came first or
    the database is not PostgreSQL (logged). Database errors are logged and retried:
    a standby outlives a database restart.
    """
    if not store.fencing.supported:
        log.critical(
            "--ha-lock needs a PostgreSQL database (--db-url postgresql://USER@HOST/DB); "
            "with SQLite run a single broker without --ha-lock."
        )
        return None
    leadership = Leadership(store, leadership_ttl)
    stop = asyncio.Event()
    with stop_on_signals(stop):
        said = ""
        while not stop.is_set():
            try:
                await asyncio.to_thread(store.open)
                break
            except StoreError as exc:
                if exc.message != said:
                    log.warning("standby: cannot open the database yet: %s", exc.message)
                    said = exc.message
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), leadership.poll)
        if stop.is_set() or not await leadership.wait_until_leader(stop):
            return None
    return leadership


# -- listening ---------------------------------------------------------------------------
def http_server(app: WebApplication) -> HTTPServer:
    """The broker's HTTP server for ``app``, in one process or in a front: behind a proxy
    (``X-Forwarded-For``, ``X-Forwarded-Proto``), bodies read up to ``DRAIN_LIMIT``."""
    return HTTPServer(app, xheaders=True, max_body_size=DRAIN_LIMIT)


def listening_sockets(port: int, ip: str, count: int) -> list[list[socket.socket]]:
    """``count`` listening sockets on ``ip:port``, one per HTTP process (``OSError``).

    Several share the port with ``SO_REUSEPORT`` (the kernel spreads new connections
    evenly; one shared socket would let the first process take them all). A bind without
    it first makes sure that no other process listens there, our own brokers included.
    """
    if count == 1:
        return [bind_sockets(port, address=ip)]
    probes = bind_sockets(port, address=ip)
    port = probes[0].getsockname()[1]  # the one port 0 chose
    for probe in probes:
        probe.close()
    return [bind_sockets(port, address=ip, reuse_port=True) for _ in range(count)]


def cannot_listen(ip: str, port: int, exc: OSError, log: Log) -> None:
    """Log why the broker cannot listen; for a busy port, whose listener holds it (a
    student's process on the broker's port would be sent every server's token, which
    ``BrokerClient`` now refuses, so the admin must free the port)."""
    advice = "Choose another address or port with --ip/--port."
    if exc.errno == errno.EADDRINUSE:
        holders = sorted({uid for _, uid in listening_on(port)})
        if holders:
            advice = (
                f"{', '.join(account(uid) for uid in holders)} listens on {ip}:{port}. "
                "If that is not another broker of yours, stop that process (ss -ltnp "
                f"'sport = :{port}' names it) and start the broker again: the servers send "
                "their tokens to no other account's listener, so no GPU kernel starts until "
                "the broker listens. Or choose another address or port with --ip/--port."
            )
    log.critical("Cannot listen on %s:%d (%s). %s", ip, port, exc.strerror or exc, advice)


def listen(app: WebApplication, ip: str, port: int, log: Log) -> HTTPServer | None:
    """An HTTP server listening on ``ip:port``; None (logged) if it cannot."""
    server = http_server(app)
    try:
        server.listen(port, address=ip)
    except OSError as exc:
        cannot_listen(ip, port, exc, log)
        return None
    return server


async def start_fronts(
    count: int,
    argv: list[str],
    ip: str,
    port: int,
    service: BrokerService,
    metrics: BrokerMetrics,
    authenticator: Authenticator,
    failed: Callable[[str], None],
    log: Log,
) -> Fronts | None:
    """``--http-processes N``: bind ``ip:port`` here, start the fronts (``fronts.py``)."""
    try:
        sockets = listening_sockets(port, ip, count)
    except OSError as exc:
        cannot_listen(ip, port, exc, log)
        return None
    fronts = Fronts(
        count,
        argv,
        sockets,
        service,
        metrics.render,
        browser_login=authenticator.browser_login,
        failed=failed,
    )
    await fronts.start()
    return fronts


# -- serving -----------------------------------------------------------------------------
def use_timetable(service: BrokerService, courses: Courses) -> None:
    """Hand the courses file's class sessions (checked) to the service."""
    service.sessions.use(
        tuple(courses.session_plans()),
        {name: frozenset(c.instructors) for name, c in courses.courses.items()},
        {
            name: c.quota.max_lease_fraction_ppm
            for name, c in courses.courses.items()
            if c.quota is not None and c.quota.max_lease_fraction_ppm
        },
    )


class CoursesWatch:
    """Reloads the courses file's class sessions when the file changes (its mtime), before
    a reaper pass: a file that is good replaces the timetable; one that cannot be read or
    is refused (``check_sessions``: more reserved than there is) is logged and the last
    good one kept. Quotas are still applied at start only."""

    def __init__(self, path: str, service: BrokerService, log: Log) -> None:
        self.path = path
        self.service = service
        self.log = log
        self.mtime = self._mtime()

    def _mtime(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return None

    async def check(self) -> bool:
        """Reload if the file changed; whether a new timetable is in use."""
        mtime = self._mtime()
        if mtime == self.mtime:
            return False
        self.mtime = mtime
        from .courses import check_sessions, load_courses

        core = self.service.core
        try:
            courses = load_courses(self.path)
            check_sessions(courses, core.pool() or None, core.policy, source=repr(self.path))
        except GPULeaseError as exc:
            self.log.error("Kept the last good courses file: %s", exc.message)
            return False
        use_timetable(self.service, courses)
        self.log.info("Reloaded the class sessions of %s", self.path)
        await core.grant_waiting()
        return True


def start_reaper(
    service: BrokerService, reap_interval: float, log: Log, watch: CoursesWatch | None = None
) -> PeriodicCallback:
    """Call ``service.reaper.tick()`` every ``reap_interval`` s (after ``watch``'s look at the
    courses file); a failed pass is logged and retried at the next one (a broker that is
    not serving skips its passes)."""

    async def reap() -> None:
        try:
            if watch is not None:
                await watch.check()
            await service.reaper.tick()
        except (StoreError, NotActive) as exc:
            log.warning("Reaper pass failed, will retry: %s", exc.message)
        except Exception:
            log.exception("Reaper pass failed unexpectedly")

    reaper = PeriodicCallback(reap, reap_interval * 1000.0)
    reaper.start()
    return reaper


async def shut_down(
    server: HTTPServer | Fronts,
    reaper: PeriodicCallback,
    service: BrokerService,
    log: Log,
    leadership: Leadership | None = None,
    keeper: asyncio.Task[None] | None = None,
) -> None:
    """Stop serving (waiting long-polls answer 503 first), the reaper and the server,
    close open connections, give the leadership up, close the store."""
    log.info("Shutting down")
    service.core.stop_serving("shutting down")
    await service.core.polls.answered(LONG_POLLS_TIMEOUT)
    await asyncio.sleep(0.01)  # their handlers write the 503s
    reaper.stop()
    if keeper is not None:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
    server.stop()
    if isinstance(server, Fronts):
        await server.close_all_connections()  # the fronts finish, or are killed
    else:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.close_all_connections(), CLOSE_CONNECTIONS_TIMEOUT)
    if leadership is not None and leadership.lost is None:
        leadership.release()
    try:
        service.close()
    except StoreError as exc:
        log.warning("%s", exc.message)


# -- an HTTP process of --http-processes ---------------------------------------------------
async def serve_front(
    service_socket: str,
    fds: list[int],
    authenticator: Authenticator,
    log: Log,
    *,
    base_url: str,
    max_body_bytes: int,
    metrics_require_auth: bool,
) -> int:
    """An HTTP process of ``--http-processes`` (``fronts.py`` starts it): the API on
    the inherited sockets ``fds``, the service over ``service_socket``; exits when
    its broker process is gone."""
    remote = RemoteService()
    try:
        await remote.connect(service_socket)
    except OSError as exc:
        log.critical("Cannot reach the broker process at %s: %s", service_socket, exc)
        return 1
    secret = os.environ.pop(COOKIE_SECRET_ENV, "")
    app = make_app(
        cast(BrokerService, remote),  # the service's API; handlers await every answer
        authenticator,
        RemoteMetrics(remote),
        base_url,
        max_body_bytes=max_body_bytes,
        metrics_require_auth=metrics_require_auth,
        **({"cookie_secret": bytes.fromhex(secret)} if secret else {}),
    )
    server = http_server(app)
    server.add_sockets([socket.socket(fileno=fd) for fd in fds])
    collect_from_now_on()
    # Ctrl-C reaches the whole process group: the broker process stops its fronts
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = asyncio.Event()
    with stop_on_signals(stop, (signal.SIGTERM,)):
        _, pending = await asyncio.wait(
            [asyncio.create_task(stop.wait()), asyncio.create_task(remote.lost.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        for task in pending:
            task.cancel()
    server.stop()
    lost = remote.lost.is_set()
    if lost:  # what waited for it answers 503 now
        log.warning("The broker process is gone; this HTTP process exits")
    else:
        await remote.idle(FRONT_FINISH_TIMEOUT)  # answers under way (long-polls: 503)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(server.close_all_connections(), CLOSE_CONNECTIONS_TIMEOUT)
    remote.close()
    return 1 if lost else 0
