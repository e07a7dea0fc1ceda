"""``QueueWait``: a kernel's GPU request while it waits in the broker's queue.

The kernel's :class:`~provisioner.kernel.lease_keeper.LeaseKeeper` hands its acquire (the
long-polling ``client.leases.acquire``) to :meth:`QueueWait.wait`, with
:meth:`QueueWait.on_queued` as its ``on_queued``: each "queued" answer (place in the queue,
estimated wait) is kept in ``queued``, logged, and shown on the server's board (JupyterLab's
start dialog). When the student clicks "Stop waiting", the board calls
:meth:`QueueWait.stop_waiting`: the acquire is cancelled, the queued request withdrawn, and
the keeper turns the cancel into the refusal the student sees.

The wait knows its keeper only through :class:`QueueHolder`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

from ..client.answers import GrantedLease
from ..errors import GPULeaseError
from .broker_clients import BrokerClients
from .status import LeaseBoard


class QueueHolder(Protocol):
    """What a :class:`QueueWait` needs of the keeper that owns it (``LeaseKeeper``)."""

    @property
    def board(self) -> LeaseBoard | None:
        """The server's board JupyterLab reads (None outside a server)."""
        ...

    @property
    def kernel_id(self) -> str: ...


class QueueWait:
    """Owns the acquire under way: its task, the broker's latest "queued" answer, and the
    student's "Stop waiting"."""

    def __init__(
        self,
        holder: QueueHolder,
        clients: BrokerClients,
        *,
        log: logging.Logger | logging.LoggerAdapter[Any],
    ) -> None:
        self.holder = holder
        self.clients = clients
        self.log = log
        #: the broker's latest "queued" answer while an acquire waits (position, eta...)
        self.queued: dict[str, Any] | None = None
        #: the student stopped waiting: the acquire's cancel is theirs
        self.stopped = False
        self._acquiring: asyncio.Task[GrantedLease] | None = None

    async def wait(self, acquiring: Coroutine[Any, Any, GrantedLease]) -> GrantedLease:
        """The broker's lease, from ``acquiring`` (an acquire that long-polls while queued).
        Raises what it raises; ``CancelledError`` with ``stopped`` set where the student
        stopped waiting."""
        self.stopped = False
        self._acquiring = asyncio.ensure_future(acquiring)
        try:
            return await self._acquiring
        finally:
            self.queued = None
            self._acquiring = None

    def on_queued(self, answer: dict[str, Any]) -> None:
        """The broker's answer while the request waits in its queue."""
        self.queued = answer
        kernel_id = self.holder.kernel_id
        board = self.holder.board
        if board is not None:
            board.queued(kernel_id, answer)
        position = answer.get("position")
        self.log.info(
            "GPU request for kernel %s waits at position %d: %s",
            kernel_id,
            position if isinstance(position, int) else 0,
            answer.get("message") or answer.get("reason") or "the GPU pool is full",
        )

    async def stop_waiting(self) -> bool:
        """The student clicked "Stop waiting": give up the queue place; the start then fails.

        Called through the server's board by ``DELETE {base_url}gpu-lease/api/kernels/{id}/
        request``. The acquire is cancelled first (so it cannot post again), then the queued
        request is withdrawn by its id (a lease granted at that very moment has the same id
        and is released with it). False if the kernel is not waiting.
        """
        task = self._acquiring
        if task is None or task.done():
            return False
        self.stopped = True
        task.cancel()
        kernel_id = self.holder.kernel_id
        board = self.holder.board
        request_id = (self.queued or {}).get("id")
        if request_id is None and board is not None:
            record = board.get(kernel_id)
            request_id = record.request_id if record is not None else None
        try:
            async with self.clients.new() as client:
                if request_id is None:  # not told yet (the first long-poll is still out)
                    mine = [
                        q for q in await client.leases.queue() if q.get("kernel_id") == kernel_id
                    ]
                    request_id = mine[0].get("id") if mine else None
                if isinstance(request_id, str):
                    await client.leases.release(request_id)
        except GPULeaseError as exc:
            self.log.warning(
                "Could not withdraw the queued GPU request of kernel %s (the broker drops it "
                "when nobody polls for it): %s",
                kernel_id,
                exc,
            )
        return True


__all__ = ["QueueHolder", "QueueWait"]
