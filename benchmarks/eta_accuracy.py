"""How good are the broker's estimated waits? Predicted vs actual wait on the simulator's traces.

Each request that joins the queue gets the estimate the broker would answer at that moment
(``estimates.estimate_waits``, from the hold times of leases that ended before); when it
is granted, its real wait is compared with it. "warm": the hold history starts with the
holds of a first run of the same trace (a broker that ran yesterday's class); "cold": it
starts empty (a broker's first day: no estimate until 5 leases have ended).

    .venv/bin/python benchmarks/eta_accuracy.py [--small]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provisioner.devtools.simulate import SCHEMES, eta_accuracy, load_trace  # noqa: E402

TRACES = ["classroom", "department", "deadline"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the test trace only")
    parser.add_argument("--scheme", default="ours", help="a scheme of benchmarks/simulate.py")
    args = parser.parse_args()
    scheme = next(s for s in SCHEMES if s.name == args.scheme)
    names = ["small"] if args.small else TRACES
    print("| trace | history | queued | estimated | bias min | MAE min | median abs min "
          "| p90 abs min | median rel | within 50 % |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        trace = load_trace(ROOT / "benchmarks" / "traces" / f"{name}.jsonl")
        for warm in (True, False):
            t0 = time.perf_counter()
            a = eta_accuracy(trace, scheme, warm=warm)
            print(
                f"| {name} | {'warm' if warm else 'cold'} | {a.queued} | {a.estimated} "
                f"| {a.bias / 60:+.1f} | {a.mae / 60:.1f} | {a.median_abs / 60:.1f} | {a.p90_abs / 60:.1f} "
                f"| {a.median_rel:.2f} | {a.within_half:.0%} |",
                flush=True,
            )
            print(f"  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
