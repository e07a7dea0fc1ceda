"""Replay every trace under every policy and baseline; print one table per trace.

    python benchmarks/simulate.py                 # all traces in benchmarks/traces/
    python benchmarks/simulate.py --small         # the small test trace only (seconds)
    python benchmarks/simulate.py --traces benchmarks/traces/department.jsonl --json out.json
    python benchmarks/simulate.py --seeds 1 2 3 4 5     # department regenerated per seed: spread
    python benchmarks/simulate.py --labs [--seeds 1 2 3] # class sessions on the labs trace

Columns: seat/GPU = most kernels holding a lease at once per GPU; wait = queue wait
(mean, p95; a request still waiting at the end counts its wait so far), "large" =
requests >= 0.5; util = allocated fraction-time / capacity over the trace's horizon,
u-sat = the same only while someone waited (saturation);
J = Jain's index over users' mean session slowdown (waits+duration)/duration, Jw over
users' mean wait;
idle-h = GPU-hours held by kernels idle >= 10 min while someone waited; revoked =
leases taken back by idle reclaim. Ratios compare ``ours`` with the baselines.
The parking table compares ``ours`` (reclaim) with ``park`` and ``park-arrival``: work
lost = kernels ended with their state (= revoked), busy-h lost = the busy hours those
kernels had run, first/return = mean wait of first asks and of returns after reclaim/park.
The class-session table (``--labs``: the ``labs`` trace, a timetable of two courses' labs
beside a research group) compares ``ours`` and ``park`` (no reservations) with the
``sessions*`` schemes: members' wait for a kernel asked within 10 min of a lab's start
(p50, p95, max), the others' (research) wait (mean, p95) and kernels lost (ended with
their state), members' kernels lost, busy hours lost, kernels parked.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_traces import WORKLOADS  # noqa: E402

from provisioner.devtools.simulate import (  # noqa: E402
    SCHEMES,
    SESSIONS,
    Metrics,
    SessionMetrics,
    load_trace,
    simulate,
    simulate_sessions,
)

TRACES = Path(__file__).parent / "traces"
FULL = ("classroom", "department", "deadline")


def _m(s: float) -> str:
    """Seconds as minutes, compactly."""
    return f"{s / 60:.1f}" if s < 6000 else f"{s / 60:.0f}"


def table(rows: list[Metrics]) -> str:
    head = (
        f"{'scheme':<20} {'seat/GPU':>8} {'wait m':>7} {'p95 m':>7} {'lg mean':>8} {'lg p95':>7} "
        f"{'lg max':>7} {'util':>6} {'u-sat':>6} {'J':>5} {'Jw':>5} {'idle-h':>7} {'revoked':>7} {'left':>5} {'sec':>5}"
    )
    lines = [head, "-" * len(head)]
    for m in rows:
        lines.append(
            f"{m.scheme:<20} {m.seated_per_gpu:>8.1f} {_m(m.wait_mean):>7} {_m(m.wait_p95):>7} "
            f"{_m(m.large_wait_mean):>8} {_m(m.large_wait_p95):>7} {_m(m.large_wait_max):>7} "
            f"{m.utilisation:>6.1%} {m.utilisation_saturated:>6.1%} {m.jain_slowdown:>5.2f} {m.jain_wait:>5.2f} "
            f"{m.idle_held_gpu_h:>7.1f} {m.revoked:>7} {m.waiting_at_end:>5} {m.wall_s:>5.1f}"
        )
    return "\n".join(lines)


def ratios(rows: list[Metrics]) -> str:
    by = {m.scheme: m for m in rows}
    ours = by["ours"]
    out = []
    if "whole-gpu" in by:
        out.append(
            f"seated vs whole-gpu: {ours.seated_max / max(1, by['whole-gpu'].seated_max):.0f}x"
        )
    for mine, ref in (("ours", "fluid"), ("ours", "fluid-reclaim"), ("no-reclaim", "fluid")):
        if mine in by and ref in by and by[ref].utilisation_saturated:
            r = by[mine].utilisation_saturated / by[ref].utilisation_saturated
            out.append(f"u-sat {mine} vs {ref}: {r:.1%}")
    for base in ("first-fit", "random-fit", "no-reclaim"):
        if base in by and ours.wait_mean:
            out.append(f"mean wait {base}/ours: {by[base].wait_mean / ours.wait_mean:.2f}x")
    if ours.large_hold_mean:
        out.append(f"large p95 wait / hold: {ours.large_wait_p95 / ours.large_hold_mean:.2f}")
    return "; ".join(out)


def parking(rows: list[Metrics]) -> str:
    """Reclaim against parking: work lost, and who waits how long."""
    by = {m.scheme: m for m in rows}
    names = [n for n in ("ours", "park", "park-arrival") if n in by]
    if len(names) < 2:
        return ""
    lines = [
        f"{'scheme':<14} {'work lost':>9} {'busy-h lost':>11} {'parked':>7} {'wait m':>7} "
        f"{'p95 m':>7} {'first m':>8} {'return m':>9}"
    ]
    for n in names:
        m = by[n]
        lines.append(
            f"{n:<14} {m.revoked:>9} {m.busy_h_lost:>11.1f} {m.parked:>7} {_m(m.wait_mean):>7} "
            f"{_m(m.wait_p95):>7} {_m(m.first_wait_mean):>8} {_m(m.return_wait_mean):>9}"
        )
    return "\n".join(lines)


def spread(workload: str, seeds: list[int], only: list[str] | None) -> str:
    """Each scheme over several seeds of one workload: mean [min..max] of the key numbers."""
    rows: dict[str, list[Metrics]] = {}
    for seed in seeds:  # the same traces as gen_traces.py --seed SEED writes
        trace = WORKLOADS[workload](random.Random(f"{seed}:{workload}"))
        for s in SCHEMES:
            if not only or s.name in only or s.name.startswith("fluid"):
                rows.setdefault(s.name, []).append(simulate(trace, s))

    def cell(xs: list[float], fmt: str) -> str:
        return f"{statistics.mean(xs):{fmt}} [{min(xs):{fmt}}..{max(xs):{fmt}}]"

    fluid, fluid_r = rows["fluid"], rows["fluid-reclaim"]
    lines = [
        f"## {workload}, seeds {' '.join(map(str, seeds))}: mean [min..max] over seeds",
        f"{'scheme':<20} {'u-sat/fluid':>21} {'u-sat/fluid-reclaim':>21} {'wait m':>17} "
        f"{'lg p95/hold':>17} {'J':>17} {'lost':>13} {'return m':>17}",
    ]
    for name, ms in rows.items():
        lines.append(
            f"{name:<20} "
            f"{cell([m.utilisation_saturated / f.utilisation_saturated for m, f in zip(ms, fluid, strict=True)], '.1%'):>21} "
            f"{cell([m.utilisation_saturated / f.utilisation_saturated for m, f in zip(ms, fluid_r, strict=True)], '.1%'):>21} "
            f"{cell([m.wait_mean / 60 for m in ms], '.0f'):>17} "
            f"{cell([m.large_wait_p95 / m.large_hold_mean if m.large_hold_mean else 0.0 for m in ms], '.2f'):>17} "
            f"{cell([m.jain_slowdown for m in ms], '.2f'):>17} "
            f"{cell([float(m.revoked) for m in ms], '.0f'):>13} "
            f"{cell([m.return_wait_mean / 60 for m in ms], '.0f'):>17}"
        )
    return "\n".join(lines)


LAB_SCHEMES = ("ours", "park")


def lab_rows(trace: Any) -> list[SessionMetrics]:
    schemes = [s for s in SCHEMES if s.name in LAB_SCHEMES] + list(SESSIONS)
    return [simulate_sessions(trace, s) for s in schemes]


def labs_table(rows: list[SessionMetrics]) -> str:
    head = (
        f"{'scheme':<24} {'start p50':>9} {'p95':>6} {'max':>6} {'others m':>8} {'p95':>6} "
        f"{'lost':>5} {'members lost':>12} {'busy-h lost':>11} {'parked':>6}"
    )
    lines = [head, "-" * len(head)]
    for m in rows:
        lines.append(
            f"{m.scheme:<24} {_m(m.member_start_p50):>9} {_m(m.member_start_p95):>6} "
            f"{_m(m.member_start_max):>6} {_m(m.others_wait_mean):>8} {_m(m.others_wait_p95):>6} "
            f"{m.others_lost:>5} {m.members_lost:>12} {m.busy_h_lost:>11.1f} {m.parked:>6}"
        )
    return "\n".join(lines)


def labs_spread(seeds: list[int]) -> str:
    """Each scheme over several seeds of the labs workload: mean [min..max]."""
    rows: dict[str, list[SessionMetrics]] = {}
    for seed in seeds:
        trace = WORKLOADS["labs"](random.Random(f"{seed}:labs"))
        for m in lab_rows(trace):
            rows.setdefault(m.scheme, []).append(m)

    def cell(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.0f} [{min(xs):.0f}..{max(xs):.0f}]"

    lines = [
        f"## labs, seeds {' '.join(map(str, seeds))}: mean [min..max] over seeds (minutes, kernels)",
        f"{'scheme':<24} {'start p50':>13} {'start p95':>13} {'others m':>13} {'lost':>13} "
        f"{'members lost':>13}",
    ]
    for name, ms in rows.items():
        lines.append(
            f"{name:<24} {cell([m.member_start_p50 / 60 for m in ms]):>13} "
            f"{cell([m.member_start_p95 / 60 for m in ms]):>13} "
            f"{cell([m.others_wait_mean / 60 for m in ms]):>13} "
            f"{cell([float(m.others_lost) for m in ms]):>13} "
            f"{cell([float(m.members_lost) for m in ms]):>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="only the small test trace")
    ap.add_argument("--traces", nargs="*", help="trace files (default: the benchmark traces)")
    ap.add_argument("--schemes", nargs="*", help="only these schemes (default: all)")
    ap.add_argument("--json", help="also write all metrics to this JSON file")
    ap.add_argument(
        "--seeds", nargs="+", type=int, help="summarise these seeds of --workload instead"
    )
    ap.add_argument("--workload", default="department", choices=sorted(WORKLOADS))
    ap.add_argument(
        "--labs", action="store_true", help="class sessions on the labs trace (or --seeds)"
    )
    args = ap.parse_args(argv)
    if args.labs:
        if args.seeds:
            print(labs_spread(args.seeds))
            return
        trace = load_trace(TRACES / "labs.jsonl")
        print(f"\n## {trace.name}: {len(trace.sessions)} sessions, class sessions")
        print(labs_table(lab_rows(trace)))
        return
    if args.seeds:
        print(spread(args.workload, args.seeds, args.schemes))
        return
    if args.traces:
        paths = [Path(p) for p in args.traces]
    else:
        names = ("small",) if args.small else FULL
        paths = [TRACES / f"{n}.jsonl" for n in names]
    schemes = [s for s in SCHEMES if not args.schemes or s.name in args.schemes]
    everything = []
    for path in paths:
        trace = load_trace(path)
        rows = [simulate(trace, s) for s in schemes]
        everything += rows
        gpus = ", ".join(f"{p.count}x {p.name}" for p in trace.pool)
        print(
            f"\n## {trace.name}: {len(trace.sessions)} sessions, {gpus}, horizon {trace.horizon / 3600:g} h"
        )
        print(table(rows))
        if any(m.scheme == "ours" for m in rows):
            print(ratios(rows))
        if parked := parking(rows):
            print(f"\nreclaim or park ({trace.name}): work lost = kernels ended with their state")
            print(parked)
    if args.json:
        Path(args.json).write_text(json.dumps([m.row() for m in everything], indent=1))


if __name__ == "__main__":
    main()
