"""Group commit: the broker's one database thread, so that the event loop never waits on I/O.

Who calls this: :class:`~provisioner.broker.services.service_core.ServiceCore` (the services), for every store
call once it serves. The service decides and applies a change to memory on the event
loop, then ``await``s :meth:`Writer.write`; the writer's thread persists every change
submitted while its previous transaction committed in ONE transaction
(:meth:`Store.write_changes`), so 64 concurrent acquires cost about one commit, not
64, and no request waits for another's commit latency on the loop.

Jobs run in the order they were submitted: consecutive ``write`` jobs are merged into
one batch; a ``call`` (a read, or a rare write such as a quota or a node) runs alone.

Failure is all or nothing, and a failed batch poisons: when a batch fails (the database is down, it
refused a grant because another writer changed it, the fence refused), every waiting
caller of that batch gets the exception, and so does every write submitted after it
(they were decided on a memory that holds the failed changes), until :meth:`recover`
runs a job that reloads the state from the database (the service's reconcile); a
``call`` submitted meanwhile fails too, unless it is a read. A failed ``call`` does
not poison: its caller restores what it changed in memory. So no
caller is ever told "done" about a change that is not in the database, and no change
decided on top of a failed one reaches it.

``barrier()`` waits until everything submitted so far is durable: the service awaits it
before an answer read from memory (an idempotent repeat, a long-poll's grant) that
could depend on a change still in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import GPULeaseError, StoreError
from ...model import Changes
from .store import Store

log = logging.getLogger("gpu_lease.broker")

T = TypeVar("T")

#: the most mutations persisted in one transaction (a bound on a transaction's size)
MAX_BATCH = 512


@dataclass
class _Job:
    future: asyncio.Future[Any]
    changes: Changes | None = None
    call: Callable[[], Any] | None = None
    #: runs even while poisoned, and clears the poison if it succeeds (a reconcile)
    recovers: bool = False
    #: runs even while poisoned (a read)
    read: bool = False


class Writer:
    """The store's one thread; the event loop submits jobs and awaits their futures."""

    def __init__(
        self,
        store: Store,
        capacity_ppm: int,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.capacity_ppm = capacity_ppm
        #: called (on the writer's thread) with each committed batch's size: the metrics
        self.on_batch = on_batch
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        #: the exception of the last failed batch, until a recovering job succeeds
        self._poison: GPULeaseError | None = None
        #: the future of the last write or reload submitted (what ``barrier`` waits for)
        self._tail: asyncio.Future[Any] | None = None

    # -- the loop's side ------------------------------------------------------------------
    def _submit(self, job: _Job) -> Awaitable[Any]:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="gpu-lease-writer", daemon=True)
            self._thread.start()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the broker's database writer has stopped")
            self._jobs.append(job)
            self._cv.notify()
        if job.changes is not None or job.recovers:
            self._tail = job.future
        job.future.add_done_callback(_retrieve)
        # a caller cancelled meanwhile (its client went away) must not cancel the job's
        # future: the write goes on, and ``barrier`` must still wait for it
        return asyncio.shield(job.future)

    async def write(self, changes: Changes) -> dict[str, tuple[str, str | None]]:
        """Persist ``changes`` (already applied to memory) with whatever else is pending.

        Returns what :meth:`Store.write_changes` returns for the whole batch: renewed
        leases the database holds as ended."""
        loop = asyncio.get_running_loop()
        gone: dict[str, tuple[str, str | None]] = await self._submit(
            _Job(loop.create_future(), changes=changes)
        )
        return gone

    async def call(self, fn: Callable[[], T], *, read: bool = False) -> T:
        """Run ``fn`` (store calls) on the writer's thread, in order with the writes.

        ``read=True``: it runs even after a failed batch (it changes nothing)."""
        loop = asyncio.get_running_loop()
        result: T = await self._submit(_Job(loop.create_future(), call=fn, read=read))
        return result

    async def recover(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a reload of the state) and, if it succeeds, accept writes again."""
        loop = asyncio.get_running_loop()
        result: T = await self._submit(_Job(loop.create_future(), call=fn, recovers=True))
        return result

    async def barrier(self) -> None:
        """Return once every change submitted so far is in the database (raise if the last
        batch failed and memory was not reloaded since)."""
        tail = self._tail
        if tail is None:
            return
        if tail.done():
            if not tail.cancelled() and tail.exception() is not None:
                raise tail.exception()  # type: ignore[misc]
            return
        await asyncio.shield(tail)

    @property
    def poisoned(self) -> bool:
        return self._poison is not None

    def stop(self) -> None:
        """Finish the jobs submitted so far, then end the thread (at shutdown)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # -- the thread's side ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                first = self._jobs.popleft()
                batch = [first]
                if first.changes is not None:
                    while (
                        self._jobs and self._jobs[0].changes is not None and len(batch) < MAX_BATCH
                    ):
                        batch.append(self._jobs.popleft())
            self._execute(batch)

    def _execute(self, batch: list[_Job]) -> None:
        job = batch[0]
        result: Any = None
        error: BaseException | None = None
        if self._poison is not None and not (job.recovers or job.read):
            error = self._poison
        else:
            try:
                if job.changes is not None:
                    result = self.store.write_changes(
                        [j.changes for j in batch if j.changes], self.capacity_ppm
                    )
                    if self.on_batch is not None:
                        self.on_batch(len(batch))
                else:
                    assert job.call is not None
                    result = job.call()
                if job.recovers:
                    self._poison = None
            except GPULeaseError as exc:
                error = exc
                if job.changes is not None:
                    self._poison = exc
            except Exception as exc:  # a bug: the callers get it; later writes wait for a reload
                log.exception("The broker's database writer failed unexpectedly")
                error = exc
                if job.changes is not None:
                    self._poison = StoreError(
                        "The broker failed to record a change (see its log); nothing of it "
                        "was recorded. Retry."
                    )
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(_settle, [j.future for j in batch], result, error)
        except RuntimeError:  # the loop closed (shutdown): nobody waits any more
            pass


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a job's exception as seen: its caller may have gone (it gets it otherwise)."""
    if not fut.cancelled():
        fut.exception()


def _settle(futures: list[asyncio.Future[Any]], result: Any, error: BaseException | None) -> None:
    for fut in futures:
        if fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


__all__ = ["MAX_BATCH", "Writer"]
