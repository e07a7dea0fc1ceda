"""A client's lease calls: ``client.leases`` of a :class:`~provisioner.client.BrokerClient`.

The kernel's lease life (acquire, with its long-poll queueing; renew; release) and the
reads and admin call on leases (one lease, the list, the queue, revoke). Each call goes
through the client's core (:meth:`BrokerClient.send`: retries, re-resolving the active
broker, errors translated once), so none of them speaks HTTP itself. A lease comes back
typed (:class:`~.answers.GrantedLease`, read once here); a queued acquire's answers and the
queue stay the broker's JSON objects.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .. import errors
from ..node_report import KernelLaunch
from ..wire import MAX_WAIT, Renewal
from .answers import GrantedLease, NodeKernelAnswer, ResumeAnswer
from .calls import Core, segment

log = logging.getLogger("gpu_lease.client")

QueuedCallback = Callable[[dict[str, Any]], Awaitable[None] | None]


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


def _lease_path(lease_id: str, action: str = "") -> str:
    return f"/leases/{segment(lease_id)}" + (f"/{action}" if action else "")


class LeaseCalls:
    """``/api/v1/leases`` and ``/api/v1/queue`` over ``client``'s core."""

    def __init__(self, client: Core) -> None:
        self._client = client

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
    ) -> GrantedLease:
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
        client = self._client
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
            response = await client.send(
                "POST",
                "/leases",
                body={**body, "wait": poll_wait},
                read_timeout=poll_wait + client.timeout,
            )
            answer = client.json_object(response)
            if response.status_code != 202:
                return GrantedLease.from_json(answer)
            log.debug("queued for kernel %s at position %s", kernel_id, answer.get("position"))
            if on_queued is not None:
                result = on_queued(answer)
                if inspect.isawaitable(result):
                    await result
            if deadline is not None and time.monotonic() >= deadline:
                await self._cancel_queued(answer)
                raise errors.NoCapacity(
                    no_capacity_message(fraction, queue_timeout or 0.0, answer),
                    position=answer.get("position"),
                    body=answer,
                )
            # A broker that answers 202 at once (wait 0, or a lower cap) is not hammered.
            pause = client.backoff - (time.monotonic() - started)
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
            if pause > 0:
                await asyncio.sleep(pause)

    async def _cancel_queued(self, answer: dict[str, Any]) -> None:
        """Best effort: withdraw a queued request so it stops holding a place."""
        request_id = answer.get("id")
        if not isinstance(request_id, str) or not request_id:
            return
        try:
            await self._client.send("DELETE", _lease_path(request_id), retries=0)
        except errors.GPULeaseError as exc:
            log.debug("could not cancel queued request %s: %s", request_id, exc.code)

    async def renew(self, lease_id: str, claim: Renewal = Renewal()) -> GrantedLease:
        """Heartbeat: ``POST /api/v1/leases/{id}/renew`` with ``claim``
        (:class:`~provisioner.wire.Renewal`: only its fields given are sent); returns the
        renewed lease. Raises :class:`errors.LeaseRevoked` / :class:`errors.LeaseExpired`
        (410) when the lease has ended; ``details['reason']`` says why.
        """
        body = claim.to_json()
        return await self._lease("POST", _lease_path(lease_id, "renew"), body=body)

    async def release(self, lease_id: str) -> None:
        """``DELETE /api/v1/leases/{id}``. A lease the broker no longer knows (404)
        or that has already ended (410) counts as released, so this is idempotent."""
        try:
            await self._client.send("DELETE", _lease_path(lease_id))
        except (errors.LeaseNotFound, errors.LeaseGone) as exc:
            log.debug("lease %s was already released (%s)", lease_id, exc.code)

    async def resume(self, lease_id: str, wait: float = 0.0) -> ResumeAnswer:
        """``POST /api/v1/leases/{id}/resume``: bring a parked lease's GPU memory back.

        Called by the lease keeper's park watch (:mod:`provisioner.kernel.parked`) when a
        cell is run in a parked kernel (the ``%gpu`` extension's hook asked for it), in a
        loop until the lease is active again. ``wait`` > 0 (at most ``MAX_WAIT``) asks the broker to
        hold the answer that long (a long-poll) while the resume waits; the read timeout is
        ``wait`` plus the client's own, so the long-poll is never cut short here.

        Returns the broker's answer typed: the lease (``state`` "active", ``waiting``
        False) when its memory is back (200), else the 202 body's lease in its park state
        ("parking"|"parked"|"resuming") with ``position``, ``eta_seconds``, ``queue_length``.
        Raises the usual errors: :class:`errors.LeaseNotFound` (404: unknown, or another
        user's), :class:`errors.LeaseRevoked`/:class:`errors.LeaseExpired`/
        :class:`errors.LeaseGone` (410: the lease ended; ``details['reason']`` says why).
        """
        client = self._client
        poll_wait = max(0.0, min(float(wait), MAX_WAIT))
        body: dict[str, Any] = {"wait": poll_wait} if poll_wait > 0 else {}
        response = await client.send(
            "POST",
            _lease_path(lease_id, "resume"),
            body=body,
            read_timeout=(poll_wait + client.timeout) if poll_wait > 0 else None,
        )
        waiting = response.status_code == 202
        return ResumeAnswer.from_json(client.json_object(response), waiting=waiting)

    async def launch_kernel(self, lease_id: str, launch: KernelLaunch) -> NodeKernelAnswer:
        """``PUT /api/v1/leases/{id}/kernel``: have the lease's node start the kernel (a new
        generation); the answer says ``launching``: follow it with :meth:`kernel`. Not
        retried after a refusal; the body (its key) is never logged."""
        client = self._client
        response = await client.send(
            "PUT", _lease_path(lease_id, "kernel"), body=launch.to_json(), retries=0
        )
        return NodeKernelAnswer.from_json(client.json_object(response))

    async def kernel(
        self, lease_id: str, after: str | None = None, wait: float = 0.0
    ) -> NodeKernelAnswer:
        """``GET /api/v1/leases/{id}/kernel``: the remote kernel now, or (``after``: the
        cursor of the last answer) once it changed or ``wait`` s passed."""
        client = self._client
        params: dict[str, str] = {}
        poll_wait = max(0.0, min(float(wait), MAX_WAIT))
        if after is not None:
            params["after"] = after
            params["timeout"] = f"{poll_wait:g}"
        response = await client.send(
            "GET",
            _lease_path(lease_id, "kernel"),
            params=params,
            read_timeout=(poll_wait + client.timeout) if poll_wait > 0 else None,
        )
        return NodeKernelAnswer.from_json(client.json_object(response))

    async def signal_kernel(self, lease_id: str, signal: str) -> NodeKernelAnswer:
        """``POST /api/v1/leases/{id}/kernel/signal {signal}``: the node signals the kernel."""
        client = self._client
        response = await client.send(
            "POST", _lease_path(lease_id, "kernel/signal"), body={"signal": signal}
        )
        return NodeKernelAnswer.from_json(client.json_object(response))

    async def revoke(self, lease_id: str, reason: str) -> GrantedLease:
        """Admin: ``POST /api/v1/leases/{id}/revoke {reason}``; returns the ended lease.

        The lease's provisioner learns at its next renewal (410 with ``reason``) and
        shuts the kernel down. A lease that has already ended raises
        :class:`errors.LeaseGone`.
        """
        return await self._lease("POST", _lease_path(lease_id, "revoke"), body={"reason": reason})

    async def get(self, lease_id: str) -> GrantedLease:
        """``GET /api/v1/leases/{id}``."""
        return await self._lease("GET", _lease_path(lease_id))

    async def listing(self, *, user: str | None = None, all: bool = False) -> list[GrantedLease]:
        """``GET /api/v1/leases[?user=&all=1]``: the caller's leases, or (admin) anyone's."""
        params: dict[str, str] = {}
        if user is not None:
            params["user"] = user
        if all:
            params["all"] = "1"
        client = self._client
        answer = client.json_list(await client.send("GET", "/leases", params=params), "leases")
        return [GrantedLease.from_json(lease) for lease in answer]

    async def queue(self) -> list[dict[str, Any]]:
        """``GET /api/v1/queue``: waiting requests with their positions."""
        return self._client.json_list(await self._client.send("GET", "/queue"), "queue")

    async def queue_page(self) -> dict[str, Any]:
        """``GET /api/v1/queue`` whole: ``{"queue": [...], "length": N}`` (N: everyone waiting)."""
        page = self._client.json_object(await self._client.send("GET", "/queue"))
        if not isinstance(page.get("queue"), list):
            page["queue"] = []
        return page

    async def _lease(self, method: str, path: str, body: Any = None) -> GrantedLease:
        """One call whose answer is a lease object, read once."""
        client = self._client
        return GrantedLease.from_json(
            client.json_object(await client.send(method, path, body=body))
        )


__all__ = ["LeaseCalls", "QueuedCallback", "no_capacity_message"]
