"""The node heartbeat's typed report (provisioner/node_report.py): what the agent sends is
what the broker parses, field for field, so that old agents and old brokers keep working."""

from __future__ import annotations

import json
from typing import Any

import pytest

from provisioner.errors import InvalidRequest
from provisioner.node_report import (
    FIELDS,
    PARTS,
    DriverLimitsReport,
    KernelReport,
    MPSReport,
    NodeParkReport,
    NodeReport,
    ParkOutcome,
    ProvenKernel,
    answer_schema,
    heartbeat_schema,
)

#: a heartbeat of an agent with every feature, as the agent sent it before the report was typed
FULL: dict[str, Any] = {
    "usage": [{"pid": 30001, "gpu_uuid": "GPU-1", "used_mb": 900}],
    "at": 1700000000.5,
    "mps": {"GPU-1": "running"},
    "mps_uid": {"GPU-1": 1000, "GPU-2": None},
    "kernels": [
        {
            "pid": 7,
            "pid_ns": 4026531001,
            "host_pid": 30001,
            "lease_id": "L-1",
            "uid": 1000,
            "cgroup": "/gpu-lease/kernel-k1",
            "escaped": [],
            "left_mps": [30002],
        },
        {
            "pid": 30005,
            "pid_ns": None,
            "host_pid": 30005,
            "lease_id": "L-2",
            "uid": 1001,
            "cgroup": None,
            "escaped": [30006],
        },
    ],
    "driver_limits": ["/gpu-lease/kernel-k1"],
    "refused": [{"lease_id": "L-3", "reason": "process 30009 does not carry the secret"}],
    "checkpoint": True,
    "host_memory_available_mb": 64000,
    "parking": [
        {
            "lease_id": "L-4",
            "action": "park",
            "outcome": "failed",
            "pids": [30010],
            "mb": 0,
            "seconds": 0.25,
            "message": "checkpoint failed",
        }
    ],
}
#: an agent older than proofs, MPS, driver limits and parking: namespaced kernels only
OLD_AGENT: dict[str, Any] = {
    "usage": [{"pid": 30001, "gpu_uuid": "GPU-1", "used_mb": 900}],
    "at": 1700000000.5,
    "kernels": [{"pid": 7, "pid_ns": 4026531001, "host_pid": 30001}],
}


@pytest.mark.parametrize("body", [FULL, OLD_AGENT, {"usage": []}], ids=["full", "old", "bare"])
def test_a_body_parses_and_writes_back_byte_for_byte(body: dict[str, Any]) -> None:
    report = NodeReport.from_json(body)
    assert json.dumps(report.to_json()) == json.dumps(body)


def test_the_broker_reads_each_feature_from_its_part() -> None:
    report = NodeReport.from_json(FULL)
    assert report.usage == ((30001, "GPU-1", 900),)
    assert report.part(MPSReport) == MPSReport({"GPU-1": "running"}, {"GPU-1": 1000, "GPU-2": None})
    kernels = report.part(KernelReport)
    assert kernels is not None and kernels.namespaced == {} and kernels.proofs is not None
    assert kernels.proofs.proven["L-1"] == ProvenKernel(
        "L-1", 30001, 1000, "/gpu-lease/kernel-k1", (), (30002,), 7, 4026531001
    )
    assert kernels.proofs.refused == {"L-3": "process 30009 does not carry the secret"}
    assert report.part(DriverLimitsReport) == DriverLimitsReport(("/gpu-lease/kernel-k1",))
    park = report.part(NodeParkReport)
    assert park is not None and park.checkpoint is True and park.host_memory_available_mb == 64000
    assert park.outcomes == (
        ParkOutcome("L-4", "park", "failed", "checkpoint failed", (30010,), 0, 0.25),
    )


def test_an_older_agent_has_no_part_of_the_features_it_lacks() -> None:
    report = NodeReport.from_json(OLD_AGENT)
    assert report.part(MPSReport) is None and report.part(DriverLimitsReport) is None
    assert report.part(NodeParkReport) is None
    kernels = report.part(KernelReport)
    assert kernels is not None and kernels.proofs is None  # believed as named
    assert kernels.namespaced == {(7, 4026531001): 30001}


def test_a_part_the_agent_leaves_out_sends_none_of_its_fields() -> None:
    """A broker older than a feature refuses its fields: an agent without it sends none."""
    body = NodeReport((), None, (KernelReport(None, None), NodeParkReport())).to_json()
    assert body == {"usage": []}


def test_the_fields_and_their_documentation_are_the_wire_s() -> None:
    """The heartbeat's fields are those agents have always sent, and every part documents
    each field it reads (the served NodeHeartbeat schema) and none it does not."""
    assert set(FIELDS) == {
        "usage",
        "at",
        "mps",
        "mps_uid",
        "kernels",
        "driver_limits",
        "checkpoint",
        "host_memory_available_mb",
        "parking",
        "refused",
        # remote kernels (a later part: its fields come after the others)
        "launches_kernels",
        "remote_kernels",
    }
    for kind in PARTS:
        assert set(kind.SCHEMA) == set(kind.FIELDS), kind.__name__
    assert set(heartbeat_schema()) == set(FIELDS) - {"usage", "at"}
    assert set(answer_schema()) == {
        "kernels",
        "limits",
        "leases",
        "orders",
        "launch",
        "kernel_signals",
        "kernel_ends",
        "kernel_expiry",
    }


def test_an_unknown_field_is_refused_by_name_with_the_allowed_ones_as_ever() -> None:
    with pytest.raises(InvalidRequest, match="'surprise'") as info:
        NodeReport.from_json({**FULL, "surprise": 1})
    assert info.value.details["fields"] == ["surprise"]
    assert "Allowed fields are usage, at, mps, mps_uid, kernels, driver_limits, checkpoint, " in (
        info.value.message
    )
    assert info.value.message.endswith(
        "parking, refused, launches_kernels, remote_kernels; remove the others."
    )
