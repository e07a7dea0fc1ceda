"""The broker's book of remote kernels (``broker/rules/node_kernels.py``, pure) and the
wire's checks of a launch and of an agent's report (``node_report.py``), in-process.

What each breaks on purpose: a restart while the old generation still runs (the node ends
the old one), a lease that ends (its kernel is ended, its launch never handed out), a
broker that restarted (it adopts what the agent reports), signals already sent (not sent
twice), bad launches and reports (refused with a sentence, nothing kept).
"""

from __future__ import annotations

from typing import Any

import pytest

from provisioner.broker.rules.node_kernels import NodeKernels
from provisioner.errors import InvalidRequest
from provisioner.node_report import KernelLaunch, RemoteKernelsReport, RemoteKernelStatus

PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}


def launch(**over: Any) -> KernelLaunch:
    body = {"kernel_id": "k1", "argv": ["python", "-f", "{connection_file}"], "key": "k" * 32}
    return KernelLaunch.from_json({**body, **over})


def running(lease: str, generation: int, signaled: int = 0) -> RemoteKernelStatus:
    return RemoteKernelStatus(
        lease, generation, "running", ip="10.0.0.2", ports=PORTS, pid=77, signaled=signaled
    )


def test_a_launch_is_handed_to_its_node_until_reported_then_the_key_is_gone() -> None:
    book = NodeKernels()
    kernel = book.ask("L1", "n1", "alice", launch(), now=1.0)
    assert kernel.generation == 1 and kernel.state == "launching"
    alive = {"L1": 100.0}
    assert book.orders("n2", alive)["launch"] == []  # another node sees nothing
    (order,) = book.orders("n1", alive)["launch"]
    assert order["user"] == "alice" and order["key"] == "k" * 32 and order["generation"] == 1
    assert book.read("n1", True, (running("L1", 1),), now=2.0) == ["L1"]
    assert kernel.launch is None and kernel.state == "running"
    assert book.orders("n1", alive)["launch"] == []
    assert "key" not in kernel.to_json() and kernel.to_json()["ports"] == PORTS
    assert book.orders("n1", alive)["kernel_expiry"] == {"L1": 100.0}


def test_a_restart_is_a_new_generation_and_the_node_ends_the_old_one() -> None:
    book = NodeKernels()
    book.ask("L1", "n1", "alice", launch(), now=1.0)
    book.read("n1", True, (running("L1", 1),), now=2.0)
    again = book.ask("L1", "n1", "alice", launch(kernel_id="k1"), now=3.0)
    assert again.generation == 2
    orders = book.orders("n1", {"L1": 100.0})
    assert orders["kernel_ends"] == [{"lease_id": "L1", "generation": 1}]
    assert [o["generation"] for o in orders["launch"]] == [2]


def test_an_ended_lease_gets_no_launch_and_its_running_kernel_is_ended() -> None:
    book = NodeKernels()
    book.ask("L1", "n1", "alice", launch(), now=1.0)
    assert book.orders("n1", {})["launch"] == []  # the lease ended before the node took it
    book.read("n1", True, (running("L1", 1),), now=2.0)
    assert book.orders("n1", {})["kernel_ends"] == [{"lease_id": "L1", "generation": 1}]
    assert book.remote("L1")
    book.read("n1", True, (RemoteKernelStatus("L1", 1, "exited", exit_code=-15),), now=3.0)
    book.read("n1", True, (), now=4.0)  # the agent forgot it after delivering the end
    book.forget(alive=set())
    assert book.on("L1") is None and not book.remote("L1")


def test_a_restarted_broker_adopts_what_the_agent_reports() -> None:
    book = NodeKernels()  # a broker that knows nothing
    changed = book.read("n1", True, (running("L9", 3, signaled=4),), now=1.0)
    kernel = book.on("L9")
    assert changed == ["L9"] and kernel is not None
    assert kernel.generation == 3 and kernel.state == "running" and kernel.next_seq == 5
    # a launch after that is a newer generation than the node's
    assert book.ask("L9", "n1", "alice", launch(), now=2.0).generation == 4


def test_signals_are_sent_once() -> None:
    book = NodeKernels()
    kernel = book.ask("L1", "n1", "alice", launch(), now=1.0)
    book.read("n1", True, (running("L1", 1),), now=2.0)
    assert book.signal(kernel, "SIGINT") == 1 and book.signal(kernel, "SIGTERM") == 2
    sent = book.orders("n1", {"L1": 9.0})["kernel_signals"]
    assert [(s["seq"], s["signal"]) for s in sent] == [(1, "SIGINT"), (2, "SIGTERM")]
    book.read("n1", True, (running("L1", 1, signaled=1),), now=3.0)
    assert [s["seq"] for s in book.orders("n1", {"L1": 9.0})["kernel_signals"]] == [2]


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"argv": []}, "argv"),
        ({"argv": "python"}, "argv"),
        ({"argv": ["a\x00b"]}, "NUL"),
        ({"key": "short"}, "key"),
        ({"key": "é" * 20}, "ASCII"),
        ({"env": {"1BAD": "x"}}, "variable name"),
        ({"env": {"OK": 3}}, "string"),
        ({"env": []}, "object"),
        ({"cwd": "relative/dir"}, "absolute"),
        ({"signature_scheme": "rot13"}, "signature_scheme"),
        ({"surprise": 1}, "surprise"),
        ({"kernel_id": ""}, "kernel_id"),
    ],
)
def test_a_bad_launch_is_refused_with_a_sentence(over: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidRequest, match=says):
        launch(**over)


def test_a_launch_never_shows_its_key_or_environment_in_a_log_line() -> None:
    text = repr(launch(env={"GPU_LEASE_KERNEL_SECRET": "s3cr3t"}))
    assert "k" * 32 not in text and "s3cr3t" not in text


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"lease_id": "L", "generation": 1, "state": "running"}, "'ip' and 'ports'"),
        ({"lease_id": "L", "generation": 0, "state": "exited"}, "generation"),
        ({"lease_id": "L", "generation": 1, "state": "launching"}, "state"),
        (
            {"lease_id": "L", "generation": 1, "state": "running", "ip": "x", "ports": {}},
            "lacks",
        ),
        ({"lease_id": "L", "generation": 1, "state": "exited", "exit_code": 999}, "exit_code"),
    ],
)
def test_a_bad_agent_report_is_refused(entry: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidRequest, match=says):
        RemoteKernelsReport.from_json({"remote_kernels": [entry]})


def test_two_reports_of_one_lease_are_refused() -> None:
    entry = {"lease_id": "L", "generation": 1, "state": "exited"}
    with pytest.raises(InvalidRequest, match="same lease"):
        RemoteKernelsReport.from_json({"remote_kernels": [entry, entry]})
