"""The broker client: the only HTTP caller on the kernel and CLI side.

``BrokerClient`` speaks the broker's REST API v1 (see DESIGN.md) over an
``httpx.AsyncClient``. It is used by the kernel provisioner (acquire before
launch, renew while the kernel lives, release at the end) and by the CLI
(``gpu-lease top``, ``leases``, ``quota``, ``usage``).

It is the edge where HTTP meets the rest of the package, so it is the one place
that turns answers back into our exceptions (:mod:`provisioner.errors`):

- a non-2xx answer carrying the broker's JSON error body becomes the matching
  exception through :func:`errors.from_response`;
- any other non-2xx answer becomes an exception whose message says what was
  answered and what to check;
- connection errors, timeouts and 502/503/504 are retried with exponential
  backoff and jitter, then become :class:`errors.BrokerUnavailable`;
- no httpx (or other foreign) exception escapes: ``raise OurError(...) from exc``.

Every call is safe to retry: acquire is idempotent per ``(user, kernel_id)``,
renew and release are idempotent, and the quota calls are PUT/GET/DELETE.

The token is sent as ``Authorization: token <token>`` and never appears in a
message, a ``repr`` or a log line. The HTTP transport is injectable
(``transport=``), so tests can play the broker with ``httpx.MockTransport``.
Nothing is read from the environment at import; :meth:`BrokerClient.from_env`
reads it when called.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import os
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from . import errors
from ._version import __version__

log = logging.getLogger("gpu_lease.client")

API_PREFIX = "/api/v1"
#: the broker caps a long-poll's ``wait`` at this many seconds
MAX_WAIT = 300.0
DEFAULT_USER_AGENT = f"jupyter-gpu-lease/{__version__}"

#: answers that mean "the broker (or the proxy in front of it) is not ready": retried
RETRY_STATUSES = frozenset({502, 503, 504})

_QUOTA_LEVELS = {"user": "users", "users": "users", "group": "groups", "groups": "groups"}
_URL_HINT = (
    "Is the gpu-lease broker running? Check GPU_LEASE_URL (or the provisioner's broker_url): "
    "it should be the broker's base URL, e.g. http://127.0.0.1:10101, or "
    "http://127.0.0.1:8000/services/gpu-lease behind JupyterHub, where the gpu-lease "
    "service must be up."
)
_NOT_JSON = object()

_C = TypeVar("_C", bound="BrokerClient")
QueuedCallback = Callable[[dict[str, Any]], Awaitable[None] | None]


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


class BrokerClient:
    """Async client of the gpu-lease broker's REST API v1.

    ``url`` is the broker's base URL (``http://127.0.0.1:10101``, or
    ``http://127.0.0.1:8000/services/gpu-lease`` through JupyterHub's proxy);
    ``/api/v1/...`` is appended. ``timeout`` (s) bounds each ordinary call; a
    long-poll acquire may read for ``wait + timeout``. Failed calls are retried up
    to ``retries`` times, sleeping ``backoff * 2**n`` seconds (with jitter, at most
    ``max_backoff``) in between.
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
        self._http = httpx.AsyncClient(
            headers=headers,
            transport=transport,
            timeout=httpx.Timeout(self.timeout),
            follow_redirects=False,
            verify=_ssl_context(),
        )

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

        ``url`` defaults to ``GPU_LEASE_URL``; ``token`` to ``GPU_LEASE_TOKEN``, else
        ``JUPYTERHUB_API_TOKEN`` (the single-user server's token). Explicit
        arguments win; ``kw`` goes to the constructor.
        """
        env = os.environ if environ is None else environ
        url = url or env.get("GPU_LEASE_URL") or None
        if not url:
            raise errors.InvalidRequest(
                "No GPU lease broker URL is set: set GPU_LEASE_URL to the broker's base URL, "
                "e.g. http://127.0.0.1:10101, or http://127.0.0.1:8000/services/gpu-lease "
                "behind JupyterHub (the hub admin can pass it with c.Spawner.environment)."
            )
        token = token or env.get("GPU_LEASE_TOKEN") or env.get("JUPYTERHUB_API_TOKEN") or None
        return cls(url, token, **kw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"

    async def aclose(self) -> None:
        """Close the connection pool. Called by ``async with`` or by the owner at shutdown."""
        await self._http.aclose()

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
    ) -> dict[str, Any]:
        """Acquire a lease for ``kernel_id``, waiting in the queue if the pool is full.

        Called by the provisioner's ``pre_launch`` before the kernel exists. Each
        long-poll asks the broker to hold the answer up to ``wait`` seconds; a
        ``202 {queued: true, position, ...}`` answer is passed to ``on_queued``
        (sync or async) and the same request is posted again, keeping its queue
        place, until a lease comes or ``queue_timeout`` seconds (``None``: no
        limit) have passed. Then :class:`errors.NoCapacity` is raised, after a
        best-effort cancel of the queued request.
        """
        body: dict[str, Any] = {"kernel_id": kernel_id, "fraction": fraction}
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
    ) -> dict[str, Any]:
        """Heartbeat: ``POST /api/v1/leases/{id}/renew``; returns the renewed lease.

        Raises :class:`errors.LeaseRevoked` / :class:`errors.LeaseExpired` (410) when
        the lease has ended; ``details['reason']`` says why.
        """
        body: dict[str, Any] = {}
        if pid is not None:
            body["pid"] = pid
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
                await asyncio.sleep(delay)
            started = time.monotonic()
            try:
                response = await self._http.request(
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
            return errors.from_response(status, body)
        # Not the broker's error body: a proxy, a login page, another server, a crash.
        cls = type(errors.from_response(status, None))
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
        position = answer.get("position")
        broker_message = answer.get("message")
        message = (
            f"No GPU capacity for a {fraction:g} GPU lease became free within {queue_timeout:g} s: "
            f"the request was still waiting at position {position} in the queue."
        )
        if isinstance(broker_message, str) and broker_message:
            message += f" The broker said: {broker_message.rstrip('.')}."
        message += (
            " Try again later, choose a kernel with a smaller GPU fraction, "
            "or ask an admin about GPU capacity."
        )
        return errors.NoCapacity(message, position=position, body=answer)

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
        if level == "default":
            if name:
                raise errors.InvalidRequest(
                    f"The default quota has no name (got {name!r}): leave the name out, or "
                    "use the level 'user' or 'group'."
                )
            return "/quotas/default"
        plural = _QUOTA_LEVELS.get(level)
        if plural is None:
            raise errors.InvalidRequest(
                f"Unknown quota level {level!r}: use 'default', 'user' or 'group'."
            )
        if not name:
            raise errors.InvalidRequest(f"A {level} quota needs the {level} name.")
        return f"/quotas/{plural}/{_quote(name)}"


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
