"""``benchmarks/park_cycle.py``: its log timeline, and one short real run.

The benchmark itself runs for minutes (see benchmarks/README.md "Parking's control
plane"); the slow test runs one round of it with every part real and checks that it
completes, that the parked lease really was parked and resumed (the script fails
otherwise), that no lease is left, and that every ratio is a finite number. No timing is
asserted: this machine's load decides those.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load() -> Any:
    spec = importlib.util.spec_from_file_location(
        "park_cycle", ROOT / "benchmarks" / "park_cycle.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("park_cycle", module)
    spec.loader.exec_module(module)
    return module


pc = load()


def test_the_timeline_reads_both_log_formats_from_a_moment_on(tmp_path: Path) -> None:
    broker = tmp_path / "broker.log"
    broker.write_text(
        "[I 2026-11-27 03:00:00.100 gpu_lease.broker.leases] Parking idle lease abcdef… of a\n"
        "[I 2026-11-27 03:00:01.250 gpu_lease.broker.leases] Parking idle lease abcdef… of a\n"
        "a line without a stamp: Parking idle lease abcdef…\n"
    )
    agent = tmp_path / "agent.log"
    agent.write_text(
        "[I 2026-11-27 03:00:02,500 gpu_lease.node.parking] Parked lease abcdef: pids 7, "
        "1000 MiB in 0.25 s\n"
    )
    first = pc.logged(broker, "Parking idle lease abcdef…", 0.0)
    assert first is not None
    later = pc.logged(broker, "Parking idle lease abcdef…", first[0] + 0.5)
    assert later is not None and later[0] - first[0] == pytest.approx(1.15)
    assert pc.logged(broker, "Parking idle lease abcdef…", later[0] + 0.01) is None
    parked = pc.logged(agent, "Parked lease abcdef:", 0.0)
    assert parked is not None and parked[0] - first[0] == pytest.approx(2.4)


def test_the_summary_pairs_rounds_and_skips_missing_parts() -> None:
    def mode(waiter: float, back: float, **more: float) -> dict[str, Any]:
        return {"waiter": {"total": waiter, **more}, "return": {"total": back}}

    hook = {"on": [0.0051, 0.0052], "off": [0.005, 0.005], "call_s": 1e-5}
    runs = [
        {pc.PARK: {**mode(2.0, 1.0, heartbeat_wait=1.0), "hook": hook}, pc.RECLAIM: mode(1.0, 2.0)},
        {pc.PARK: {**mode(3.0, 1.0), "hook": hook}, pc.RECLAIM: mode(1.0, 4.0)},
    ]
    s = pc.summarize(runs)
    assert s["waiter"]["ratio_of_medians"] == pytest.approx(2.5)
    assert s["waiter"]["median_of_ratios"] == pytest.approx(2.5)
    assert s["return"]["ratio_of_medians"] == pytest.approx(1 / 3)
    assert s["return"]["median_of_ratios"] == pytest.approx((0.5 + 0.25) / 2)
    assert s["waiter_parts"][pc.PARK]["heartbeat_wait"] == 1.0  # one round had it
    assert s["hook"]["extra_median_us"] == pytest.approx(150)
    assert s["hook"]["call_us"] == pytest.approx(10)


@pytest.mark.slow
def test_one_round_of_the_benchmark_completes(tmp_path: Path) -> None:
    out = tmp_path / "park.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "park_cycle.py"),
            "--quick",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--cells",
            "5",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["leases_left"] == 0
    s = data["summary"]
    ratios = [
        s["waiter"]["ratio_of_medians"],
        s["return"]["ratio_of_medians"],
        s["hook"]["ratio_of_medians"],
    ]
    assert all(math.isfinite(r) and r > 0 for r in ratios), ratios
    # the park's timeline was read from the logs: the order, the heartbeat, the outcome
    assert {"to_order", "heartbeat_wait", "driver"} <= set(s["waiter_parts"][pc.PARK])
    assert {"to_order", "heartbeat_wait", "driver"} <= set(s["return_parts"][pc.PARK])
    assert "The %gpu hook when not parked" in run.stdout
