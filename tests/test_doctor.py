"""``gpu-lease doctor`` as an admin runs it: a subprocess, with NVML or without.

NVML cannot exist here: one run gets the stand-in ``pynvml`` (``tests/fake_nvml``), the
other the real nvidia-ml-py, which finds no driver on this machine. The cap probes are real
processes started under the kernel launcher; the frameworks installed here (CPU builds of
PyTorch and TensorFlow) see no GPU, and a stand-in CuPy (``tests/standin_gpu``) plays a GPU
framework and its driver. What the real frameworks did on a real GPU is in
``benchmarks/gpu/README.md``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from provisioner.node.doctor import EXIT_FAILED, EXIT_NOT_RUN, FRAMEWORKS, Check, exit_status

from .conftest import Broker

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAKE_NVML = HERE / "fake_nvml"
STANDIN_GPU = HERE / "standin_gpu"


def doctor(
    *args: str,
    fake_nvml: Path | None = None,
    standin: bool = False,
    first: Path | None = None,
    **env_vars: str,
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    path = [str(ROOT), env.get("PYTHONPATH", "")]
    if first is not None:  # modules that shadow the installed ones
        path.insert(0, str(first))
    if fake_nvml is not None:
        path.insert(0, str(FAKE_NVML))
        env["FAKE_NVML_FILE"] = str(fake_nvml)
    if standin:
        path.insert(0, str(STANDIN_GPU))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    for name in ("GPU_LEASE_URL", "GPU_LEASE_TOKEN"):  # a broker only where a test names one
        env.pop(name, None)
    env.update(env_vars)
    return subprocess.run(
        [sys.executable, "-m", "provisioner", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def by_name(out: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads(out)["checks"]}


@pytest.mark.slow
def test_with_nvml_it_lists_the_driver_and_every_gpu(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    state.write_text(
        json.dumps(
            {
                "driver": "555.42.06",
                "gpus": [
                    {"uuid": "GPU-aaaa", "name": "NVIDIA A100-SXM4-40GB", "memory_mb": 40960},
                    {"uuid": "GPU-bbbb", "name": "Tesla T4", "memory_mb": 15360},
                ],
            }
        )
    )
    text = doctor(fake_nvml=state)
    assert "driver 555.42.06, 2 GPU(s)" in text.stdout, text.stdout + text.stderr
    assert "GPU 0: NVIDIA A100-SXM4-40GB, 40960 MiB, GPU-aaaa" in text.stdout
    assert "GPU 1: Tesla T4, 15360 MiB, GPU-bbbb" in text.stdout
    # the probes ran (under the launcher, capped) but the frameworks here are CPU builds:
    # nothing measured, said per framework, and the exit status says so
    assert "not run here: context_overhead, cap_escape" in text.stdout
    assert text.returncode == EXIT_NOT_RUN

    checks = by_name(doctor("--json", "--processes", "2", fake_nvml=state).stdout)
    assert checks["cap_escape"]["data"]["processes"] == 2
    assert checks["nvml"]["status"] == "ok"
    assert checks["nvml"]["data"]["driver"] == "555.42.06"
    assert [g["memory_mb"] for g in checks["nvml"]["data"]["gpus"]] == [40960, 15360]
    assert checks["mps"]["status"] in {"ok", "missing"}
    assert {f"framework:{m}" for m in FRAMEWORKS} <= set(checks)
    results = checks["cap_escape"]["data"]["results"]
    assert [r["framework"] for r in results] == ["torch", "tensorflow"]
    assert all(r["status"] == "not run" and "sees no GPU" in r["error"] for r in results)
    assert "torch 2." in checks["context_overhead"]["detail"]
    assert "sees no GPU" in checks["context_overhead"]["detail"]


def nvml_state(tmp_path: Path) -> Path:
    state = tmp_path / "nvml.json"
    gpu = {"uuid": "GPU-aaaa", "name": "NVIDIA A100-SXM4-40GB", "memory_mb": 40960}
    state.write_text(json.dumps({"driver": "555.42.06", "gpus": [gpu]}))
    return state


@pytest.mark.slow
def test_a_cap_that_holds_and_a_small_context_pass(tmp_path: Path) -> None:
    """The stand-in CuPy honours CUPY_GPU_MEMORY_LIMIT, which the probe got as a kernel does."""
    result = doctor("--json", "--processes", "3", fake_nvml=nvml_state(tmp_path), standin=True)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = by_name(result.stdout)
    assert checks["context_overhead"]["status"] == "ok"
    assert checks["context_overhead"]["data"]["context_mb"] == {"cupy": 300}
    cap = checks["cap_escape"]
    assert cap["status"] == "ok" and cap["detail"].startswith("3 capped processes")
    assert "held by cupy" in cap["detail"]
    (cupy,) = [r for r in cap["data"]["results"] if r["framework"] == "cupy"]
    assert cupy["cap_report"] == f"CUPY_GPU_MEMORY_LIMIT={1024 * 2**20} (1024 MiB; environment)"
    assert cupy["block"]["refused"] and "limit set to: 1,073,741,824" in cupy["block"]["error"]
    assert cupy["chunks"]["refused"] and cupy["chunks"]["granted_mb"] <= 1024
    # NVML saw the context plus what the pool held at the peak, no more than cap + context
    assert 300 < cupy["peak_mb"] <= 1024 + 300


@pytest.mark.slow
def test_a_cap_that_does_not_hold_and_a_large_context_fail(tmp_path: Path) -> None:
    state = nvml_state(tmp_path)
    env = {"STANDIN_IGNORE_LIMIT": "1", "STANDIN_CONTEXT_MB": "700"}
    result = doctor("--json", "--processes", "3", fake_nvml=state, standin=True, **env)
    assert result.returncode == EXIT_FAILED, result.stdout + result.stderr
    checks = by_name(result.stdout)
    assert checks["cap_escape"]["status"] == "failed"
    assert checks["cap_escape"]["detail"].endswith("not held by cupy")
    (cupy,) = [r for r in checks["cap_escape"]["data"]["results"] if r["framework"] == "cupy"]
    assert not cupy["block"]["refused"] and cupy["peak_mb"] > 1024 + 700
    context = checks["context_overhead"]
    assert context["status"] == "failed"
    assert "set the broker's context_overhead_mb to at least 700" in context["detail"]
    assert context["detail"].endswith(
        "[512 MiB: the broker's default; set GPU_LEASE_URL to compare with its setting]"
    )
    # a broker that reserves enough for that context: the context check passes
    env.pop("STANDIN_IGNORE_LIMIT")
    again = doctor(
        "--json",
        "--processes",
        "3",
        "--context-overhead-mb",
        "768",
        "--cap-mb",
        "256",
        fake_nvml=state,
        standin=True,
        **env,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    checks = by_name(again.stdout)
    assert checks["context_overhead"]["detail"].endswith(
        "(within the 768 MiB a lease reserves) [768 MiB: --context-overhead-mb]"
    )
    assert checks["cap_escape"]["data"]["cap_mb"] == 256


@pytest.mark.slow
def test_without_a_driver_it_says_what_it_could_not_check() -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py is a dependency of the package")
    result = doctor("--json")
    assert result.returncode == EXIT_NOT_RUN, result.stderr
    checks = by_name(result.stdout)
    assert checks["nvml"]["status"] == "not run"
    assert checks["nvml"]["detail"].startswith("no NVIDIA driver here")
    assert checks["context_overhead"] == {
        "name": "context_overhead",
        "status": "not run",
        "detail": "CUDA context overhead: no GPU here",
        "data": {},
    }
    # torch and tensorflow are in the test requirements, so these two are found
    assert checks["framework:torch"]["status"] == "ok"
    assert checks["framework:tensorflow"]["status"] == "ok"


@pytest.mark.slow
def test_a_driver_with_no_gpus_is_not_a_pass(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": []}))
    checks = by_name(doctor("--json", fake_nvml=state).stdout)
    assert checks["nvml"]["status"] == "not run"
    assert checks["nvml"]["detail"] == "driver 550.54.15 reports 0 GPUs"


@pytest.mark.slow
def test_a_framework_that_cannot_start_is_a_failure_with_why(tmp_path: Path) -> None:
    """A framework that crashes at import is not a pass and not a cap that failed to hold."""
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text(
        "raise RuntimeError('libcuda.so.1: cannot open shared object file')\n"
    )
    result = doctor(
        "--json", "--processes", "3", fake_nvml=nvml_state(tmp_path), standin=True, first=broken
    )
    assert result.returncode == EXIT_FAILED, result.stdout + result.stderr
    checks = by_name(result.stdout)
    assert checks["cap_escape"]["detail"] == (
        "3 capped processes allocating past a 1024 MiB cap: could not run: torch "
        "(RuntimeError: libcuda.so.1: cannot open shared object file)"
    )
    assert checks["context_overhead"]["status"] == "ok"  # CuPy's was measured


@pytest.mark.slow
def test_the_context_is_compared_with_the_brokers_setting(tmp_path: Path) -> None:
    """With GPU_LEASE_URL, doctor asks the broker (GET /api/v1/gpus) what it reserves."""
    state = nvml_state(tmp_path)

    def with_700(**env: str) -> subprocess.CompletedProcess[str]:
        """Doctor with the stand-in CuPy, whose context is 700 MiB, against ``env``'s broker."""
        args = ("--json", "--processes", "3")
        return doctor(*args, fake_nvml=state, standin=True, STANDIN_CONTEXT_MB="700", **env)

    db = f"sqlite:///{tmp_path / 'b.sqlite'}"
    with Broker(tmp_path, db, ("--GPULeaseBroker.context_overhead_mb=768",)).running() as b:
        result = with_700(GPU_LEASE_URL=b.url, GPU_LEASE_TOKEN=b.tokens["alice"])
    assert result.returncode == 0, result.stdout + result.stderr
    context = by_name(result.stdout)["context_overhead"]
    assert context["status"] == "ok"
    assert context["detail"].endswith(
        "(within the 768 MiB a lease reserves) [768 MiB: the broker's setting]"
    )
    # a broker that cannot be asked: the default, and why
    result = with_700(GPU_LEASE_URL="http://127.0.0.1:9", GPU_LEASE_TOKEN="t")
    assert result.returncode == EXIT_FAILED
    detail = by_name(result.stdout)["context_overhead"]["detail"]
    assert "at least 700 [512 MiB: the default: the broker could not be asked (" in detail


@pytest.mark.parametrize(
    ("statuses", "code"),
    [(["ok", "missing"], 0), (["ok", "not run"], 3), (["not run", "failed", "ok"], 1)],
)
def test_exit_status(statuses: list[str], code: int) -> None:
    assert exit_status([Check(str(i), s, "") for i, s in enumerate(statuses)]) == code


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("--processes", "0"),
        ("--processes", "-2"),
        ("--processes", "many"),
        ("--cap-mb", "0"),
        ("--cap-mb", "1.5"),
        ("--context-overhead-mb", "-1"),
    ],
)
def test_bad_numbers_are_refused(args: tuple[str, str]) -> None:
    result = doctor(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert args[0] in result.stderr


@pytest.mark.slow
def test_checkpoint_parks_and_resumes_a_probe_on_a_driver_that_offers_it(tmp_path: Path) -> None:
    """The stand-in libcuda first on the library path: the driver's checkpoint API is there.

    The stand-in CuPy writes its memory into the stand-in NVML, which shows a process the
    stand-in driver holds CHECKPOINTED with 0 MiB: parked means off the GPU, resumed back."""
    from tests.standin_libcuda.build import build

    lib = build(tmp_path / "lib")
    driver = tmp_path / "driver"
    driver.mkdir()
    env = {"LD_LIBRARY_PATH": str(lib), "STANDIN_LIBCUDA_DIR": str(driver)}
    result = doctor(
        "--json", "--processes", "3", fake_nvml=nvml_state(tmp_path), standin=True, **env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    check = by_name(result.stdout)["checkpoint"]
    assert check["status"] == "ok", check
    data = check["data"]
    assert data["framework"] == "cupy" and data["driver_api"] == 12090
    assert data["before_mb"] > 1024 and data["parked_mb"] == 0
    assert data["after_mb"] == data["before_mb"]
    assert data["park_gib_per_s"] > 0 and data["resume_gib_per_s"] > 0
    assert check["detail"].count("GiB/s") == 2
    steps = [line.split()[0] for line in (driver / "calls.log").read_text().splitlines()]
    assert steps == [
        "cuCheckpointProcessLock",
        "cuCheckpointProcessCheckpoint",
        "cuCheckpointProcessRestore",
        "cuCheckpointProcessUnlock",
    ]


@pytest.mark.slow
def test_checkpoint_on_a_driver_without_it_is_missing_not_failed(tmp_path: Path) -> None:
    """Driver 580 and older 5xx have it; one without the entry points is said plainly."""
    from tests.standin_libcuda.build import build

    lib = build(tmp_path / "lib", checkpoint=False)
    env = {"LD_LIBRARY_PATH": str(lib), "STANDIN_LIBCUDA_DIR": str(tmp_path)}
    result = doctor(
        "--json", "--processes", "3", fake_nvml=nvml_state(tmp_path), standin=True, **env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    check = by_name(result.stdout)["checkpoint"]
    assert check["status"] == "missing"
    assert "driver 570 or later" in check["detail"] and "reclaimed" in check["detail"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("driver", "status", "says"),
    [
        (
            "580.95.05",
            "missing",
            "driver 580.95.05 has no nvmlDeviceSetMemoryLimits_v1 (it needs R615 or newer)",
        ),
        ("615.10", "ok", "driver 615.10 offers nvmlDeviceSetMemoryLimits_v1"),
    ],
)
def test_it_says_whether_the_driver_caps_a_kernels_cgroup(
    tmp_path: Path, driver: str, status: str, says: str
) -> None:
    """Driver 580 has no per-cgroup memory limits: said plainly, never a failure."""
    state = tmp_path / "nvml.json"
    gpu = {"uuid": "GPU-aaaa", "name": "NVIDIA H100", "memory_mb": 81559}
    state.write_text(json.dumps({"driver": driver, "gpus": [gpu]}))
    result = doctor("--json", "--processes", "1", fake_nvml=state)
    check = by_name(result.stdout)["driver_limits"]
    assert check["status"] == status, check
    assert says in check["detail"], check
    assert check["data"]["offered"] is (status == "ok")
    assert result.returncode != EXIT_FAILED
    text = doctor("--processes", "1", fake_nvml=state).stdout
    assert re.search(rf"^driver_limits +{status} +{re.escape(says)}", text, re.M), text
