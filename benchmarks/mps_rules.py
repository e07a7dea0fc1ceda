"""What the MPS ownership rules cost: the broker's owners of each GPU (``node_rules.mps_owners``,
run by every placement of an MPS kernel) and the agent's daemon-side limits from one
heartbeat answer (``node.mps.mps_leases`` + ``pinned_limit_mb``, with a ``getpwnam`` per
user), on a node of 8 GPUs with 100 MPS kernels (half of them proven).

    .venv/bin/python benchmarks/mps_rules.py
"""

from __future__ import annotations

import json
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioner.broker.rules import node_rules  # noqa: E402
from provisioner.broker.rules.policy import Policy  # noqa: E402
from provisioner.model import GPU, Lease, PoolState  # noqa: E402
from provisioner.node.mps import mps_leases, pinned_limit_mb  # noqa: E402

KERNELS, GPUS = 100, 8


def main() -> None:
    gpus = [GPU(f"g{i}", "n", "H100", 81920, i) for i in range(GPUS)]
    leases = [
        Lease(f"L{i}", f"u{i}", "k", f"g{i % GPUS}", 10_000, 100, "active", 0, 0, 90, mps_uid=i)
        for i in range(KERNELS)
    ]
    state = PoolState.build(gpus, leases, [])
    state.mps_proven = {f"L{i}": i for i in range(0, KERNELS, 2)}
    policy = Policy()
    n = 2000
    per = timeit.timeit(lambda: node_rules.mps_owners(state, 100.0, policy), number=n) / n
    base = timeit.timeit(lambda: {u: {x.mps_uid} for u, x in state.leases.items()}, number=n) / n
    print(
        f"broker: mps_owners over {KERNELS} MPS leases on {GPUS} GPUs: {per * 1e6:.1f} µs, "
        f"{per / base:.1f}x one pass over the leases that believes every claim (baseline, "
        f"{base * 1e6:.1f} µs)"
    )
    kernels = [
        {
            "pid": i,
            "pid_ns": 1,
            "lease_id": f"L{i}",
            "user": ("root", "nobody")[i % 2],
            "proof": "x",
            "gpu_uuid": f"g{i % GPUS}",
            "memory_mb": 1000 + i,
        }
        for i in range(KERNELS)
    ]

    def agent_side() -> None:
        found = mps_leases({"kernels": kernels})
        for g in range(GPUS):
            pinned_limit_mb(found, f"g{g}", 0)
            pinned_limit_mb(found, f"g{g}", None)

    per = timeit.timeit(agent_side, number=200) / 200
    body = json.dumps({"kernels": kernels, "leases": kernels})
    base = timeit.timeit(lambda: json.loads(body), number=200) / 200
    print(
        f"agent: the limits of {GPUS} GPUs from an answer naming {KERNELS} kernels: "
        f"{per * 1e3:.2f} ms per heartbeat, {per / base:.1f}x decoding that answer's JSON "
        f"(baseline, {base * 1e3:.2f} ms); control commands only when a limit changes"
    )


if __name__ == "__main__":
    main()
