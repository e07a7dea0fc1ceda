"""The MPS daemon-side pinned memory limits the agent sets, as tables:
which leases a heartbeat answer names (``mps.mps_leases``) and the limit each GPU's server
gets for the uid it serves (``mps.pinned_limit_mb``). No process here; the daemon and the
agent that set them are in ``tests/test_agent.py``
(``test_the_mps_daemon_holds_the_cap_when_a_kernel_unsets_or_raises_its_variable``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from provisioner.kernel.refusals import wait_for_mps_limit
from provisioner.node.mps import MPSDaemon, MPSLease, mps_leases, pinned_limit_mb
from provisioner.wire import lease_digest, mps_covered_file

G0, G1 = "GPU-0", "GPU-1"
ACCOUNTS = {"ann": 1000, "bob": 1001}  # the node's accounts; "pod" is none (Kubernetes)


def uid_of_user(name: str) -> int | None:
    return ACCOUNTS.get(name)


def kernel(user: str, gpu: str, memory: int, enforcement: str | None = None) -> dict[str, Any]:
    """A heartbeat answer's ``kernels`` entry as the broker sends it now."""
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
        # with proofs: each kernel with its user, GPU and memory (limits then unused)
        (
            {
                "kernels": [kernel("ann", G0, 4096), kernel("bob", G1, 2048, "mps")],
                "limits": [{"cgroup": "/gl/k", "gpu_uuid": G0, "memory_mb": 9999}],
            },
            [MPSLease(G0, 4096, "ann", "L-ann"), MPSLease(G1, 2048, "bob", "L-bob")],
        ),
        # a broker that names every lease from its grant (``leases``): those, pid or not;
        # a lease that reads cooperative counts too (a restarted broker forgets the MPS
        # hint, and a bound too tight would cut an honest kernel short for its life)
        (
            {
                "kernels": [kernel("ann", G0, 4096)],
                "leases": [
                    {"lease_id": "L-cat", "user": "cat", "gpu_uuid": G1, "memory_mb": 1024},
                    {
                        "lease_id": "L-dan",
                        "user": "dan",
                        "gpu_uuid": G0,
                        "memory_mb": 512,
                        "enforcement": "cooperative",
                    },
                ],
            },
            [MPSLease(G1, 1024, "cat", "L-cat"), MPSLease(G0, 512, "dan", "L-dan")],
        ),
        # nonsense entries are skipped
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
            [MPSLease(G0, 4096, "ann", "L-ann")],
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


def covered_text(mps_dir: str) -> str:
    return Path(mps_covered_file(mps_dir, G0)).read_text()


async def test_a_provisioner_waits_until_the_agent_covers_its_lease(tmp_path: Any) -> None:
    """An MPS client keeps the limit of its first CUDA call for life: the provisioner
    starts an MPS kernel once the agent's ``covered`` file names its lease (a digest, never
    the id), gives up after its wait, and waits for nothing where the agent writes none."""
    mps_dir = str(tmp_path)
    assert await wait_for_mps_limit(mps_dir, G0, "L-ann", timeout=5) is None  # older agent
    daemon = MPSDaemon(G0, mps_dir, control="/nonexistent")
    daemon.tell_covered([MPSLease(G0, 2048, "bob", "L-bob"), MPSLease(G0, 512)])
    text = covered_text(mps_dir)
    assert text == lease_digest("L-bob") + "\n" and "L-bob" not in text
    assert await wait_for_mps_limit(mps_dir, G0, "L-ann", timeout=0.3) is False
    daemon.tell_covered([MPSLease(G0, 2048, "bob", "L-bob"), MPSLease(G0, 4096, "ann", "L-ann")])
    assert await wait_for_mps_limit(mps_dir, G0, "L-ann", timeout=5) is True
