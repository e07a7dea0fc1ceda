"""``gpu-lease broker``: the broker as a traitlets Application.

Every option is a trait (``c.GPULeaseBroker.<name>`` in a config file given with
``--config FILE``, or on the command line; ``--generate-config`` prints them all); the
traits, their help, defaults and checks are :class:`~.options.BrokerOptions`, which
:class:`GPULeaseBroker` inherits. :meth:`GPULeaseBroker.serve` passes the values into
plain objects and the plain functions of :mod:`.startup` — ``Store``,
``inventory.load_gpus``, ``Policy``, the authenticator, ``BrokerService``,
``BrokerMetrics`` and :func:`routes.make_app` — so tests and benchmarks build the same
pieces without the Application.

Start-up, one step each: load the GPUs (exit 2 with the inventory's message if
there are none), build the authenticator (exit 2 on a bad tokens file), open the
store, stand by until it leads (``--ha-lock``: :mod:`.leadership`), rebuild the state
(``service.start()``, exit 1 if the database fails), listen (exit 2 if the address is
taken), run the reaper (``service.reaper.tick()`` every ``reap_interval`` s) and, with
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
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from tornado.httpserver import HTTPServer
from tornado.web import Application as WebApplication
from traitlets import default
from traitlets.config import Application, catch_config_error

from .._version import __version__
from ..errors import GPULeaseError
from ..inventory import load_gpus
from ..model import GPU
from . import startup
from .fronts.processes import FRONT_ENV, Fronts
from .options import BrokerOptions
from .services.broker_service import BrokerService
from .store.leadership import Leadership
from .store.store import Store
from .web.auth import AUTHENTICATORS, Authenticator
from .web.handlers import normalize_base_url
from .web.metrics import BrokerMetrics
from .web.routes import make_app

if TYPE_CHECKING:
    from .courses import Courses

log = logging.getLogger("gpu_lease.broker.app")

LOG_FORMAT = "[%(levelname).1s %(asctime)s.%(msecs).03d %(name)s] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


class GPULeaseBroker(BrokerOptions, Application):
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
            "Answer GET /metrics only to an admin's or a metrics token (the default).",
        ),
        "no-metrics-auth": (
            {"GPULeaseBroker": {"metrics_require_auth": False}},
            "Answer GET /metrics to anyone: for a network only Prometheus reaches.",
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

    def load_courses(self, gpus: list[GPU]) -> Courses | None:
        """The courses file ``quotas_file`` (None without one), its class sessions checked
        against the declared pool ``gpus`` (``CoursesFileError``)."""
        if not self.quotas_file:
            return None
        from .courses import check_sessions, load_courses

        courses = load_courses(self.quotas_file)
        check_sessions(courses, gpus or None, self.policy(), source=repr(self.quotas_file))
        return courses

    def load_state(self, service: BrokerService, courses: Courses | None) -> None:
        """Rebuild the state from the store, then apply ``quotas_file`` (``GPULeaseError``):
        its quotas and its class sessions' timetable."""
        service.start()
        if courses is not None:
            service.quotas.apply_quotas(courses.quota_entries(), self.quotas_file)
            startup.use_timetable(service, courses)

    def web_options(self) -> dict[str, Any]:
        """The options of :func:`routes.make_app` besides the service (also a front's)."""
        return {
            "base_url": self.base_url,
            "max_body_bytes": self.max_body_bytes,
            "metrics_require_auth": self.metrics_require_auth,
        }

    def make_web_app(
        self, service: BrokerService, authenticator: Authenticator, metrics: BrokerMetrics
    ) -> WebApplication:
        """The tornado application of the route table."""
        return make_app(service, authenticator, metrics, **self.web_options())

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

    # -- the whole run ---------------------------------------------------------------
    async def serve(self, stop: asyncio.Event | None = None) -> int:
        """Start up, serve until SIGTERM/SIGINT (or a lost leadership, or ``stop`` is set),
        shut down; the exit status."""
        front = os.environ.pop(FRONT_ENV, "")
        if front:
            return await self.serve_front(**json.loads(front))
        self.lost_leadership = False
        self.failed = ""
        try:
            gpus = self.load_inventory()
            authenticator = self.make_authenticator()
            courses = self.load_courses(gpus)
            store = startup.open_store(
                self.db_url,
                sqlite_synchronous=self.sqlite_synchronous,
                sqlite_busy_timeout=self.sqlite_busy_timeout,
                pg_timeout=self.pg_timeout,
                ha_lock=self.ha_lock,
                leadership_ttl=self.leadership_ttl,
            )
        except GPULeaseError as exc:
            self.log.critical("%s", exc.message)
            return 2
        service, metrics = startup.build_service(
            store,
            gpus,
            self.policy(),
            metrics_per_user=self.metrics_per_user,
            reap_interval=self.reap_interval,
            park=self.park_settings(),
        )
        leadership: Leadership | None = None
        if self.ha_lock:
            startup.collect_from_now_on()  # a standby may wait for hours before it leads
            leadership = await startup.stand_by(store, self.leadership_ttl, self.log)
            if leadership is None:
                store.close()
                return 0 if store.fencing.supported else 2
            service.core.gate = leadership.check
        try:
            self.load_state(service, courses)
        except GPULeaseError as exc:
            self.log.critical("Cannot start: %s", exc.message)
            if leadership is not None:
                leadership.release()
            store.close()
            return 1
        stop = asyncio.Event() if stop is None else stop

        def fronts_failed(why: str) -> None:
            self.failed = why
            stop.set()

        server: HTTPServer | Fronts | None
        if self.http_processes:
            server = await startup.start_fronts(
                self.http_processes,
                list(self.argv),
                self.ip,
                self.port,
                service,
                metrics,
                authenticator,
                fronts_failed,
                self.log,
            )
        else:
            app = self.make_web_app(service, authenticator, metrics)
            server = startup.listen(app, self.ip, self.port, self.log)
        if server is None:
            if leadership is not None:
                leadership.release()
            service.close()
            return 2
        startup.collect_from_now_on()
        watch = startup.CoursesWatch(self.quotas_file, service, self.log) if courses else None
        reaper = startup.start_reaper(service, self.reap_interval, self.log, watch)
        keeper = self.keep_leadership(leadership, service, stop) if leadership else None
        with startup.stop_on_signals(stop):
            self.log_listening(gpus, store, authenticator)
            await stop.wait()
        if self.failed:
            self.log.critical("Cannot serve: %s", self.failed)
        await startup.shut_down(server, reaper, service, self.log, leadership, keeper)
        return 1 if self.lost_leadership or self.failed else 0

    async def serve_front(self, service_socket: str, fds: list[int]) -> int:
        """An HTTP process of ``--http-processes`` (``fronts.py`` starts it): the API on
        the inherited sockets ``fds``, the service over ``service_socket``
        (:func:`.startup.serve_front`); exits when its broker process is gone."""
        try:
            authenticator = self.make_authenticator()
        except GPULeaseError as exc:
            self.log.critical("%s", exc.message)
            return 2
        return await startup.serve_front(
            service_socket, fds, authenticator, self.log, **self.web_options()
        )


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
