"""The soak benchmark, short: ~20 s of a simulated class against a real broker.

``benchmarks/soak.py`` runs as a subprocess (its own broker, the real client); the test
asserts only what must hold exactly — nothing leaked, nothing left queued, every lease
ended as its kernel did, no GPU over-allocated, no client error. Memory is reported by
the benchmark, not judged here (timing- and machine-dependent).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_soak_short() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--seconds", "20", "--json"],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=ROOT,
    )
    assert run.stdout.strip(), run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["errors"] == []
    assert report["leaked_leases"] == 0
    assert report["queued_at_end"] == 0
    assert report["overallocated"] == 0 and report["gpu_samples"] > 0
    assert report["restart_mismatches"] == 0
    assert report["accounted"], json.dumps(report)  # a string: shown whole on failure
    assert report["acquired"] > 20 and report["died"] > 0 and report["released"] > 0
    assert report["broker_alive"] and report["ok"]
    assert run.returncode == 0, run.stderr[-3000:]
