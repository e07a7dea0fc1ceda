"""``benchmarks/gpu/gpu_checks.py --park --density`` runs here, on the stand-ins.

A device call is precious (minutes a session), so the script that spends it must not fail
on a typo: this runs its park and density steps end to end with ``--device cpu`` (PyTorch on
the CPU), the stand-in NVML for the agent and NVML reads, and the stand-in libcuda for the
checkpoint calls: a real broker, a real agent, real kernels started by the provisioner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.standin_libcuda.build import build

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FAKE_NVML = ROOT / "tests" / "fake_nvml"


@pytest.mark.timeout(300)
def test_park_and_density_steps_run_on_the_stand_ins(tmp_path: Path) -> None:
    lib = build(tmp_path / "lib")
    driver = tmp_path / "driver"
    driver.mkdir()
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"gpus": [{"uuid": "GPU-1", "name": "H100", "memory_mb": 81559}]}))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(FAKE_NVML), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
        "FAKE_NVML_FILE": str(nvml),
        "LD_LIBRARY_PATH": str(lib),
        "STANDIN_LIBCUDA_DIR": str(driver),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu" / "gpu_checks.py"),
            "--out",
            str(out),
            "--steps",
            "park",
            "density",
            "--device",
            "cpu",
            "--park-gib",
            "1",
            "--density-kernels",
            "3",
            "--density-seconds",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "gpu_checks.json").read_text())

    (park,) = results["park"]["runs"]
    assert "error" not in park, park
    assert park["checksum_equal"] is True
    assert park["state_parked"] == "CHECKPOINTED" and park["state_resumed"] == "RUNNING"
    calls = (driver / "calls.log").read_text().split()[0::3]
    assert calls == [
        "cuCheckpointProcessLock",
        "cuCheckpointProcessCheckpoint",
        "cuCheckpointProcessRestore",
        "cuCheckpointProcessUnlock",
    ]

    density = results["density"]
    assert "error" not in density, density
    assert density["started"] == 3 and not density["start_errors"]
    assert not density["warm_errors"] and not density["allocation_failures"]
    assert density["exclusive_steps_per_s"] > 0 and density["aggregate_steps_per_s"] > 0
    assert density["active_leases_after"] == 0
    assert "park 1 GiB" in (out / "gpu_checks.txt").read_text()
