"""jupyter_client's and jupyter_server's own test suites, with our provisioner as the default.

Run by ``make upstream`` (part of ``make test``)::

    python tests/upstream/run_upstream.py                 # both suites, with our provisioner
    python tests/upstream/run_upstream.py --without       # the same tests, jupyter_client's own
    python tests/upstream/run_upstream.py --suite client -- -k test_restart
    python tests/upstream/run_upstream.py --serial        # one pytest process at a time

For the *installed* versions of jupyter_client and jupyter_server it downloads their sdists
(``pip download --no-binary :all: --no-deps``, once: they are kept in ``.upstream/``, which
git ignores), unpacks them, starts a real broker (static tokens, a pool of four declared
GPUs), makes our provisioner the default one (``JUPYTER_DEFAULT_PROVISIONER_NAME``: the
``gpu-lease-upstream-default`` entry point of ``tests/upstream/site``, our provisioner
with a default fraction) and runs the test files in :data:`SUITES` from the unpacked
sdist, with its own ``conftest.py`` and its own pytest settings (every warning an error).
Each shard of :data:`SUITES` is one pytest process, all of them at once, each as a broker
user of its own; each writes its output to ``.upstream/<dist>-<n>.log``.

Afterwards the broker must have granted each shard's user a lease for the kernels its
tests started, and every one of them must have been released (none left active): a
kernel the provisioner lost track of fails the run even when its test passed. Exit
status 0 only if every shard passed and that holds.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

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

#: distribution -> its shards: the test files (or directories) of its sdist that one pytest
#: process runs. The shards run at the same time (``--serial``: one after another), each in
#: a copy of the sdist of its own: the tests mostly wait (for kernels, restarters and
#: timeouts), not for a CPU; and the ipc tests make their sockets in the working directory
#: under fixed names (``ip = "test"``), so two shards in one directory would cross-talk.
#: More shards would be quicker still, but every kernel start picks free TCP ports by
#: binding port 0 and closing it, and another process may take such a port before the
#: kernel binds it: each shard more is one more process racing for them.
SUITES: dict[str, tuple[tuple[str, ...], ...]] = {
    "jupyter_client": (
        ("tests/test_kernelmanager.py", "tests/test_multikernelmanager.py"),
        ("tests/test_restarter.py", "tests/test_client.py"),
    ),
    "jupyter_server": (
        (
            "tests/services/kernels",
            "tests/services/sessions",
            "tests/services/kernelspecs",
            "tests/auth/test_authorizer.py",
        ),
    ),
}
SHORT = {"client": "jupyter_client", "server": "jupyter_server"}

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
                "--no-deps",  # pip reads the sdist's metadata with its build backend,
                # fetched into an isolated build environment (nothing lands in the venv)
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


class Shard(NamedTuple):
    """One pytest process: some of ``dist``'s test files, as broker user ``user``."""

    dist: str
    number: int
    files: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.dist}-{self.number}"

    @property
    def user(self) -> str:
        """Its own broker user: the leases of one shard are told from another's."""
        return f"upstream-{self.name}"


def shards(dists: list[str]) -> list[Shard]:
    return [Shard(d, n, files) for d in dists for n, files in enumerate(SUITES[d], 1)]


def start_shard(
    shard: Shard, env: dict[str, str], pytest_args: list[str], log: Path, tmp: Path
) -> tuple[subprocess.Popen[bytes], float]:
    """pytest on ``shard``'s test files, in a copy of the unpacked sdist in ``tmp``; its
    output goes to ``log``."""
    source = sdist(shard.dist)
    workdir = tmp / shard.name
    shutil.copytree(source, workdir, symlinks=True)
    command = [*pytest_command(), *shard.files, *pytest_args]
    version = source.name[len(shard.dist) + 1 :]
    print(f"upstream: {shard.name} ({version}): {' '.join(command[3:])}", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, time.monotonic()


def pytest_command() -> list[str]:
    """pytest as every shard runs it (their own conftest and settings, ours on top)."""
    return [
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
    ]


def finish_shard(shard: Shard, proc: subprocess.Popen[bytes], started: float, log: Path) -> int:
    """Wait for ``shard``'s pytest; print its summary (and its failures)."""
    code = proc.wait()
    lines = log.read_text(errors="replace").splitlines()
    summary = next((x for x in reversed(lines) if x.startswith("=") or " in " in x), "")
    print(f"upstream: {shard.name}: {summary.strip('= ')} ({time.monotonic() - started:.0f} s)")
    if code not in (0, NO_TESTS_COLLECTED):
        print("\n".join(failure_lines(lines)))
        print(f"upstream: the whole output is in {log}")
    return code


#: at most this many lines of a failed shard's output are printed (CI keeps only the tail)
FAILURE_LINES = 120


def failure_lines(lines: list[str]) -> list[str]:
    """What says why a shard failed, from its pytest output: each exception line (``E``)
    and each captured WARNING or ERROR log line (ours say why a kernel could not start),
    once, at most :data:`FAILURE_LINES` of them, then the summary's ``FAILED``/``ERROR``
    lines, last so that they survive when only the tail of the output is kept."""
    summary = [x for x in lines if x.startswith(("FAILED ", "ERROR ")) and "::" in x]
    said: dict[str, None] = {}
    for line in lines:
        text = line.rstrip()
        if text.startswith(("E ", "WARNING ", "ERROR ")) and line not in summary:
            said.setdefault(text[:400], None)
    if not said and not summary:
        return lines[-60:]
    return [*list(said)[:FAILURE_LINES], *summary]


#: pytest's exit status when ``-k`` (or another selection) left a shard no test to run
NO_TESTS_COLLECTED = 5
#: a shard with at most this many failed tests runs them once more, alone; more is no flake.
#: Three, not two: one CI run had three, each the blocking MappingKernelManager's variant
#: (``jp_server_config0``) of a jupyter_server session test that starts a second kernel or
#: restarts one; seven runs here (six beside three busy-looping processes) passed them all
RERUN_AT_MOST = 3


def failed_tests(lines: list[str]) -> list[str]:
    """The node ids of the failed tests in a pytest output's summary, in order."""
    return [x.split()[1] for x in lines if x.startswith("FAILED ") and "::" in x]


def rerun_failed(shard: Shard, env: dict[str, str], tmp: Path, log: Path) -> int:
    """Run ``shard``'s failed tests once more, one pytest, in its own copy of the sdist.

    For races of the upstream suites that load brings out (jupyter_server's
    ``test_restart_kernel`` meets tornado's "fd added twice" when a kernel's channels are
    reopened under load, the race of jupyter_client#988; its ``[jp_server_config0]`` variant
    restarts the kernel while the websocket's ``open()`` still waits for the kernel's
    reply, and tornado reads the client's close only once the *restarted* kernel answers,
    later than the test's second of polling when the kernel starts slowly: 2 of 6 runs
    here with our provisioner, whose launcher starts the kernel slower, none of 5
    without it; without it, a kernel made 2 s slower to start timed the same test out in
    2 of 5 runs): each is printed and logged in
    ``.upstream/reruns.log`` whatever the second run gives, and fails the shard unless it
    passes then. More than ``RERUN_AT_MOST`` failures are not rerun."""
    failed = failed_tests(log.read_text(errors="replace").splitlines())
    if not failed or len(failed) > RERUN_AT_MOST:
        return 1
    again = log.with_name(f"{log.stem}-rerun.log")
    with open(again, "wb") as out:
        code = subprocess.run(
            [*pytest_command(), *failed],
            cwd=tmp / shard.name,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    verdict = "passed" if code == 0 else "FAILED again"
    with open(CACHE / "reruns.log", "a") as book:
        book.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {shard.name}: {verdict}: {failed}\n")
    print(f"upstream: {shard.name}: {len(failed)} failed test(s) run once more: {verdict}")
    print("\n".join(f"upstream:   {x}" for x in failed))
    return code


def run_shards(
    todo: list[Shard],
    env: dict[str, str],
    pytest_args: list[str],
    *,
    tmp: Path,
    serial: bool,
    tokens: dict[str, str] | None = None,
    suffix: str = "",
) -> tuple[list[Shard], list[Shard]]:
    """Run every shard (at once, or one after another): the shards that failed, and those
    that had no test selected (``-k``), which fail nothing."""
    running = []
    codes: dict[Shard, int] = {}
    for shard in todo:
        shard_env = dict(env)
        if tokens is not None:
            shard_env["GPU_LEASE_TOKEN"] = tokens[shard.user]
        log = CACHE / f"{shard.name}{suffix}.log"
        running.append((shard, *start_shard(shard, shard_env, pytest_args, log, tmp), log))
        if serial:
            codes[shard] = finish_shard(*running.pop())
    for shard, proc, started, log in running:
        codes[shard] = finish_shard(shard, proc, started, log)
    for shard in todo:
        if codes[shard] not in (0, NO_TESTS_COLLECTED):
            shard_env = dict(env)
            if tokens is not None:
                shard_env["GPU_LEASE_TOKEN"] = tokens[shard.user]
            codes[shard] = rerun_failed(shard, shard_env, tmp, CACHE / f"{shard.name}{suffix}.log")
    empty = [x for x in todo if codes[x] == NO_TESTS_COLLECTED]
    return [x for x in todo if codes[x] not in (0, NO_TESTS_COLLECTED)], empty


def leases(broker: BrokerProcess, user: str) -> list[dict[str, object]]:
    """Every lease of ``user``, ended ones included."""
    r = httpx.get(
        f"{broker.url}/api/v1/leases",
        params={"user": user, "history": "1"},
        headers={"Authorization": f"token {broker.tokens[ADMIN]}"},
        timeout=10.0,
    )
    r.raise_for_status()
    return list(r.json()["leases"])


def check_leases(broker: BrokerProcess, shard: Shard) -> list[str]:
    """Problems with the leases ``shard`` left: none granted, or some never released."""
    try:
        wait_for(
            lambda: not [x for x in leases(broker, shard.user) if x.get("state") == "active"],
            15.0,
            "every lease to be released",
        )
    except AssertionError:
        pass
    every = leases(broker, shard.user)
    active = [x for x in every if x.get("state") == "active"]
    problems = []
    if not every:
        problems.append("the broker granted no lease: our provisioner was not the default")
    if active:
        kernels = ", ".join(str(x.get("kernel_id")) for x in active)
        problems.append(f"{len(active)} lease(s) were never released (kernels {kernels})")
    print(
        f"upstream: {shard.name}: the broker granted {len(every)} lease(s); "
        f"{len(active)} left active"
    )
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
    parser.add_argument(
        "--serial", action="store_true", help="one pytest process after another (default: at once)"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    dists = list(SUITES) if args.suite == "all" else [SHORT[args.suite]]
    for dist in dists:
        sdist(dist)
    todo = shards(dists)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-lease-upstream-") as tmp:
        env = dict(os.environ)
        env.pop("JUPYTERHUB_API_TOKEN", None)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), str(SITE), env.get("PYTHONPATH")])
        )
        users: dict[str, tuple[list[str], bool]] = {x.user: ([], False) for x in todo}
        broker = BrokerProcess(
            Path(tmp),
            f"sqlite:///{tmp}/broker.sqlite",
            {**users, ADMIN: ([], True)},
            gpus="4x81920:H100",  # 80 kernels at once,
        )
        failures: list[str] = []
        if args.without:
            env.pop("JUPYTER_DEFAULT_PROVISIONER_NAME", None)
            env.pop("GPU_LEASE_TOKEN", None)
            failed, _ = run_shards(
                todo, env, args.pytest_args, tmp=Path(tmp), serial=args.serial, suffix="-without"
            )
            failures += [f"{x.name}'s tests failed" for x in failed]
        else:
            env["GPU_LEASE_URL"] = broker.url
            env["JUPYTER_DEFAULT_PROVISIONER_NAME"] = PROVISIONER_NAME
            with broker.running():
                failed, empty = run_shards(
                    todo,
                    env,
                    args.pytest_args,
                    tmp=Path(tmp),
                    serial=args.serial,
                    tokens=broker.tokens,
                )
                failures += [f"{x.name}'s tests failed with our provisioner" for x in failed]
                for shard in todo:
                    if shard not in empty:
                        failures += [f"{shard.name}: {x}" for x in check_leases(broker, shard)]
        for failure in failures:
            print(f"upstream: FAILED: {failure}")
        took = time.monotonic() - started
        print(f"upstream: {'passed' if not failures else 'failed'} ({took:.0f} s)")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
