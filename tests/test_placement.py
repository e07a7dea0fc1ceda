"""Where a kernel's lease goes: the node and GPUs from each engine's environment.

Environments as Slurm (a job's ``srun``/``sbatch`` variables with ``--gres=gpu``), Kubernetes
(the downward API and the NVIDIA device plugin) and an admin set them for a server."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from provisioner.errors import InvalidRequest
from provisioner.kernel.placement import Placement, discover, parse_devices, resolve_indexes

SLURM_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURMD_NODENAME": "node2",
    "SLURM_JOB_GPUS": "1,3",
    "CUDA_VISIBLE_DEVICES": "0,1",  # renumbered inside the job's cgroup: not the node's
}
POD = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "GPU_LEASE_NODE": "gke-gpu-pool-7f3a",  # valueFrom fieldRef spec.nodeName
    "NVIDIA_VISIBLE_DEVICES": "GPU-8a1f0c2e-3b4d-4e5f-9a6b-7c8d9e0f1a2b",
}


@pytest.mark.parametrize(
    "env, placement",
    [
        ({}, Placement()),
        (
            {"GPU_LEASE_NODE": " gpu-a ", "GPU_LEASE_GPU_UUIDS": "GPU-1, GPU-2,"},
            Placement("gpu-a", ("GPU-1", "GPU-2"), (), "GPU_LEASE_NODE", "GPU_LEASE_GPU_UUIDS"),
        ),
        # Slurm: the node from slurmd, the GPUs as the node numbers them (SLURM_JOB_GPUS), not
        # the job's renumbered CUDA_VISIBLE_DEVICES
        (SLURM_JOB, Placement("node2", (), (1, 3), "SLURMD_NODENAME", "SLURM_JOB_GPUS")),
        (
            {**SLURM_JOB, "SLURM_STEP_GPUS": "3"},
            Placement("node2", (), (3,), "SLURMD_NODENAME", "SLURM_STEP_GPUS"),
        ),
        (
            {k: v for k, v in SLURM_JOB.items() if k != "SLURM_JOB_GPUS"},
            Placement("node2", (), (0, 1), "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES"),
        ),
        # a Slurm job without GPUs asked: any GPU of its node
        (
            {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node1"},
            Placement("node1", node_from="SLURMD_NODENAME"),
        ),
        # an explicit GPU_LEASE_NODE wins over Slurm's
        (
            {**SLURM_JOB, "GPU_LEASE_NODE": "node2.cluster"},
            Placement("node2.cluster", (), (1, 3), "GPU_LEASE_NODE", "SLURM_JOB_GPUS"),
        ),
        # Kubernetes: the node from the downward API, the GPU from the device plugin
        (
            POD,
            Placement(
                "gke-gpu-pool-7f3a",
                ("GPU-8a1f0c2e-3b4d-4e5f-9a6b-7c8d9e0f1a2b",),
                (),
                "GPU_LEASE_NODE",
                "NVIDIA_VISIBLE_DEVICES",
            ),
        ),
        (
            {**POD, "NVIDIA_VISIBLE_DEVICES": "all"},
            Placement("gke-gpu-pool-7f3a", node_from="GPU_LEASE_NODE"),
        ),
        # outside a job or a pod these variables say nothing about the engine's placement
        ({"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "GPU-1"}, Placement()),
    ],
)
def test_discover(env: dict[str, str], placement: Placement) -> None:
    assert discover(env) == placement


@pytest.mark.parametrize(
    "env, words",
    [
        ({**POD, "NVIDIA_VISIBLE_DEVICES": "void"}, "this server was given no GPU"),
        ({**POD, "NVIDIA_VISIBLE_DEVICES": "none"}, "ask for a server with a GPU"),
        ({"GPU_LEASE_GPU_UUIDS": "0,1"}, "lists device indexes; it takes GPU UUIDs"),
        ({**POD, "GPU_LEASE_NODE": "", "NVIDIA_VISIBLE_DEVICES": "0"}, "set GPU_LEASE_NODE"),
        ({**SLURM_JOB, "SLURM_JOB_GPUS": "0,GPU-1"}, "mixes device indexes and UUIDs"),
    ],
)
def test_discover_refuses_what_cannot_be_placed(env: dict[str, str], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        discover(env)


POOL: list[dict[str, Any]] = [
    {"uuid": f"GPU-{node}-{i}", "node": node, "index": i}
    for node in ("node1", "node2")
    for i in range(4)
]


def test_indexes_resolve_against_the_pool_of_that_node() -> None:
    placement = discover(SLURM_JOB)
    assert resolve_indexes(placement, POOL) == ("GPU-node2-1", "GPU-node2-3")
    lost = Placement("node3", (), (0,), "SLURMD_NODENAME", "SLURM_JOB_GPUS")
    with pytest.raises(InvalidRequest, match="run the node agent") as info:
        resolve_indexes(lost, POOL)
    assert "node3" in info.value.message and "SLURM_JOB_GPUS" in info.value.message


def test_describe_says_where_each_fact_came_from() -> None:
    assert discover(SLURM_JOB).describe() == (
        "node node2 (SLURMD_NODENAME), GPUs 1,3 (SLURM_JOB_GPUS)"
    )
    assert Placement().describe() == "any node, any GPU there"


@given(st.text(max_size=40))
@example("1,\u00b2")  # a digit to str.isdigit, not to int()
def test_device_lists_parse_or_refuse_clearly(value: str) -> None:
    try:
        out = parse_devices(value, "NVIDIA_VISIBLE_DEVICES")
    except InvalidRequest as exc:
        assert "NVIDIA_VISIBLE_DEVICES" in exc.message
        return
    if out is not None:
        uuids, indexes = out
        assert not (uuids and indexes) and (uuids or indexes)
        assert all(i >= 0 for i in indexes) and all(u and "," not in u for u in uuids)
