"""What proving the claimed kernels costs the node agent per heartbeat.

A node with ``--kernels`` (default 100) kernels: real sleeping processes, each started as a
provisioner starts a kernel (its own lease secret in its environment), each "using" GPU
memory in the sample. Per heartbeat the agent attributes the sample to kernels; now
it first proves each claim (resolves ``(pid, pid_ns)`` through ``/proc``, reads
``/proc/<pid>/environ``, hashes the secret, checks the uid, reads the cgroup). Measured in
the same run, on the same processes:

- **before**: the attribution that believed the claims (a ``KernelFinder`` over
  ``(pid, pid_ns)``, then ``attribute`` and ``merge_samples``);
- **cold**: a fresh ``Prover`` (the first heartbeat after the agent starts) + the
  attribution over the proven kernels;
- **warm**: the same ``Prover`` again (verdicts cached per pid and start time);
- **warm + MPS**: the same, every lease an MPS lease, and each kernel process checked
  against its GPU's MPS clients (``outside_mps`` + ``MPSLeavers``; every one a client, as
  on an honest node; the daemon's client list is the query the agent made before).

Run as root (the agent is root; ``/proc/<pid>/environ`` of another uid needs it)::

    .venv/bin/python benchmarks/agent_proof.py [--kernels 100] [--rounds 50]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provisioner.node.agent import attribute, merge_samples, proven_finder  # noqa: E402
from provisioner.node.pidns import KernelFinder, own_pid_ns  # noqa: E402
from provisioner.node.proof import Claim, MPSLeavers, Prover, outside_mps  # noqa: E402
from tests.proven import kernel_env  # noqa: E402

GPU = "GPU-bench-0"


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Median milliseconds of ``fn`` over ``rounds`` calls."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    procs, claims = [], []
    ns = own_pid_ns()
    try:
        for i in range(args.kernels):
            env, proof = kernel_env()
            p = subprocess.Popen(["sleep", "600"], env=env)
            procs.append(p)
            claims.append(Claim(f"lease-{i:04d}", p.pid, ns, proof, "", f"k{i}", GPU, 900))
        sample = [(p.pid, GPU, 100) for p in procs]
        believed = {(c.pid, c.pid_ns) for c in claims}

        def before() -> None:
            merge_samples(attribute(sample, KernelFinder(set(believed)))[0])

        def cold() -> None:
            proven, _ = Prover(check_account="auto").prove(claims)
            merge_samples(attribute(sample, proven_finder(proven, set()))[0])

        warm_prover = Prover(check_account="auto")
        proven, refused = warm_prover.prove(claims)
        assert len(proven) == args.kernels and not refused, refused

        def warm() -> None:
            proven, _ = warm_prover.prove(claims)
            merge_samples(attribute(sample, proven_finder(proven, set()))[0])

        mps_claims = [replace(c, enforcement="mps") for c in claims]
        mps_prover, leavers = Prover(check_account="auto"), MPSLeavers()
        clients: dict[str, frozenset[int] | None] = {GPU: frozenset(p.pid for p in procs)}

        def warm_mps() -> None:
            proven, _ = mps_prover.prove(mps_claims)
            samples, members = attribute(sample, proven_finder(proven, set()))
            assert not leavers(outside_mps(sample, members, proven, clients))
            merge_samples(samples)

        warm_mps()
        results = {
            "before (claims believed)": timed(before, args.rounds),
            "cold (first beat: prove all)": timed(cold, args.rounds),
            "warm (cached verdicts)": timed(warm, args.rounds),
            "warm + MPS clients check": timed(warm_mps, args.rounds),
        }
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    base = results["before (claims believed)"]
    print(f"{args.kernels} kernels, median of {args.rounds} heartbeats, ms per heartbeat:")
    for name, ms in results.items():
        print(f"  {name:30s} {ms:8.2f} ms   x{ms / base:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
