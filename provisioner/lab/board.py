"""``GPULeaseLab``: this server's GPU kernels, as the JupyterLab extension shows them.

Called by the handlers (``handlers.py``) once per browser poll. The answer comes from
memory: the provisioners write what they learn anyway (grant, renewals every TTL/3,
queued long-poll answers, the broker's reason when a lease ends) on the server's
:class:`~provisioner.kernel.status.LeaseBoard`. The one thing they learn too rarely is a
waiting kernel's place in the queue: their long-poll answers come every ``long_poll``
seconds (30 by default), and the first only after that long. So while some kernel of this
server waits *and* a browser is asking, this class makes one aggregated
``GET /api/v1/queue`` (every waiting request of this server's user, with positions, the
queue's length and estimated waits) at most every ``queue_refresh_interval`` seconds, in
the background: a browser's poll never waits for the broker, and 60 open notebooks cost
the broker at most one request per server per interval.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import os
import re
import time
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from traitlets import Float, Unicode, default
from traitlets.config import LoggingConfigurable

from ..client import BrokerClient, broker_env
from ..errors import GPULeaseError
from ..kernel.kernelspecs import PROVISIONER_NAME
from ..kernel.status import ENDED, LeaseBoard, board_for

#: the temporary session path JupyterLab starts a notebook's kernel on, ``dir/<uuid4>``
#: (``SessionContext._changeKernel``), before it moves the session to the notebook
_TEMPORARY = re.compile(r"(^|/)[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def session_text(s: dict[str, Any]) -> str:
    """A held class session as the launcher's outlook says it: to a member "GPU reserved
    for ml101 until 11:30", to anyone else "Part of the GPUs is reserved for ml101's class
    session until 11:30"."""
    try:
        zone: dt.tzinfo = ZoneInfo(str(s.get("tz") or "UTC"))
    except (ZoneInfoNotFoundError, ValueError):
        zone = dt.UTC
    until = f"{dt.datetime.fromtimestamp(float(s.get('end') or 0), zone):%H:%M}"
    course = s.get("course")
    if s.get("member"):
        return f"GPU reserved for {course} until {until}"
    return f"Part of the GPUs is reserved for {course}'s class session until {until}"


class GPULeaseLab(LoggingConfigurable):
    """The server extension's state: the board of this server, and the queue look-ups."""

    queue_refresh_interval = Float(
        5.0,
        help="Seconds between two looks at the broker's queue (GET /api/v1/queue) while a "
        "kernel of this server waits and a browser asks for its position. At least 1. "
        "Default: 5.",
    ).tag(config=True)

    broker_url = Unicode(
        help="Base URL of the gpu-lease broker for the queue look-ups. "
        "Default: env GPU_LEASE_URL (the provisioner's default too)."
    ).tag(config=True)

    @default("broker_url")
    def _default_broker_url(self) -> str:
        return broker_env().url or ""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._refreshed_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None
        self._client: BrokerClient | None = None
        self._client_key: tuple[str, str | None] | None = None
        #: kernel id -> the notebook's path (API path) last seen in a session
        self._paths: dict[str, str] = {}
        #: broker requests this extension made (the polling benchmark reads it)
        self.broker_requests = 0
        #: the pool and the queue's length as last asked (outlooks), and when
        self._pool: tuple[float, list[dict[str, Any]], int] | None = None
        #: the class sessions held now (lead time or hours), as the pool was last asked
        self._sessions: list[dict[str, Any]] = []

    # -- what the handlers call ---------------------------------------------------------------
    @property
    def kernel_manager(self) -> Any:
        return getattr(self.parent, "kernel_manager", None)

    @property
    def board(self) -> LeaseBoard | None:
        return board_for(self.kernel_manager)

    async def kernels(self) -> list[dict[str, Any]]:
        """Every GPU kernel of this server (waiting, active, recently ended), newest state."""
        board = self.board
        if board is None:
            return []
        known = self._known_kernels()
        await self._remember_paths()
        if board.waiting_ids():
            self._maybe_refresh_queue(board)
        out = []
        for record in board.snapshot():
            if record.state not in ENDED and record.kernel_id not in known:
                continue  # its manager is gone without a word (never seen; defensive)
            item = record.to_json()
            path = self._paths.get(record.kernel_id)
            if path is None or _TEMPORARY.search(path):
                # a session still on JupyterLab's temporary path (the page that started the
                # kernel moves it to the notebook once started; reloaded meanwhile, it never
                # does): the notebook's name the kernel was started with, so that the
                # reloaded page finds its kernel and re-attaches (which moves the session)
                path = self._api_path(record.session_path) or path
            if path:
                item["path"] = path
            out.append(item)
        return out

    async def stop_waiting(self, kernel_id: str) -> bool:
        """``DELETE .../kernels/{id}/request``: the waiting kernel gives up its queue place."""
        board = self.board
        return bool(board is not None and await board.stop_waiting(kernel_id))

    async def attach(
        self, kernel_id: str, where: dict[str, str], timeout: float = 30.0
    ) -> dict[str, Any] | None:
        """``POST .../kernels/{id}/session``: a page re-attaches to its waiting kernel.

        JupyterLab finds a notebook's kernel by its session, and jupyter_server saves a
        session only once its kernel has started: a page reloaded while the kernel waits
        for its GPU found none and started a second kernel. Here the page waits (up to
        ``timeout`` seconds a call: ``None`` then, ask again) until the kernel has started,
        then the kernel's session is moved to the notebook's path (the page that started
        it would have done so; it is gone) or, if none was saved, one is made. Returns the
        session's model. Raises :class:`StartFailed` with the start's error when the
        kernel did not start, ``KeyError`` when it is no kernel of this server.
        """
        km = self.kernel_manager
        sessions = getattr(self.parent, "session_manager", None)
        if km is None or sessions is None:
            raise KeyError(kernel_id)
        deadline = time.monotonic() + timeout
        while kernel_id not in km:
            pending = (getattr(km, "_pending_kernels", {}) or {}).get(kernel_id)
            board = self.board
            if pending is None or pending.done():
                if kernel_id in km:
                    break
                why = board.start_error(kernel_id) if board is not None else None
                if why is None and (board is None or board.get(kernel_id) is None):
                    raise KeyError(kernel_id)
                raise StartFailed(why or "The kernel did not start (see the server's log).")
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.2)
        # started: the session its own start saves right after (moments later)
        for _ in range(50):
            mine = [
                m
                for m in await sessions.list_sessions()
                if (m.get("kernel") or {}).get("id") == kernel_id
            ]
            for model in mine:
                if model.get("path") == where["path"]:
                    return dict(model)
            if mine:
                await sessions.update_session(mine[0]["id"], path=where["path"], name=where["name"])
                return dict(await sessions.get_session(session_id=mine[0]["id"]))
            await asyncio.sleep(0.2)
        model = await sessions.create_session(
            path=where["path"], name=where["name"], type=where["type"], kernel_id=kernel_id
        )
        return dict(model)

    async def kernelspec(self, name: str) -> dict[str, Any] | None:
        """``GET .../kernelspecs/{name}``: whether this user can ever start kernelspec ``name``
        (a notebook saved with it; the kernel list leaves it out), and why not."""
        specs = getattr(self.parent, "kernel_spec_manager", None)
        why_not = getattr(specs, "why_not", None)
        if why_not is None:
            return None
        answer = await why_not(name)
        return dict(answer) if answer is not None else None

    async def outlook(self, name: str) -> dict[str, Any] | None:
        """``GET .../kernelspecs/{name}/outlook``: what starting GPU kernelspec ``name`` would
        take now (a notebook saved with it opened without starting it): ``{name,
        display_name, fraction, gpu_name, free_now, position, queue_length}``; ``free_now``
        when a GPU has room for it and nobody waits, else ``position``, the place at the
        end of the queue. None if this server offers no such GPU kernelspec. The pool is
        asked at most every ``queue_refresh_interval`` seconds, whoever asks."""
        specs = getattr(self.parent, "kernel_spec_manager", None)
        if specs is None:
            return None
        listed = specs.get_all_specs()
        if inspect.isawaitable(listed):
            listed = await listed
        entry = (listed or {}).get(name)
        spec = entry.get("spec") if isinstance(entry, dict) else None
        provisioner = ((spec or {}).get("metadata") or {}).get("kernel_provisioner") or {}
        fraction = (provisioner.get("config") or {}).get("fraction")
        if provisioner.get("provisioner_name") != PROVISIONER_NAME or not isinstance(
            fraction, (int, float)
        ):
            return None
        out: dict[str, Any] = {
            "name": name,
            "display_name": str((spec or {}).get("display_name") or name),
            "fraction": float(fraction),
            "gpu_name": None,
            "free_now": False,
            "position": None,
            "queue_length": None,
        }
        pool = await self._pool_now()
        if pool is None:
            return out  # the broker did not answer: the kernel's size only
        if self._sessions:  # a class session held now: "GPU reserved for ml101 until 11:30"
            out["session"] = session_text(self._sessions[0])
        gpus, length = pool
        room = sorted(
            gpus,
            key=lambda g: float(g.get("capacity_fraction", 1)) - float(g["allocated_fraction"]),
            reverse=True,
        )
        best = room[0] if room else None
        free = (
            float(best.get("capacity_fraction", 1)) - float(best["allocated_fraction"])
            if best
            else 0.0
        )
        out["gpu_name"] = best.get("name") if best else None
        out["queue_length"] = length
        out["free_now"] = length == 0 and free + 1e-9 >= float(fraction)
        if not out["free_now"]:
            out["position"] = length + 1
        return out

    async def _pool_now(self) -> tuple[list[dict[str, Any]], int] | None:
        now = time.monotonic()
        if self._pool is not None and now - self._pool[0] < max(1.0, self.queue_refresh_interval):
            return self._pool[1], self._pool[2]
        try:
            client = self._broker()
            self.broker_requests += 2
            gpus = [g for g in await client.gpus() if isinstance(g, dict)]
            answer = await client.leases.queue_page()
        except GPULeaseError as exc:
            self.log.debug("jupyter-gpu-lease: no outlook this time: %s", exc)
            return None
        try:
            self.broker_requests += 1
            listed = (await client.sessions.listing()).get("sessions") or []
        except GPULeaseError:  # a broker older than class sessions: none
            listed = []
        held = [x for x in listed if isinstance(x, dict) and x.get("state") != "planned"]
        # the user's own course's session first
        self._sessions = sorted(held, key=lambda x: not x.get("member"))
        length = answer.get("length")
        self._pool = (now, gpus, length if isinstance(length, int) else 0)
        return gpus, self._pool[2]

    # -- the queue look-up --------------------------------------------------------------------
    def _maybe_refresh_queue(self, board: LeaseBoard) -> None:
        now = time.monotonic()
        interval = max(1.0, float(self.queue_refresh_interval))
        if self._refresh is not None and not self._refresh.done():
            return
        if now - self._refreshed_at < interval:
            return
        self._refreshed_at = now
        self._refresh = asyncio.ensure_future(self._refresh_queue(board))

    async def _refresh_queue(self, board: LeaseBoard) -> None:
        try:
            client = self._broker()
            self.broker_requests += 1
            answer = await client.leases.queue_page()
        except GPULeaseError as exc:
            self.log.debug("jupyter-gpu-lease: no queue positions this time: %s", exc)
            return
        entries = {e.get("kernel_id"): e for e in answer.get("queue", []) if isinstance(e, dict)}
        length = answer.get("length")
        for kernel_id in board.waiting_ids():
            board.queue_seen(
                kernel_id, entries.get(kernel_id), length if isinstance(length, int) else None
            )

    def _broker(self) -> BrokerClient:
        token = broker_env().token
        key = (self.broker_url, token)
        if self._client is None or self._client_key != key:
            if self._client is not None:
                asyncio.ensure_future(self._client.aclose())
            self._client = BrokerClient(self.broker_url, token, retries=0, timeout=5.0)
            self._client_key = key
        return self._client

    # -- kernels and notebooks ---------------------------------------------------------------
    def _known_kernels(self) -> set[str]:
        km = self.kernel_manager
        if km is None:
            return set()
        pending = getattr(km, "_pending_kernels", {}) or {}
        return set(km.list_kernel_ids()) | set(pending)

    async def _remember_paths(self) -> None:
        sessions = getattr(self.parent, "session_manager", None)
        if sessions is None:
            return
        try:
            listed = await sessions.list_sessions()
        except Exception as exc:  # the session database is not ours; never fail the poll
            self.log.debug("jupyter-gpu-lease: could not list sessions: %s", exc)
            return
        for model in listed:
            kernel = model.get("kernel") or {}
            if kernel.get("id") and model.get("path"):
                self._paths[kernel["id"]] = model["path"]
        board = self.board
        if board is not None and len(self._paths) > 4 * board.keep:
            keep = {r.kernel_id for r in board.snapshot()}
            self._paths = {k: v for k, v in self._paths.items() if k in keep}

    def _api_path(self, session_path: str | None) -> str | None:
        """``JPY_SESSION_NAME`` (the notebook's file path) as a path of the contents API."""
        if not session_path:
            return None
        root = getattr(getattr(self.parent, "contents_manager", None), "root_dir", None)
        if not root or not os.path.isabs(session_path):
            return session_path
        rel = os.path.relpath(session_path, root)
        return None if rel.startswith("..") else rel.replace(os.sep, "/")


class StartFailed(Exception):
    """The kernel a page wanted to re-attach to did not start; the message says why."""


__all__ = ["GPULeaseLab", "StartFailed"]
