"""``gpu-lease broker``: the broker as a traitlets Application.

Every option is a trait (``c.GPULeaseBroker.<name>`` in a config file given with
``--config FILE``, or on the command line; ``--generate-config`` prints them all);
:meth:`GPULeaseBroker.serve` passes the values into plain objects — ``Store``,
``inventory.load_gpus``, ``Policy``, the authenticator, ``BrokerService``,
``BrokerMetrics`` and :func:`routes.make_app` — so tests and benchmarks build the same
pieces without the Application. A default lives in one place: the policy knobs' in
:class:`~provisioner.scheduling.Policy` (the pure core, which the simulator also runs
with), the others in the trait or in the constant of the module that uses it.

Start-up, one method each: load the GPUs (exit 2 with the inventory's message if
there are none), build the authenticator (exit 2 on a bad tokens file), open the
store, stand by until it leads (``--ha-lock``: :mod:`.leadership`), rebuild the state
(``service.start()``, exit 1 if the database fails), listen (exit 2 if the address is
taken), run the reaper (``service.leases.tick()`` every ``reap_interval`` s) and, with
``--ha-lock``, keep the leadership renewed. SIGTERM/SIGINT stop serving (a waiting
long-poll answers 503), stop listening, give the leadership up, close the store and
return (exit 0) within a second. A broker that loses its leadership stops serving at
once and exits 1.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # ``python -m provisioner.broker.app``: no collections while start-up imports and builds
    # ~90,000 objects that live as long as the process (about a sixth of the start's CPU);
    # serve() freezes them and turns the collector back on once the broker listens.
    gc.disable()

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast
from urllib.parse import urlsplit

from tornado.httpserver import HTTPServer
from tornado.ioloop import PeriodicCallback
from tornado.netutil import bind_sockets
from tornado.web import Application as WebApplication
from traitlets import Bool, CaselessStrEnum, Float, Integer, Type, Unicode, default, validate
from traitlets.config import Application, catch_config_error

from .._version import __version__
from ..errors import GPULeaseError, NotActive, StoreError
from ..inventory import load_gpus
from ..model import GPU, fraction_to_ppm, ppm_to_fraction
from ..policy import Policy
from ..store import (
    DEFAULT_PG_TIMEOUT,
    DEFAULT_SQLITE_BUSY_TIMEOUT,
    DEFAULT_SQLITE_SYNCHRONOUS,
    SQLITE_SYNCHRONOUS,
    Store,
)
from .auth import AUTHENTICATORS, HUB_CACHE_MAX_AGE, Authenticator
from .fronts import COOKIE_SECRET_ENV, FRONT_ENV, Fronts
from .handlers import DRAIN_LIMIT, MAX_BODY_BYTES, normalize_base_url
from .leadership import Leadership
from .metrics import BrokerMetrics
from .remote import RemoteMetrics, RemoteService
from .routes import make_app
from .service import REAP_INTERVAL, BrokerService

log = logging.getLogger("gpu_lease.broker.app")

LOG_FORMAT = "[%(levelname).1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
#: where the broker listens unless JUPYTERHUB_SERVICE_URL (or --ip/--port) says otherwise
DEFAULT_IP = "127.0.0.1"
DEFAULT_PORT = 10101
#: the signals that stop the broker
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: seconds a shutdown waits for open connections to close
CLOSE_CONNECTIONS_TIMEOUT = 0.5
#: seconds a shutdown waits for waiting long-polls to answer 503
LONG_POLLS_TIMEOUT = 0.5
#: seconds an HTTP process (``--http-processes``) waits after SIGTERM for its broker's answers
FRONT_FINISH_TIMEOUT = 3.0


def _service_url() -> Any:
    """``JUPYTERHUB_SERVICE_URL`` (set by the hub for a managed service) parsed, or None."""
    url = os.environ.get("JUPYTERHUB_SERVICE_URL")
    if not url:
        return None
    try:
        return urlsplit(url)
    except ValueError:
        return None


class OptionalType(Type):
    """A class trait whose default may be None (traitlets' ``Type`` cannot print that)."""

    def default_value_repr(self) -> str:
        return "None" if self.default_value is None else str(super().default_value_repr())


@contextlib.contextmanager
def stop_on_signals(
    stop: asyncio.Event, signals: tuple[signal.Signals, ...] = STOP_SIGNALS
) -> Iterator[None]:
    """Set ``stop`` on SIGTERM/SIGINT (``signals``) while the block runs (in the event loop)."""
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


class GPULeaseBroker(Application):
    """The GPU lease broker: REST API v1 over a persisted pool of fractional GPU leases."""

    name = "gpu-lease-broker"
    version = __version__
    description = (
        "Fractional GPU leases for Jupyter kernels: the broker service. "
        "Run it as a JupyterHub-managed service (--auth hub) or on its own with a "
        "tokens file (--auth static --tokens-file FILE)."
    )
    examples = """
    gpu-lease broker --gpus 1x32768:V100 --auth static --tokens-file tokens.json
    gpu-lease broker --db-url postgresql://gpulease@db/gpulease --port 10101
    gpu-lease broker --config /etc/gpu-lease/broker_config.py
    gpu-lease broker --generate-config > broker_config.py
    """

    aliases = {
        "ip": "GPULeaseBroker.ip",
        "port": "GPULeaseBroker.port",
        "db-url": "GPULeaseBroker.db_url",
        "gpus": "GPULeaseBroker.gpus",
        "auth": "GPULeaseBroker.auth",
        "tokens-file": "GPULeaseBroker.tokens_file",
        "config": "GPULeaseBroker.config_file",
        "base-url": "GPULeaseBroker.base_url",
        "ttl": "GPULeaseBroker.ttl",
        "quotas-file": "GPULeaseBroker.quotas_file",
        "sqlite-busy-timeout": "GPULeaseBroker.sqlite_busy_timeout",
        "leadership-ttl": "GPULeaseBroker.leadership_ttl",
        "pg-timeout": "GPULeaseBroker.pg_timeout",
        "log-level": "Application.log_level",
        "http-processes": "GPULeaseBroker.http_processes",
    }
    flags = {
        "debug": (
            {"Application": {"log_level": logging.DEBUG}},
            "Log everything, including every HTTP request.",
        ),
        "metrics-require-auth": (
            {"GPULeaseBroker": {"metrics_require_auth": True}},
            "Answer GET /metrics only with a valid token.",
        ),
        "ha-lock": (
            {"GPULeaseBroker": {"ha_lock": True}},
            "Active/standby on PostgreSQL: serve only while holding the fenced leadership.",
        ),
        "generate-config": (
            {"GPULeaseBroker": {"generate_config": True}},
            "Print a config file with every option, its help and its default, and exit.",
        ),
    }

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

    generate_config = Bool(
        False,
        help="Print a config file (broker_config.py) with every option, its help and its "
        "default to standard output, and exit. Default: False.",
    ).tag(config=True)

    config_file = Unicode(
        "",
        help="A traitlets config file (.py or .json) to load, e.g. broker_config.py. "
        "Command-line options win over it. Default: none.",
    ).tag(config=True)

    # -- listening ---------------------------------------------------------------
    ip = Unicode(
        DEFAULT_IP,
        help=f"""IP address to listen on. Default: {DEFAULT_IP}, or the host of
        JUPYTERHUB_SERVICE_URL when run as a JupyterHub-managed service.""",
    ).tag(config=True)

    http_processes = Integer(
        0,
        help="""Processes that serve HTTP in front of this one. 0 (the default): this
        process answers HTTP itself. N >= 1: this process keeps every decision (memory,
        the database, the reaper) and N more processes accept the connections on
        --ip/--port, each running the same API (tokens, validation, JSON) and asking this
        one over a private Unix socket; HTTP work then runs beside the decisions instead
        of taking turns with them. 1 is enough on 2 cores; see docs/admins.md.""",
    ).tag(config=True)

    @validate("http_processes")
    def _check_http_processes(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if not 0 <= value <= 64:
            raise ValueError("http_processes must be between 0 and 64.")
        return value

    @default("ip")
    def _ip_default(self) -> str:
        url = _service_url()
        return (url.hostname if url and url.hostname else None) or DEFAULT_IP

    port = Integer(
        DEFAULT_PORT,
        help=f"""TCP port to listen on. Default: {DEFAULT_PORT}, or the port of
        JUPYTERHUB_SERVICE_URL when run as a JupyterHub-managed service.""",
    ).tag(config=True)

    @default("port")
    def _port_default(self) -> int:
        url = _service_url()
        try:
            return (url.port if url else None) or DEFAULT_PORT
        except ValueError:
            return DEFAULT_PORT

    base_url = Unicode(
        "/",
        help="""URL prefix everything is served under. Default: JUPYTERHUB_SERVICE_PREFIX
        (e.g. /services/gpu-lease/) when set, else /.""",
    ).tag(config=True)

    @default("base_url")
    def _base_url_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or "/"

    max_body_bytes = Integer(
        MAX_BODY_BYTES,
        help="Largest request body accepted, in bytes; larger ones get 413. "
        f"Default: {MAX_BODY_BYTES}.",
    ).tag(config=True)

    metrics_require_auth = Bool(
        False,
        help="Whether GET /metrics needs a valid token. Default: False (anyone may scrape).",
    ).tag(config=True)

    metrics_per_user = Bool(
        True,
        help="Export the per-user and per-lease series on /metrics "
        "(gpu_lease_user_held_fraction, gpu_lease_lease_used_memory_bytes): one series per "
        "user or lease. Turn off on very large hubs. Default: True.",
    ).tag(config=True)

    # -- state -----------------------------------------------------------------
    db_url = Unicode(
        "sqlite:///gpu-lease.sqlite",
        help="""SQLAlchemy URL of the lease database. Default: sqlite:///gpu-lease.sqlite
        (a file in the working directory); postgresql://USER@HOST/DB is supported.""",
    ).tag(config=True)

    sqlite_synchronous = CaselessStrEnum(
        list(SQLITE_SYNCHRONOUS),
        DEFAULT_SQLITE_SYNCHRONOUS,
        help=f"""SQLite's synchronous pragma (SQLite only). NORMAL (with WAL) may lose the
        last transactions on power loss but never corrupts; FULL survives it. Default:
        {DEFAULT_SQLITE_SYNCHRONOUS}.""",
    ).tag(config=True)

    sqlite_busy_timeout = Float(
        DEFAULT_SQLITE_BUSY_TIMEOUT,
        help=f"""Seconds a write waits for another process's lock on the SQLite database
        before the request fails with 503 (SQLite only). Writes queued behind it wait
        too (reads and heartbeats are still answered), so keep it short if other tools
        write the file. Default:
        {DEFAULT_SQLITE_BUSY_TIMEOUT:g}.""",
    ).tag(config=True)

    ha_lock = Bool(
        False,
        help="""Active/standby (PostgreSQL only): before loading state and listening, take
        the database's leadership row (fenced: every write checks it); while another
        broker holds it, stand by, listening on nothing, and take over once its
        leadership expires (leadership_ttl). An active broker that cannot confirm its
        leadership answers 503; one that lost it to another broker stops serving at once
        and exits with status 1. Default: False (one broker).""",
    ).tag(config=True)

    leadership_ttl = Float(
        6.0,
        help="""Seconds a broker's leadership lasts unless renewed (--ha-lock). The active
        broker renews it every third of this; it answers 503 once it could not renew for
        this long minus a margin (a tenth, at most 1 s); a standby takes over once it has
        expired, between 2/3 of it and all of it after the active paused, died or lost
        the database. Shorter: faster failover, but a database pause this long deposes
        the active broker. Default: 6.""",
    ).tag(config=True)

    pg_timeout = Float(
        DEFAULT_PG_TIMEOUT,
        help=f"""Seconds that bound every wait of the broker on PostgreSQL (PostgreSQL only):
        connect timeout, statement_timeout, idle_in_transaction_session_timeout, TCP
        keepalives and tcp_user_timeout; with --ha-lock at most half of leadership_ttl.
        Settings in the --db-url query (e.g. ?connect_timeout=10) win. Default:
        {DEFAULT_PG_TIMEOUT:g}.""",
    ).tag(config=True)

    gpus = Unicode(
        "nvml",
        help="""The GPU pool: 'nvml' (default: discover this machine's GPUs with NVML) or a
        declaration COUNTxMEMORY_MiB[:NAME], comma-separated, optionally per node:
        '1x32768:V100', 'gpu-a/2x81920:H100,gpu-b/4x16384:T4'; or 'agents': none
        declared here, only the GPUs node agents (`gpu-lease agent`) register. Registered
        nodes' GPUs join any declared ones.""",
    ).tag(config=True)

    quotas_file = Unicode(
        "",
        help="""A courses/quotas TOML file (see hub_config/courses.toml) applied at every
        start: its default, course (group) and user quotas replace those the API set for
        the same names; others are kept. Default: none.""",
    ).tag(config=True)

    # -- identity --------------------------------------------------------------
    auth = CaselessStrEnum(
        list(AUTHENTICATORS),
        "static",
        help="""Short name of a built-in authenticator_class: 'hub' (JupyterHub's API
        identifies callers; the default when JUPYTERHUB_API_TOKEN is set) or 'static'
        (a JSON tokens file, --tokens-file; the default otherwise).""",
    ).tag(config=True)

    @default("auth")
    def _auth_default(self) -> str:
        return "hub" if os.environ.get("JUPYTERHUB_API_TOKEN") else "static"

    authenticator_class = OptionalType(
        None,
        klass=Authenticator,
        allow_none=True,
        help="""The class that identifies callers: a subclass of
        provisioner.broker.auth.Authenticator, or its import name; its own options are
        c.<ClassName>.*. Default: None, the class --auth names (HubTokens for 'hub',
        StaticTokens for 'static').""",
    ).tag(config=True)

    tokens_file = Unicode(
        "",
        help="""JSON file of tokens for --auth static:
        {"TOKEN": {"user": "alice", "groups": ["ml101"], "admin": false}}; an entry may add
        "expires_at" (POSIX seconds or ISO 8601, no zone = UTC), after which the token gets
        401. Node agents' tokens are {"agent": true, "node": "NODE"}; with --auth hub the
        file may hold only those (users come from JupyterHub). Re-read when it changes.
        Default: none.""",
    ).tag(config=True)

    hub_cache_max_age = Integer(
        HUB_CACHE_MAX_AGE,
        help="Seconds a token's JupyterHub identity (owner, groups, admin) is cached "
        "(--auth hub): a revoked token or a course membership change reaches the broker "
        f"within this time. Default: {HUB_CACHE_MAX_AGE}, as JupyterHub's own HubAuth.",
    ).tag(config=True)

    # -- policy (defaults: the fields of scheduling.Policy) --------------------------
    ttl = Float(
        Policy.ttl,
        help="Lease time to live in seconds; provisioners renew well within it. "
        f"Default: {Policy.ttl:g}.",
    ).tag(config=True)

    context_overhead_mb = Integer(
        Policy.context_overhead_mb,
        help=f"""GPU memory (MiB) each CUDA process needs for its context, outside every
        framework cap; a lease's cap is its share minus this. Default: {Policy.context_overhead_mb}.""",
    ).tag(config=True)

    reserve_fraction = Float(
        ppm_to_fraction(Policy.reserve_ppm),
        help="Fraction of each GPU kept out of leases (0 <= r < 1). "
        f"Default: {ppm_to_fraction(Policy.reserve_ppm):g}.",
    ).tag(config=True)

    placement = CaselessStrEnum(
        ["best-fit", "spread"],
        Policy.placement,
        help="'best-fit' (the fullest GPU that fits) or 'spread' (the emptiest). "
        f"Default: {Policy.placement}.",
    ).tag(config=True)

    idle_reclaim_after = Float(
        Policy.idle_reclaim_after or 0.0,
        help=f"""Seconds a kernel may stay idle before its lease is revoked, and only while
        someone waits for a GPU; 0 turns idle reclaim off. Default: {Policy.idle_reclaim_after or 0:g}.""",
    ).tag(config=True)

    queue_poll_grace = Float(
        Policy.queue_poll_grace,
        help="Seconds a queued request is kept after its client stopped polling. "
        f"Default: {Policy.queue_poll_grace:g}.",
    ).tag(config=True)

    starvation_after = Float(
        Policy.starvation_after,
        help="Seconds after which a waiting request goes ahead of every newer one. "
        f"Default: {Policy.starvation_after:g}.",
    ).tag(config=True)

    node_grace = Float(
        Policy.node_grace,
        help="Seconds a node agent may stay silent before its node is lost: nothing new is "
        "placed there (its leases run out by their TTL) until the agent heartbeats again. "
        f"Default: {Policy.node_grace:g}.",
    ).tag(config=True)

    overuse_grace = Float(
        Policy.overuse_grace,
        help="Seconds a kernel may use more GPU memory than its lease (as its node agent "
        "reports) before an agent with --enforce revoke|kill gets its lease revoked. "
        f"Default: {Policy.overuse_grace:g}.",
    ).tag(config=True)

    overuse_tolerance_mb = Integer(
        Policy.overuse_tolerance_mb,
        help="MiB a kernel may use above its cap plus context_overhead_mb before it counts "
        f"as over its lease. Default: {Policy.overuse_tolerance_mb}.",
    ).tag(config=True)

    max_queued_per_user = Integer(
        Policy.max_queued_per_user,
        help="Most requests one user may have waiting at once (a count). "
        f"Default: {Policy.max_queued_per_user}.",
    ).tag(config=True)

    reap_interval = Float(
        REAP_INTERVAL,
        help="Seconds between reaper passes (expiry, stale requests, idle reclaim). "
        f"Default: {REAP_INTERVAL:g}.",
    ).tag(config=True)

    @validate("reserve_fraction")
    def _check_reserve(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0.0 <= value < 1.0:
            raise ValueError("reserve_fraction must be at least 0 and below 1.")
        return value

    @validate("ttl", "reap_interval", "node_grace", "leadership_ttl", "pg_timeout")
    def _check_positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise ValueError(f"{proposal['trait'].name} must be a positive number of seconds.")
        return value

    # -- life cycle -------------------------------------------------------------
    @catch_config_error
    def initialize(self, argv: Any = None) -> None:
        """Parse the command line, then load ``--config FILE`` (the command line wins).

        Called by :meth:`launch_instance` (``gpu-lease broker``) before :meth:`start`.
        """
        super().initialize(argv)
        if self.config_file:
            path = os.path.abspath(self.config_file)
            if not os.path.isfile(path):
                self.log.critical("The config file %s does not exist.", path)
                self.exit(2)
            self.load_config_file(path)

    def start(self) -> None:
        """Run until SIGTERM/SIGINT; exits 2 on a configuration error, 1 if the database fails.

        Called by :meth:`launch_instance` after :meth:`initialize`.
        """
        if self.generate_config:
            print(self.generate_config_file())
            return
        self._setup_logging()
        try:
            status = asyncio.run(self.serve())
        except KeyboardInterrupt:
            status = 0
        if status:
            self.exit(status)

    def _setup_logging(self) -> None:
        # LOG_FORMAT names no source line, thread or process: don't look them up for
        # every record (the logging HOWTO's "Optimization"; grants and releases are
        # logged at INFO, two records per lease)
        logging._srcfile = None
        logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
        for name in ("gpu_lease", "tornado"):
            logger = logging.getLogger(name)
            logger.handlers = [handler]
            logger.propagate = False
            logger.setLevel(int(self.log_level))  # type: ignore[call-overload]
        self.log = logging.getLogger("gpu_lease.broker.app")

    # -- the pieces, built from the traits ----------------------------------------------
    def policy(self) -> Policy:
        """The core's knobs from the policy traits."""
        return Policy(
            ttl=self.ttl,
            context_overhead_mb=self.context_overhead_mb,
            reserve_ppm=fraction_to_ppm(self.reserve_fraction),
            placement=self.placement,
            starvation_after=self.starvation_after,
            idle_reclaim_after=self.idle_reclaim_after or None,
            queue_poll_grace=self.queue_poll_grace,
            max_queued_per_user=self.max_queued_per_user,
            node_grace=self.node_grace,
            overuse_grace=self.overuse_grace,
            overuse_tolerance_mb=self.overuse_tolerance_mb,
        )

    def load_inventory(self) -> list[GPU]:
        """The GPUs of ``--gpus`` (raises ``GPULeaseError`` when there are none).

        ``--gpus agents``: none declared; the pool is what node agents register.
        """
        if self.gpus.strip() == "agents":
            return []
        return load_gpus(self.gpus)

    def make_authenticator(self) -> Authenticator:
        """An ``authenticator_class`` (else the ``--auth`` one); ``GPULeaseError`` if misconfigured."""
        cls: type[Authenticator] = self.authenticator_class or AUTHENTICATORS[self.auth]
        return cls.for_broker(
            parent=self,
            tokens_file=self.tokens_file,
            cache_max_age=self.hub_cache_max_age,
            base_url=normalize_base_url(self.base_url),
        )

    def quota_entries(self) -> list[tuple[str, str, Any]]:
        """The ``(level, name, Quota)`` entries of ``quotas_file`` (none without one)."""
        if not self.quotas_file:
            return []
        from .courses import load_courses

        return load_courses(self.quotas_file).quota_entries()

    def open_store(self) -> Store:
        """The store of ``db_url`` (not connected yet: ``service.start()`` opens it)."""
        pg_timeout = self.pg_timeout
        if self.ha_lock:  # a paused broker's open transaction must end well within a TTL
            pg_timeout = min(pg_timeout, self.leadership_ttl / 2)
        return Store(
            self.db_url,
            sqlite_synchronous=self.sqlite_synchronous,
            sqlite_busy_timeout=self.sqlite_busy_timeout,
            pg_timeout=pg_timeout,
            application_name=f"gpu-lease broker {os.getpid()}",
        )

    def build_service(self, store: Store, gpus: list[GPU]) -> tuple[BrokerService, BrokerMetrics]:
        """The service over ``store`` and ``gpus``, and the metrics that read it."""
        service: BrokerService | None = None
        metrics = BrokerMetrics(lambda: service, per_user=self.metrics_per_user)
        service = BrokerService(
            store, gpus, self.policy(), metrics=metrics, reap_interval=self.reap_interval
        )
        return service, metrics

    def load_state(self, service: BrokerService, quota_entries: list[Any]) -> None:
        """Rebuild the state from the store, then apply ``quotas_file`` (``GPULeaseError``)."""
        service.start()
        if self.quotas_file:
            service.quotas.apply_quotas(quota_entries, self.quotas_file)

    def make_web_app(
        self, service: BrokerService, authenticator: Authenticator, metrics: BrokerMetrics
    ) -> WebApplication:
        """The tornado application of the route table."""
        return make_app(
            service,
            authenticator,
            metrics,
            self.base_url,
            max_body_bytes=self.max_body_bytes,
            metrics_require_auth=self.metrics_require_auth,
        )

    def listen(self, app: WebApplication) -> HTTPServer | None:
        """An HTTP server listening on ``ip:port``; None (logged) if it cannot."""
        server = http_server(app)
        try:
            server.listen(self.port, address=self.ip)
        except OSError as exc:
            self.cannot_listen(exc)
            return None
        return server

    def cannot_listen(self, exc: OSError) -> None:
        self.log.critical(
            "Cannot listen on %s:%d (%s); choose another address or port with --ip/--port.",
            self.ip,
            self.port,
            exc.strerror or exc,
        )

    def start_reaper(self, service: BrokerService) -> PeriodicCallback:
        """Call ``service.leases.tick()`` every ``reap_interval`` s; a failed pass is logged and
        retried at the next one (a broker that is not serving skips its passes)."""

        async def reap() -> None:
            try:
                await service.leases.tick()
            except (StoreError, NotActive) as exc:
                self.log.warning("Reaper pass failed, will retry: %s", exc.message)
            except Exception:
                self.log.exception("Reaper pass failed unexpectedly")

        reaper = PeriodicCallback(reap, self.reap_interval * 1000.0)
        reaper.start()
        return reaper

    async def stand_by(self, store: Store) -> Leadership | None:
        """``--ha-lock``: wait, listening on nothing, until this broker leads.

        Opens the store first (the leadership row is part of the schema). Returns the
        leadership (the store's fence is set), or None if SIGTERM/SIGINT came first or
        the database is not PostgreSQL (logged). Database errors are logged and retried:
        a standby outlives a database restart.
        """
        if not store.fencing.supported:
            self.log.critical(
                "--ha-lock needs a PostgreSQL database (--db-url postgresql://USER@HOST/DB); "
                "with SQLite run a single broker without --ha-lock."
            )
            return None
        leadership = Leadership(store, self.leadership_ttl)
        stop = asyncio.Event()
        with stop_on_signals(stop):
            said = ""
            while not stop.is_set():
                try:
                    await asyncio.to_thread(store.open)
                    break
                except StoreError as exc:
                    if exc.message != said:
                        self.log.warning("standby: cannot open the database yet: %s", exc.message)
                        said = exc.message
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), leadership.poll)
            if stop.is_set() or not await leadership.wait_until_leader(stop):
                return None
        return leadership

    def keep_leadership(
        self, leadership: Leadership, service: BrokerService, stop: asyncio.Event
    ) -> asyncio.Task[None]:
        """Renew the leadership in the background; once lost, stop serving at once and
        set ``stop`` (the broker exits 1: ``lost_leadership``)."""

        def lost(why: str) -> None:
            self.lost_leadership = True
            service.core.stop_serving("not the active broker any more")
            stop.set()

        return asyncio.create_task(leadership.keep(lost))

    def log_listening(self, gpus: list[GPU], store: Store, authenticator: Authenticator) -> None:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        self.log.info(
            "GPU lease broker %s listening on http://%s:%d%s with %d GPU(s), database %s, auth %s",
            __version__,
            host,
            self.port,
            normalize_base_url(self.base_url),
            len(gpus),
            store.url_for_logs,
            authenticator.auth_name or type(authenticator).__name__,
        )

    async def shut_down(
        self,
        server: HTTPServer | Fronts,
        reaper: PeriodicCallback,
        service: BrokerService,
        leadership: Leadership | None = None,
        keeper: asyncio.Task[None] | None = None,
    ) -> None:
        """Stop serving (waiting long-polls answer 503 first), the reaper and the server,
        close open connections, give the leadership up, close the store."""
        self.log.info("Shutting down")
        service.core.stop_serving("shutting down")
        await service.core.long_polls_answered(LONG_POLLS_TIMEOUT)
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
            self.log.warning("%s", exc.message)

    # -- the whole run ---------------------------------------------------------------
    async def serve(self) -> int:
        """Start up, serve until SIGTERM/SIGINT (or a lost leadership), shut down; the exit status."""
        front = os.environ.pop(FRONT_ENV, "")
        if front:
            return await self.serve_front(**json.loads(front))
        self.lost_leadership = False
        self.failed = ""
        try:
            gpus = self.load_inventory()
            authenticator = self.make_authenticator()
            quota_entries = self.quota_entries()
            store = self.open_store()
        except GPULeaseError as exc:
            self.log.critical("%s", exc.message)
            return 2
        service, metrics = self.build_service(store, gpus)
        leadership: Leadership | None = None
        if self.ha_lock:
            _collect_from_now_on()  # a standby may wait for hours before it leads
            leadership = await self.stand_by(store)
            if leadership is None:
                store.close()
                return 0 if store.fencing.supported else 2
            service.core.gate = leadership.check
        try:
            self.load_state(service, quota_entries)
        except GPULeaseError as exc:
            self.log.critical("Cannot start: %s", exc.message)
            if leadership is not None:
                leadership.release()
            store.close()
            return 1
        stop = asyncio.Event()

        def fronts_failed(why: str) -> None:
            self.failed = why
            stop.set()

        server: HTTPServer | Fronts | None
        if self.http_processes:
            server = await self.start_fronts(service, metrics, authenticator, fronts_failed)
        else:
            server = self.listen(self.make_web_app(service, authenticator, metrics))
        if server is None:
            if leadership is not None:
                leadership.release()
            service.close()
            return 2
        _collect_from_now_on()
        reaper = self.start_reaper(service)
        keeper = self.keep_leadership(leadership, service, stop) if leadership else None
        with stop_on_signals(stop):
            self.log_listening(gpus, store, authenticator)
            await stop.wait()
        if self.failed:
            self.log.critical("Cannot serve: %s", self.failed)
        await self.shut_down(server, reaper, service, leadership, keeper)
        return 1 if self.lost_leadership or self.failed else 0

    async def start_fronts(
        self,
        service: BrokerService,
        metrics: BrokerMetrics,
        authenticator: Authenticator,
        failed: Callable[[str], None],
    ) -> Fronts | None:
        """``--http-processes N``: bind ``ip:port`` here, start the fronts (``fronts.py``)."""
        try:
            sockets = listening_sockets(self.port, self.ip, self.http_processes)
        except OSError as exc:
            self.cannot_listen(exc)
            return None
        fronts = Fronts(
            self.http_processes,
            list(self.argv),
            sockets,
            service,
            metrics.render,
            browser_login=authenticator.browser_login,
            failed=failed,
        )
        await fronts.start()
        return fronts

    async def serve_front(self, service_socket: str, fds: list[int]) -> int:
        """An HTTP process of ``--http-processes`` (``fronts.py`` starts it): the API on
        the inherited sockets ``fds``, the service over ``service_socket``; exits when
        its broker process is gone."""
        try:
            authenticator = self.make_authenticator()
        except GPULeaseError as exc:
            self.log.critical("%s", exc.message)
            return 2
        remote = RemoteService()
        try:
            await remote.connect(service_socket)
        except OSError as exc:
            self.log.critical("Cannot reach the broker process at %s: %s", service_socket, exc)
            return 1
        secret = os.environ.pop(COOKIE_SECRET_ENV, "")
        app = make_app(
            cast(BrokerService, remote),  # the service's API; handlers await every answer
            authenticator,
            RemoteMetrics(remote),
            self.base_url,
            max_body_bytes=self.max_body_bytes,
            metrics_require_auth=self.metrics_require_auth,
            **({"cookie_secret": bytes.fromhex(secret)} if secret else {}),
        )
        server = http_server(app)
        server.add_sockets([socket.socket(fileno=fd) for fd in fds])
        _collect_from_now_on()
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
            self.log.warning("The broker process is gone; this HTTP process exits")
        else:
            await remote.idle(FRONT_FINISH_TIMEOUT)  # answers under way (long-polls: 503)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.close_all_connections(), CLOSE_CONNECTIONS_TIMEOUT)
        remote.close()
        return 1 if lost else 0


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


def _collect_from_now_on() -> None:
    """Freeze what start-up built and turn the garbage collector (back) on.

    Everything loaded so far (the imports, the pool state) lives as long as the process:
    the collector need not scan it again, neither in every full collection nor in the
    interpreter's teardown after SIGTERM (~0.35 s of CPU without the freeze, ~0.03 s with
    it: seconds of exit on a loaded machine). ``main()`` and ``python -m`` keep the
    collector off while start-up builds it (a sixth of the start's CPU otherwise).
    """
    gc.freeze()
    gc.enable()


def main(argv: list[str] | None = None) -> int:
    """``gpu-lease broker [options]``; returns 0 (errors exit with their status).

    The garbage collector is off until the broker listens (see ``serve``) and on again
    when this returns, also when it returns early (``--help``, a configuration error).
    """
    gc.disable()
    try:
        GPULeaseBroker.launch_instance(argv)
    finally:
        gc.enable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
