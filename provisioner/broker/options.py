"""The broker's options: every ``c.GPULeaseBroker.<name>`` trait, its help, default and check.

:class:`BrokerOptions` holds the traits; :class:`~provisioner.broker.app.GPULeaseBroker`
(the traitlets Application) inherits them, so the config section, the command line
(``--GPULeaseBroker.x``, the aliases) and ``--generate-config`` still name
``GPULeaseBroker``. ``BrokerOptions`` is not a ``Configurable``: it never becomes a
section of its own. A default lives in one place: the policy knobs' in
:class:`~provisioner.broker.rules.policy.Policy`, the others in the trait or in the constant of
the module that uses it.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from traitlets import (
    Bool,
    CaselessStrEnum,
    Float,
    HasTraits,
    Integer,
    Type,
    Unicode,
    default,
    validate,
)

from ..model import fraction_to_ppm, ppm_to_fraction
from .rules.policy import Policy
from .services.broker_service import REAP_INTERVAL, ParkSettings
from .store.store import (
    DEFAULT_PG_TIMEOUT,
    DEFAULT_SQLITE_BUSY_TIMEOUT,
    DEFAULT_SQLITE_SYNCHRONOUS,
    SQLITE_SYNCHRONOUS,
)
from .web.auth import AUTHENTICATORS, HUB_CACHE_MAX_AGE, Authenticator
from .web.handlers import MAX_BODY_BYTES

#: where the broker listens unless JUPYTERHUB_SERVICE_URL (or --ip/--port) says otherwise
DEFAULT_IP = "127.0.0.1"
DEFAULT_PORT = 10101


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


class BrokerOptions(HasTraits):
    """The broker's configurable traits (``c.GPULeaseBroker.<name>``), and the
    :class:`~provisioner.broker.rules.policy.Policy` they make."""

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
        True,
        help="""Whether GET /metrics needs an admin's token or one with the metrics
        permission (JupyterHub's scope read:metrics; "metrics": true in the tokens file): its
        series name users and lease ids. False (--no-metrics-auth) lets anyone scrape, for a
        network only Prometheus reaches. Default: True.""",
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
        provisioner.broker.web.auth.Authenticator, or its import name; its own options are
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

    # -- policy (defaults: the fields of policy.Policy) --------------------------
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

    session_lead = Float(
        Policy.session_lead,
        help=f"""Seconds before a class session's start (courses file, or started by hand)
        from which no new lease of a non-member is placed in the course's reserved share.
        Default: {Policy.session_lead:g}.""",
    ).tag(config=True)

    session_lend_after = Float(
        Policy.session_lend_after or 0.0,
        help=f"""Seconds into a class session after which the unused part of its share is
        lent back to everyone until a member of the course asks for a GPU; 0: never lent.
        Default: {Policy.session_lend_after or 0:g}.""",
    ).tag(config=True)

    session_busy_grace = Float(
        Policy.session_busy_grace or 0.0,
        help=f"""Seconds after a class session's start after which non-members' BUSY kernels
        in its share are parked or revoked too (idle ones are at the start); 0: never.
        Default: {Policy.session_busy_grace or 0:g}.""",
    ).tag(config=True)

    @validate("session_lead", "session_lend_after", "session_busy_grace")
    def _check_not_negative(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value >= 0:
            raise ValueError(f"{proposal['trait'].name} must be 0 or more seconds.")
        return value

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

    # -- parking ------------------------------------------------------
    park_idle = Bool(
        ParkSettings.idle,
        help="""Park an idle kernel instead of revoking its lease when idle reclaim picks it
        for someone waiting: its node's agent checkpoints the kernel's GPU memory into host
        RAM (the CUDA driver's checkpoint API), the lease keeps its id and kernel but no GPU
        memory, and the kernel's next cell resumes it on the same GPU, its variables
        intact. Only where the node's agent reports the checkpoint API and enough free host
        memory (park_host_reserve_mb); elsewhere the lease is revoked as before. Default:
        True.""",
    ).tag(config=True)

    park_host_reserve_mb = Integer(
        ParkSettings.host_reserve_mb,
        help="""Host memory (MiB) a node keeps free beyond what parked kernels take: a kernel
        is parked only if its node's available host memory, less this and less what the
        kernels parking there already take, holds the kernel's GPU memory. Default:
        """
        f"{ParkSettings.host_reserve_mb}.",
    ).tag(config=True)

    park_timeout = Float(
        ParkSettings.timeout,
        help="""Seconds a node's agent has to park a kernel (checkpoint its GPU memory)
        once ordered to; a lease still parking after this is revoked, its reason saying
        parking did not finish. Default: """
        f"{ParkSettings.timeout:g}.",
    ).tag(config=True)

    @validate("park_host_reserve_mb")
    def _check_park_reserve(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if value < 0:
            raise ValueError("park_host_reserve_mb must be 0 or more MiB.")
        return value

    @validate("reserve_fraction")
    def _check_reserve(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0.0 <= value < 1.0:
            raise ValueError("reserve_fraction must be at least 0 and below 1.")
        return value

    @validate("ttl", "reap_interval", "node_grace", "leadership_ttl", "pg_timeout", "park_timeout")
    def _check_positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise ValueError(f"{proposal['trait'].name} must be a positive number of seconds.")
        return value

    # -- what the traits make ------------------------------------------------------
    def park_settings(self) -> ParkSettings:
        """The service's parking options from the park traits."""
        return ParkSettings(
            idle=self.park_idle,
            host_reserve_mb=self.park_host_reserve_mb,
            timeout=self.park_timeout,
        )

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
            session_lead=self.session_lead,
            session_lend_after=self.session_lend_after or None,
            session_busy_grace=self.session_busy_grace or None,
        )
