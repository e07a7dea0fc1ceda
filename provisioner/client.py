"""The broker client: the only HTTP caller on the kernel and CLI side.

``BrokerClient`` speaks the broker's REST API v1 (docs/developers.md, "REST API") over an
``httpx.AsyncClient``. It is used by the kernel provisioner (acquire before
launch, renew while the kernel lives, release at the end) and by the CLI
(``gpu-lease top``, ``leases``, ``quota``, ``usage``).

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
message, a ``repr`` or a log line. The HTTP transport is injectable
(``transport=``), so tests can play the broker with ``httpx.MockTransport``.

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
import inspect
import json
import logging
import math
import os
import random
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from . import errors
from ._version import __version__
from .model import QUOTA_LEVEL_PLURALS, quota_key_problem
from .wire import ERROR_BY_STATUS, MAX_WAIT

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
QueuedCallback = Callable[[dict[str, Any]], Awaitable[None] | None]

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


def _quote(segment: str) -> str:
    return quote(segment, safe="")


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One verifying SSL context per process, built on first use.

    httpx builds a fresh one (loading the whole CA bundle, ~50 ms) for every client
    otherwise, and the provisioner makes a client per kernel start.
    """
    return ssl.create_default_context()


def no_capacity_message(fraction: float, queue_timeout: float, answer: dict[str, Any]) -> str:
    """What the student reads when a GPU kernel gave up waiting: once the place in the
    queue, the broker's ``reason`` (how full the GPUs are, and whether a smaller kernel
    would fit now), and what to do. Pure: the last ``202`` answer is passed in."""
    position, length = answer.get("position"), answer.get("queue_length")
    where = ""
    if isinstance(position, int) and position > 0:
        where = f"; it was at position {position}"
        if isinstance(length, int) and length >= position:
            where += f" of {length}"
        where += " in the queue"
    reason = answer.get("reason")
    if not isinstance(reason, str):  # an older broker: its message repeats the position
        reason = ""
    text = (
        f"No GPU became free for this kernel ({fraction:g} of a GPU) within "
        f"{_waited(queue_timeout)}{where}."
    )
    if reason.strip():
        text += " " + reason.strip()
    return text + " Try again later, or ask your instructor or administrator about GPU capacity."


def _waited(seconds: float) -> str:
    """30 -> "30 s", 600 -> "10 minutes", 90 -> "1.5 minutes"."""
    if seconds < 120:
        return f"{seconds:g} s"
    return f"{round(seconds / 60, 1):g} minutes"


class BrokerClient:
    """Async client of the gpu-lease broker's REST API v1.

    ``url`` is the broker's base URL (``http://127.0.0.1:10101``, or
    ``http://127.0.0.1:8000/services/gpu-lease`` through JupyterHub's proxy);
    ``/api/v1/...`` is appended. ``timeout`` (s) bounds each ordinary call; a
    long-poll acquire may read for ``wait + timeout``. Failed calls are retried up
    to ``retries`` times, sleeping ``backoff * 2**n`` seconds (with jitter, at most
    ``max_backoff``) in between. ``keep_alive=False`` opens a connection per call
    (for callers whose calls are seconds apart and may run on different event loops).
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
    ) -> None:
        self._base = normalize_url(url)
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
                    transport=self._transport,
                    limits=self._limits,
                    timeout=httpx.Timeout(self.timeout),
                    follow_redirects=False,
                    verify=_ssl_context(),
                )
        return http

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
    async def health(self) -> dict[str, Any]:
        """``GET /api/v1/health``: status, version, GPU count, active leases."""
        return self._dict(await self._send("GET", "/health"))

    async def gpus(self) -> list[dict[str, Any]]:
        """``GET /api/v1/gpus``: the pool, one dict per GPU."""
        return self._items(await self._send("GET", "/gpus"), "gpus")

    async def acquire(
        self,
        kernel_id: str,
        fraction: float,
        *,
        node: str | None = None,
        gpu_uuids: list[str] | None = None,
        group: str | None = None,
        wait: float = 30.0,
        queue_timeout: float | None = None,
        on_queued: QueuedCallback | None = None,
        mps_uid: int | None = None,
    ) -> dict[str, Any]:
        """Acquire a lease for ``kernel_id``, waiting in the queue if the pool is full.

        Called by the provisioner's ``pre_launch`` before the kernel exists. Each
        long-poll asks the broker to hold the answer up to ``wait`` seconds; a
        ``202 {queued: true, position, ...}`` answer is passed to ``on_queued``
        (sync or async) and the same request is posted again, keeping its queue
        place, until a lease comes or ``queue_timeout`` seconds (``None``: no
        limit) have passed. Then :class:`errors.NoCapacity` is raised, after a
        best-effort cancel of the queued request. ``mps_uid`` (enforcement=mps kernels
        only): the Unix uid the kernel runs as, so that the broker places it only where
        the GPU's MPS server serves that uid or none.
        """
        body: dict[str, Any] = {"kernel_id": kernel_id, "fraction": fraction}
        if mps_uid is not None:
            body["mps_uid"] = mps_uid
        if node is not None:
            body["node"] = node
        if gpu_uuids is not None:
            body["gpu_uuids"] = list(gpu_uuids)
        if group is not None:
            body["group"] = group
        deadline = None if queue_timeout is None else time.monotonic() + max(0.0, queue_timeout)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            poll_wait = min(wait, MAX_WAIT) if remaining is None else min(wait, remaining, MAX_WAIT)
            poll_wait = max(0.0, poll_wait)
            started = time.monotonic()
            response = await self._send(
                "POST",
                "/leases",
                body={**body, "wait": poll_wait},
                read_timeout=poll_wait + self.timeout,
            )
            answer = self._dict(response)
            if response.status_code != 202:
                return answer
            log.debug("queued for kernel %s at position %s", kernel_id, answer.get("position"))
            if on_queued is not None:
                result = on_queued(answer)
                if inspect.isawaitable(result):
                    await result
            if deadline is not None and time.monotonic() >= deadline:
                await self._cancel_queued(answer)
                raise self._no_capacity(fraction, queue_timeout or 0.0, answer)
            # A broker that answers 202 at once (wait 0, or a lower cap) is not hammered.
            pause = self.backoff - (time.monotonic() - started)
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
            if pause > 0:
                await asyncio.sleep(pause)

    async def renew(
        self,
        lease_id: str,
        *,
        pid: int | None = None,
        execution_state: str | None = None,
        last_activity: float | None = None,
        pid_ns: int | None = None,
        cgroup: str | None = None,
    ) -> dict[str, Any]:
        """Heartbeat: ``POST /api/v1/leases/{id}/renew``; returns the renewed lease.

        ``pid_ns``: the inode of the pid namespace ``pid`` is numbered in; ``cgroup``: the
        kernel's cgroup v2 path (from the v2 root) for a driver memory limit.
        Raises :class:`errors.LeaseRevoked` / :class:`errors.LeaseExpired` (410) when
        the lease has ended; ``details['reason']`` says why.
        """
        body: dict[str, Any] = {}
        if pid is not None:
            body["pid"] = pid
        if pid_ns is not None:
            body["pid_ns"] = pid_ns
        if cgroup is not None:
            body["cgroup"] = cgroup
        if execution_state is not None:
            body["execution_state"] = execution_state
        if last_activity is not None:
            body["last_activity"] = last_activity
        return self._dict(await self._send("POST", f"/leases/{_quote(lease_id)}/renew", body=body))

    async def release(self, lease_id: str) -> None:
        """``DELETE /api/v1/leases/{id}``. A lease the broker no longer knows (404)
        or that has already ended (410) counts as released, so this is idempotent."""
        try:
            await self._send("DELETE", f"/leases/{_quote(lease_id)}")
        except (errors.LeaseNotFound, errors.LeaseGone) as exc:
            log.debug("lease %s was already released (%s)", lease_id, exc.code)

    async def revoke(self, lease_id: str, reason: str) -> dict[str, Any]:
        """Admin: ``POST /api/v1/leases/{id}/revoke {reason}``; returns the ended lease.

        The lease's provisioner learns at its next renewal (410 with ``reason``) and
        shuts the kernel down. A lease that has already ended raises
        :class:`errors.LeaseGone`.
        """
        return self._dict(
            await self._send("POST", f"/leases/{_quote(lease_id)}/revoke", body={"reason": reason})
        )

    # -- node agents (``gpu-lease agent``) ------------------------------------------------
    async def register_node(
        self, node: str, gpus: list[dict[str, Any]], agent_version: str, enforce: str = "report"
    ) -> dict[str, Any]:
        """``PUT /api/v1/nodes/{node}``: register or refresh the node's GPUs; undrains it."""
        body = {"gpus": gpus, "agent_version": agent_version, "enforce": enforce}
        return self._dict(await self._send("PUT", f"/nodes/{_quote(node)}", body=body))

    async def node_heartbeat(
        self,
        node: str,
        usage: list[dict[str, Any]],
        at: float | None = None,
        mps: dict[str, str] | None = None,
        mps_uid: dict[str, int | None] | None = None,
        kernels: list[dict[str, int]] | None = None,
        driver_limits: list[str] | None = None,
    ) -> dict[str, Any]:
        """``POST /api/v1/nodes/{node}/heartbeat``; raises ``LeaseNotFound`` if unregistered.

        ``mps``: GPU uuid -> ``running`` | ``down`` of the agent's MPS daemons (``--mps``);
        ``mps_uid``: GPU uuid -> the uid its MPS server serves clients of (None: none).
        ``kernels``: ``{pid, pid_ns, host_pid}`` of the namespaced kernels the agent found;
        ``driver_limits``: the kernel cgroups whose driver memory limit is in force.
        """
        body: dict[str, Any] = {"usage": usage}
        if at is not None:
            body["at"] = at
        if mps is not None:
            body["mps"] = mps
        if mps_uid is not None:
            body["mps_uid"] = mps_uid
        if kernels:
            body["kernels"] = kernels
        if driver_limits is not None:
            body["driver_limits"] = driver_limits
        return self._dict(
            await self._send("POST", f"/nodes/{_quote(node)}/heartbeat", body=body, retries=0)
        )

    async def drain_node(self, node: str) -> None:
        """``DELETE /api/v1/nodes/{node}``: no new leases there (a clean agent stop)."""
        await self._send("DELETE", f"/nodes/{_quote(node)}")

    async def nodes(self) -> list[dict[str, Any]]:
        """``GET /api/v1/nodes``."""
        return self._items(await self._send("GET", "/nodes"), "nodes")

    async def effective_quota(self, user: str) -> dict[str, Any]:
        """``GET /api/v1/quotas/users/{name}?effective=1``: ``user``'s effective quota as
        admission applies it, the source of each value and their own record (admin, or
        the user themself)."""
        return self._dict(
            await self._send("GET", self._quota_path("user", user), params={"effective": "1"})
        )

    async def my_quota(self) -> dict[str, Any]:
        """``GET /api/v1/quotas/me``: the caller's effective quota and what they hold now."""
        return self._dict(await self._send("GET", "/quotas/me"))

    async def get_lease(self, lease_id: str) -> dict[str, Any]:
        """``GET /api/v1/leases/{id}``."""
        return self._dict(await self._send("GET", f"/leases/{_quote(lease_id)}"))

    async def list_leases(
        self, *, user: str | None = None, all: bool = False
    ) -> list[dict[str, Any]]:
        """``GET /api/v1/leases[?user=&all=1]``: the caller's leases, or (admin) anyone's."""
        params: dict[str, str] = {}
        if user is not None:
            params["user"] = user
        if all:
            params["all"] = "1"
        return self._items(await self._send("GET", "/leases", params=params), "leases")

    async def queue(self) -> list[dict[str, Any]]:
        """``GET /api/v1/queue``: waiting requests with their positions."""
        return self._items(await self._send("GET", "/queue"), "queue")

    async def queue_page(self) -> dict[str, Any]:
        """``GET /api/v1/queue`` whole: ``{"queue": [...], "length": N}`` (N: everyone waiting)."""
        page = self._dict(await self._send("GET", "/queue"))
        if not isinstance(page.get("queue"), list):
            page["queue"] = []
        return page

    async def get_quota(self, level: str, name: str | None = None) -> dict[str, Any]:
        """``GET /api/v1/quotas/default|users/{name}|groups/{name}``."""
        return self._dict(await self._send("GET", self._quota_path(level, name)))

    async def list_quotas(self) -> dict[str, Any]:
        """``GET /api/v1/quotas``: ``{"default": {...}, "groups": {...}, "users": {...}}``."""
        return self._dict(await self._send("GET", "/quotas"))

    async def set_quota(
        self, level: str, name: str | None, quota: dict[str, Any]
    ) -> dict[str, Any]:
        """``PUT`` a quota at ``level`` (``default``, ``user`` or ``group``); returns it as stored."""
        return self._dict(await self._send("PUT", self._quota_path(level, name), body=quota))

    async def delete_quota(self, level: str, name: str | None) -> None:
        """``DELETE`` the quota at ``level``."""
        await self._send("DELETE", self._quota_path(level, name))

    async def usage(self, *, since: float | str | None = None, by: str = "user") -> dict[str, Any]:
        """``GET /api/v1/usage?since=&by=``: fraction-hours used, per user or group."""
        params: dict[str, str] = {"by": by}
        if since is not None:
            params["since"] = str(since)
        return self._dict(await self._send("GET", "/usage", params=params))

    # -- HTTP ----------------------------------------------------------------
    async def _send(
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
    def _dict(self, response: httpx.Response) -> dict[str, Any]:
        body = self._json(response)
        if not isinstance(body, dict):
            raise self._not_api(response, "a JSON object was expected")
        return body

    def _items(self, response: httpx.Response, key: str) -> list[dict[str, Any]]:
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

    def _no_capacity(
        self, fraction: float, queue_timeout: float, answer: dict[str, Any]
    ) -> errors.NoCapacity:
        """The sentence a student reads when the queue timeout ran out (from the last 202)."""
        return errors.NoCapacity(
            no_capacity_message(fraction, queue_timeout, answer),
            position=answer.get("position"),
            body=answer,
        )

    async def _cancel_queued(self, answer: dict[str, Any]) -> None:
        """Best effort: withdraw a queued request so it stops holding a place."""
        request_id = answer.get("id")
        if not isinstance(request_id, str) or not request_id:
            return
        try:
            await self._send("DELETE", f"/leases/{_quote(request_id)}", retries=0)
        except errors.GPULeaseError as exc:
            log.debug("could not cancel queued request %s: %s", request_id, exc.code)

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

    @staticmethod
    def _quota_path(level: str, name: str | None) -> str:
        # a named level, in the singular ("user") or as in the URL ("users")
        singulars = {plural: one for one, plural in QUOTA_LEVEL_PLURALS.items()}
        level = singulars.get(level, level)
        why = quota_key_problem(level, name or "")
        if why:
            raise errors.InvalidRequest(why)
        if level == "default":
            return "/quotas/default"
        return f"/quotas/{QUOTA_LEVEL_PLURALS[level]}/{_quote(name or '')}"


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
