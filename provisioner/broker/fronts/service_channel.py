"""The broker's service across processes: HTTP in front processes, decisions in one.

With ``--http-processes N`` (``GPULeaseBroker.http_processes``) the broker process keeps
the :class:`~provisioner.broker.services.broker_service.BrokerService` (memory, the writer, the reaper:
every decision) and serves no HTTP itself; ``N`` front processes accept the connections
on the broker's address, run the same tornado app (the same handlers, authentication,
validation and JSON), and call the service through a :class:`RemoteService` over a
Unix socket. HTTP parsing and answering, token checks and JSON run beside the
decisions instead of taking turns with them under one interpreter lock.

The wire: frames of a 4-byte big-endian length and a pickle.

- front -> broker: ``("call", id, method, args, kwargs)`` and ``("cancel", id)`` (the
  HTTP client went away: a long-poll is cancelled as it is in one process);
- broker -> front: ``("ok", id, result, facts)`` or ``("error", id, exception)``;
  ``facts`` maps the id of each lease in ``result`` to
  ``service.queries.lease_facts(lease)``, which the handler asks for next when it writes
  the lease (one round trip, not two).

A ``method`` names a service and its method (``"leases.acquire"``), as the handlers call
them (``service.leases.acquire``), or one of :data:`ROOT_METHODS`. Only the methods in
:data:`METHODS` may be called. The socket lives in a directory only
the broker's user may enter, and the broker answers only processes of its own user
(``SO_PEERCRED``): a pickle from a front is trusted as the broker's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, cast

from ...errors import GPULeaseError, NotActive
from ...model import Lease
from ..services.broker_service import BrokerService
from ..services.leases import AcquireResult

log = logging.getLogger("gpu_lease.broker.remote")

_LEN = struct.Struct(">I")
#: the largest frame either side accepts (a history or lease list of a big site fits)
MAX_FRAME = 256 * 1024 * 1024

#: what a front may call: each service's API as the handlers use it (service -> methods)
METHODS: dict[str, frozenset[str]] = {
    "leases": frozenset({"acquire", "release", "renew", "revoke"}),
    "resumes": frozenset({"resume"}),
    "kernels": frozenset({"launch", "kernel", "signal"}),
    "queries": frozenset(
        {
            "get_lease",
            "list_leases",
            "queue",
            "queue_length",
            "gpus",
            "health",
            "lease_facts",
            "history",
        }
    ),
    "quotas": frozenset(
        {
            "get_quota",
            "my_quota",
            "check_may_read_quota_of",
            "effective_quota_of",
            "list_quotas",
            "put_quota",
            "delete_quota",
            "usage",
        }
    ),
    "nodes": frozenset(
        {"register_node", "drain_node", "node_heartbeat", "node_orders", "list_nodes"}
    ),
    "sessions": frozenset({"list", "start", "extend", "end"}),
}
#: what a front may call besides: the broker's policy, and its metrics rendered
ROOT_METHODS = frozenset({"policy", "render_metrics"})


def _pack(msg: tuple[Any, ...]) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


class _Link(asyncio.Protocol):
    """One end of the service socket: frames out (:meth:`send`), frames in (``frame``).

    A protocol, not streams: the frames that one read brings are parsed in that read's
    callback (no task, no await per frame). A frame that cannot be read drops the link.
    """

    #: for the log
    what = "The service connection"

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def frame(self, msg: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        buf: bytes | bytearray = data
        if self._buf:
            self._buf += data
            buf = self._buf
        pos, end = 0, len(buf)
        try:
            while end - pos >= _LEN.size:
                (n,) = _LEN.unpack_from(buf, pos)
                if n > MAX_FRAME:
                    raise ConnectionError(f"a frame of {n} bytes is more than {MAX_FRAME}")
                stop = pos + _LEN.size + n
                if stop > end:
                    break
                msg = pickle.loads(buf[pos + _LEN.size : stop])  # noqa: S301 (our own user)
                pos = stop
                self.frame(msg)
        except Exception as exc:  # noqa: BLE001 (whatever the frame was: drop the link)
            self.fault(exc)
            return
        if buf is self._buf:
            del self._buf[:pos]
        elif pos < end:
            self._buf += buf[pos:]

    def fault(self, exc: BaseException) -> None:
        """A frame could not be read: log it and drop the link."""
        log.error("%s failed", self.what, exc_info=exc)
        self._buf.clear()
        if self.transport is not None:
            self.transport.abort()


def _leases_in(result: Any) -> list[Lease]:
    if isinstance(result, Lease):
        return [result]
    if isinstance(result, AcquireResult) and result.lease is not None:
        return [result.lease]
    if isinstance(result, list) and result and isinstance(result[0], Lease):
        return result
    return []


# -- the broker's side -------------------------------------------------------------------


class ServiceServer:
    """Answers the fronts' calls with ``service`` (and ``metrics``) on a Unix socket."""

    def __init__(self, service: BrokerService, render_metrics: Callable[[], Any]) -> None:
        self.service = service
        self.render_metrics = render_metrics
        self._server: asyncio.AbstractServer | None = None
        self._links: set[_FrontLink] = set()

    async def start(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _FrontLink(self), path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for link in self._links for task in link.calls.values()]
        for link in list(self._links):
            if link.transport is not None:
                link.transport.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def target(self, name: str) -> Callable[..., Any]:
        if name == "render_metrics":
            return self.render_metrics
        if name == "policy":
            return lambda: self.service.policy
        part, _, method_name = name.partition(".")
        if method_name not in METHODS.get(part, ()):
            raise AttributeError(f"{name} may not be called by a front")
        method: Callable[..., Any] = getattr(getattr(self.service, part), method_name)
        return method


class _FrontLink(_Link):
    """The broker's end of one front's connection: each call answered in turn."""

    what = "A front's connection"

    def __init__(self, server: ServiceServer) -> None:
        super().__init__()
        self.server = server
        self.calls: dict[int, asyncio.Future[Any]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and not _same_user(sock):
            log.warning("Refused a connection to the service socket from another user")
            cast(asyncio.Transport, transport).abort()
            return
        self.server._links.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            log.warning("%s failed: %s", self.what, exc)
        self.server._links.discard(self)
        for call in list(self.calls.values()):  # its clients are gone with it
            call.cancel()

    def frame(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "cancel":
            if (cancelled := self.calls.get(msg[1])) is not None:
                cancelled.cancel()
            return
        _, rid, name, args, kwargs = msg
        try:
            result = self.server.target(name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (answered as an error)
            self.answer(rid, name, exc=exc)
            return
        if not inspect.isawaitable(result):
            self.answer(rid, name, result)
            return
        call = asyncio.ensure_future(result)
        self.calls[rid] = call
        call.add_done_callback(functools.partial(self._done, rid, name))

    def _done(self, rid: int, name: str, call: asyncio.Future[Any]) -> None:
        self.calls.pop(rid, None)
        if call.cancelled():
            return  # the front's client went away, or the broker stops
        exc = call.exception()
        if exc is None:
            self.answer(rid, name, call.result())
        else:
            self.answer(rid, name, exc=exc)

    def answer(
        self, rid: int, name: str, result: Any = None, exc: BaseException | None = None
    ) -> None:
        if exc is None:
            try:
                queries = self.server.service.queries
                facts = {x.id: queries.lease_facts(x) for x in _leases_in(result)}
            except Exception as failed:  # noqa: BLE001 (answered as an error)
                exc = failed
        if exc is None:
            reply: tuple[Any, ...] = ("ok", rid, result, facts)
        elif isinstance(exc, GPULeaseError):
            reply = ("error", rid, exc)
        else:  # the front logs it as a 500
            log.error("A front's call of %s failed", name, exc_info=exc)
            reply = ("error", rid, RuntimeError(f"{type(exc).__name__}: {exc}"))
        try:
            data = _pack(reply)
        except Exception:  # noqa: BLE001 (an answer that cannot be pickled: a 500, not a hang)
            log.exception("The answer to a front's call of %s cannot be sent", name)
            data = _pack(("error", rid, RuntimeError(f"the answer to {name} cannot be sent")))
        self.send(data)


def _same_user(sock: socket.socket) -> bool:
    if not hasattr(socket, "SO_PEERCRED"):  # not Linux: the directory's mode guards it
        return True
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


# -- a front's side ----------------------------------------------------------------------


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Set ``exc`` on ``fut``, marked as seen: the caller's task may be cancelled (its
    client went away, the front stops) before it reads it, and asyncio would log it."""
    fut.set_exception(exc)
    fut.add_done_callback(lambda f: f.exception())


def _gone() -> NotActive:
    return NotActive("The broker process is gone; retry in a moment.", retry_after=1)


class _Answer(asyncio.Future[Any]):
    """The answer to one call. Cancelling it (the HTTP client went away) tells the
    broker process, so a long-poll is cancelled there as it is in one process."""

    def __init__(self, remote: RemoteService, rid: int) -> None:
        super().__init__(loop=remote.loop)
        self._remote = remote
        self._rid = rid

    def cancel(self, msg: Any = None) -> bool:
        if not self.done():
            self._remote._cancel(self._rid)
        return super().cancel(msg=msg)


class _BrokerLink(_Link):
    """A front's end of the service socket."""

    what = "The broker's service connection"

    def __init__(self, remote: RemoteService) -> None:
        super().__init__()
        self.remote = remote

    def frame(self, msg: tuple[Any, ...]) -> None:
        self.remote._answer(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            log.warning("%s failed: %s", self.what, exc)
        self.remote._lost()


class _RemotePart:
    """One service of the broker (``leases``, ``quotas``, ...) as the handlers use it:
    each of its methods in :data:`METHODS` sends ``"PART.METHOD"`` and returns a future."""

    def __init__(self, remote: RemoteService, part: str) -> None:
        self._remote = remote
        self._part = part
        self._methods = METHODS[part]

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name not in self._methods:
            raise AttributeError(name)
        method = functools.partial(self._remote.call, f"{self._part}.{name}")
        setattr(self, name, method)  # found in the instance from now on
        return method


class _RemoteQueries(_RemotePart):
    """``queries``, whose :meth:`lease_facts` is answered from what came with the lease."""

    def lease_facts(self, lease: Lease) -> Any:
        """What came with ``lease`` (see the module), else a future that asks."""
        facts = self._remote._facts.pop(lease.id, None)
        return facts if facts is not None else self._remote.call("queries.lease_facts", lease)


class RemoteService:
    """The service's API, as the handlers use it, answered by the broker process.

    ``leases``, ``resumes``, ``kernels``, ``quotas``, ``nodes`` and ``queries`` stand for the broker's
    services: every method returns a future (the handlers await what may be remote);
    ``clock`` is this process's ``time.time`` and ``policy`` is asked once at
    :meth:`connect`.
    ``queries.lease_facts`` is answered from what came with the lease, else asked.
    ``lost`` is set when the broker's end closes (the front then exits).
    """

    def __init__(self) -> None:
        self.clock = time.time
        self.policy: Any = None
        self.lost = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self._ids = itertools.count()
        self._pending: dict[int, _Answer] = {}
        self._facts: dict[str, Any] = {}
        self._link: _BrokerLink | None = None
        self._idle: asyncio.Future[None] | None = None
        self.leases = _RemotePart(self, "leases")
        self.resumes = _RemotePart(self, "resumes")
        self.kernels = _RemotePart(self, "kernels")
        self.quotas = _RemotePart(self, "quotas")
        self.nodes = _RemotePart(self, "nodes")
        self.sessions = _RemotePart(self, "sessions")
        self.queries = _RemoteQueries(self, "queries")

    async def connect(self, path: str) -> None:
        _, self._link = await self.loop.create_unix_connection(lambda: _BrokerLink(self), path)
        self.policy = await self.call("policy")

    def close(self) -> None:
        if self._link is not None and self._link.transport is not None:
            self._link.transport.close()

    async def idle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until no call awaits its answer."""
        if self._pending:
            self._idle = self.loop.create_future()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._idle), timeout)

    def _settle_idle(self) -> None:
        if not self._pending and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _answer(self, msg: tuple[Any, ...]) -> None:
        fut = self._pending.pop(msg[1], None)
        self._settle_idle()
        if fut is None or fut.done():
            return
        if msg[0] == "ok":
            if len(self._facts) > 4096:  # a handler that failed never asked
                self._facts.clear()
            self._facts.update(msg[3])
            fut.set_result(msg[2])
        else:
            _fail(fut, msg[2])

    def _lost(self) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                _fail(fut, _gone())
        self._settle_idle()
        self.lost.set()

    def _cancel(self, rid: int) -> None:
        if self._pending.pop(rid, None) is not None and self._link is not None:
            self._link.send(_pack(("cancel", rid)))
            self._settle_idle()

    def call(self, name: str, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Send the call; the future is its answer (cancel it to cancel the call)."""
        if self.lost.is_set() or self._link is None:
            failed: asyncio.Future[Any] = self.loop.create_future()
            _fail(failed, _gone())
            return failed
        rid = next(self._ids)
        fut = self._pending[rid] = _Answer(self, rid)
        self._link.send(_pack(("call", rid, name, args, kwargs)))
        return fut

    def render_metrics(self) -> Any:
        return self.call("render_metrics")


class RemoteMetrics:
    """``GET /metrics`` in a front: the broker process renders its registry."""

    def __init__(self, remote: RemoteService) -> None:
        self.remote = remote

    def render(self) -> Any:
        return self.remote.render_metrics()


__all__ = ["METHODS", "ROOT_METHODS", "RemoteMetrics", "RemoteService", "ServiceServer"]
