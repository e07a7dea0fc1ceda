"""Generate the simulator's workloads into ``benchmarks/traces/`` (JSONL, one session a line).

    python benchmarks/gen_traces.py --seed 1 [--out benchmarks/traces]

Same seed, same files. Each workload is a function of an ``random.Random``:

* ``classroom``  -- 60 students at 0.02 start within 2 minutes, 90-minute sessions,
  short cells between long idle stretches (a lecture); 1x V100 32 GiB.
* ``department`` -- a week: three courses at 0.02/0.05/0.1 (lectures plus evening
  homework) and researchers' leases at 0.25/0.5/1.0 lasting hours (training runs,
  mostly busy, and interactive notebooks, mostly idle); 4x A100 80 GiB.
* ``deadline``   -- 72 hours before a project deadline: 80 students at 0.05/0.1 with an
  arrival rate that grows towards the deadline, and a few research jobs; 2x A100 40 GiB.
* ``small``      -- a few hours on two GPUs with every feature (crashes, idle
  stretches, large requests); the trace ``make test`` replays.
* ``labs``       -- a week of a research group beside two courses' labs with a timetable
  (class sessions): ml101 (40 seats at 0.02: 0.8 GPU) Tue and Thu 10:00-11:30, dl201 (30
  seats at 0.05: 1.5 GPU) Wed and Fri 14:00-15:30; students open the lab's notebook in its
  first minutes; ten researchers run training jobs and idle notebooks of 0.25-1.0 for
  hours, day and night; 2x A100 80 GiB. Its header lists the sessions.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provisioner.devtools.simulate import PoolSpec, Session, Trace  # noqa: E402
from provisioner.model import ClassSession  # noqa: E402
from provisioner.wire import fraction_to_ppm  # noqa: E402

H = 3600.0
DAY = 86400.0
Busy = tuple[tuple[float, float], ...]


def pattern(
    rng: random.Random,
    duration: float,
    mean_busy: float,
    mean_idle: float,
    p_long: float = 0.0,
    long_idle: tuple[float, float] = (0.0, 0.0),
) -> Busy:
    """Busy stretches (session seconds): exponential cells and gaps, some gaps long."""
    out = []
    t = rng.uniform(0, 30)
    while t < duration:
        b = min(t + max(2.0, rng.expovariate(1 / mean_busy)), duration)
        out.append((t, b))
        gap = rng.uniform(*long_idle) if rng.random() < p_long else rng.expovariate(1 / mean_idle)
        t = b + max(1.0, gap)
    return tuple(out)


def student(rng: random.Random, duration: float) -> Busy:
    """A student in a notebook: cells of ~20 s, ~2 min of reading, now and then 10-30 min away."""
    return pattern(rng, duration, 20, 120, 0.06, (600, 1800))


def trainer(rng: random.Random, duration: float) -> Busy:
    """A training run: long busy stretches, short pauses."""
    return pattern(rng, duration, 2400, 60)


def explorer(rng: random.Random, duration: float) -> Busy:
    """An interactive research notebook: mostly idle, sometimes for an hour or two."""
    return pattern(rng, duration, 180, 900, 0.2, (3600, 7200))


def crashed(rng: random.Random) -> bool:
    return rng.random() < 0.02


def classroom(rng: random.Random) -> Trace:
    sessions = []
    for i in range(60):
        d = 5400 + rng.uniform(-300, 300)
        sessions.append(
            Session(
                f"c{i}",
                f"stu{i:02d}",
                rng.uniform(0, 120),
                0.02,
                d,
                student(rng, d),
                "ml101",
                crashed(rng),
            )
        )
    return Trace(
        "classroom", 2 * H, [PoolSpec(1, 32768, "V100")], sessions,
        "60 students at 0.02 start within 2 minutes; 90-minute sessions; one V100 32 GiB",
    )  # fmt: skip


def _evening_hour(rng: random.Random) -> float:
    """Homework hours: 9-23h, weighted towards the evening."""
    return 9 + 14 * math.sqrt(rng.random())


def department(rng: random.Random, research_jobs: int = 290) -> Trace:
    sessions: list[Session] = []
    # (course, students, fraction, lectures as (day, hour, minutes), homework/week, hw minutes)
    courses = [
        ("ml101", 60, 0.02, [(0, 10, 90), (2, 10, 90)], 3, (30, 120)),
        ("dl201", 40, 0.05, [(1, 14, 90), (3, 14, 90)], 3, (45, 180)),
        ("cv301", 24, 0.1, [(4, 13, 120)], 2, (60, 180)),
    ]
    for name, n, frac, lectures, hw, (lo, hi) in courses:
        for k in range(n):
            user = f"{name}-s{k:02d}"
            for day, hour, minutes in lectures:
                d = minutes * 60 + rng.uniform(-300, 0)
                t = day * DAY + hour * H + rng.uniform(0, 300)
                sid = f"{user}-L{day}"
                sessions.append(Session(sid, user, t, frac, d, student(rng, d), name, crashed(rng)))
            for j in range(hw):
                d = rng.uniform(lo, hi) * 60
                t = rng.randrange(7) * DAY + _evening_hour(rng) * H
                sessions.append(
                    Session(f"{user}-h{j}", user, t, frac, d, student(rng, d), name, crashed(rng))
                )
    for j in range(research_jobs):
        user = f"res{rng.randrange(12):02d}"
        frac = rng.choices([0.25, 0.5, 1.0], [0.4, 0.35, 0.25])[0]
        d = min(12 * H, max(1 * H, rng.lognormvariate(math.log(3 * H), 0.6)))
        t = rng.uniform(0, 7 * DAY - 6 * H)
        busy = trainer(rng, d) if rng.random() < 0.6 else explorer(rng, d)
        sessions.append(Session(f"r{j}", user, t, frac, d, busy, "research", crashed(rng)))
    return Trace(
        "department", 7 * DAY, [PoolSpec(4, 81920, "A100-80GB")], sessions,
        "a week: courses at 0.02-0.1 (lectures, homework) and research at 0.25-1.0 for hours; 4x A100 80 GiB",
    )  # fmt: skip


def deadline(rng: random.Random) -> Trace:
    sessions: list[Session] = []
    span = 72 * H
    for k in range(80):
        user = f"proj-s{k:02d}"
        frac = rng.choice([0.05, 0.1])
        for j in range(4):
            # density grows as exp(t / 18h) towards the deadline
            u = rng.random()
            t = 18 * H * math.log(1 + u * (math.exp(span / (18 * H)) - 1))
            d = rng.uniform(1, 4) * H
            busy = pattern(rng, d, 300, 300, 0.1, (1200, 3600))
            sessions.append(Session(f"{user}-{j}", user, t, frac, d, busy, "proj", crashed(rng)))
    for j in range(8):
        frac = rng.choice([0.5, 1.0])
        d = rng.uniform(2, 6) * H
        sessions.append(
            Session(
                f"r{j}",
                f"res{j % 3}",
                rng.uniform(0, span - 6 * H),
                frac,
                d,
                trainer(rng, d),
                "research",
            )
        )
    return Trace(
        "deadline", span, [PoolSpec(2, 40960, "A100-40GB")], sessions,
        "72 hours before a deadline: 80 students at 0.05/0.1, arrivals growing towards it; 2x A100 40 GiB",
    )  # fmt: skip


def small(rng: random.Random) -> Trace:
    sessions: list[Session] = []
    for k in range(40):
        frac = rng.choice([0.02, 0.02, 0.05, 0.1])
        d = rng.uniform(0.3, 1.5) * H
        t = rng.uniform(0, 2 * H)
        sessions.append(
            Session(f"s{k}", f"stu{k % 25:02d}", t, frac, d, student(rng, d), "c", k % 9 == 0)
        )
    for j in range(5):
        d = rng.uniform(0.5, 1.5) * H
        frac = [0.5, 1.0, 0.25, 1.0, 0.5][j]
        sessions.append(
            Session(f"r{j}", f"res{j % 2}", rng.uniform(0, 2 * H), frac, d, explorer(rng, d), "r")
        )
    return Trace(
        "small", 3 * H, [PoolSpec(1, 32768, "V100"), PoolSpec(1, 40960, "A100-40GB")], sessions,
        "a small mixed trace with crashes, idle stretches and large requests (the test trace)",
    )  # fmt: skip


def labs(rng: random.Random) -> Trace:
    sessions: list[Session] = []
    timetable: list[ClassSession] = []
    # (course, seats, fraction, labs as (day, hour), minutes, homework sessions per student)
    courses = [
        ("ml101", 40, 0.02, [(1, 10), (3, 10)], 90, 2),
        ("dl201", 30, 0.05, [(2, 14), (4, 14)], 90, 2),
    ]
    for name, seats, frac, slots, minutes, hw in courses:
        for day, hour in slots:
            start = day * DAY + hour * H
            share = fraction_to_ppm(seats * frac)
            label = f"day {day} {hour:02d}:00"
            timetable.append(
                ClassSession(name, start, start + minutes * 60, share_ppm=share, label=label)
            )
            for k in range(seats):
                # most open the lab's notebook in its first 5 minutes, a few come late
                late = rng.uniform(0, 300) if rng.random() < 0.85 else rng.uniform(300, 1200)
                d = max(600.0, minutes * 60 - late - rng.uniform(0, 300))
                user = f"{name}-s{k:02d}"
                sessions.append(
                    Session(
                        f"{user}-L{day}", user, start + late, frac, d, student(rng, d), name,
                        crashed(rng),
                    )
                )  # fmt: skip
        for k in range(seats):
            user = f"{name}-s{k:02d}"
            for j in range(hw):
                d = rng.uniform(30, 120) * 60
                t = rng.randrange(7) * DAY + _evening_hour(rng) * H
                sessions.append(
                    Session(f"{user}-h{j}", user, t, frac, d, student(rng, d), name, crashed(rng))
                )
    for j in range(120):
        user = f"res{rng.randrange(10):02d}"
        frac = rng.choices([0.25, 0.5, 1.0], [0.4, 0.35, 0.25])[0]
        d = min(12 * H, max(1 * H, rng.lognormvariate(math.log(3 * H), 0.6)))
        t = rng.uniform(0, 7 * DAY - 6 * H)
        busy = trainer(rng, d) if rng.random() < 0.6 else explorer(rng, d)
        sessions.append(Session(f"r{j}", user, t, frac, d, busy, "research", crashed(rng)))
    return Trace(
        "labs", 7 * DAY, [PoolSpec(2, 81920, "A100-80GB")], sessions,
        "a week: a research group (0.25-1.0 for hours) beside two courses' labs with a "
        "timetable (ml101 40x0.02 Tue/Thu 10:00, dl201 30x0.05 Wed/Fri 14:00); 2x A100 80 GiB",
        class_sessions=timetable,
    )  # fmt: skip


WORKLOADS: dict[str, Callable[[random.Random], Trace]] = {
    "classroom": classroom,
    "department": department,
    "deadline": deadline,
    "small": small,
    "labs": labs,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "traces"), help="output folder")
    ap.add_argument("--only", nargs="*", choices=sorted(WORKLOADS), help="generate only these")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        trace = make(random.Random(f"{args.seed}:{name}"))
        trace.seed = args.seed
        path = out / f"{name}.jsonl"
        trace.dump(path)
        work = sum(s.fraction * s.duration for s in trace.sessions) / H
        cap = sum(p.count for p in trace.pool) * trace.horizon / H
        print(
            f"{path}: {len(trace.sessions)} sessions, offered {work:.0f} GPU-h / {cap:.0f} GPU-h capacity"
        )


if __name__ == "__main__":
    main()
