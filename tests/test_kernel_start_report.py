"""``benchmarks/kernel_start.py``'s arithmetic: the intervals and the GPU path's own cost.

The benchmark itself starts real kernels for minutes (see benchmarks/README.md); these
check, on made-up rounds, that what it prints follows from what it measured.
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def load() -> Any:
    spec = importlib.util.spec_from_file_location(
        "kernel_start", ROOT / "benchmarks" / "kernel_start.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kernel_start", module)
    spec.loader.exec_module(module)
    return module


ks = load()


def rounds(
    n: int, gpu_extra_launch: float, gpu_factor: float, seed: int = 1
) -> list[dict[str, Any]]:
    """``n`` rounds: the kernel's part varies ±10 % (as here), the launch little."""
    rng = random.Random(seed)
    runs = []
    for _ in range(n):
        run: dict[str, Any] = {}
        for name, extra, factor in ((ks.PLAIN, 0.0, 1.0), (ks.GPU, gpu_extra_launch, gpu_factor)):
            launch = 0.014 + extra + rng.uniform(-0.001, 0.001)
            ready = 0.5 * factor * rng.uniform(0.9, 1.1)
            run[name] = {
                "launch": launch,
                "ready": ready,
                "start": launch + ready,
                "restart": 0.7 * rng.uniform(0.9, 1.1),
                "shutdown": 0.2,
                "server_cpu": 0.004,
                "kernel_cpu": 0.3,
            }
        runs.append(run)
    return runs


def test_the_interval_holds_the_median_of_paired_ratios_and_narrows_with_rounds() -> None:
    widths = []
    for n in (30, 300):
        s = ks.summarize(rounds(n, 0.005, 1.0))
        x = s["start"]
        assert x["median_of_ratios_low"] <= x["median_of_ratios"] <= x["median_of_ratios_high"]
        widths.append(x["median_of_ratios_high"] - x["median_of_ratios_low"])
    assert widths[1] < widths[0] / 2


def test_own_cost_is_the_launch_extra_plus_the_kernel_side_parts() -> None:
    runs = rounds(30, 0.006, 1.0)
    data = {
        "rounds": 30,
        "summary": ks.summarize(runs),
        "breakdown": {
            "client_ms": 0.1,
            "acquire_ms": 4.0,
            "repeat_acquire_ms": 1.9,
            "release_ms": 2.0,
            "acquire_stdlib_ms": 2.0,
            "repeat_stdlib_ms": 0.9,
            "launcher_ms": 1.0,
            "python_m_ms": 20.0,
            "extension_import_ms": 0.5,
        },
    }
    paired = statistics.median(r[ks.GPU]["launch"] - r[ks.PLAIN]["launch"] for r in runs) * 1e3
    assert abs(data["summary"]["launch"]["extra_paired_ms"] - paired) < 1e-9
    plain = statistics.median(r[ks.PLAIN]["start"] for r in runs) * 1e3
    text = ks.report(data)
    line = next(x for x in text.splitlines() if "own cost" in x)
    assert f"= {paired + 1.5:.1f} ms -> {1 + (paired + 1.5) / plain:.3f} of the plain start" in line


def test_a_slower_gpu_kernel_is_reported_as_not_met() -> None:
    text = ks.report({"rounds": 300, "summary": ks.summarize(rounds(300, 0.005, 1.06))})
    start = next(x for x in text.splitlines() if x.startswith("start "))
    assert "NOT met" in start
