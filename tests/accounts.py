"""Helpers shared by the tests whose students are real Unix accounts (``test_accounts_hub``:
a root hub with ``GPU_LEASE_SPAWNER=system-users``; ``test_slurm``: Slurm jobs submitted
as the students with ``sudo -u``): making and removing accounts, a Python they can run,
and the uids of a process from ``/proc``.

The students must be able to run the hub's Python. A Python under a private directory
(pyenv in ``/root``, mode 0700, as on this project's machines) cannot be: then
:func:`student_python` builds a virtual environment of Debian's ``python3.X`` (the same
minor version) over this environment's site-packages, with this environment's console
scripts, in a directory the test made with :func:`passable_dir` (mode 0711) and removes.
Nothing outside what the tests make changes mode.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest


def needs_root(*tools: str) -> None:
    """Skip unless this runs as root with ``useradd``, ``userdel``, ``runuser`` and ``tools``."""
    if os.geteuid() != 0:
        pytest.skip("makes Unix accounts and runs a root hub: run as root (make test in CI does)")
    for tool in ("useradd", "userdel", "runuser", *tools):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (make install installs Debian's packages)")


#: tests run on several pytest-xdist workers at once; useradd and userdel each take
#: /etc/passwd's lock and fail ("cannot lock /etc/passwd") instead of waiting for another's
ACCOUNTS_LOCK = Path(tempfile.gettempdir()) / "gpu-lease-tests-accounts.lock"


@contextlib.contextmanager
def _accounts_lock() -> Iterator[None]:
    with open(ACCOUNTS_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def account_command(cmd: list[str], *, check: bool = True) -> None:
    """Run a ``useradd``/``userdel`` command line under the tests' accounts lock."""
    with _accounts_lock():
        subprocess.run(cmd, check=check, capture_output=True)


def useradd(name: str, *, system: bool = False) -> pwd.struct_passwd:
    """A new account ``name``: a student's (home 0700, bash), or a service's (``system``)."""
    if system:  # a service account: no home, no login
        cmd = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    else:  # Debian's useradd makes homes with UMASK's mode (0755) unless told
        cmd = ["useradd", "--create-home", "--shell", "/bin/bash", "-K", "HOME_MODE=0700", name]
    with _accounts_lock():
        subprocess.run(cmd, check=True, capture_output=True)
    return pwd.getpwnam(name)


def userdel(name: str) -> None:
    """Kill whatever ``name`` still runs, then remove the account and its home."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for proc in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["uids"] and proc.info["uids"].real == uid:
                proc.kill()
    with _accounts_lock():
        subprocess.run(["userdel", "--remove", name], capture_output=True)


@contextlib.contextmanager
def passable_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory of root's, mode 0711 (students pass through to what the test
    puts there, and list nothing), removed at the end."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        base.chmod(0o711)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def runs_as(user: str, python: str) -> bool:
    """Whether ``user`` can start ``python`` and import what a server and a kernel need."""
    code = "import jupyterhub, ipykernel, jupyter_server, provisioner"
    done = subprocess.run(
        ["runuser", "-u", user, "--", python, "-c", code],
        capture_output=True,
        cwd="/",
        timeout=120,
    )
    return done.returncode == 0


def student_python(base: Path, user: str) -> str:
    """A Python every student can run: this one, else a venv of Debian's (see the docstring),
    made in ``base`` with this environment's console scripts (``jupyterhub-singleuser``,
    ``batchspawner-singleuser``, ``gpu-lease``, ...) pointed at it."""
    if runs_as(user, sys.executable):
        return sys.executable
    system = Path(f"/usr/bin/python3.{sys.version_info.minor}")
    if not system.exists():
        pytest.skip(
            f"students cannot run {sys.executable} (a directory on its path is private) and "
            f"there is no {system} to build a shared environment on"
        )
    venv = base / "venv"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = sysconfig.get_paths()["purelib"]
    site_packages = next((venv / "lib").glob("python3.*/site-packages"))
    (site_packages / "gpu-lease-shared.pth").write_text(
        f"import site; site.addsitedir({purelib!r})\n", encoding="utf-8"
    )
    python = venv / "bin" / "python"
    # Jupyter's configuration and data under sys.prefix (server extensions such as
    # JupyterLab's, its labextensions, ours): the venv's prefix finds them as this one does
    for sub in ("etc/jupyter", "share/jupyter"):
        mine = Path(sys.prefix) / sub
        if mine.is_dir():
            (venv / sub).parent.mkdir(parents=True, exist_ok=True)
            (venv / sub).symlink_to(mine, target_is_directory=True)
    ours = Path(sys.executable).parent
    for script in sorted(ours.iterdir()):
        target = venv / "bin" / script.name
        if target.exists() or not script.is_file():
            continue
        with open(script, "rb") as f:
            first = f.readline()
        if (
            not first.startswith(b"#!")
            or Path(first[2:].decode(errors="replace").strip()).parent != ours
        ):
            continue  # not a console script of this environment
        target.write_bytes(f"#!{python}\n".encode() + script.read_bytes()[len(first) :])
        target.chmod(0o755)
    if not runs_as(user, str(python)):
        pytest.skip(f"students cannot import this environment's packages ({purelib})")
    return str(python)


def courses(path: Path, names: list[str]) -> None:
    """A courses file (``GPU_LEASE_COURSES``) whose one course has ``names`` (0.05 of a GPU
    each, one lease), readable by the broker's account."""
    members = ", ".join(json.dumps(n) for n in names)
    path.write_text(
        "admins = []\n\n[quota.default]\nmax_fraction = 0.05\nmax_leases = 1\n\n"
        f'[courses.acct]\ndescription = "accounts test"\nmembers = [{members}]\n',
        encoding="utf-8",
    )
    path.chmod(0o644)


def status(pid: int, key: str) -> list[str]:
    """The fields of ``key`` in ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return line.split()[1:]
    raise AssertionError(f"no {key} line for process {pid}")


def ids(pid: int) -> set[int]:
    """The real, effective, saved and file-system uids of process ``pid``."""
    return {int(x) for x in status(pid, "Uid")}
