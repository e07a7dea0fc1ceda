"""``gpu-lease broker``: the broker as a traitlets Application.

Every option is a trait (``c.GPULeaseBroker.<name>`` in a config file given with
``--config FILE``, or on the command line); :meth:`GPULeaseBroker.start` passes the
values into plain objects — ``Store``, ``inventory.load_gpus``, ``Policy``,
``BrokerService``, ``BrokerMetrics`` and :func:`handlers.make_app` — so tests and
benchmarks build the same pieces without the Application.

Start-up: load the GPUs (exit 2 with the inventory's message if there are none),
build the authenticator (exit 2 on a bad tokens file), open the store and rebuild
the state (``service.start()``, exit 1 if the database fails), listen, and run the
reaper (``service.tick()`` every ``reap_interval`` s). SIGTERM/SIGINT stop
listening, close the store and return (exit 0) within a second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any
from urllib.parse import urlsplit

from tornado.httpserver import HTTPServer
from tornado.ioloop import PeriodicCallback
from traitlets import Bool, CaselessStrEnum, Float, Integer, Unicode, default, validate
from traitlets.config import Application

from .._version import __version__
from ..errors import GPULeaseError, StoreError
from ..model import fraction_to_ppm
from ..scheduling import Policy
from . import handlers
from .auth import Authenticator, HubTokens, StaticTokens, make_hub_oauth

log = logging.getLogger("gpu_lease.broker.app")

LOG_FORMAT = "[%(levelname).1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def _service_url() -> Any:
    """``JUPYTERHUB_SERVICE_URL`` (set by the hub for a managed service) parsed, or None."""
    url = os.environ.get("JUPYTERHUB_SERVICE_URL")
    if not url:
        return None
    try:
        return urlsplit(url)
    except ValueError:
        return None


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
        "log-level": "Application.log_level",
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
            "Active/standby on PostgreSQL: serve only while holding the database's HA lock.",
        ),
    }

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

    # -- listening ---------------------------------------------------------------
    ip = Unicode(
        help="""IP address to listen on. Default: 127.0.0.1, or the host of
        JUPYTERHUB_SERVICE_URL when run as a JupyterHub-managed service.""",
    ).tag(config=True)

    @default("ip")
    def _ip_default(self) -> str:
        url = _service_url()
        return (url.hostname if url and url.hostname else None) or "127.0.0.1"

    port = Integer(
        help="""TCP port to listen on. Default: 10101, or the port of
        JUPYTERHUB_SERVICE_URL when run as a JupyterHub-managed service.""",
    ).tag(config=True)

    @default("port")
    def _port_default(self) -> int:
        url = _service_url()
        try:
            return (url.port if url else None) or 10101
        except ValueError:
            return 10101

    base_url = Unicode(
        help="""URL prefix everything is served under. Default: JUPYTERHUB_SERVICE_PREFIX
        (e.g. /services/gpu-lease/) when set, else /.""",
    ).tag(config=True)

    @default("base_url")
    def _base_url_default(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or "/"

    max_body_bytes = Integer(
        64 * 1024,
        help="Largest request body accepted, in bytes; larger ones get 413. Default: 65536.",
    ).tag(config=True)

    metrics_require_auth = Bool(
        False,
        help="Whether GET /metrics needs a valid token. Default: False (anyone may scrape).",
    ).tag(config=True)

    # -- state -----------------------------------------------------------------
    db_url = Unicode(
        "sqlite:///gpu-lease.sqlite",
        help="""SQLAlchemy URL of the lease database. Default: sqlite:///gpu-lease.sqlite
        (a file in the working directory); postgresql://USER@HOST/DB is supported.""",
    ).tag(config=True)

    sqlite_synchronous = CaselessStrEnum(
        ["OFF", "NORMAL", "FULL", "EXTRA"],
        "NORMAL",
        help="""SQLite's synchronous pragma (SQLite only). NORMAL (default, with WAL) may
        lose the last transactions on power loss but never corrupts; FULL survives it.""",
    ).tag(config=True)

    sqlite_busy_timeout = Float(
        5.0,
        help="""Seconds a write waits for another process's lock on the SQLite database
        before the request fails with 503 (SQLite only). The broker answers nothing
        else meanwhile, so keep it short if other tools write the file. Default: 5.""",
    ).tag(config=True)

    ha_lock = Bool(
        False,
        help="""Active/standby (PostgreSQL only): before loading state and listening, take
        the database's HA lock (a session advisory lock); while another broker holds it,
        stand by and retry every second, listening on nothing. An active broker that loses
        the lock (its database session ended) exits with status 1. Default: False (one broker).""",
    ).tag(config=True)

    gpus = Unicode(
        "nvml",
        help="""The GPU pool: 'nvml' (default: discover this machine's GPUs with NVML) or a
        declaration COUNTxMEMORY_MiB[:NAME], comma-separated, optionally per node:
        '1x32768:V100', 'gpu-a/2x81920:H100,gpu-b/4x16384:T4'.""",
    ).tag(config=True)

    # -- identity --------------------------------------------------------------
    auth = CaselessStrEnum(
        ["hub", "static"],
        help="""How callers are identified: 'hub' (JupyterHub's API; the default when
        JUPYTERHUB_API_TOKEN is set) or 'static' (a JSON tokens file, --tokens-file).""",
    ).tag(config=True)

    @default("auth")
    def _auth_default(self) -> str:
        return "hub" if os.environ.get("JUPYTERHUB_API_TOKEN") else "static"

    tokens_file = Unicode(
        "",
        help="""JSON file of tokens for --auth static:
        {"TOKEN": {"user": "alice", "groups": ["ml101"], "admin": false}}; an entry may add
        "expires_at" (POSIX seconds or ISO 8601, no zone = UTC), after which the token gets
        401. Re-read when it changes. Default: none.""",
    ).tag(config=True)

    hub_cache_max_age = Integer(
        300,
        help="Seconds a token's JupyterHub identity (owner, groups, admin) is cached "
        "(--auth hub): a revoked token or a course membership change reaches the broker "
        "within this time. Default: 300, as JupyterHub's own HubAuth.",
    ).tag(config=True)

    config_file = Unicode(
        "",
        help="A traitlets config file (.py or .json) to load, e.g. broker_config.py. "
        "Command-line options win over it. Default: none.",
    ).tag(config=True)

    quotas_file = Unicode(
        "",
        help="""A courses/quotas TOML file (see hub_config/courses.toml) applied at every
        start: its default, course (group) and user quotas replace those the API set for
        the same names; others are kept. Default: none.""",
    ).tag(config=True)

    # -- policy ----------------------------------------------------------------
    ttl = Float(
        90.0,
        help="Lease time to live in seconds; provisioners renew well within it. Default: 90.",
    ).tag(config=True)

    context_overhead_mb = Integer(
        512,
        help="""GPU memory (MiB) each CUDA process needs for its context, outside every
        framework cap; a lease's cap is its share minus this. Default: 512.""",
    ).tag(config=True)

    reserve_fraction = Float(
        0.0,
        help="Fraction of each GPU kept out of leases (0 <= r < 1). Default: 0.",
    ).tag(config=True)

    placement = CaselessStrEnum(
        ["best-fit", "spread"],
        "best-fit",
        help="'best-fit' (default: the fullest GPU that fits) or 'spread' (the emptiest).",
    ).tag(config=True)

    idle_reclaim_after = Float(
        0.0,
        help="""Seconds a kernel may stay idle before its lease is revoked, and only while
        someone waits for a GPU. 0 (default) turns idle reclaim off.""",
    ).tag(config=True)

    queue_poll_grace = Float(
        30.0,
        help="Seconds a queued request is kept after its client stopped polling. Default: 30.",
    ).tag(config=True)

    starvation_after = Float(
        600.0,
        help="Seconds after which a waiting request goes ahead of every newer one. Default: 600.",
    ).tag(config=True)

    max_queued_per_user = Integer(
        10, help="Most requests one user may have waiting at once. Default: 10."
    ).tag(config=True)

    reap_interval = Float(
        5.0,
        help="Seconds between reaper passes (expiry, stale requests, idle reclaim). Default: 5.",
    ).tag(config=True)

    @validate("reserve_fraction")
    def _check_reserve(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0.0 <= value < 1.0:
            raise ValueError("reserve_fraction must be at least 0 and below 1.")
        return value

    @validate("ttl", "reap_interval")
    def _check_positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise ValueError(f"{proposal['trait'].name} must be a positive number of seconds.")
        return value

    # -- life cycle -------------------------------------------------------------
    def initialize(self, argv: Any = None) -> None:
        """Parse the command line, then load ``--config FILE`` (the command line wins)."""
        super().initialize(argv)  # parses the command line
        if self.config_file:
            path = os.path.abspath(self.config_file)
            if not os.path.isfile(path):
                self.log.critical("The config file %s does not exist.", path)
                self.exit(2)
            self.load_config_file(os.path.basename(path), os.path.dirname(path))
            self.update_config(self.cli_config)

    def _setup_logging(self) -> None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
        for name in ("gpu_lease", "tornado"):
            logger = logging.getLogger(name)
            logger.handlers = [handler]
            logger.propagate = False
            logger.setLevel(int(self.log_level))  # type: ignore[call-overload]
        self.log = logging.getLogger("gpu_lease.broker.app")

    def policy(self) -> Policy:
        return Policy(
            ttl=self.ttl,
            context_overhead_mb=self.context_overhead_mb,
            reserve_ppm=fraction_to_ppm(self.reserve_fraction),
            placement=self.placement,
            starvation_after=self.starvation_after,
            idle_reclaim_after=self.idle_reclaim_after or None,
            queue_poll_grace=self.queue_poll_grace,
            max_queued_per_user=self.max_queued_per_user,
        )

    def authenticator(self) -> Authenticator:
        if self.auth == "static":
            if not self.tokens_file:
                raise GPULeaseError(
                    "--auth static needs a tokens file: give --tokens-file FILE with "
                    '{"TOKEN": {"user": "alice", "groups": [], "admin": false}}.'
                )
            return StaticTokens(self.tokens_file)
        # as a hub service with a URL, browsers log in to the dashboard with hub OAuth
        oauth = make_hub_oauth(
            handlers.normalize_base_url(self.base_url), cache_max_age=self.hub_cache_max_age
        )
        return HubTokens(cache_max_age=self.hub_cache_max_age, hub_auth=oauth)

    def quota_entries(self) -> list[tuple[str, str, Any]]:
        """The ``(level, name, Quota)`` entries of ``quotas_file`` (none without one)."""
        if not self.quotas_file:
            return []
        from .courses import load_courses

        return load_courses(self.quotas_file).quota_entries()

    def start(self) -> None:
        """Run until SIGTERM/SIGINT; exits 2 on a configuration error, 1 if the database fails."""
        self._setup_logging()
        try:
            status = asyncio.run(self.serve())
        except KeyboardInterrupt:
            status = 0
        if status:
            self.exit(status)

    async def serve(self) -> int:
        from ..inventory import load_gpus
        from ..store import Store
        from .metrics import BrokerMetrics
        from .service import BrokerService

        try:
            gpus = load_gpus(self.gpus)
            authenticator = self.authenticator()
            quota_entries = self.quota_entries()
            store = Store(
                self.db_url,
                sqlite_synchronous=self.sqlite_synchronous,
                sqlite_busy_timeout=self.sqlite_busy_timeout,
            )
        except GPULeaseError as exc:
            self.log.critical("%s", exc.message)
            return 2
        service: BrokerService | None = None
        metrics = BrokerMetrics(lambda: service)
        service = BrokerService(
            store, gpus, self.policy(), metrics=metrics, reap_interval=self.reap_interval
        )
        if self.ha_lock and not await self._wait_for_ha_lock(store):
            store.close()
            return 0 if store.supports_ha_lock else 2
        try:
            service.start()
            if self.quotas_file:
                service.apply_quotas(quota_entries, self.quotas_file)
        except GPULeaseError as exc:
            self.log.critical("Cannot start: %s", exc.message)
            store.close()
            return 1

        app = handlers.make_app(
            service,
            authenticator,
            metrics,
            self.base_url,
            max_body_bytes=self.max_body_bytes,
            metrics_require_auth=self.metrics_require_auth,
        )
        server = HTTPServer(app, xheaders=True, max_body_size=handlers.DRAIN_LIMIT)
        try:
            server.listen(self.port, address=self.ip)
        except OSError as exc:
            self.log.critical(
                "Cannot listen on %s:%d (%s); choose another address or port with --ip/--port.",
                self.ip,
                self.port,
                exc.strerror or exc,
            )
            service.close()
            return 2

        lost_lock = False

        def reap() -> None:
            nonlocal lost_lock
            if self.ha_lock and not store.ha_lock_held():
                self.log.critical(
                    "Lost the HA lock (the database session ended): another broker may be "
                    "active now, so this one stops; restart it to stand by."
                )
                lost_lock = True
                stop.set()
                return
            try:
                service.tick()
            except StoreError as exc:
                self.log.warning("Reaper pass failed, will retry: %s", exc.message)
            except Exception:
                self.log.exception("Reaper pass failed unexpectedly")

        reaper = PeriodicCallback(reap, self.reap_interval * 1000.0)
        reaper.start()

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        self.log.info(
            "GPU lease broker %s listening on http://%s:%d%s with %d GPU(s), database %s, auth %s",
            __version__,
            host,
            self.port,
            handlers.normalize_base_url(self.base_url),
            len(gpus),
            store.url_for_logs,
            self.auth,
        )
        await stop.wait()

        self.log.info("Shutting down")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        reaper.stop()
        server.stop()
        try:
            await asyncio.wait_for(server.close_all_connections(), 0.5)
        except asyncio.TimeoutError:
            pass
        try:
            service.close()
        except StoreError as exc:
            self.log.warning("%s", exc.message)
        return 1 if lost_lock else 0

    async def _wait_for_ha_lock(self, store: Any) -> bool:
        """Stand by until this broker holds the HA lock; False if stopped (or no PostgreSQL).

        Polls once a second; SIGTERM/SIGINT end the wait. Database errors are logged and
        retried: a standby outlives a database restart.
        """
        if not store.supports_ha_lock:
            self.log.critical(
                "--ha-lock needs a PostgreSQL database (--db-url postgresql://USER@HOST/DB); "
                "with SQLite run a single broker without --ha-lock."
            )
            return False
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            said = ""
            while not stop.is_set():
                try:
                    if store.try_ha_lock():
                        self.log.info("HA lock taken: this broker is now the active one")
                        return True
                    line = "standby: another broker holds the lock; retrying every second"
                except StoreError as exc:
                    line = f"standby: cannot take the HA lock yet: {exc.message}"
                if line != said:
                    self.log.warning("%s", line)
                    said = line
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
            return False
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    """``gpu-lease broker [options]``; returns the exit status."""
    app = GPULeaseBroker()
    app.initialize(argv)
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
