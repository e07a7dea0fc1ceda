"""The long-polls waiting now: acquires that wait for a grant, resumes that wait for a
parked lease to be active again, node agents that wait for their node's orders,
provisioners that wait for their remote kernel to start or end.

Each waits on a :class:`Waiter` (one per ``(user, kernel_id)`` for acquires, per lease id
for resumes, per node for orders, shared by the long-polls of that key) that a commit
concerning the key wakes
(``ServiceCore.commit``), and looks at the state again. A broker that stops serving wakes
them all, so that each answers 503, and waits (:meth:`LongPolls.answered`) until none
waits before it closes the connections (``serving.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class Waiter:
    """The long-polls (acquire, resume) waiting on one key; a commit that concerns it sets
    ``event``."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0

    async def pause(self, seconds: float) -> None:
        """Until the next wake-up, or ``seconds`` at most."""
        self.event.clear()
        try:
            await asyncio.wait_for(self.event.wait(), seconds)
        except asyncio.TimeoutError:
            pass


class LongPolls:
    """Who waits now, by key: :attr:`acquires`, :attr:`resumes` and :attr:`orders`."""

    def __init__(self) -> None:
        #: (user, kernel_id) -> the acquire long-polls waiting for its grant
        self.acquires: dict[tuple[str, str], Waiter] = {}
        #: lease id -> the resume long-polls waiting for it to be active again
        self.resumes: dict[str, Waiter] = {}
        #: node name -> its agent's long-polls waiting for a change of its orders
        self.orders: dict[str, Waiter] = {}
        #: lease id -> the long-polls waiting for its remote kernel's state to change
        self.kernels: dict[str, Waiter] = {}
        self._none_waiting: asyncio.Event | None = None

    def for_grant(self, key: tuple[str, str]) -> contextlib.AbstractContextManager[Waiter]:
        """The :class:`Waiter` of an acquire of ``(user, kernel_id)``, while it waits."""
        return self._waiter(self.acquires, key)

    def for_resume(self, lease_id: str) -> contextlib.AbstractContextManager[Waiter]:
        """The :class:`Waiter` of a resume of ``lease_id``, while it waits."""
        return self._waiter(self.resumes, lease_id)

    def for_orders(self, node: str) -> contextlib.AbstractContextManager[Waiter]:
        """The :class:`Waiter` of ``node``'s orders long-poll, while it waits."""
        return self._waiter(self.orders, node)

    def for_kernel(self, lease_id: str) -> contextlib.AbstractContextManager[Waiter]:
        """The :class:`Waiter` of a long-poll on ``lease_id``'s remote kernel."""
        return self._waiter(self.kernels, lease_id)

    @contextlib.contextmanager
    def _waiter(self, table: dict[K, Waiter], key: K) -> Iterator[Waiter]:
        """``key``'s :class:`Waiter` in ``table``, counted while one long-poll waits on it,
        dropped when none does."""
        waiter = table.setdefault(key, Waiter())
        waiter.count += 1
        try:
            yield waiter
        finally:
            waiter.count -= 1
            if waiter.count <= 0:
                table.pop(key, None)
            if self._none_waiting is not None and not self.waiting:
                self._none_waiting.set()

    @property
    def waiting(self) -> int:
        """How many long-polls are waiting now."""
        tables = (self.acquires, self.resumes, self.orders, self.kernels)
        return sum(w.count for table in tables for w in table.values())

    async def answered(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until no long-poll waits: after
        ``ServiceCore.stop_serving``, ``serving.py`` lets them answer 503 before it closes
        the connections."""
        if not self.waiting:
            return
        self._none_waiting = asyncio.Event()
        try:
            await asyncio.wait_for(self._none_waiting.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def wake_acquires(self, keys: Iterable[tuple[str, str]]) -> None:
        """The acquires of ``keys`` look again (granted, or dropped from the queue)."""
        for key in keys:
            waiter = self.acquires.get(key)
            if waiter is not None:
                waiter.event.set()

    def wake_resumes(self) -> None:
        """Every resume looks at its lease again (they are few)."""
        for waiter in self.resumes.values():
            waiter.event.set()

    def wake_orders(self, nodes: Iterable[str] | None = None) -> None:
        """The orders long-polls of ``nodes`` (None: every node's) look again."""
        for node in list(self.orders) if nodes is None else nodes:
            waiter = self.orders.get(node)
            if waiter is not None:
                waiter.event.set()

    def wake_kernels(self, lease_ids: Iterable[str] | None = None) -> None:
        """The remote-kernel long-polls of ``lease_ids`` (None: all) look again."""
        for lease_id in list(self.kernels) if lease_ids is None else lease_ids:
            waiter = self.kernels.get(lease_id)
            if waiter is not None:
                waiter.event.set()

    def wake_all(self) -> None:
        self.wake_acquires(list(self.acquires))
        self.wake_resumes()
        self.wake_orders()
        self.wake_kernels()


__all__ = ["LongPolls", "Waiter"]
