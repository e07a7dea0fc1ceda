"""provisioner.broker.rules.history: the pool's history in buckets, as table tests (pure, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from provisioner.broker.rules.history import MAX_POINTS, bucket_starts, compute
from provisioner.model import PPM, Lease, QueueRecord


def lease(
    start: float,
    end: float | None,
    fraction: float,
    *,
    user: str = "u",
    group: str | None = None,
    groups: tuple[str, ...] = (),
) -> Lease:
    ppm = round(fraction * PPM)
    return Lease(
        id=f"{user}-{start}",
        user=user,
        kernel_id=f"k{start}",
        gpu_uuid="GPU-0",
        fraction_ppm=ppm,
        memory_limit_mb=100,
        state="active" if end is None else "released",
        created_at=start,
        renewed_at=start,
        expires_at=start + 90,
        group=group,
        ended_at=end,
        groups=groups,
    )


def wait(
    arrived: float,
    left: float | None,
    outcome: str | None = "granted",
    *,
    group: str | None = None,
    groups: tuple[str, ...] = (),
) -> QueueRecord:
    return QueueRecord(
        id=f"r{arrived}",
        user="u",
        kernel_id=f"k{arrived}",
        fraction_ppm=500_000,
        arrived_at=arrived,
        group=group,
        groups=groups,
        left_at=left,
        outcome=None if left is None else outcome,
    )


def column(points: list[Any], name: str) -> list[Any]:
    return [getattr(p, name) for p in points]


@pytest.mark.parametrize(
    ("since", "until", "step", "starts"),
    [
        (0, 300, 100, [0, 100, 200]),
        (50, 300, 100, [0, 100, 200]),  # rounded down to a multiple of step
        (0, 301, 100, [0, 100, 200, 300]),  # the last bucket is partial
        (100, 100, 100, []),
        (7200.5, 10800, 3600, [7200]),
        (7200.5, 10800.5, 3600, [7200, 10800]),
    ],
)
def test_bucket_starts(since: float, until: float, step: float, starts: list[float]) -> None:
    assert bucket_starts(since, until, step) == starts


@pytest.mark.parametrize("step", [0, -1, float("nan"), float("inf")])
def test_bucket_starts_refuses_a_bad_step(step: float) -> None:
    with pytest.raises(ValueError, match="step"):
        bucket_starts(0, 100, step)


def test_too_many_points_are_refused() -> None:
    assert len(bucket_starts(0, MAX_POINTS, 1)) == MAX_POINTS
    with pytest.raises(ValueError, match="choose a larger step"):
        bucket_starts(0, MAX_POINTS + 1, 1)


@pytest.mark.parametrize(
    ("leases", "mean", "peak", "grants"),
    [
        # nothing held
        ([], [0, 0, 0], [0, 0, 0], [0, 0, 0]),
        # 0.5 for the whole period, granted before it: no grant inside
        ([lease(-50, None, 0.5)], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0, 0, 0]),
        # 0.5 from 50 to 150: half of bucket 0, half of bucket 1
        ([lease(50, 150, 0.5)], [0.25, 0.25, 0], [0.5, 0.5, 0], [1, 0, 0]),
        # two leases overlapping in bucket 1 (peak 0.75), active one counts to until
        (
            [lease(100, 200, 0.25), lease(150, None, 0.5)],
            [0, 0.25 + 0.25, 0.5],
            [0, 0.75, 0.5],
            [0, 2, 0],
        ),
        # one ends as another starts at 100: the peak never counts both
        ([lease(0, 100, 1.0), lease(100, 200, 1.0)], [1, 1, 0], [1, 1, 0], [1, 1, 0]),
        # ended before the period / granted after it: nothing
        ([lease(-300, -100, 1.0), lease(400, None, 1.0)], [0, 0, 0], [0, 0, 0], [0, 0, 0]),
        # a lease that ended the instant it began is a grant holding nothing
        ([lease(120, 120, 1.0)], [0, 0, 0], [0, 0, 0], [0, 1, 0]),
        # 50 leases of 0.02 fill a GPU exactly (ppm: no float drift)
        (
            [lease(i, None, 0.02, user=f"s{i}") for i in range(50)],
            [0.755, 1, 1],
            [1, 1, 1],
            [50, 0, 0],
        ),
    ],
)
def test_allocation(
    leases: list[Lease], mean: list[float], peak: list[float], grants: list[int]
) -> None:
    points = compute(leases, [], 0, 300, 100)
    assert column(points, "t") == [0, 100, 200]
    assert column(points, "allocated") == pytest.approx(mean)
    assert column(points, "allocated_max") == pytest.approx(peak)
    assert column(points, "grants") == grants


def test_partial_last_bucket_averages_over_the_time_passed() -> None:
    points = compute([lease(0, 150, 1.0)], [], 0, 175, 100)
    # bucket 1 is [100, 175): held 50 of its 75 seconds
    assert column(points, "allocated") == pytest.approx([1.0, 50 / 75])


@pytest.mark.parametrize(
    ("queue", "mean", "peak", "waited", "wait_mean", "wait_max", "withdrawn"),
    [
        ([], [0, 0, 0], [0, 0, 0], [0, 0, 0], [None] * 3, [None] * 3, [0, 0, 0]),
        # waits 50 -> 150, granted in bucket 1 after 100 s
        (
            [wait(50, 150)],
            [0.5, 0.5, 0],
            [1, 1, 0],
            [0, 1, 0],
            [None, 100, None],
            [None, 100, None],
            [0, 0, 0],
        ),
        # two granted in bucket 2 (waits 60 and 180 s); one cancelled, one dropped in bucket 0
        (
            [
                wait(40, 220),
                wait(150, 210),
                wait(10, 30, "cancelled"),
                wait(20, 40, "dropped"),
            ],
            [(20 + 20 + 60) / 100, (100 + 50) / 100, (20 + 10) / 100],
            [2, 2, 2],
            [0, 0, 2],
            [None, None, 120],
            [None, None, 180],
            [2, 0, 0],
        ),
        # still waiting at until: counts as queued to the end, no wait recorded yet
        ([wait(250, None)], [0, 0, 0.5], [0, 0, 1], [0, 0, 0], [None] * 3, [None] * 3, [0, 0, 0]),
        # waiting since before the period; gone at the instant bucket 1 starts
        (
            [wait(-500, 100)],
            [1, 0, 0],
            [1, 0, 0],
            [0, 1, 0],
            [None, 600, None],
            [None, 600, None],
            [0, 0, 0],
        ),
    ],
)
def test_queue_and_waits(
    queue: list[QueueRecord],
    mean: list[float],
    peak: list[int],
    waited: list[int],
    wait_mean: list[float | None],
    wait_max: list[float | None],
    withdrawn: list[int],
) -> None:
    points = compute([], queue, 0, 300, 100)
    assert column(points, "queue") == pytest.approx(mean)
    assert column(points, "queue_max") == peak
    assert column(points, "waited") == waited
    assert column(points, "wait_mean_s") == wait_mean
    assert column(points, "wait_max_s") == wait_max
    assert column(points, "withdrawn") == withdrawn


COURSES = [
    lease(0, None, 0.4, user="dan", groups=("ml101",)),  # generic kernel, one course
    lease(0, None, 0.2, user="eve", groups=("cs50", "ml101")),  # two courses: split
    lease(0, None, 0.1, user="eve", group="cs50", groups=("cs50", "ml101")),  # course kernel
    lease(0, None, 0.3, user="frank"),  # no course
]


@pytest.mark.parametrize(
    ("group", "allocated", "queue"),
    [
        (None, 1.0, 3),
        ("ml101", 0.4 + 0.1, 1),
        ("cs50", 0.1 + 0.1, 1),
        ("", 0.3, 1),  # users in no course
        ("art", 0.0, 0),
    ],
)
def test_per_course_view(group: str | None, allocated: float, queue: int) -> None:
    waiting = [
        wait(0, None, groups=("ml101",)),
        wait(1, None, group="cs50", groups=("cs50", "ml101")),  # a course kernel: cs50 only
        wait(2, None),
    ]
    (point,) = compute(COURSES, waiting, 0, 100, 100, group=group)
    assert point.allocated == pytest.approx(allocated)
    assert point.queue_max == queue
    assert point.to_json()["allocated"] == point.allocated


def test_course_shares_add_up_to_the_pool() -> None:
    total = sum(
        compute(COURSES, [], 0, 100, 100, group=g)[0].allocated for g in ("ml101", "cs50", "")
    )
    assert total == pytest.approx(compute(COURSES, [], 0, 100, 100)[0].allocated)
