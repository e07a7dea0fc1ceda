"""The CUDA checkpoint binding (provisioner/node/checkpoint.py) against the stand-in libcuda.

The stand-in (tests/standin_libcuda/libcuda.c) is built with cc, loaded exactly as the
driver is (by soname on ``LD_LIBRARY_PATH`` in a child process, by path in this one), and
checks the driver's transitions; the target of each call is a real process (``sleep``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from provisioner.node.checkpoint import (
    CheckpointFailed,
    CheckpointUnavailable,
    CudaCheckpoint,
    ProcessState,
    support,
)
from tests.standin_libcuda.build import build

pytestmark = pytest.mark.slow  # builds a C library and starts processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("libcuda"))


@pytest.fixture(scope="module")
def old_libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("libcuda-old"), checkpoint=False)


@pytest.fixture
def driver(libdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CudaCheckpoint:
    state = tmp_path / "driver"
    state.mkdir()
    monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(state))
    return CudaCheckpoint(str(libdir / "libcuda.so.1"))


@pytest.fixture
def pid() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def calls() -> list[str]:
    log = Path(os.environ["STANDIN_LIBCUDA_DIR"]) / "calls.log"
    return [" ".join(line.split()[:1] + line.split()[2:]) for line in log.read_text().splitlines()]


def test_park_then_resume_walks_the_driver_states(driver: CudaCheckpoint, pid: int) -> None:
    assert driver.state(pid) is ProcessState.RUNNING
    assert driver.park(pid) >= 0
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    assert driver.resume(pid) >= 0
    assert driver.state(pid) is ProcessState.RUNNING
    assert calls() == [
        "cuCheckpointProcessLock 0",
        "cuCheckpointProcessCheckpoint 0",
        "cuCheckpointProcessRestore 0",
        "cuCheckpointProcessUnlock 0",
    ]
    assert driver.driver_api == 12090


def test_a_failed_checkpoint_unlocks_so_the_kernel_runs_on(
    driver: CudaCheckpoint, pid: int
) -> None:
    (Path(os.environ["STANDIN_LIBCUDA_DIR"]) / "fail-checkpoint").write_text("")
    with pytest.raises(CheckpointFailed) as caught:
        driver.park(pid)
    assert caught.value.step == "cuCheckpointProcessCheckpoint"
    assert caught.value.pid == pid
    assert "CUDA_ERROR_UNKNOWN" in str(caught.value)
    assert driver.state(pid) is ProcessState.RUNNING
    assert calls()[-1] == "cuCheckpointProcessUnlock 0"


def test_a_process_left_failed_is_named_and_not_resumed(driver: CudaCheckpoint, pid: int) -> None:
    (Path(os.environ["STANDIN_LIBCUDA_DIR"]) / "fail-checkpoint").write_text("failed")
    with pytest.raises(CheckpointFailed) as caught:
        driver.park(pid)
    assert caught.value.state is ProcessState.FAILED
    assert "FAILED" in str(caught.value)
    with pytest.raises(CheckpointFailed, match="cannot be resumed: end the kernel"):
        driver.resume(pid)


def test_resume_of_a_running_process_is_a_no_op(driver: CudaCheckpoint, pid: int) -> None:
    driver.resume(pid)  # e.g. an agent restarted after it had already resumed the kernel
    assert driver.state(pid) is ProcessState.RUNNING
    assert not (Path(os.environ["STANDIN_LIBCUDA_DIR"]) / "calls.log").exists()


def test_steps_out_of_order_are_refused_with_the_state(driver: CudaCheckpoint, pid: int) -> None:
    with pytest.raises(CheckpointFailed, match="CUDA_ERROR_ILLEGAL_STATE.*RUNNING"):
        driver.checkpoint(pid)
    with pytest.raises(CheckpointFailed, match="CUDA_ERROR_INVALID_VALUE"):
        driver.lock(2**22 + 12345)  # no such process (above the default pid_max)


def test_no_driver_no_old_driver_no_x86(
    old_libdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(tmp_path))
    with pytest.raises(CheckpointUnavailable, match="could not be loaded"):
        CudaCheckpoint(str(tmp_path / "nowhere" / "libcuda.so.1"))
    with pytest.raises(CheckpointUnavailable, match="driver 570 or later"):
        CudaCheckpoint(str(old_libdir / "libcuda.so.1"))
    assert not support(str(old_libdir / "libcuda.so.1")).works
    with pytest.raises(CheckpointUnavailable, match="x86-64 only"):
        CudaCheckpoint(str(old_libdir / "libcuda.so.1"), machine="aarch64")


def test_a_driver_api_below_12_8_is_reported(
    libdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_LIBCUDA_DIR", str(tmp_path))
    monkeypatch.setenv("STANDIN_LIBCUDA_DRIVER_API", "12040")
    verdict = support(str(libdir / "libcuda.so.1"))
    assert not verdict.works
    assert "12.4" in verdict.reason and "570" in verdict.reason


def test_the_soname_is_found_on_the_library_path(libdir: Path, tmp_path: Path) -> None:
    """A fresh process loads ``libcuda.so.1`` by soname: the stand-in first on the path."""
    code = textwrap.dedent(
        """
        from provisioner.node.checkpoint import support
        s = support()
        print(s.works, s.driver_api)
        """
    )
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(libdir),
        "STANDIN_LIBCUDA_DIR": str(tmp_path),
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "12090"]
