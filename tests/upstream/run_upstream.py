"""jupyter_client's and jupyter_server's own test suites, with our provisioner as the default.

Run by ``make upstream`` (part of ``make test``)::

    python tests/upstream/run_upstream.py                 # both suites, with our provisioner
    python tests/upstream/run_upstream.py --without       # the same tests, jupyter_client's own
    python tests/upstream/run_upstream.py --suite client -- -k test_restart

For the *installed* versions of jupyter_client and jupyter_server it downloads their sdists
(``pip download --no-binary :all: --no-deps``, once: they are kept in ``.upstream/``, which
git ignores), unpacks them, starts a real broker (static tokens, a pool of four declared
GPUs), makes our provisioner the default one (``JUPYTER_DEFAULT_PROVISIONER_NAME``: the
``gpu-lease-upstream-default`` entry point of ``tests/upstream/site``, our provisioner
with a default fraction) and runs the test files in :data:`SUITES` from the unpacked
sdist, with its own ``conftest.py`` and its own pytest settings (every warning an error).

Afterwards the broker must have granted a lease for the kernels those tests started, and
every one of them must have been released (none left active): a kernel the provisioner
lost track of fails the run even when its test passed. Exit status 0 only if every suite
passed and that holds.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: `provisioner` from this checkout
    sys.path.insert(0, str(ROOT))

from provisioner.devtools.testing import BrokerProcess, wait_for  # noqa: E402

#: where the sdists are kept and unpacked (ignored by git)
CACHE = ROOT / ".upstream"
#: the directory put on PYTHONPATH: our provisioner, registered as a default-able one
SITE = Path(__file__).resolve().parent / "site"
PROVISIONER_NAME = "gpu-lease-upstream-default"

#: distribution -> the test files (or directories) of its sdist that run here
SUITES: dict[str, tuple[str, ...]] = {
    "jupyter_client": (
        "tests/test_kernelmanager.py",
        "tests/test_multikernelmanager.py",
        "tests/test_restarter.py",
        "tests/test_client.py",
    ),
    "jupyter_server": (
        "tests/services/kernels",
        "tests/services/sessions",
        "tests/services/kernelspecs",
        "tests/auth/test_authorizer.py",
    ),
}
SHORT = {"client": "jupyter_client", "server": "jupyter_server"}

USER = "upstream"
ADMIN = "upstream-admin"


def sdist(dist: str) -> Path:
    """The unpacked sdist of the installed version of ``dist`` (downloaded once)."""
    version = importlib.metadata.version(dist)
    unpacked = CACHE / f"{dist}-{version}"
    if (unpacked / "pyproject.toml").exists():
        return unpacked
    CACHE.mkdir(exist_ok=True)
    archive = CACHE / f"{dist}-{version}.tar.gz"
    if not archive.exists():
        print(f"upstream: downloading the sdist of {dist}=={version}", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-binary",
                ":all:",
                "--no-deps",
                "--no-build-isolation",
                "--dest",
                str(CACHE),
                f"{dist}=={version}",
            ],
            check=True,
        )
    if not archive.exists():
        raise SystemExit(f"upstream: pip download left no {archive.name} in {CACHE}: remove it")
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    return unpacked


def run_suite(dist: str, env: dict[str, str], pytest_args: list[str], log: Path) -> int:
    """pytest on ``dist``'s test files, from its unpacked sdist; its output goes to ``log``."""
    source = sdist(dist)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:asyncio",  # not among their test dependencies: they run async tests otherwise
        # jupyter_server 2.21.1's test_connection.py builds HTTPServerRequest the way
        # tornado 6.6 deprecates: 5 failures with or without our provisioner
        "-W",
        "ignore:The method, uri, and version arguments to HTTPServerRequest:DeprecationWarning",
        "-W",
        "ignore:The start_line argument to HTTPServerRequest:DeprecationWarning",
        "-q",
        "--color=no",
        *SUITES[dist],
        *pytest_args,
    ]
    print(f"upstream: {dist} {source.name[len(dist) + 1 :]}: {' '.join(command[3:])}", flush=True)
    started = time.monotonic()
    with open(log, "wb") as out:
        code = subprocess.run(command, cwd=source, env=env, stdout=out, stderr=subprocess.STDOUT)
    lines = log.read_text(errors="replace").splitlines()
    summary = next((x for x in reversed(lines) if x.startswith("=") or " in " in x), "")
    print(f"upstream: {dist}: {summary.strip('= ')} ({time.monotonic() - started:.0f} s)")
    if code.returncode != 0:
        failed = [x for x in lines if x.startswith(("FAILED", "ERROR"))]
        print("\n".join(failed or lines[-60:]))
        print(f"upstream: the whole output is in {log}")
    return code.returncode


def leases(broker: BrokerProcess) -> list[dict[str, object]]:
    """Every lease of the suites' user, ended ones included."""
    r = httpx.get(
        f"{broker.url}/api/v1/leases",
        params={"user": USER, "history": "1"},
        headers={"Authorization": f"token {broker.tokens[ADMIN]}"},
        timeout=10.0,
    )
    r.raise_for_status()
    return list(r.json()["leases"])


def check_leases(broker: BrokerProcess, before: int) -> list[str]:
    """Problems with the leases the suite left: none granted, or some never released."""
    try:
        wait_for(
            lambda: not [x for x in leases(broker) if x.get("state") == "active"],
            15.0,
            "every lease to be released",
        )
    except AssertionError:
        pass
    every = leases(broker)
    active = [x for x in every if x.get("state") == "active"]
    problems = []
    if len(every) <= before:
        problems.append("the broker granted no lease: our provisioner was not the default")
    if active:
        kernels = ", ".join(str(x.get("kernel_id")) for x in active)
        problems.append(f"{len(active)} lease(s) were never released (kernels {kernels})")
    print(f"upstream: the broker granted {len(every) - before} lease(s); {len(active)} left active")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--suite", choices=["client", "server", "all"], default="all", help="default: all"
    )
    parser.add_argument(
        "--without",
        action="store_true",
        help="run the same tests with jupyter_client's own default provisioner (a baseline)",
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    dists = list(SUITES) if args.suite == "all" else [SHORT[args.suite]]
    for dist in dists:
        sdist(dist)

    with tempfile.TemporaryDirectory(prefix="gpu-lease-upstream-") as tmp:
        env = dict(os.environ)
        env.pop("JUPYTERHUB_API_TOKEN", None)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), str(SITE), env.get("PYTHONPATH")])
        )
        broker = BrokerProcess(
            Path(tmp),
            f"sqlite:///{tmp}/broker.sqlite",
            {USER: ([], False), ADMIN: ([], True)},
            gpus="4x81920:H100",  # 80 kernels at once,
        )
        failures: list[str] = []
        if args.without:
            env.pop("JUPYTER_DEFAULT_PROVISIONER_NAME", None)
            for dist in dists:
                if run_suite(dist, env, args.pytest_args, CACHE / f"{dist}-without.log"):
                    failures.append(f"{dist}'s tests failed")
        else:
            env["GPU_LEASE_URL"] = broker.url
            env["GPU_LEASE_TOKEN"] = broker.tokens[USER]
            env["JUPYTER_DEFAULT_PROVISIONER_NAME"] = PROVISIONER_NAME
            with broker.running():
                for dist in dists:
                    before = len(leases(broker))
                    log = CACHE / f"{dist}.log"
                    if run_suite(dist, env, args.pytest_args, log):
                        failures.append(f"{dist}'s tests failed with our provisioner")
                    failures += [f"{dist}: {x}" for x in check_leases(broker, before)]
        for failure in failures:
            print(f"upstream: FAILED: {failure}")
        if not failures:
            print("upstream: passed")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
