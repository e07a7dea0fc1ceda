"""The node's orders as they arise: the long-poll the agent keeps open.

The broker's orders for a node (park, resume) are state: each is repeated in every
heartbeat's answer until the agent's outcome settles it (``parking.py`` runs them). Alone,
that makes an order wait for the agent's next heartbeat. :class:`OrderWatch` keeps one
long-poll open (``GET /api/v1/nodes/{node}/orders?after=CURSOR&timeout=S``, its own
connection), which the broker answers as soon as the node's due orders differ from those
of ``after``; when they changed and some are due, it sets :attr:`OrderWatch.due`, and
:func:`~provisioner.node.agent.run_agent` heartbeats at once. The orders themselves are
taken from that heartbeat's answer, as from any other (it proves the kernels they name and
carries the outcomes back), so a long-poll that races a heartbeat hands nothing twice, and
one that is lost (the broker restarted, a proxy cut it) costs only its speed: the next
heartbeat still carries every order.

A broker older than the long-poll answers 404 (or a proxy 405): the watch logs it once and
asks again after :data:`OLDER_RETRY` s (the broker may be upgraded meanwhile); orders come
with the heartbeats until then. A broker that cannot be reached is asked again after
:data:`RETRY` s.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..client import BrokerClient
from ..errors import BrokerUnavailable, GPULeaseError, MethodNotAllowed, NotFound, StoreError
from ..wire import ORDERS_WAIT

log = logging.getLogger("gpu_lease.agent")

#: seconds before a broker without the orders long-poll (404/405) is asked again
OLDER_RETRY = 600.0
#: seconds before the long-poll is tried again after the broker could not be reached
RETRY = 2.0
#: seconds before it is tried again after any other refusal (the heartbeat says why too)
REFUSED_RETRY = 30.0


class OrderWatch:
    """One long-poll for ``node``'s orders at a time, on ``client`` (a client of its own:
    its connection waits for ``wait`` s at a time); :attr:`due` is set when the orders
    changed and some are due (the agent heartbeats at once and clears it)."""

    def __init__(
        self,
        client: BrokerClient,
        node: str,
        wait: float = ORDERS_WAIT,
        *,
        retry: float = RETRY,
        older_retry: float = OLDER_RETRY,
        refused_retry: float = REFUSED_RETRY,
    ) -> None:
        self.client = client
        self.node = node
        self.wait = wait
        self.retry = retry
        self.older_retry = older_retry
        self.refused_retry = refused_retry
        #: set when the node's orders changed and some are due: heartbeat now
        self.due = asyncio.Event()
        #: the cursor of the orders last seen (None: none yet, the broker answers at once)
        self.cursor: str | None = None
        #: answers that brought changed, due orders (for the log and the tests)
        self.pushed = 0
        #: whether the broker was last found older than the long-poll
        self.older = False

    async def run(self, stop: asyncio.Event) -> None:
        """Long-poll until ``stop`` (or until cancelled)."""
        while not stop.is_set():
            try:
                pause = await self.poll()
            except Exception:  # noqa: BLE001 - the heartbeats carry the orders meanwhile
                log.exception("The orders long-poll of node %s failed", self.node)
                pause = self.refused_retry
            if pause > 0:
                try:
                    await asyncio.wait_for(stop.wait(), pause)
                except asyncio.TimeoutError:
                    pass

    async def poll(self) -> float:
        """One long-poll; returns the seconds to pause before the next (0: at once)."""
        started = time.monotonic()
        try:
            answer = await self.client.nodes.orders(self.node, self.cursor, self.wait)
        except (NotFound, MethodNotAllowed) as exc:
            self.cursor = None
            if isinstance(exc, NotFound) and exc.details.get("node"):
                # the broker forgot the node: the next heartbeat registers it again
                return self.retry
            if not self.older:
                log.warning(
                    "The broker has no orders long-poll (%s): node %s learns its orders "
                    "from its heartbeats (every --interval) until the broker is upgraded.",
                    exc.message,
                    self.node,
                )
            self.older = True
            return self.older_retry
        except (BrokerUnavailable, StoreError) as exc:
            log.debug("The orders long-poll of node %s failed: %s", self.node, exc.message)
            return self.retry
        except GPULeaseError as exc:
            log.warning("The broker refused node %s's orders long-poll: %s", self.node, exc.message)
            return self.refused_retry
        if self.older:
            log.info("The broker pushes node %s's orders again", self.node)
            self.older = False
        cursor = answer.get("cursor")
        orders = answer.get("orders") or []
        if cursor != self.cursor and (orders or answer.get("remote_kernel_orders")):
            self.pushed += 1
            log.debug("Orders for node %s changed (%d due): heartbeat now", self.node, len(orders))
            self.due.set()
        same = cursor == self.cursor
        self.cursor = str(cursor) if cursor is not None else None
        if same and time.monotonic() - started < self.wait / 2:
            # answered early with nothing new (a proxy that does not hold the request):
            # do not spin; the heartbeats carry the orders meanwhile
            return self.retry
        return 0.0


__all__ = ["OLDER_RETRY", "RETRY", "OrderWatch"]
