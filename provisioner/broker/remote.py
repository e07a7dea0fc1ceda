"""The broker's service across processes: HTTP in front processes, decisions in one.

With ``--http-processes N`` (``GPULeaseBroker.http_processes``) the broker process keeps
the :class:`~provisioner.broker.service.BrokerService` (memory, the writer, the reaper:
every decision) and serves no HTTP itself; ``N`` front processes accept the connections
on the broker's address, run the same tornado app (the same handlers, authentication,
validation and JSON), and call the service through a :class:`RemoteService` over a
Unix socket. HTTP parsing and answering, token checks and JSON run beside the
decisions instead of taking turns with them under one interpreter lock.

The wire: frames of a 4-byte big-endian length and a pickle.

- front -> broker: ``("call", id, method, args, kwargs)`` and ``("cancel", id)`` (the
  HTTP client went away: a long-poll is cancelled as it is in one process);
- broker -> front: ``("ok", id, result, facts)`` or ``("error", id, exception)``;
  ``facts`` maps the id of each lease in ``result`` to ``service.lease_facts(lease)``,
  which the handler asks for next when it writes the lease (one round trip, not two).

Only the methods in :data:`METHODS` may be called. The socket lives in a directory only
the broker's user may enter, and the broker answers only processes of its own user
(``SO_PEERCRED``): a pickle from a front is trusted as the broker's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from ..errors import GPULeaseError, NotActive
from ..model import Lease
from .service import AcquireResult, BrokerService

log = logging.getLogger("gpu_lease.broker.remote")

_LEN = struct.Struct(">I")
#: the largest frame either side accepts (a history or lease list of a big site fits)
MAX_FRAME = 256 * 1024 * 1024

#: what a front may call: the service's API as the handlers use it
METHODS = frozenset(
    {
        "acquire",
        "release",
        "renew",
        "revoke",
        "get_lease",
        "list_leases",
        "queue",
        "queue_length",
        "gpus",
        "health",
        "get_quota",
        "my_quota",
        "check_may_read_quota_of",
        "effective_quota_of",
        "list_quotas",
        "put_quota",
        "delete_quota",
        "usage",
        "history",
        "register_node",
        "drain_node",
        "node_heartbeat",
        "list_nodes",
        "lease_facts",
        "policy",
        "render_metrics",
    }
)


def _pack(msg: tuple[Any, ...]) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


async def _read(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    """The next frame, or None at the end of the stream."""
    try:
        head = await reader.readexactly(_LEN.size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes is more than {MAX_FRAME}")
    try:
        return pickle.loads(await reader.readexactly(n))  # noqa: S301 (our own user: see above)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


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
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _target(self, name: str) -> Callable[..., Any]:
        if name not in METHODS:
            raise AttributeError(f"{name} may not be called by a front")
        if name == "render_metrics":
            return self.render_metrics
        if name == "policy":
            return lambda: self.service.policy
        return getattr(self.service, name)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None and not _same_user(sock):
            log.warning("Refused a connection to the service socket from another user")
            writer.close()
            return
        calls: dict[int, asyncio.Task[None]] = {}

        async def call(rid: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            try:
                result = self._target(name)(*args, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
                facts = {x.id: self.service.lease_facts(x) for x in _leases_in(result)}
                reply: tuple[Any, ...] = ("ok", rid, result, facts)
            except asyncio.CancelledError:
                return  # the front's client went away, or the broker stops
            except GPULeaseError as exc:
                reply = ("error", rid, exc)
            except Exception as exc:  # noqa: BLE001 (the front logs it as a 500)
                log.exception("A front's call of %s failed", name)
                reply = ("error", rid, RuntimeError(f"{type(exc).__name__}: {exc}"))
            finally:
                calls.pop(rid, None)
            try:
                data = _pack(reply)
            except Exception:  # noqa: BLE001 (an answer that cannot be pickled: a 500, not a hang)
                log.exception("The answer to a front's call of %s cannot be sent", name)
                data = _pack(("error", rid, RuntimeError(f"the answer to {name} cannot be sent")))
            if not writer.is_closing():
                writer.write(data)

        try:
            while (msg := await _read(reader)) is not None:
                if msg[0] == "call":
                    task = asyncio.create_task(call(*msg[1:]))
                    calls[msg[1]] = task
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif msg[0] == "cancel" and (cancelled := calls.get(msg[1])) is not None:
                    cancelled.cancel()
        except ConnectionError as exc:
            log.warning("A front's connection failed: %s", exc)
        except Exception:  # noqa: BLE001 (a frame that cannot be read: drop the front's link)
            log.exception("A front's connection failed")
        finally:
            for task in calls.values():  # its clients are gone with it
                task.cancel()
            writer.close()


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


class RemoteService:
    """The service's API, as the handlers use it, answered by the broker process.

    Every method is a coroutine (the handlers await what may be remote); ``clock`` is
    this process's ``time.time`` and ``policy`` is asked once at :meth:`connect`.
    :meth:`lease_facts` is answered from what came with the lease, else asked.
    ``lost`` is set when the broker's end closes (the front then exits).
    """

    def __init__(self) -> None:
        self.clock = time.time
        self.policy: Any = None
        self.lost = asyncio.Event()
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._facts: dict[str, Any] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._idle: asyncio.Future[None] | None = None

    async def connect(self, path: str) -> None:
        reader, self._writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        self._reading = asyncio.create_task(self._read_replies(reader))
        self.policy = await self.call("policy")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    async def idle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until no call awaits its answer."""
        if self._pending:
            self._idle = asyncio.get_running_loop().create_future()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._idle), timeout)

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await _read(reader)) is not None:
                fut = self._pending.pop(msg[1], None)
                if not self._pending and self._idle is not None and not self._idle.done():
                    self._idle.set_result(None)
                if fut is None or fut.done():
                    continue
                if msg[0] == "ok":
                    if len(self._facts) > 4096:  # a handler that failed never asked
                        self._facts.clear()
                    self._facts.update(msg[3])
                    fut.set_result(msg[2])
                else:
                    _fail(fut, msg[2])
        except ConnectionError as exc:
            log.warning("The broker's service connection failed: %s", exc)
        except Exception:  # noqa: BLE001 (an answer that cannot be read: this front exits)
            log.exception("The broker's service connection failed")
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    _fail(
                        fut,
                        NotActive("The broker process is gone; retry in a moment.", retry_after=1),
                    )
            self._pending.clear()
            if self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
            self.lost.set()

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.lost.is_set() or self._writer is None:
            raise NotActive("The broker process is gone; retry in a moment.", retry_after=1)
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._writer.write(_pack(("call", rid, name, args, kwargs)))
        try:
            return await fut
        except asyncio.CancelledError:
            if self._pending.pop(rid, None) is not None and not self._writer.is_closing():
                self._writer.write(_pack(("cancel", rid)))
            raise

    def lease_facts(self, lease: Lease) -> Any:
        """What came with ``lease`` (see the module), else a coroutine that asks."""
        facts = self._facts.pop(lease.id, None)
        return facts if facts is not None else self.call("lease_facts", lease)

    def render_metrics(self) -> Any:
        return self.call("render_metrics")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in METHODS:
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)


class RemoteMetrics:
    """``GET /metrics`` in a front: the broker process renders its registry."""

    def __init__(self, remote: RemoteService) -> None:
        self.remote = remote

    def render(self) -> Any:
        return self.remote.render_metrics()


__all__ = ["METHODS", "RemoteMetrics", "RemoteService", "ServiceServer"]
