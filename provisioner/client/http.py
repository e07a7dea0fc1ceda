"""The broker client: the only HTTP caller on the kernel and CLI side.

``BrokerClient`` speaks the broker's REST API v1 (docs/developers.md, "REST API") over an
``httpx.AsyncClient``. It is used by the kernel provisioner (acquire before
launch, renew while the kernel lives, release at the end), the lab extension, the node
agent and the CLI (``gpu-lease top``, ``leases``, ``quota``, ``usage``).

It is the transport core: retries, backoff, the broker re-resolved after a 503, and the
answers translated; the calls themselves are grouped by what they touch, each group a
small class over this core (:meth:`BrokerClient.send`), as the broker's services are:
``client.leases`` (:mod:`provisioner.client.leases`: acquire with its long-poll
queueing, renew, release, revoke, the lease list and the queue), ``client.quotas``
(:mod:`provisioner.client.quotas`: quotas and usage) and ``client.nodes``
(:mod:`provisioner.client.nodes`: the node agent's register, heartbeat and drain).

It is the edge where HTTP meets the rest of the package, so it is the one place
that turns answers back into our exceptions (:mod:`provisioner.errors`):

- a non-2xx answer carrying the broker's JSON error body becomes the matching
  exception (its ``error`` code, else its HTTP status, picks the class);
- any other non-2xx answer becomes an exception whose message says what was
  answered and what to check;
- connection errors, timeouts and 502/503/504 are retried with exponential
  backoff and jitter (at least the answer's ``Retry-After``, up to ``max_backoff``),
  each retry on a new connection, so that a host name is resolved again and a load
  balancer can send it to the broker that is active now (after a failover); then
  they become :class:`errors.BrokerUnavailable`;
- no httpx (or other foreign) exception escapes: ``raise OurError(...) from exc``.

Every call is safe to retry: acquire is idempotent per ``(user, kernel_id)``,
renew and release are idempotent, and the quota calls are PUT/GET/DELETE.

The token is sent as ``Authorization: token <token>`` and never appears in a
message, a ``repr`` or a log line. It goes only to a listener the client trusts: each
new connection whose server end is on this machine (a loopback URL) is checked before
a byte is sent (:mod:`provisioner.listeners`; ``broker_uid`` or ``GPU_LEASE_BROKER_UID``
names the broker's account). The HTTP transport is injectable (``transport=``), so
tests can play the broker with ``httpx.MockTransport``; an injected transport is not
checked.

One ``BrokerClient`` may be used from several event loops, one after the other or at
once from several threads: jupyter_client's blocking ``KernelManager`` runs each call
on whichever loop it finds (the thread's own, or a runner thread's when a loop is
already running), so a kernel's acquire, renewals and release may each run on another
loop. An httpx client's connections and locks belong to the loop that made them, so
there is one ``httpx.AsyncClient`` per loop, made on first use there; ``keep_alive=False``
closes every connection after its call, so a loop that stops holds no socket.

Nothing is read from the environment at import. :func:`broker_env` is the one place
that knows which variables name the broker and its token, and in which order; it reads
them when called (:meth:`BrokerClient.from_env`, the kernel provisioner, the server
extension's ``introduce`` and the CLI all go through it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import math
import os
import random
import ssl
import threading
import time
import urllib.request
from collections.abc import Mapping
from types import TracebackType
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx

from .. import errors
from .._version import __version__
from ..listeners import Owners, checked_transport
from ..wire import ERROR_BY_STATUS
from .leases import LeaseCalls
from .nodes import NodeCalls
from .quotas import QuotaCalls
from .sessions import SessionCalls

log = logging.getLogger("gpu_lease.client")

API_PREFIX = "/api/v1"
DEFAULT_USER_AGENT = f"jupyter-gpu-lease/{__version__}"

#: answers that mean "the broker (or the proxy in front of it) is not ready": retried
RETRY_STATUSES = frozenset({502, 503, 504})

_URL_HINT = (
    "Is the gpu-lease broker running? Check GPU_LEASE_URL (or the provisioner's broker_url): "
    "it should be the broker's base URL, e.g. http://127.0.0.1:10101, or "
    "http://127.0.0.1:8000/services/gpu-lease behind JupyterHub, where the gpu-lease "
    "service must be up."
)
_NOT_JSON = object()

_C = TypeVar("_C", bound="BrokerClient")

#: the broker's base URL, in the environment of the Jupyter server and of the CLI
URL_ENV = "GPU_LEASE_URL"
#: the broker token, when the caller has one of its own
TOKEN_ENV = "GPU_LEASE_TOKEN"
#: a single-user server's own JupyterHub token: the broker token when TOKEN_ENV is unset
HUB_TOKEN_ENV = "JUPYTERHUB_API_TOKEN"


class BrokerEnv(NamedTuple):
    """What the environment says about the broker; ``None`` where it says nothing."""

    url: str | None
    token: str | None


def broker_env(environ: Mapping[str, str] | None = None) -> BrokerEnv:
    """The broker URL and token the environment gives, read now (the one home of this rule).

    ``url`` is ``GPU_LEASE_URL``; ``token`` is ``GPU_LEASE_TOKEN``, else
    ``JUPYTERHUB_API_TOKEN`` (the single-user server's own token). Empty values count
    as unset. ``environ`` defaults to ``os.environ``. Callers that keep a client read
    this again before each use: JupyterHub rotates a server's token.
    """
    env = os.environ if environ is None else environ
    return BrokerEnv(
        url=env.get(URL_ENV) or None,
        token=env.get(TOKEN_ENV) or env.get(HUB_TOKEN_ENV) or None,
    )


def normalize_url(url: str) -> str:
    """The broker base URL without a trailing slash or ``/api/v1``; raises InvalidRequest if unusable.

    >>> normalize_url("http://127.0.0.1:8000/services/gpu-lease/")
    'http://127.0.0.1:8000/services/gpu-lease'
    """
    base = url.strip().rstrip("/")
    if base.endswith(API_PREFIX):
        base = base[: -len(API_PREFIX)].rstrip("/")
    try:
        parsed = httpx.URL(base)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise errors.InvalidRequest(
            f"The GPU lease broker URL {_display(base)!r} is not a valid URL ({exc}). {_URL_HINT}"
        ) from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise errors.InvalidRequest(
            f"The GPU lease broker URL {_display(base)!r} is not an http:// or https:// URL. {_URL_HINT}"
        )
    return base


def _display(url: str) -> str:
    """``url`` without any ``user:password@`` part, fit for messages and logs."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One verifying SSL context per process, built on first use.

    httpx builds a fresh one (loading the whole CA bundle, ~50 ms) for every client
    otherwise, and the provisioner makes a client per kernel start.
    """
    return ssl.create_default_context()


class BrokerClient:
    """Async client of the gpu-lease broker's REST API v1.

    ``url`` is the broker's base URL (``http://127.0.0.1:10101``, or
    ``http://127.0.0.1:8000/services/gpu-lease`` through JupyterHub's proxy);
    ``/api/v1/...`` is appended. ``timeout`` (s) bounds each ordinary call; a
    long-poll acquire may read for ``wait + timeout``. Failed calls are retried up
    to ``retries`` times, sleeping ``backoff * 2**n`` seconds (with jitter, at most
    ``max_backoff``) in between. ``keep_alive=False`` opens a connection per call
    (for callers whose calls are seconds apart and may run on different event loops).
    ``broker_uid`` (a uid, an account name, or several) is the account whose listener
    may receive the token; by default ``GPU_LEASE_BROKER_UID``, else root, a system
    account or the caller's own (:class:`provisioner.listeners.Owners`).
    The calls are grouped in ``leases``, ``quotas`` and ``nodes`` (see the module docstring).
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 10.0,
        retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        user_agent: str = DEFAULT_USER_AGENT,
        keep_alive: bool = True,
        broker_uid: int | str | list[int | str] | None = None,
    ) -> None:
        self._base = normalize_url(url)
        self._owners = Owners.from_env() if broker_uid is None else Owners.parse(broker_uid)
        self.url = _display(self._base)
        self._token = token or None
        self.timeout = float(timeout)
        self.retries = max(0, int(retries))
        self.backoff = max(0.0, float(backoff))
        self.max_backoff = max(0.0, float(max_backoff))
        headers = {"User-Agent": user_agent, "Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"token {self._token}"
        self._headers = headers
        self._transport = transport
        self._limits = httpx.Limits() if keep_alive else httpx.Limits(max_keepalive_connections=0)
        #: the httpx client of each event loop this client was used on (see the module docstring)
        self._https: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._https_lock = threading.Lock()

    @classmethod
    def from_env(
        cls: type[_C],
        *,
        url: str | None = None,
        token: str | None = None,
        environ: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> _C:
        """A client configured from the environment (read now, not at import).

        ``url`` and ``token`` default to what :func:`broker_env` reads (``GPU_LEASE_URL``;
        ``GPU_LEASE_TOKEN``, else ``JUPYTERHUB_API_TOKEN``). Explicit arguments win;
        ``kw`` goes to the constructor.
        """
        found = broker_env(environ)
        url = url or found.url
        if not url:
            raise errors.InvalidRequest(
                "No GPU lease broker URL is set: set GPU_LEASE_URL to the broker's base URL, "
                "e.g. http://127.0.0.1:10101, or http://127.0.0.1:8000/services/gpu-lease "
                "behind JupyterHub (the hub admin can pass it with c.Spawner.environment)."
            )
        return cls(url, token or found.token, **kw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"

    def _http(self) -> httpx.AsyncClient:
        """The httpx client of the running event loop, made there on first use.

        Clients of loops that have been closed are forgotten: their connections went
        with their loop.
        """
        loop = asyncio.get_running_loop()
        with self._https_lock:
            http = self._https.get(loop)
            if http is None:
                for gone in [x for x in self._https if x.is_closed()]:
                    del self._https[gone]
                http = self._https[loop] = httpx.AsyncClient(
                    headers=self._headers,
                    transport=self._transport or self._checked(),
                    limits=self._limits,
                    timeout=httpx.Timeout(self.timeout),
                    follow_redirects=False,
                    verify=_ssl_context(),
                )
        return http

    def _checked(self) -> httpx.AsyncHTTPTransport | None:
        """A transport that checks who listens before the token is sent (``listeners.py``),
        or ``None`` (httpx's own) for a URL off this machine that an environment proxy
        (``HTTPS_PROXY``, ...) serves: httpx honours those only with its own transport."""
        host = httpx.URL(self._base).host
        if not _local(host) and any(urllib.request.getproxies_environment().values()):
            return None
        return checked_transport(self._owners, self.url, verify=_ssl_context(), limits=self._limits)

    async def _reconnect(self) -> None:
        """Drop this loop's connections before a retry: the next attempt connects anew.

        A kept-alive connection stays with the broker (or the balancer's backend) that
        failed; a new one resolves the name again and reaches the active broker.
        """
        loop = asyncio.get_running_loop()
        with self._https_lock:
            http = self._https.pop(loop, None)
        if http is not None:
            await http.aclose()

    async def aclose(self) -> None:
        """Close the connection pools. Called by ``async with`` or by the owner at shutdown.

        The running loop's pool is closed now. Another loop's pool is handed to that loop,
        which closes it when it runs next, and is never waited for: that loop may be blocked
        on this very call (jupyter_core's ``run_sync`` runs a synchronous manager's call on
        a nested runner loop while the outer one waits for it), though it says it is
        running. A pool of ``keep_alive=False`` holds no connection between calls anyway.
        """
        loop = asyncio.get_running_loop()
        with self._https_lock:
            https, self._https = self._https, {}
        for other, http in https.items():
            if other is loop:
                await http.aclose()
            elif not other.is_closed():
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    other.call_soon_threadsafe(_close_there, http)

    async def __aenter__(self: _C) -> _C:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- API -----------------------------------------------------------------
    # The call groups are made on each use: held, each would make a reference cycle, and a
    # client dropped unclosed would keep its connections until the garbage collector ran.
    @property
    def leases(self) -> LeaseCalls:
        """Lease calls: acquire (long-poll queueing), renew, release, revoke, list, queue."""
        return LeaseCalls(self)

    @property
    def quotas(self) -> QuotaCalls:
        """Quota and usage calls."""
        return QuotaCalls(self)

    @property
    def sessions(self) -> SessionCalls:
        """Class sessions: the timetable; start, extend and end (a course's instructors)."""
        return SessionCalls(self)

    @property
    def nodes(self) -> NodeCalls:
        """The node agent's calls: register, heartbeat, drain; the node list."""
        return NodeCalls(self)

    async def health(self) -> dict[str, Any]:
        """``GET /api/v1/health``: status, version, GPU count, active leases."""
        return self.json_object(await self.send("GET", "/health"))

    async def gpus(self) -> list[dict[str, Any]]:
        """``GET /api/v1/gpus``: the pool, one dict per GPU."""
        return self.json_list(await self.send("GET", "/gpus"), "gpus")

    # -- HTTP ----------------------------------------------------------------
    async def send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        read_timeout: float | None = None,
        retries: int | None = None,
    ) -> httpx.Response:
        """One API call with retries; returns a 2xx response or raises one of ours.

        ``path`` follows ``/api/v1`` (its segments already quoted). The call groups
        (``leases``, ``quotas``, ``nodes``) and ``health``/``gpus`` all come through here.
        ``read_timeout`` marks a long-poll: its read timeout is not retried (it
        already waited ``read_timeout`` seconds); connection failures still are.
        """
        url = self._base + API_PREFIX + path
        content: bytes | None = None
        headers: dict[str, str] = {}
        if body is not None:
            try:
                content = json.dumps(body, allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise errors.InvalidRequest(
                    f"Cannot send this request to the GPU lease broker: {exc}. "
                    "Use finite numbers, strings, lists and dicts only."
                ) from exc
            headers["Content-Type"] = "application/json"
        if read_timeout is None:
            timeout = httpx.Timeout(self.timeout)
        else:
            timeout = httpx.Timeout(self.timeout, read=read_timeout)
        attempts = (self.retries if retries is None else max(0, retries)) + 1
        problem = ""
        cause: Exception | None = None
        hint: float | None = None
        for attempt in range(attempts):
            if attempt:
                delay = self._delay(attempt - 1, hint)
                log.debug("%s %s: retrying in %.2f s after %s", method, path, delay, problem)
                await self._reconnect()
                await asyncio.sleep(delay)
            started = time.monotonic()
            try:
                response = await self._http().request(
                    method, url, params=params, content=content, headers=headers, timeout=timeout
                )
            except httpx.TimeoutException as exc:
                elapsed_ms = (time.monotonic() - started) * 1000
                log.debug("%s %s -> %s after %.0f ms", method, path, type(exc).__name__, elapsed_ms)
                if read_timeout is not None and not isinstance(exc, httpx.ConnectTimeout):
                    raise self._unavailable(
                        f"no answer to a long-poll within {read_timeout:g} s", attempt + 1
                    ) from exc
                problem, cause, hint = self._describe(exc), exc, None
                continue
            except httpx.TransportError as exc:
                elapsed_ms = (time.monotonic() - started) * 1000
                log.debug("%s %s -> %s after %.0f ms", method, path, type(exc).__name__, elapsed_ms)
                problem, cause, hint = self._describe(exc), exc, None
                continue
            except (httpx.HTTPError, httpx.InvalidURL) as exc:  # not worth retrying
                raise self._unavailable(self._describe(exc), attempt + 1) from exc
            elapsed_ms = (time.monotonic() - started) * 1000
            status = response.status_code
            log.debug("%s %s -> %d in %.0f ms", method, path, status, elapsed_ms)
            if status in RETRY_STATUSES:
                problem, cause, hint = self._describe_status(response), None, _retry_after(response)
                continue
            if 200 <= status < 300:
                return response
            raise self._error(response)
        raise self._unavailable(problem, attempts) from cause

    def _delay(self, attempt: int, hint: float | None) -> float:
        """Exponential backoff with "equal jitter", capped; a Retry-After hint is honoured up to the cap."""
        base = min(self.max_backoff, self.backoff * 2.0 ** min(attempt, 30))
        delay = base / 2 + random.uniform(0, base / 2)
        if hint is not None:
            delay = max(delay, min(hint, self.max_backoff))
        return delay

    # -- answers -------------------------------------------------------------
    def json_object(self, response: httpx.Response) -> dict[str, Any]:
        """A 2xx answer's JSON object, or :class:`errors.BrokerUnavailable` if it is none."""
        body = self._json(response)
        if not isinstance(body, dict):
            raise self._not_api(response, "a JSON object was expected")
        return body

    def json_list(self, response: httpx.Response, key: str) -> list[dict[str, Any]]:
        """A list answer, either ``{key: [...]}`` (the API's shape) or a bare list."""
        body = self._json(response)
        if isinstance(body, dict):
            body = body.get(key)
        if not isinstance(body, list):
            raise self._not_api(response, f"a JSON object with a {key!r} list was expected")
        return body

    def _json(self, response: httpx.Response) -> Any:
        body = _parse_json(response)
        if body is _NOT_JSON:
            raise self._not_api(response, "the body is not JSON")
        return body

    def _not_api(self, response: httpx.Response, why: str) -> errors.BrokerUnavailable:
        return errors.BrokerUnavailable(
            f"The GPU lease broker at {self.url} answered {response.request.method} "
            f"{response.url.path} with HTTP {response.status_code}, but {why} "
            f"({self._snippet(response)}): is this URL the broker's? {_URL_HINT}",
            url=self.url,
            http_status=response.status_code,
        )

    def _error(self, response: httpx.Response) -> errors.GPULeaseError:
        """Translate a non-2xx, non-retried answer into one of our exceptions."""
        status = response.status_code
        body = _parse_json(response)
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            return _from_error_body(status, body)
        # Not the broker's error body: a proxy, a login page, another server, a crash.
        cls = ERROR_BY_STATUS.get(status, errors.GPULeaseError)
        where = f"The GPU lease broker at {self.url} answered HTTP {status}"
        if 300 <= status < 400:
            location = self._scrub(response.headers.get("Location", "?"))
            message = (
                f"{where}, redirecting to {location}: usually a login page, so the token was "
                "not accepted or the URL is not the broker's. Check GPU_LEASE_URL and the "
                "token (GPU_LEASE_TOKEN or JUPYTERHUB_API_TOKEN)."
            )
        elif status in (401, 403):
            message = (
                f"{where}: the token was refused ({self._snippet(response)}). Check "
                "GPU_LEASE_TOKEN; behind JupyterHub the server's token needs the scope "
                "access:services!service=gpu-lease."
            )
        elif status == 404:
            # The broker answers its own 404s in JSON; this one comes from something else.
            cls = errors.BrokerUnavailable
            message = f"{where} from something that is not the broker ({self._snippet(response)}). {_URL_HINT}"
        else:
            message = (
                f"{where} without a JSON error body ({self._snippet(response)}). "
                "Check the broker's log; if this is not the broker, check GPU_LEASE_URL."
            )
        return cls(message, url=self.url, http_status=status)

    def _unavailable(self, problem: str, attempts: int) -> errors.BrokerUnavailable:
        tries = "1 attempt" if attempts == 1 else f"{attempts} attempts"
        return errors.BrokerUnavailable(
            f"Cannot reach the GPU lease broker at {self.url} ({problem}; {tries}). {_URL_HINT}",
            url=self.url,
            attempts=attempts,
        )

    def _describe(self, exc: Exception) -> str:
        text = str(exc).strip()
        return self._scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)

    def _describe_status(self, response: httpx.Response) -> str:
        text = f"HTTP {response.status_code}"
        body = _parse_json(response)
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            return f"{text}: {self._scrub(body['message'])}"
        return text

    def _snippet(self, response: httpx.Response, limit: int = 200) -> str:
        ctype = response.headers.get("Content-Type", "no content type").split(";")[0]
        try:
            text = " ".join(response.text.split())
        except (UnicodeDecodeError, LookupError):
            text = "<undecodable>"
        if not text:
            return f"{ctype}, empty"
        if len(text) > limit:
            text = text[:limit] + "..."
        return f"{ctype}: {self._scrub(text)!r}"

    def _scrub(self, text: str) -> str:
        return text.replace(self._token, "<token>") if self._token else text


#: the broker's error ``code`` -> our exception class
_BY_CODE: dict[str, type[errors.GPULeaseError]] = {
    cls.code: cls
    for cls in (
        errors.InvalidRequest,
        errors.NotAuthenticated,
        errors.Forbidden,
        errors.QuotaExceeded,
        errors.LeaseNotFound,
        errors.Conflict,
        errors.LeaseGone,
        errors.LeaseRevoked,
        errors.LeaseExpired,
        errors.BodyTooLarge,
        errors.CannotFit,
        errors.StoreError,
        errors.BrokerUnavailable,
    )
}


def _from_error_body(status: int, body: dict[str, Any]) -> errors.GPULeaseError:
    """Rebuild our exception from the broker's error body ``{"error", "message", ...}``."""
    code = body.get("error")
    cls = _BY_CODE.get(code) if isinstance(code, str) else None
    if cls is None:
        cls = ERROR_BY_STATUS.get(status, errors.GPULeaseError)
    details = {k: v for k, v in body.items() if k not in ("error", "message")}
    return cls(body["message"], **details)


def _close_there(http: httpx.AsyncClient) -> None:
    """Close ``http`` on the loop that runs this callback (its own; see ``aclose``)."""
    task = asyncio.ensure_future(http.aclose())
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


#: closes scheduled by ``_close_there``, held until done (the loop keeps only weak references)
_CLOSING: set[asyncio.Future[None]] = set()


def _parse_json(response: httpx.Response) -> Any:
    """The response's JSON, ``None`` for an empty body, or ``_NOT_JSON``."""
    if not response.content:
        return None
    try:
        return response.json()
    except (ValueError, UnicodeDecodeError):
        return _NOT_JSON


def _local(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    if host.lower().rstrip(".") in ("localhost", "localhost6") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _retry_after(response: httpx.Response) -> float | None:
    """A ``Retry-After: <seconds>`` header as a float (dates are ignored)."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
