"""The MPS daemon-side pinned memory limits the agent sets (issue 36, item 3), as tables:
which leases a heartbeat answer names (``mps.mps_leases``) and the limit each GPU's server
gets for the uid it serves (``mps.pinned_limit_mb``). No process here; the daemon and the
agent that set them are in ``tests/test_agent.py``
(``test_the_mps_daemon_holds_the_cap_when_a_kernel_unsets_or_raises_its_variable``)."""

from __future__ import annotations

from typing import Any

import pytest

from provisioner.node.mps import MPSLease, mps_leases, pinned_limit_mb

G0, G1 = "GPU-0", "GPU-1"
ACCOUNTS = {"ann": 1000, "bob": 1001}  # the node's accounts; "pod" is none (Kubernetes)


def uid_of_user(name: str) -> int | None:
    return ACCOUNTS.get(name)


def kernel(user: str, gpu: str, memory: int, enforcement: str | None = None) -> dict[str, Any]:
    """A heartbeat answer's ``kernels`` entry as the broker sends it after issue 36."""
    out = {"pid": 7, "pid_ns": 1, "lease_id": f"L-{user}", "user": user, "proof": "x"}
    out |= {"gpu_uuid": gpu, "memory_mb": memory}
    return out if enforcement is None else {**out, "enforcement": enforcement}


@pytest.mark.parametrize(
    "answer, leases",
    [
        ({}, []),
        # today's broker: kernels without memory; its cgroup limits say the GPU and memory
        (
            {
                "kernels": [{"pid": 7, "pid_ns": 1}],
                "limits": [{"cgroup": "/gl/k", "gpu_uuid": G0, "memory_mb": 4096}],
            },
            [MPSLease(G0, 4096)],
        ),
        # after issue 36: each kernel with its user, GPU and memory (limits then unused)
        (
            {
                "kernels": [kernel("ann", G0, 4096), kernel("bob", G1, 2048, "mps")],
                "limits": [{"cgroup": "/gl/k", "gpu_uuid": G0, "memory_mb": 9999}],
            },
            [MPSLease(G0, 4096, "ann"), MPSLease(G1, 2048, "bob")],
        ),
        # a cooperative kernel is no MPS client; nonsense entries are skipped
        (
            {
                "kernels": [
                    kernel("ann", G0, 4096, "cooperative"),
                    {"gpu_uuid": G0, "memory_mb": True},
                    {"gpu_uuid": 5, "memory_mb": 10},
                    {"gpu_uuid": G0, "memory_mb": -1},
                    "junk",
                ]
            },
            [],
        ),
    ],
)
def test_the_leases_a_heartbeat_answer_names(
    answer: dict[str, Any], leases: list[MPSLease]
) -> None:
    assert mps_leases(answer) == leases


ANN_SMALL, ANN_BIG = MPSLease(G0, 2048, "ann"), MPSLease(G0, 6144, "ann")
BOB = MPSLease(G0, 8192, "bob")
POD = MPSLease(G0, 3072, "pod")  # a user with no account here
ANON = MPSLease(G0, 5120)  # an older broker's limits entry: whose, it does not say


@pytest.mark.parametrize(
    "leases, uid, limit",
    [
        ([], 1000, None),  # no MPS lease on the GPU: nothing to bound by
        ([MPSLease(G1, 4096, "ann")], 1000, None),  # another GPU's
        ([ANN_SMALL, ANN_BIG, BOB], 1000, 6144),  # per client: ann's largest, not the sum
        ([ANN_SMALL, ANN_BIG, BOB], 1001, 8192),
        ([ANN_SMALL, BOB], None, 8192),  # the next server's default: the GPU's largest
        ([ANN_SMALL, BOB], 4242, 8192),  # a uid with no lease here: the GPU's largest
        ([ANN_SMALL, POD], 1000, 3072),  # one uid for all: anyone's might be ann's
        ([POD, ANON], 1000, 5120),
        ([ANN_BIG, ANON, BOB], 1000, 6144),
    ],
)
def test_each_client_may_pin_its_users_largest_lease_on_the_gpu(
    leases: list[MPSLease], uid: int | None, limit: int | None
) -> None:
    assert pinned_limit_mb(leases, G0, uid, uid_of_user) == limit
    # where the broker is known to name every kernel's memory, a GPU with none is no one's
    assert pinned_limit_mb(leases, G0, uid, uid_of_user, empty=1) == (limit or 1)
