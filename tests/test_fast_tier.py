"""The fast tier (``-m "not slow"``) starts no process: tests/conftest.py fails a test not
marked ``slow`` that tries, whichever way it tries (docs/developers.md, Tests)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys

import pytest

REFUSED = "started a process .* but is not marked slow"


def test_subprocesses_are_refused() -> None:
    with pytest.raises(AssertionError, match=REFUSED):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(AssertionError, match=REFUSED):
        os.system("true")


def test_fork_is_refused() -> None:
    with pytest.raises(AssertionError, match=REFUSED):
        if os.fork() == 0:  # only if the guard failed: the child leaves at once
            os._exit(0)


async def test_asyncio_subprocesses_are_refused() -> None:
    with pytest.raises(AssertionError, match=REFUSED):
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_multiprocessing_is_refused(method: str) -> None:
    process = multiprocessing.get_context(method).Process(target=print)
    with pytest.raises(AssertionError, match=REFUSED):
        process.start()
    if process._popen is not None:  # only if the guard failed
        process.join()


@pytest.mark.slow
def test_a_slow_test_may_start_processes() -> None:
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                          text=True, check=True).stdout == "42\n"  # fmt: skip
    assert os.system("exit 7") >> 8 == 7
