"""Two source trees' brokers under load at the same moment: CPU per acquire+release pair.

    git worktree add /tmp/before HEAD~2
    python benchmarks/broker_paired.py --tree /tmp/before --tree .            # ~1.5 min
    python benchmarks/broker_paired.py --tree /tmp/before --tree /tmp/before  # A/A: the noise
    python benchmarks/broker_paired.py --tree /tmp/before --tree . --broker-args ''

Why: on a shared 2-vCPU machine the rate of one broker, and even the no-op ceiling it
is divided by, moves by ±20 % from one 5-s window to the next (``broker_throughput.py``
gave 0.45–0.83 of the ceiling for the same code within an hour), so windows taken one
after the other cannot resolve a change of a few per cent. Here both brokers run
throughout (``--broker-args``, default ``--http-processes 1``; a fresh SQLite database
each), and each window drives both at once from one load generator (``--clients`` each,
closed loop as in ``broker_throughput.py``; which broker's clients start first
alternates), so whatever the machine does hits both alike. For each window the CPU
seconds (user + system, ``/proc``) of each broker's processes are divided by its pairs;
the report gives each tree's median and the median of its per-window ratio to the first
tree, the broker process and the HTTP process (``--http-processes``) apart.

This measures work per pair, not rate: the throughput aims stay with
``broker_throughput.py``. Run the first tree against itself (A/A) to see the noise of
the ratio (0.99–1.03 on 2 vCPUs over 12 windows).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import broker_throughput as bt  # noqa: E402

from provisioner.devtools.testing import BrokerProcess, children_of, cpu_seconds  # noqa: E402


def window(brokers: list[BrokerProcess], clients: int, seconds: float, flip: bool) -> list[dict]:
    """Drive every broker at once for ``seconds``; per broker: pairs and CPU µs per pair."""
    pids = [[b.proc.pid, *children_of(b.proc.pid)] for b in brokers if b.proc is not None]
    before = [[cpu_seconds(p) for p in group] for group in pids]
    order = list(range(len(brokers)))[:: -1 if flip else 1]

    async def drive() -> list[bt.LoadResult]:
        return await asyncio.gather(
            *(
                bt.closed_loop(
                    brokers[i], clients, warmup=0.5, duration=seconds, fraction=0.01, db="sqlite"
                )
                for i in order
            )
        )

    results = dict(zip(order, asyncio.run(drive()), strict=True))
    out = []
    for i, group in enumerate(pids):
        pairs = results[i].pairs_per_s * (seconds + 0.5)  # the warm-up's pairs used CPU too
        used = [cpu_seconds(p) - b for p, b in zip(group, before[i], strict=True)]
        out.append(
            {
                "pairs_per_s": results[i].pairs_per_s,
                "total_us": 1e6 * sum(used) / pairs,
                "broker_us": 1e6 * used[0] / pairs,
                "http_us": 1e6 * sum(used[1:]) / pairs,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="a source tree (twice or more)")
    ap.add_argument("--windows", type=int, default=12, help="measured windows (12)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per window (3)")
    ap.add_argument("--clients", type=int, default=32, help="clients per broker (32)")
    ap.add_argument("--broker-args", default="--http-processes 1", help="options of every broker")
    args = ap.parse_args(argv)
    if len(args.tree) < 2:
        ap.error("give --tree at least twice (the first is the baseline)")
    trees = [Path(t).resolve() for t in args.tree]
    for tree in trees:
        if not (tree / "provisioner" / "broker" / "app.py").is_file():
            ap.error(f"{tree} is not a source tree of this project")
    rows: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        tmp = Path(d)
        brokers = []
        for i, tree in enumerate(trees):
            broker = bt.broker_process(
                tmp,
                f"sqlite:///{tmp / f'b{i}.sqlite'}",
                "1x81920:A100",
                tuple(args.broker_args.split()),
            )
            broker.source = tree
            broker.start()
            stack.callback(broker.stop)
            brokers.append(broker)
        for w in range(args.windows):
            row = window(brokers, args.clients, args.seconds, flip=w % 2 == 1)
            rows.append(row)
            print(
                f"window {w + 1:2d}: "
                + " | ".join(
                    f"{i}: {r['pairs_per_s']:5.0f}/s {r['total_us']:5.0f} µs/pair "
                    f"(broker {r['broker_us']:.0f} + HTTP {r['http_us']:.0f})"
                    for i, r in enumerate(row)
                ),
                flush=True,
            )
    print(
        f"\n{args.windows} windows of {args.seconds:g} s, {args.clients} clients per broker, "
        f"broker options {args.broker_args!r}"
    )
    print(f"{'tree':40s} {'µs/pair':>8s} {'÷ tree 0':>9s} {'broker ÷':>9s} {'HTTP ÷':>8s}")
    for i, tree in enumerate(trees):
        med = statistics.median(r[i]["total_us"] for r in rows)

        def ratio(key: str, i: int = i) -> float:
            vals = [r[i][key] / r[0][key] for r in rows if r[0][key] > 0]
            return statistics.median(vals) if vals else float("nan")

        print(
            f"{str(tree)[-40:]:40s} {med:8.0f} {ratio('total_us'):9.3f} "
            f"{ratio('broker_us'):9.3f} {ratio('http_us'):8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
