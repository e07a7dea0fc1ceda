"""Inside a Slurm kernel's job: start the kernel on this node and say where it listens.

:class:`~.slurm_kernel.SlurmKernel` submits ``python -m provisioner.kernel.slurm_job DIR``
as the student's job on the lease's node. ``DIR`` is the kernel's exchange directory (in the
student's home, which the server and the nodes share; 0700, the student's), in which the
server wrote, each 0600:

- ``job.json``: the kernel's argv, its environment (the lease's, the kernelspec's), the
  notebook's directory, the address setting (``bind``) and how long the kernel may take to
  listen; **no key**;
- ``kernel.json``: the kernel's connection file, its HMAC key and every port 0.

This runner, the job's batch step, finds this node's address (:func:`resolve_bind`),
writes it into ``kernel.json``, starts the kernel on it (ipykernel binds each port 0 to a
free port and writes the ports back into the file: ``IPKernelApp.write_connection_file``
merges what it bound into the existing file), then, once every port is set, writes
``launched.json`` (the address, the ports, the node, the working directory; renamed into
place, so the server never reads half of it) and removes ``kernel.json``: from then on the
key lives only in the kernel's memory and the server's own connection file. When the
kernel ends it writes ``exit.json`` (its exit code). A kernel that cannot start (a bad
argv, an exit before it listened, an address this node does not have) gets
``launched.json`` with ``error``, the sentence the server raises.

The key is never on a command line, in the job's environment, in its script (Slurm keeps
the script and ``scontrol show job`` shows the command) or on stdout/stderr.

Signals come from Slurm: ``scancel --signal=SIG --full`` signals every process of the batch
step, the kernel and this runner alike; this runner ignores them (the kernel's own
disposition decides: SIGINT interrupts a cell) and keeps waiting for the kernel's end.

Only the standard library (and psutil, which ipykernel needs, for a named interface):
this runs in the job with the server's Python, before any kernel.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

#: the files of an exchange directory
JOB_FILE = "job.json"
CONNECTION = "kernel.json"
LAUNCHED = "launched.json"
EXITED = "exit.json"
#: Slurm's ``--output`` and ``--error`` of the job
STDOUT = "slurm.out"
STDERR = "slurm.err"

#: where the kernel's connection file goes in its argv (as in :mod:`.remote`)
CONNECTION_FILE = "{connection_file}"
#: the connection file's port fields
PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
#: the signals the runner outlives (Slurm sends them to every process of the step)
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: the job's own variables that the kernel keeps (``SLURM_JOB_ID``, ``SLURMD_NODENAME``, ...)
SLURM_PREFIXES = ("SLURM_", "SLURMD_")


class LaunchError(Exception):
    """The kernel cannot start here; the message is the sentence the student reads."""


def resolve_bind(bind: str, addresses: Mapping[str, Sequence[str]]) -> str:
    """The address the kernel binds to on this node.

    ``bind`` is an IP address (used as it is), an interface name or pattern (``ib0``,
    ``eth*``: its first IPv4 address) or an address pattern (``10.1.*``: the first of this
    node's addresses that matches). ``addresses`` maps each interface to its addresses, as
    :func:`node_addresses` reads them; "" is the address this node's host name resolves
    to. Raises :class:`LaunchError` when none matches.
    """
    if not bind:
        import socket

        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            raise LaunchError(
                f"This node's host name does not resolve ({exc}); set the kernel address "
                "setting to an interface or address pattern."
            ) from exc
    try:
        return str(ipaddress.ip_address(bind))
    except ValueError:
        pass
    for name in sorted(addresses):
        if fnmatch.fnmatchcase(name, bind):
            for addr in addresses[name]:
                if _is_ipv4(addr):
                    return addr
    for name in sorted(addresses):
        for addr in addresses[name]:
            if fnmatch.fnmatchcase(addr, bind):
                return addr
    have = ", ".join(f"{n}={'/'.join(a)}" for n, a in sorted(addresses.items()) if a)
    raise LaunchError(
        f"No interface or address of this node matches the kernel address setting {bind!r} "
        f"(this node has {have or 'none'}); set it to an interface or address pattern "
        "that every compute node has."
    )


def _is_ipv4(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).version == 4
    except ValueError:
        return False


def node_addresses() -> dict[str, list[str]]:
    """This node's interfaces and their IP addresses."""
    import socket

    import psutil  # ipykernel's dependency: there wherever a kernel runs

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[name] = [
            a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)
        ]
    return out


def kernel_environment(
    job_env: Mapping[str, str], own_env: Mapping[str, str], account: pwd.struct_passwd, path: str
) -> dict[str, str]:
    """The kernel's environment: the account's login basics (HOME, USER, LOGNAME, SHELL),
    ``path`` as PATH, this job's Slurm variables, then what the server sent (the lease's
    and the kernelspec's, which win). Nothing else of the node's or the server's."""
    env = {
        "HOME": account.pw_dir,
        "USER": account.pw_name,
        "LOGNAME": account.pw_name,
        "SHELL": account.pw_shell or "/bin/sh",
        "PATH": path,
    }
    env.update({k: v for k, v in own_env.items() if k.startswith(SLURM_PREFIXES)})
    env.update(job_env)
    return env


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` to ``path`` (0600), renamed into place: a reader sees all of it or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_ports(path: Path) -> dict[str, int] | None:
    """The ports of the connection file at ``path`` once the kernel set every one, else None
    (not written yet, half written, a port still 0)."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        ports = {p: int(info[p]) for p in PORTS}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ports if all(ports.values()) else None


def _working_directory(cwd: str | None, directory: Path) -> tuple[str, bool]:
    """The notebook's directory where this node sees it (a shared home), else a scratch
    directory of the job's on this node."""
    if cwd and os.path.isdir(cwd) and os.access(cwd, os.R_OK | os.X_OK):
        return cwd, True
    base = os.environ.get("TMPDIR") or tempfile.gettempdir()
    scratch = tempfile.mkdtemp(prefix=f"gpu-lease-kernel-{directory.name[:8]}-", dir=base)
    return scratch, False


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The runner outlives the signals Slurm sends to the whole step (a handler, not
    SIG_IGN: the kernel, started after, keeps the default dispositions)."""


def run(directory: Path) -> int:
    """Start the kernel that ``directory`` describes; its exit code (see the docstring)."""
    started = time.time()
    job = json.loads((directory / JOB_FILE).read_text(encoding="utf-8"))
    connection = directory / CONNECTION
    for sig in IGNORED:
        signal.signal(sig, _ignore)
    try:
        ip = resolve_bind(str(job["bind"]), node_addresses())
        info = json.loads(connection.read_text(encoding="utf-8"))
        info["ip"] = ip
        write_json(connection, info)
        cwd, shared = _working_directory(job.get("cwd"), directory)
        env = kernel_environment(job["env"], os.environ, pwd.getpwuid(os.getuid()), job["path"])
        argv = [str(connection) if a == CONNECTION_FILE else str(a) for a in job["argv"]]
        try:
            kernel = subprocess.Popen(argv, env=env, cwd=cwd)
        except OSError as exc:
            raise LaunchError(
                f"The kernel's command {argv[0]!r} could not be started on node "
                f"{os.environ.get('SLURMD_NODENAME', '?')}: {exc.strerror or exc}; check the "
                "kernelspec's argv and that the node has that program."
            ) from exc
    except LaunchError as exc:
        print(f"gpu-lease: {exc}", file=sys.stderr, flush=True)
        write_json(directory / LAUNCHED, {"error": str(exc)})
        connection.unlink(missing_ok=True)
        return 2
    deadline = time.monotonic() + float(job.get("ready_timeout", 60.0))
    ports = None
    while ports is None:
        code = kernel.poll()
        if code is not None:
            said = (
                f"The kernel exited with code {code} on node "
                f"{os.environ.get('SLURMD_NODENAME', '?')} before it listened; its stderr "
                "(the job's) says why."
            )
            print(f"gpu-lease: {said}", file=sys.stderr, flush=True)
            write_json(directory / LAUNCHED, {"error": said, "returncode": code})
            write_json(directory / EXITED, {"returncode": code})
            connection.unlink(missing_ok=True)
            return 3
        if time.monotonic() > deadline:
            kernel.kill()
            said = (
                f"The kernel did not write its ports within {job.get('ready_timeout')} s; "
                "a kernel launched this way must bind ports 0 and rewrite its connection "
                "file, as ipykernel does."
            )
            write_json(directory / LAUNCHED, {"error": said})
            connection.unlink(missing_ok=True)
            return 4
        ports = read_ports(connection)
        if ports is None:
            time.sleep(0.01)
    connection.unlink(missing_ok=True)
    write_json(
        directory / LAUNCHED,
        {
            "ip": ip,
            "ports": ports,
            "node": os.environ.get("SLURMD_NODENAME", ""),
            "cwd": cwd,
            "cwd_shared": shared,
            "pid": kernel.pid,
            "job_id": os.environ.get("SLURM_JOB_ID", ""),
            # when the job began and when the kernel listened (the node's clock)
            "started_at": started,
            "listening_at": time.time(),
        },
    )
    while True:
        try:
            code = kernel.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
    write_json(directory / EXITED, {"returncode": code})
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m provisioner.kernel.slurm_job EXCHANGE_DIR", file=sys.stderr)
        return 64
    return run(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
