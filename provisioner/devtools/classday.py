"""Two days of a GPU classroom in a broker's database, and the dashboard's screenshots.

``seed_history`` replays lab sessions through the real :class:`BrokerService` (its
scheduling, quotas and store) with a clock it drives: students of two courses arrive
at the start of each session, hold a lease for a while, or wait in the queue and give
up after their patience runs out. The database then holds what a broker records over
those days (leases with their users' courses, the queue's log), so the dashboard's
history plots have something to show. ``fill_pool`` puts the live state on a running
broker through its REST API: the pool full, a queue, a few releases.

``python -m provisioner.devtools.classday [--out docs/img] [--width 1280]`` does both
on a fresh broker and takes the screenshots that ``docs/admins.md`` shows (needs
Playwright and Debian's chromium, like the browser tests).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from ..broker.rules.policy import Ask, Policy
from ..broker.services.broker_service import BrokerService
from ..broker.store.store import Store
from ..inventory import parse_gpu_spec
from ..model import Identity, fraction_to_ppm
from .testing import BrokerProcess

ROOT = Path(__file__).resolve().parents[2]
GPUS = "1x32768:V100"
CHROMIUM = "/usr/bin/chromium"


def classroom_users() -> dict[str, tuple[list[str], bool]]:
    """ml101 (student01-40), cs50 (cs01-16; cs01-04 also in ml101), two guests, an admin."""
    users: dict[str, tuple[list[str], bool]] = {}
    for n in range(1, 41):
        users[f"student{n:02d}"] = (["ml101"], False)
    for n in range(1, 17):
        users[f"cs{n:02d}"] = (["cs50", "ml101"] if n <= 4 else ["cs50"], False)
    users["guest01"] = ([], False)
    users["guest02"] = ([], False)
    users["instructor"] = (["ml101"], True)
    users["admin"] = ([], True)
    return users


#: (course, hours before the end the session starts, its length in minutes)
SESSIONS: tuple[tuple[str, float, float], ...] = (
    ("ml101", 21.0, 100),
    ("cs50", 20.5, 75),  # overlaps ml101's: the pool fills, students queue
    ("ml101", 6.0, 110),
    ("cs50", 5.6, 80),
)


def seed_history(
    db_url: str,
    users: Mapping[str, tuple[Sequence[str], bool]],
    *,
    end: float,
    gpus: str = GPUS,
    hours: float = 32.0,
    sessions: Sequence[tuple[str, float, float]] = SESSIONS,
    seed: int = 13,
) -> dict[str, int]:
    """Replay ``sessions`` (and a trickle of guests) over ``hours`` before ``end``.

    Everything has ended by ``end``. Returns counts: granted, queued, gave_up.
    """
    rng = random.Random(seed)
    # a thread of its own: the caller may run an event loop already (Playwright's sync API)
    with ThreadPoolExecutor(1) as pool:
        replay = _replay(db_url, users, end, gpus, hours, sessions, rng)
        return pool.submit(asyncio.run, replay).result()


async def _replay(
    db_url: str,
    users: Mapping[str, tuple[Sequence[str], bool]],
    end: float,
    gpus: str,
    hours: float,
    sessions: Sequence[tuple[str, float, float]],
    rng: random.Random,
) -> dict[str, int]:
    clock = [end - hours * 3600]
    # nothing expires or is dropped: the replay releases and cancels by itself
    policy = Policy(ttl=10 * 86400.0, queue_poll_grace=10 * 86400.0)
    service = BrokerService(Store(db_url), parse_gpu_spec(gpus), policy, clock=lambda: clock[0])
    service.start()
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def at(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    for course, before, minutes in sessions:
        start = end - before * 3600
        members = [u for u, (groups, admin) in users.items() if course in groups and not admin]
        for user in members:
            if rng.random() < 0.1:
                continue  # absent
            # ml101 uses the generic 0.02 kernel; cs50 its course kernel of 0.05
            fraction, group = (0.02, None) if course == "ml101" else (0.05, "cs50")
            hold = rng.uniform(0.35, 0.95) * minutes * 60
            patience = rng.uniform(4, 25) * 60
            when = start + rng.expovariate(1 / 240.0)
            at(when, "arrive", (user, f"{course}-{int(start)}", fraction, group, hold, patience))
    guests = [u for u, (groups, admin) in users.items() if not groups and not admin]
    t = clock[0]
    while guests and t < end:
        t += rng.expovariate(1 / 2400.0)
        hold = rng.uniform(10, 60) * 60
        at(t, "arrive", (rng.choice(guests), f"g-{int(t)}", 0.05, None, hold, 600.0))

    idents = {u: Identity(u, frozenset(g), a) for u, (g, a) in users.items()}
    waiting: dict[tuple[str, str], tuple[str, float]] = {}  # key -> (request id, hold)
    counts = {"granted": 0, "queued": 0, "gave_up": 0}

    def started(key: tuple[str, str], hold: float) -> None:
        lease = service.state.lease_for_kernel(*key)
        assert lease is not None
        counts["granted"] += 1
        at(clock[0] + hold, "release", (key[0], lease.id))

    def granted_from_queue() -> None:
        for key in [k for k in waiting if service.state.lease_for_kernel(*k) is not None]:
            _, hold = waiting.pop(key)
            started(key, hold)

    while events and events[0][0] < end:
        t, _, kind, data = heapq.heappop(events)
        clock[0] = t
        if kind == "arrive":
            user, kernel, fraction, group, hold, patience = data
            if service.state.lease_for_kernel(user, kernel) or (user, kernel) in waiting:
                continue
            ident = idents[user]
            ask = Ask(user, kernel, fraction_to_ppm(fraction), ident.groups, False, group=group)
            result = await service.leases.acquire(ident, ask, 0)
            if result.outcome == "queued":
                assert result.request is not None
                counts["queued"] += 1
                waiting[(user, kernel)] = (result.request.id, hold)
                at(t + patience, "give-up", (user, kernel))
            else:
                started((user, kernel), hold)
        elif kind == "release":
            user, lease_id = data
            await service.leases.release(idents[user], lease_id)
            granted_from_queue()
        elif kind == "give-up" and data in waiting:
            request_id, _ = waiting.pop(data)
            counts["gave_up"] += 1
            await service.leases.release(idents[data[0]], request_id)
            granted_from_queue()
    clock[0] = end
    for key, (request_id, _) in list(waiting.items()):
        await service.leases.release(idents[key[0]], request_id)
    for lease in list(service.state.leases.values()):
        await service.leases.release(idents[lease.user], lease.id)
    service.close()
    return counts


def fill_pool(url: str, tokens: Mapping[str, str]) -> dict[str, list[str]]:
    """The live state: fill the pool, queue six, release three (the queue gets what fits).

    Returns the ids of the leases still held (``held``) and the users who queued.
    """

    def acquire(user: str, fraction: float, group: str | None, expect: int) -> str:
        body: dict[str, Any] = {"kernel_id": f"lab-{user}", "fraction": fraction, "wait": 0}
        if group:
            body["group"] = group
        r = httpx.post(
            f"{url}/api/v1/leases",
            json=body,
            headers={"Authorization": f"token {tokens[user]}"},
            timeout=30,
        )
        if r.status_code != expect:
            raise RuntimeError(f"{user}'s acquire answered {r.status_code}: {r.text}")
        return str(r.json()["id"])

    held: dict[str, str] = {}
    for n in range(1, 16):  # 15 x 0.02 + 11 x 0.05 + 3 x 0.05: the V100 is full
        held[f"student{n:02d}"] = acquire(f"student{n:02d}", 0.02, None, 201)
    for n in range(16, 27):
        held[f"student{n:02d}"] = acquire(f"student{n:02d}", 0.05, None, 201)
    for n in range(1, 4):
        held[f"cs{n:02d}"] = acquire(f"cs{n:02d}", 0.05, "cs50", 201)
    queued = []
    for user in ("cs04", "cs05", "cs06", "guest01", "cs07", "cs08"):
        acquire(user, 0.05, None if user.startswith("guest") else "cs50", 202)
        queued.append(user)
    for user in ("student03", "student17", "cs02"):  # frees 0.12: two of the queue start
        r = httpx.delete(
            f"{url}/api/v1/leases/{held.pop(user)}",
            headers={"Authorization": f"token {tokens[user]}"},
            timeout=30,
        )
        r.raise_for_status()
    return {"held": list(held.values()), "queued": queued}


def screenshots(out: Path, width: int) -> list[Path]:
    """A fresh broker with two seeded days and a full pool; the dashboard as admin, at ``width`` px."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    shots = []
    with tempfile.TemporaryDirectory(prefix="gpu-lease-shots-") as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'gpu-lease.sqlite'}"
        users = classroom_users()
        counts = seed_history(db_url, users, end=time.time() - 120)
        print(f"[classday] seeded: {counts}", flush=True)
        broker = BrokerProcess(
            Path(tmp),
            db_url,
            users,
            gpus=GPUS,
            extra=(
                "--ttl",
                "3600",
                "--GPULeaseBroker.queue_poll_grace=3600",
                "--quotas-file",
                str(ROOT / "hub_config" / "courses.toml"),
            ),
        )
        broker.start()
        try:
            fill_pool(broker.url, broker.tokens)
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
                )
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(f"{broker.url}/")
                page.fill("#token", broker.tokens["admin"])
                page.click("button[type=submit]")
                page.wait_for_selector("#history svg[data-plot=waits]")
                page.wait_for_selector("#courses table")
                page.evaluate("document.fonts.ready")
                shot = out / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                shots.append(shot)
                page.select_option("#course", "cs50")
                page.wait_for_selector("#leases caption:has-text('cs50')")
                page.wait_for_selector("#history figcaption:has-text('cs50')")
                history = page.locator("#history-h").locator("xpath=../..")
                shot = out / "dashboard-course.png"
                history.screenshot(path=str(shot))
                shots.append(shot)
                page.select_option("#course", "*")
                page.locator("#leases button.danger").first.click()
                page.fill("#revoke-reason", "maintenance at 18:00")
                shot = out / "dashboard-revoke.png"
                page.screenshot(path=str(shot))
                shots.append(shot)
                browser.close()
        finally:
            broker.stop()
    return shots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m provisioner.devtools.classday", description=__doc__)
    p.add_argument("--out", default=str(ROOT / "docs" / "img"), help="default: docs/img/")
    p.add_argument("--width", type=int, default=1280, help="viewport width in px (1280)")
    args = p.parse_args(argv)
    for shot in screenshots(Path(args.out), args.width):
        print(shot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
