"""The upstream runner's reading of a shard's pytest output (``tests/upstream/run_upstream.py``):
what it prints when a shard fails, and which tests it runs once more.

CI keeps only the tail of a run's output, so a failed shard must print why (the exception
lines and the captured warnings) and end with its ``FAILED`` lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "upstream"))

import run_upstream  # noqa: E402

OUTPUT = """\
..F.F
=================================== FAILURES ===================================
___________________ test_modify_kernel_name[jp_server_config0] ___________________
E   tornado.httpclient.HTTPClientError: HTTP 501: Not Implemented
------------------------------ Captured log call -------------------------------
WARNING  ServerApp:provisioner.py:120 GPU request for kernel k1 failed: the broker said no
ERROR    ServerApp:handlers.py:187 Error starting kernel: python3
___________________ test_modify_kernel_id[jp_server_config0] ___________________
E   tornado.httpclient.HTTPClientError: HTTP 500: Internal Server Error
ERROR    ServerApp:handlers.py:187 Error starting kernel: python3
=========================== short test summary info ============================
FAILED tests/services/sessions/test_api.py::test_modify_kernel_name[jp_server_config0] - tornado.httpclient.HTTPClientError: HTTP 501
FAILED tests/services/sessions/test_api.py::test_modify_kernel_id[jp_server_config0] - tornado.httpclient.HTTPClientError: HTTP 500
2 failed, 3 passed in 9.10s
""".splitlines()


def test_a_failed_shard_prints_why_once_and_ends_with_its_failures() -> None:
    printed = run_upstream.failure_lines(OUTPUT)
    assert printed == [
        "E   tornado.httpclient.HTTPClientError: HTTP 501: Not Implemented",
        "WARNING  ServerApp:provisioner.py:120 GPU request for kernel k1 failed: the broker said no",
        "ERROR    ServerApp:handlers.py:187 Error starting kernel: python3",
        "E   tornado.httpclient.HTTPClientError: HTTP 500: Internal Server Error",
        *[x for x in OUTPUT if x.startswith("FAILED ")],
    ]


def test_what_is_printed_is_bounded() -> None:
    many = [f"E   error {n}" for n in range(1000)] + ["FAILED t.py::a - x"]
    printed = run_upstream.failure_lines(many)
    assert len(printed) == run_upstream.FAILURE_LINES + 1
    assert printed[-1] == "FAILED t.py::a - x"


def test_an_output_without_failures_or_exceptions_prints_its_tail() -> None:
    crashed = [f"line {n}" for n in range(100)]
    assert run_upstream.failure_lines(crashed) == crashed[-60:]


def test_the_failed_tests_are_read_from_the_summary() -> None:
    assert run_upstream.failed_tests(OUTPUT) == [
        "tests/services/sessions/test_api.py::test_modify_kernel_name[jp_server_config0]",
        "tests/services/sessions/test_api.py::test_modify_kernel_id[jp_server_config0]",
    ]
