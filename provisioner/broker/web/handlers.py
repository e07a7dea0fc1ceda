"""HTTP handlers of REST API v1: the only place where HTTP status codes live.

Every handler does three things: identify the caller (``Authorization`` header ->
the app's :class:`~provisioner.broker.web.auth.Authenticator`), validate the input
(:mod:`.validation`), and make ONE call into
:class:`~provisioner.broker.services.broker_service.BrokerService` (awaiting its answer with
:func:`resolved`: behind ``--http-processes`` the service is a
:class:`~provisioner.broker.fronts.service_channel.RemoteService` in the broker's process, so
handlers never read its memory directly); our exceptions become JSON error
bodies ``{"error": CODE, "message": ...}`` with ``exc.status``. Tornado's own errors
(unknown route 404, method 405) are JSON too; an unexpected exception is a 500 with
no traceback in the answer (the traceback goes to the broker's log).

The URLs, which handler serves each, and which answer without a token are in the
route table, :data:`provisioner.broker.web.routes.TABLE` (which also builds the app); a
handler learns ``public`` from its route.

Identity: the ``Authorization`` token, or, with an authenticator that has browser
login (``--auth hub`` as a hub service) and no such header, the login cookie the
dashboard's login set (JupyterHub's ``HubOAuth`` accepts that cookie only with its
XSRF token in ``X-XSRFToken``, which the page sends; ``hub_login.py`` mixes
JupyterHub's handler support into these classes only then, so ``--auth static``
never imports jupyterhub).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from tornado import web

from ... import errors
from ..._version import __version__
from ...errors import BodyTooLarge, GPULeaseError, NotActive, NotAuthenticated
from ...model import QUOTA_FIELDS, Identity, Lease, Quota, QuotaBook, min_ppm_for, reserved_mb
from ...wire import NO_FRAMES, error_code, ppm_to_fraction
from ..rules.admission import EffectiveQuota
from ..rules.policy import Policy
from ..services.broker_service import (
    BrokerService,
    GPUHolding,
    Health,
    Heartbeat,
    History,
    NodeView,
    QuotaStanding,
    Waiting,
)
from . import validation
from .auth import Authenticator, token_from_header

log = logging.getLogger("gpu_lease.broker.http")

T = TypeVar("T")


async def resolved(value: T | Awaitable[T]) -> T:
    """``value``, awaited if it is awaitable: the service's answer in this process is a
    value, a front's :class:`~provisioner.broker.fronts.service_channel.RemoteService` answers every
    call with a future (``--http-processes``)."""
    if inspect.isawaitable(value):
        return await value
    return cast(T, value)


JSON_TYPE = "application/json; charset=UTF-8"
#: the largest request body accepted by default (``GPULeaseBroker.max_body_bytes``)
MAX_BODY_BYTES = 64 * 1024
#: bodies larger than this are not even read (the connection is closed after the 413)
DRAIN_LIMIT = 4 * 1024 * 1024
#: seconds a queued client is told to wait before it posts again
RETRY_AFTER_QUEUED = 2


def normalize_base_url(base_url: str) -> str:
    """``services/gpu-lease`` -> ``/services/gpu-lease/`` (always a leading and trailing slash)."""
    base = "/" + (base_url or "").strip().strip("/")
    return base if base.endswith("/") else base + "/"


def api(method: Callable[..., Any]) -> Callable[..., Awaitable[None]]:
    """Wrap a handler method: identify the caller first (unless the handler is public)."""

    @functools.wraps(method)
    async def wrapper(self: APIHandler, *args: Any) -> None:
        if self.auth_required:
            self._ident = await self.identify()
            if self._ident.node is not None and not self.agent_allowed:
                raise errors.Forbidden(
                    "This is a node agent's token: it may call only /api/v1/nodes. "
                    "Use a user's or an admin's token for anything else."
                )
        args = tuple(validation.parse_path_arg(a) if isinstance(a, str) else a for a in args)
        result = method(self, *args)
        if inspect.isawaitable(result):
            await result

    return wrapper


# -- the base ---------------------------------------------------------------------------


#: an acquire's outcome (``AcquireResult.outcome``) -> its HTTP status
ACQUIRE_STATUS = {"granted": 201, "repeated": 200, "queued": 202}


# -- the service's outcomes as JSON (the wire's field names live here) ---------------------


def health_json(h: Health) -> dict[str, Any]:
    return {
        "status": "ok",
        "version": h.version,
        "gpus": h.gpus,
        "active_leases": h.active_leases,
        "queued": h.queued,
        "uptime_s": round(h.uptime_s, 3),
    }


def gpu_json(h: GPUHolding, policy: Policy) -> dict[str, Any]:
    g = h.gpu
    return {
        **g.to_json(),
        "index": g.index,
        "allocated_fraction": ppm_to_fraction(h.allocated_ppm),
        "allocated_mb": reserved_mb(h.allocated_ppm, g.memory_mb),
        "capacity_fraction": ppm_to_fraction(policy.capacity_ppm),
        "min_fraction": ppm_to_fraction(min_ppm_for(g.memory_mb, policy.context_overhead_mb)),
        "context_overhead_mb": policy.context_overhead_mb,
        "leases": h.leases,
        "mps_uid": h.mps_uid,
    }


def waiting_json(w: Waiting) -> dict[str, Any]:
    req = w.request
    return {
        "id": req.id,
        "position": w.position,
        "user": req.user,
        "kernel_id": req.kernel_id,
        "fraction": ppm_to_fraction(req.fraction_ppm),
        "group": req.group,
        "groups": sorted(req.groups),
        "priority": req.priority,
        "waiting_s": round(w.waiting_s, 3),
        **({} if w.eta_seconds is None else {"eta_seconds": w.eta_seconds}),
        **({} if w.session is None else {"session": w.session}),
    }


def sources_json(eff: EffectiveQuota) -> dict[str, str]:
    """The sources keyed by the wire's field names (``max_fraction``, ``budget_window``, ...)."""
    return {wire: eff.sources[attr] for wire, attr in zip(QUOTA_FIELDS, Quota.FIELDS, strict=True)}


def standing_json(q: QuotaStanding) -> dict[str, Any]:
    return {
        "user": q.user,
        "groups": sorted(q.groups),
        "effective": q.effective.quota.to_json(),
        "sources": sources_json(q.effective),
        "held_fraction": ppm_to_fraction(q.held_ppm),
        "leases": q.leases,
    }


def book_json(book: QuotaBook) -> dict[str, Any]:
    return {
        "default": book.default.to_json(),
        "groups": {k: v.to_json() for k, v in sorted(book.groups.items())},
        "users": {k: v.to_json() for k, v in sorted(book.users.items())},
    }


def node_json(view: NodeView, detail: bool) -> dict[str, Any]:
    """A node as an admin (``detail``: GPUs and usage) or anyone else sees it."""
    return view.node.detail(view.state) if detail else view.node.summary(view.state)


def heartbeat_json(h: Heartbeat) -> dict[str, Any]:
    return {
        "node": h.node,
        "state": h.state,
        "at": h.at,
        "watch": h.watch,
        "kill": h.kill,
        **h.answers,
    }


def history_json(h: History) -> dict[str, Any]:
    return {
        "since": h.since,
        "until": h.until,
        "step": h.step,
        "user": h.user,
        "group": h.group,
        "capacity": h.capacity,
        "points": [p.to_json() for p in h.points],
    }


@web.stream_request_body
class APIHandler(web.RequestHandler):
    """JSON in, JSON out; identity from the token; errors as ``{"error", "message"}``.

    The body is streamed in (see :meth:`data_received`) so that a body over
    ``max_body_bytes`` gets a clean 413 JSON answer instead of tornado's bare 400.
    """

    #: False for the routes anyone may call (health, OpenAPI, index): their route's ``public``
    auth_required = True
    #: True for the node routes, the only ones a node agent's token may call
    agent_allowed = False

    def initialize(self, public: bool = False) -> None:
        """Called by tornado for each request with the route's keyword arguments."""
        self.auth_required = not public
        self._chunks: list[bytes] = []
        self._body_bytes = 0
        self._ident: Identity | None = None
        self._prepared = False

    def get_current_user(self) -> Any:
        """The identity ``@api`` found (JupyterHub's blocking lookup is never used)."""
        return self._ident

    # -- settings -----------------------------------------------------------------
    @property
    def service(self) -> BrokerService:
        return self.settings["gpu_lease_service"]

    @property
    def authenticator(self) -> Authenticator:
        return self.settings["gpu_lease_authenticator"]

    @property
    def base_url(self) -> str:
        return self.settings["gpu_lease_base_url"]

    @property
    def max_body_bytes(self) -> int:
        return self.settings["gpu_lease_max_body_bytes"]

    @property
    def ident(self) -> Identity:
        assert self._ident is not None, "@api identifies the caller before the method runs"
        return self._ident

    # -- headers, body, identity -----------------------------------------------------
    def set_default_headers(self) -> None:
        self.set_header("Content-Type", JSON_TYPE)
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")
        for name, value in NO_FRAMES.items():  # the dashboard's page narrows its CSP further
            self.set_header(name, value)

    def compute_etag(self) -> str | None:
        return None

    def prepare(self) -> None:
        length = self.request.headers.get("Content-Length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = 0
            if declared > DRAIN_LIMIT:
                # let tornado read nothing more; the connection closes after the 413
                self.request.connection.set_max_body_size(declared)  # type: ignore[union-attr]
                raise BodyTooLarge(
                    f"The request body has {declared} bytes, more than the broker accepts "
                    f"({self.max_body_bytes} bytes); send a smaller JSON object.",
                    max_bytes=self.max_body_bytes,
                )
        # read (and drop) bodies up to DRAIN_LIMIT so that the 413 arrives cleanly
        self.request.connection.set_max_body_size(DRAIN_LIMIT)  # type: ignore[union-attr]
        # nothing else may fail here: an answer sent from prepare() is sent before the
        # body is read, and tornado then closes the connection. Identity is checked by
        # @api at the start of each method, once the body is in.
        self._prepared = True

    def data_received(self, chunk: bytes) -> None:
        self._body_bytes += len(chunk)
        if self._body_bytes <= self.max_body_bytes:
            self._chunks.append(chunk)
        else:
            self._chunks = []

    def json_body(self) -> dict[str, Any]:
        """The request body as a JSON object (413 / 400 from ``validation``)."""
        if self._body_bytes > self.max_body_bytes:
            raise BodyTooLarge(
                f"The request body has {self._body_bytes} bytes, more than the broker accepts "
                f"({self.max_body_bytes} bytes); send a smaller JSON object.",
                max_bytes=self.max_body_bytes,
            )
        return validation.parse_json_body(b"".join(self._chunks), self.max_body_bytes)

    async def identify(self) -> Identity:
        token = token_from_header(self.request.headers.get("Authorization"))
        if token is not None:
            return await self.authenticator.identify(token)
        ident = await self.identify_browser()
        if ident is not None:
            return ident
        raise NotAuthenticated(
            "This endpoint needs a token: send your JupyterHub API token (or the token "
            "your administrator gave you) as 'Authorization: token <TOKEN>'"
            + (
                ", or log in through the dashboard (a browser request must also send the "
                "page's X-XSRFToken header)."
                if self.authenticator.browser_login
                else "."
            )
        )

    async def identify_browser(self) -> Identity | None:
        """The login cookie's user (``--auth hub`` with browser login), else None."""
        if not self.authenticator.browser_login:
            return None
        return await self.authenticator.identify_browser(self)

    def query(self, name: str) -> str | None:
        values = self.request.query_arguments.get(name)
        if not values:
            return None
        try:
            text = values[-1].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise errors.InvalidRequest(f"The query value {name!r} is not UTF-8 text.") from exc
        return validation.parse_query_text(text, name)

    # -- answers -----------------------------------------------------------------
    def write_json(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body, allow_nan=False, separators=(",", ":")))

    async def lease_json(self, lease: Lease) -> dict[str, Any]:
        gpu, usage = await resolved(self.service.queries.lease_facts(lease))
        body = lease.to_json(gpu)
        body.update(
            used_mb=usage.used_mb,
            enforcement=usage.enforcement,
            mps=usage.mps,
            mps_server_uid=usage.mps_server_uid,
            kernel_refused=usage.kernel_refused,
            session=usage.session,
        )
        if usage.resume is not None:  # parked, its resume request waiting
            body["resume"] = usage.resume
        return body

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        self.clear_header("Location")
        self.clear_header("Retry-After")
        if isinstance(exc, GPULeaseError):
            body = exc.to_json()
            if exc.status == 401:
                self.set_header("WWW-Authenticate", 'Bearer realm="gpu-lease"')
            if exc.status == 503:
                self.set_header("Retry-After", f"{exc.retry_after:g}")
            if isinstance(exc, NotActive):
                # the next attempt opens a new connection, which a load balancer may
                # send to the active broker
                self.set_header("Connection", "close")
        elif isinstance(exc, web.HTTPError) and status_code < 500:
            body = {"error": error_code(status_code)}
            if status_code == 404:
                body["message"] = (
                    f"There is no such endpoint: {self.request.method} {self.request.path}. "
                    f"The API is under {self.base_url}api/v1/ "
                    f"(see {self.base_url}api/v1/openapi.json)."
                )
            elif status_code == 405:
                body["message"] = (
                    f"{self.request.method} is not allowed on {self.request.path}; "
                    f"see {self.base_url}api/v1/openapi.json for the methods it takes."
                )
            else:
                body["message"] = f"{self._reason}. Check the request and retry."
        else:
            body = {
                "error": "internal_error",
                "message": "internal error; the broker's log has details",
            }
        if not self._prepared:
            # refused before the body was read: tornado closes the connection after
            # this answer, so tell the client not to reuse it
            self.set_header("Connection", "close")
        self.set_header("Content-Type", JSON_TYPE)
        self.finish(json.dumps(body, default=str, separators=(",", ":")))

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        task = asyncio.current_task()
        if exc is None and task is not None and task.cancelling():
            # tornado answers a handler whose own task is cancelled with a bare 500: that
            # is this process exiting (asyncio.run cancels what runs still), so say retry
            exc = NotActive(
                "This broker is shutting down; retry, and the active broker will answer."
            )
            kwargs["exc_info"] = (NotActive, exc, None)
        if isinstance(exc, GPULeaseError):
            status_code = exc.status if 400 <= exc.status < 600 else 500
        super().send_error(status_code, **kwargs)

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        where = f"{self.request.method} {self.request.path}"
        if isinstance(value, GPULeaseError):
            if value.status >= 500:
                log.warning("%s failed: %s", where, value.message)
            else:
                log.debug("%s refused (%s): %s", where, value.code, value.message)
        elif isinstance(value, web.HTTPError):
            if value.status_code >= 500:
                log.warning("%s: HTTP %d %s", where, value.status_code, value.log_message or "")
        else:
            log.error(
                "Unexpected error answering %s:\n%s",
                where,
                "".join(traceback.format_exception(typ, value, tb)),
            )


class NotFoundHandler(APIHandler):
    """Any unknown path: a JSON 404 (never tornado's HTML page), before any auth."""

    def _not_found(self, *args: Any) -> None:
        raise web.HTTPError(404)

    get = post = put = delete = patch = head = options = _not_found


# -- public ---------------------------------------------------------------------------


class IndexHandler(APIHandler):
    """``GET {p}api/v1/`` (and ``GET {p}`` for non-browsers): where the API is."""

    def write_index(self) -> None:
        p = self.base_url
        self.write_json(
            {
                "name": "jupyter-gpu-lease broker",
                "version": __version__,
                "api": f"{p}api/v1/",
                "health": f"{p}api/v1/health",
                "openapi": f"{p}api/v1/openapi.json",
                "metrics": f"{p}metrics",
                "dashboard": p,
                "message": "This is the GPU lease broker's REST API; send requests with "
                "'Authorization: token <TOKEN>'. Open the dashboard in a browser.",
            }
        )

    @api
    def get(self) -> None:
        self.write_index()


#: the dashboard page may load only its own script and style and call only its own API
DASHBOARD_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


class DashboardHandler(IndexHandler):
    """``GET {p}``: the HTML dashboard for browsers (``Accept: text/html``), else the index.

    With hub OAuth (``--auth hub`` as a hub service) an anonymous browser is sent to the
    hub's ``/hub/api/oauth2/authorize``; the page then calls the API with the login
    cookie and the XSRF token it carries. Otherwise (``--auth static``) the page is
    public and asks for a token, which it keeps in ``sessionStorage`` and sends as
    ``Authorization``.
    """

    def wants_html(self) -> bool:
        accept = self.request.headers.get("Accept", "")
        return "text/html" in accept or "application/xhtml+xml" in accept

    async def get(self) -> None:
        if not self.wants_html():
            self.write_index()
            return
        login = self.authenticator.browser_login
        user = ""
        xsrf = ""
        if login:
            ident = await self.identify_browser()
            if ident is None:
                self.redirect(self.get_login_url())
                return
            self._ident = ident
            user = ident.user
            xsrf = self.xsrf_token.decode("ascii")
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.set_header("Content-Security-Policy", DASHBOARD_CSP)
        self.set_header("Referrer-Policy", "same-origin")
        self.render(
            "dashboard.html",
            base_url=self.base_url,
            auth_mode="hub" if login else "token",
            hub_user=user,
            xsrf=xsrf,
            version=__version__,
        )


class HealthHandler(APIHandler):
    @api
    async def get(self) -> None:
        self.write_json(health_json(await resolved(self.service.queries.health())))


class OpenAPIHandler(APIHandler):
    """``GET {p}api/v1/openapi.json``: the document the route table builds (``document``,
    ``routes.build_openapi``, handed in by the table, which sits above the handlers)."""

    def initialize(
        self, public: bool = False, document: Callable[[str], dict[str, Any]] | None = None
    ) -> None:
        super().initialize(public)
        assert document is not None, "the route table hands the document's builder in"
        self.document = document

    @api
    def get(self) -> None:
        self.write_json(self.document(self.base_url))


class MetricsHandler(APIHandler):
    """``GET {p}metrics``: Prometheus text, which names users and lease ids: an admin's
    token or one with the metrics permission (``Identity.metrics``) unless
    ``metrics_require_auth`` is off (``--no-metrics-auth``: a scrape-only network)."""

    def prepare(self) -> None:
        if not self.settings.get("gpu_lease_metrics_require_auth", True):
            self.auth_required = False
        super().prepare()

    @api
    async def get(self) -> None:
        if self.auth_required and not (self.ident.admin or self.ident.metrics):
            raise errors.Forbidden(
                "GET /metrics names users and lease ids: it needs a GPU lease admin's token "
                "or one with the metrics permission (JupyterHub: the scope read:metrics; the "
                'tokens file: "metrics": true). Ask your administrator for a scraper token, '
                "or run the broker with --no-metrics-auth on a network only Prometheus reaches."
            )
        metrics = self.settings.get("gpu_lease_metrics")
        if metrics is None or not hasattr(metrics, "render"):
            raise errors.NotFound("This broker does not export metrics.")
        body, content_type = await resolved(metrics.render())
        self.set_header("Content-Type", content_type)
        self.finish(body)


# -- pool and leases ---------------------------------------------------------------------


class GPUsHandler(APIHandler):
    @api
    async def get(self) -> None:
        policy = self.service.policy
        self.write_json({"gpus": [gpu_json(h, policy) for h in await self.service.queries.gpus()]})


class LongPollHandler(APIHandler):
    """A handler whose answer may wait (an acquire or a resume that long-polls): a client
    that hangs up cancels the wait, and is not answered."""

    _task: asyncio.Future[Any] | None = None
    _client_gone = False

    async def answer_of(self, work: Awaitable[T]) -> T | None:
        """``work``'s result; None when the client hung up meanwhile (nobody to answer)."""
        self._task = asyncio.ensure_future(work)
        try:
            return cast(T, await self._task)
        except asyncio.CancelledError:
            if self._client_gone:
                return None
            raise
        finally:
            self._task = None

    def on_connection_close(self) -> None:
        # the client gave up its long-poll: stop waiting (a queue place stays until the
        # poll grace runs out, so a quick re-post keeps it)
        self._client_gone = True
        if self._task is not None and not self._task.done():
            self._task.cancel()


class LeasesHandler(LongPollHandler):
    """``GET`` lists leases; ``POST`` acquires (201 new, 200 repeat, 202 queued)."""

    @api
    async def get(self) -> None:
        leases = await self.service.queries.list_leases(
            self.ident,
            user=self.query("user") or None,
            all_users=validation.parse_flag(self.query("all"), "all"),
            history=validation.parse_flag(self.query("history"), "history"),
        )
        self.write_json({"leases": [await self.lease_json(x) for x in leases]})

    @api
    async def post(self) -> None:
        ask, wait = validation.parse_acquire(self.json_body(), self.ident)
        result = await self.answer_of(self.service.leases.acquire(self.ident, ask, wait))
        if result is None:
            return
        if result.outcome == "queued":
            req = result.request
            assert req is not None
            self.set_header("Retry-After", str(RETRY_AFTER_QUEUED))
            self.write_json(
                {
                    "queued": True,
                    "id": req.id,
                    "position": result.position,
                    "kernel_id": req.kernel_id,
                    "fraction": ppm_to_fraction(req.fraction_ppm),
                    "queue_length": result.queue_length,
                    "reason": result.reason,
                    **({} if result.eta_seconds is None else {"eta_seconds": result.eta_seconds}),
                    "message": f"Your request waits at position {result.position} of "
                    f"{result.queue_length} in the GPU queue. {result.reason}".strip(),
                },
                status=202,
            )
            return
        assert result.lease is not None
        if result.outcome == "granted":
            self.set_header("Location", f"{self.base_url}api/v1/leases/{result.lease.id}")
        self.write_json(await self.lease_json(result.lease), status=ACQUIRE_STATUS[result.outcome])


class LeaseHandler(APIHandler):
    @api
    async def get(self, lease_id: str) -> None:
        self.write_json(
            await self.lease_json(await self.service.queries.get_lease(self.ident, lease_id))
        )

    @api
    async def delete(self, lease_id: str) -> None:
        await self.service.leases.release(self.ident, lease_id)
        self.set_status(204)
        self.clear_header("Content-Type")
        self.finish()


class RenewHandler(APIHandler):
    @api
    async def post(self, lease_id: str) -> None:
        claim = validation.parse_renewal(self.json_body())
        lease = await self.service.leases.renew(self.ident, lease_id, claim)
        self.write_json(await self.lease_json(lease))


class ResumeHandler(LongPollHandler):
    """``POST {p}api/v1/leases/{id}/resume {wait?}``: the owner wants a parked kernel's GPU
    memory back: 200 with the lease once it is active, else 202 with where it stands."""

    @api
    async def post(self, lease_id: str) -> None:
        wait = validation.parse_resume(self.json_body())
        result = await self.answer_of(self.service.resumes.resume(self.ident, lease_id, wait))
        if result is None:
            return
        lease = await self.lease_json(result.lease)
        if result.state == "active":
            self.write_json(lease)
            return
        self.set_header("Retry-After", str(RETRY_AFTER_QUEUED))
        self.write_json(
            {
                "lease": lease,
                "state": result.state,
                "position": result.position,
                "eta_seconds": result.eta_seconds,
                "queue_length": result.queue_length,
            },
            status=202,
        )


class KernelHandler(LongPollHandler):
    """``PUT {p}api/v1/leases/{id}/kernel``: the holder has the lease's node launch its kernel
    (202, the new generation ``launching``); ``GET`` (``?after=CURSOR&timeout=S``): the
    kernel's state, its address and ports once it runs (long-poll on a change)."""

    @api
    async def put(self, lease_id: str) -> None:
        launch = validation.parse_kernel_launch(self.json_body())
        kernel = await self.service.kernels.launch(self.ident, lease_id, launch)
        self.write_json(kernel.to_json(), status=202)

    @api
    async def get(self, lease_id: str) -> None:
        after, timeout = validation.parse_kernel_poll(self.query("after"), self.query("timeout"))
        kernel = await self.answer_of(
            self.service.kernels.kernel(self.ident, lease_id, after, timeout)
        )
        if kernel is None:
            return
        self.write_json(kernel.to_json())


class KernelSignalHandler(APIHandler):
    """``POST {p}api/v1/leases/{id}/kernel/signal {signal}``: the node signals the kernel."""

    @api
    async def post(self, lease_id: str) -> None:
        name = validation.parse_kernel_signal(self.json_body())
        kernel = await self.service.kernels.signal(self.ident, lease_id, name)
        self.write_json(kernel.to_json(), status=202)


class RevokeHandler(APIHandler):
    """``POST {p}api/v1/leases/{id}/revoke {reason}``: an admin ends someone's lease."""

    @api
    async def post(self, lease_id: str) -> None:
        reason = validation.parse_revoke(self.json_body())
        lease = await self.service.leases.revoke(self.ident, lease_id, reason)
        self.write_json(await self.lease_json(lease))


# -- node agents -----------------------------------------------------------------------


class NodesHandler(APIHandler):
    """``GET {p}api/v1/nodes``: registered nodes (a user: summary; an admin: detail)."""

    agent_allowed = True

    @api
    async def get(self) -> None:
        nodes = await self.service.nodes.list_nodes(self.ident)
        self.write_json({"nodes": [node_json(v, self.ident.admin) for v in nodes]})


class NodeHandler(APIHandler):
    """``PUT`` registers a node (its agent, or an admin); ``DELETE`` drains it."""

    agent_allowed = True

    @api
    async def put(self, node: str) -> None:
        gpus, version, enforce = validation.parse_node_registration(self.json_body(), node)
        view = await self.service.nodes.register_node(self.ident, node, gpus, version, enforce)
        self.write_json(node_json(view, detail=True))

    @api
    async def delete(self, node: str) -> None:
        await self.service.nodes.drain_node(self.ident, node)
        self.set_status(204)
        self.clear_header("Content-Type")
        self.finish()


class NodeHeartbeatHandler(APIHandler):
    """``POST {p}api/v1/nodes/{node}/heartbeat``: the node's agent is alive; its report
    (:class:`~provisioner.node_report.NodeReport`) carries its usage and its features' parts."""

    agent_allowed = True

    @api
    async def post(self, node: str) -> None:
        report = validation.parse_node_report(self.json_body())
        beat = await self.service.nodes.node_heartbeat(self.ident, node, report)
        self.write_json(heartbeat_json(beat))


class NodeOrdersHandler(LongPollHandler):
    """``GET {p}api/v1/nodes/{node}/orders?after=CURSOR&timeout=S``: the node's agent waits
    for its orders to change (answered at once when they differ from ``after``)."""

    agent_allowed = True

    @api
    async def get(self, node: str) -> None:
        after, timeout = validation.parse_orders_poll(self.query("after"), self.query("timeout"))
        due = await self.answer_of(self.service.nodes.node_orders(self.ident, node, after, timeout))
        if due is None:
            return
        body: dict[str, Any] = {"node": due.node, "cursor": due.cursor, "orders": due.orders}
        if due.remote:
            body["remote_kernel_orders"] = due.remote
        self.write_json(body)


class QueueHandler(APIHandler):
    @api
    async def get(self) -> None:
        # length: everyone waiting, also where a student sees only their own entries
        waiting = await self.service.queries.queue(self.ident)
        length = await resolved(self.service.queries.queue_length())
        self.write_json({"queue": [waiting_json(w) for w in waiting], "length": length})


# -- quotas and usage --------------------------------------------------------------------


class QuotasHandler(APIHandler):
    @api
    async def get(self) -> None:
        self.write_json(book_json(await resolved(self.service.quotas.list_quotas(self.ident))))


class MyQuotaHandler(APIHandler):
    @api
    async def get(self) -> None:
        mine = await resolved(self.service.quotas.my_quota(self.ident))
        self.write_json({**standing_json(mine), "admin": self.ident.admin})


class QuotaHandler(APIHandler):
    """``/quotas/default`` (no path argument) and ``/quotas/users|groups/{name}``.

    The route gives the ``level`` (default, user or group) and the path the name.
    """

    def initialize(self, public: bool = False, level: str = "default") -> None:
        super().initialize(public)
        self.level = level

    @api
    async def get(self, name: str = "") -> None:
        if self.level == "user" and validation.parse_flag(self.query("effective"), "effective"):
            # the effective quota as admission applies it: needs the user's groups
            await resolved(self.service.quotas.check_may_read_quota_of(self.ident, name))
            if name == self.ident.user:
                groups, source = self.ident.groups, "your token"
            else:
                groups, source = await self.authenticator.groups_of(name)
            standing = await resolved(
                self.service.quotas.effective_quota_of(self.ident, name, groups)
            )
            own = standing.own.to_json() if standing.own is not None else None
            self.write_json({**standing_json(standing), "groups_from": source, "own": own})
            return
        quota, effective = await resolved(
            self.service.quotas.get_quota(self.ident, self.level, name)
        )
        body = quota.to_json()
        if effective is not None:
            body["effective"] = effective.to_json()
        self.write_json(body)

    @api
    async def put(self, name: str = "") -> None:
        quota = validation.parse_quota(self.json_body())
        stored = await self.service.quotas.put_quota(self.ident, self.level, name, quota)
        self.write_json(stored.to_json())

    @api
    async def delete(self, name: str = "") -> None:
        await self.service.quotas.delete_quota(self.ident, self.level, name)
        self.set_status(204)
        self.clear_header("Content-Type")
        self.finish()


class UsageHandler(APIHandler):
    @api
    async def get(self) -> None:
        since = validation.parse_since(self.query("since"), self.service.clock())
        by = self.query("by") or "user"
        self.write_json(await self.service.quotas.usage(self.ident, since, by))


class HistoryHandler(APIHandler):
    """``GET {p}api/v1/history?since=&step=&group=&user=``: the dashboard's plots."""

    @api
    async def get(self) -> None:
        now = self.service.clock()
        since = validation.parse_since(
            self.query("since") or validation.DEFAULT_HISTORY_WINDOW, now
        )
        step = validation.parse_step(self.query("step"), now - since)
        body = await self.service.queries.history(
            self.ident, since, step, group=self.query("group"), user=self.query("user") or None
        )
        self.write_json(history_json(body))


# -- class sessions ---------------------------------------------------------------------


class SessionsHandler(APIHandler):
    """``GET {p}api/v1/sessions[?course=]``: the timetable from now to two days ahead."""

    @api
    async def get(self) -> None:
        course = self.query("course") or None
        views = await self.service.sessions.list(self.ident, course)
        mine = self.ident.groups
        self.write_json(
            {
                "sessions": [{**v.to_json(), "member": v.session.course in mine} for v in views],
                "now": self.service.clock(),
            }
        )


class SessionHandler(APIHandler):
    """``{p}api/v1/sessions/{course}``: POST starts one now, PATCH extends the one under
    way, DELETE ends it (the course's instructors or an admin)."""

    @api
    async def post(self, course: str) -> None:
        ask = validation.parse_session_start(self.json_body())
        view = await self.service.sessions.start(self.ident, course, **ask)
        self.write_json(view.to_json(), 201)

    @api
    async def patch(self, course: str) -> None:
        until = validation.parse_session_until(self.json_body())
        view = await self.service.sessions.extend(self.ident, course, until)
        self.write_json(view.to_json())

    @api
    async def delete(self, course: str) -> None:
        view = await self.service.sessions.end(self.ident, course)
        self.write_json(view.to_json())


__all__ = [
    "APIHandler",
    "MAX_BODY_BYTES",
    "normalize_base_url",
]
