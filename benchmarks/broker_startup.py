"""Broker start-up time: process start until ``GET /api/v1/health`` answers 200.

    python benchmarks/broker_startup.py                       # this checkout, 7 starts
    python benchmarks/broker_startup.py --starts 9 --tree /tmp/before --tree .
    python benchmarks/broker_startup.py --variant '' --variant '--http-processes 1'

Each start runs ``python -m provisioner.broker.app --auth static --tokens-file FILE
--gpus 1x32768:V100`` on a free port with a fresh SQLite database in a temporary
directory, polls ``/api/v1/health`` every 10 ms from the moment ``Popen`` returns, then
stops the broker with SIGTERM. With several ``--tree`` (source trees put first on
``PYTHONPATH``, e.g. an older ``git archive`` next to this checkout) the starts
alternate between the trees (A B A B ...), so background load hits them alike; the
median of each tree's starts is reported, with the fastest start and the spread, and
the CPU seconds (user + system, Linux ``/proc``) the broker process had used by then,
which shared-machine load disturbs less than wall time. Each ``--variant`` times every
tree once more with those broker options (its HTTP processes' CPU counted too).

Every tree (and the baseline) is byte-compiled first (``compileall``), as a broker
installed from a wheel is: with ``PYTHONDONTWRITEBYTECODE=1`` in the environment (as on
our CI machines) each start would otherwise compile the broker's modules again (about
0.07 s of CPU), a cost no installed broker pays.

The baseline, timed the same way and interleaved with the broker's starts (A B base A
B base ...): ``benchmarks/noop_broker.py``, a no-op tornado app with the broker's lease
routes; every tree's median is also given as a ratio to the baseline's median (the aim:
a static-auth broker starts within 3x of it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the timed brokers run from their own trees (PYTHONPATH); this only reads /proc
from provisioner.devtools.testing import free_port, tree_cpu_seconds  # noqa: E402

#: stands for the no-op baseline among the trees
BASELINE = Path("no-op tornado app")


def one_start(
    tree: Path, tmp: Path, n: int, extra: tuple[str, ...] = (), timeout: float = 60.0
) -> tuple[float, float]:
    """Wall seconds from ``Popen`` to the first 200 of ``/api/v1/health``, and the broker's
    CPU seconds by then (the broker is stopped afterwards). ``tree`` ``BASELINE``: the
    no-op app instead."""
    port = free_port()
    tokens = tmp / "tokens.json"
    tokens.write_text(json.dumps({"startup-bench-token": {"user": "bench"}}))
    env = dict(os.environ)
    env.pop("JUPYTERHUB_API_TOKEN", None)
    # the tree first; what the environment had after it (dependencies installed with
    # ``pip --target``, as on a machine without a virtual environment)
    first = str(ROOT / "benchmarks" if tree == BASELINE else tree)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [first, env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "provisioner.broker.app",
        "--port",
        str(port),
        "--auth",
        "static",
        "--tokens-file",
        str(tokens),
        "--gpus",
        "1x32768:V100",
        "--db-url",
        f"sqlite:///{tmp / f'start-{n}.sqlite'}",
        *extra,
    ]
    if tree == BASELINE:
        cmd = [sys.executable, "-m", "noop_broker", "--port", str(port)]  # -m: its bytecode
    url = f"http://127.0.0.1:{port}/api/v1/health"
    with open(tmp / f"start-{n}.log", "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            with httpx.Client(timeout=1.0) as client:
                while time.perf_counter() - t0 < timeout:
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"the broker exited with {proc.returncode}: see {log.name}"
                        )
                    try:
                        if client.get(url).status_code == 200:
                            return time.perf_counter() - t0, tree_cpu_seconds(proc.pid)
                    except httpx.TransportError:
                        pass
                    time.sleep(0.01)
            raise RuntimeError(f"no answer from {url} in {timeout} s")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=7, help="starts per tree (7)")
    p.add_argument(
        "--tree",
        action="append",
        type=Path,
        help="a source tree to time (repeatable; default: this checkout)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        help="broker options to time each tree with (repeatable, e.g. '' and "
        "'--http-processes 1'; default: none)",
    )
    args = p.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    configs = [(t, tuple(v.split())) for t in trees for v in (args.variant or [""])]
    configs.append((BASELINE, ()))
    times: dict[tuple[Path, tuple[str, ...]], list[float]] = {c: [] for c in configs}
    cpu: dict[tuple[Path, tuple[str, ...]], list[float]] = {c: [] for c in configs}
    for src in [t / "provisioner" for t in trees] + [ROOT / "benchmarks"]:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], check=True)
    with tempfile.TemporaryDirectory(prefix="broker-startup-") as tmp:
        n = 0
        for _ in range(args.starts):
            for tree, extra in configs:
                n += 1
                wall, used = one_start(tree, Path(tmp), n, extra)
                times[tree, extra].append(wall)
                cpu[tree, extra].append(used)
    base = statistics.median(times[BASELINE, ()])
    for (tree, extra), got in times.items():
        print(
            f"{tree}{' ' + ' '.join(extra) if extra else ''}: median {statistics.median(got):.3f} s, fastest {min(got):.3f} s, "
            f"slowest {max(got):.3f} s over {len(got)} starts "
            f"({', '.join(f'{x:.3f}' for x in got)}); "
            f"CPU median {statistics.median(cpu[tree, extra]):.2f} s"
            + ("" if tree == BASELINE else f"; {statistics.median(got) / base:.2f}x the no-op app")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
