"""A student's process on the broker's port gets no token, with REAL
processes: a Unix account made here with ``useradd`` (removed at teardown) runs a
listener on the broker's port while no broker runs, as a student would after a restart
or a crash, and records every byte it is sent. A ``BrokerClient``, a kernel started
through ``GPULeaseProvisioner`` and a broker started on that port meet it.

The fast tests at the end check the listener lookup on this process's own sockets.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import AsyncKernelManager

from provisioner import errors, listeners
from provisioner.client import BrokerClient
from provisioner.devtools.testing import BrokerProcess, free_port, wait_for
from provisioner.kernel.kernelspecs import build_kernelspec, spec_json

from . import accounts

#: the squatter: listen on the port, record each connection's bytes (a line of JSON on
#: stdout), answer 404 and close, as any web server would
LISTENER = r"""
import json, socket, sys
srv = socket.socket()
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(16)
print(json.dumps({"listening": True}), flush=True)
while True:
    conn, _ = srv.accept()
    conn.settimeout(10)
    got = b""
    try:
        while b"\r\n\r\n" not in got:
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += chunk
        if got:
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    except OSError:
        pass
    conn.close()
    print(json.dumps({"bytes": len(got), "head": got.decode("latin-1")[:2000]}), flush=True)
"""

TOKEN = "tok-of-a-student-" + uuid.uuid4().hex


class Squatter:
    """The student's listener on ``port``: ``got`` is what each connection sent."""

    def __init__(self, user: str, port: int) -> None:
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        self.port = port
        self.got: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            ["runuser", "-u", user, "--", python, "-c", LISTENER, str(port)],
            stdout=subprocess.PIPE,
            cwd="/",
            start_new_session=True,  # runuser and the listener: one process group
        )
        self.listening = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self.listening.wait(20), "the squatter did not listen"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            record = json.loads(line)
            if record.get("listening"):
                self.listening.set()
            else:
                self.got.append(record)

    def tokens_seen(self) -> list[str]:
        return [r["head"] for r in self.got if "authorization" in r["head"].lower()]

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def student() -> Iterator[str]:
    accounts.needs_root()
    name = f"sq{uuid.uuid4().hex[:6]}"
    accounts.useradd(name)
    try:
        yield name
    finally:
        accounts.userdel(name)


@pytest.fixture
def squatter(student: str) -> Iterator[Squatter]:
    s = Squatter(student, free_port())
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("configured", [False, True], ids=["default", "GPU_LEASE_BROKER_UID"])
async def test_a_client_sends_no_token_to_a_student_listener(
    squatter: Squatter, student: str, configured: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_LEASE_URL", f"http://127.0.0.1:{squatter.port}")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", TOKEN)
    monkeypatch.delenv("GPU_LEASE_TOKEN", raising=False)
    if configured:  # the hub's setting: the broker's account, here root's
        monkeypatch.setenv("GPU_LEASE_BROKER_UID", "0")
    else:
        monkeypatch.delenv("GPU_LEASE_BROKER_UID", raising=False)
    uid = pwd.getpwnam(student).pw_uid
    async with BrokerClient.from_env(retries=0) as client:
        with pytest.raises(errors.BrokerUnavailable) as info:
            await client.health()
    wait_for(lambda: squatter.got, what="the squatter to see the connection closed")
    assert squatter.tokens_seen() == [] and squatter.got[0]["bytes"] == 0, squatter.got
    message = str(info.value)
    assert f"127.0.0.1:{squatter.port} belongs to uid {uid} ({student})" in message
    assert "no token was sent" in message and "Ask your admin" in message
    assert TOKEN not in message


@pytest.mark.slow
async def test_a_kernel_start_fails_with_the_reason(
    squatter: Squatter, student: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The provisioner (as the hub's servers run it) refuses to start the kernel and says why."""
    root = tmp_path / "jupyter"
    folder = root / "kernels" / "gpu-sq"
    folder.mkdir(parents=True)
    (folder / "kernel.json").write_text(spec_json(build_kernelspec(0.05)))
    monkeypatch.setenv("JUPYTER_PATH", str(root))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("GPU_LEASE_URL", f"http://127.0.0.1:{squatter.port}")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", TOKEN)
    monkeypatch.setenv("GPU_LEASE_BROKER_UID", "0")
    for name in ("GPU_LEASE_TOKEN", "GPU_LEASE_NODE", "GPU_LEASE_GPU_UUIDS"):
        monkeypatch.delenv(name, raising=False)
    km = AsyncKernelManager(kernel_name="gpu-sq")
    with pytest.raises(errors.GPULeaseError) as info:
        await km.start_kernel()
    assert squatter.tokens_seen() == [], squatter.got
    assert f"belongs to uid {pwd.getpwnam(student).pw_uid} ({student})" in str(info.value)
    assert squatter.tokens_seen() == [], squatter.got
    assert not km.has_kernel


@pytest.mark.slow
def test_the_broker_names_who_holds_its_port(
    squatter: Squatter, student: str, tmp_path: Path
) -> None:
    broker = BrokerProcess(tmp_path, f"sqlite:///{tmp_path / 'b.sqlite'}", {"alice": ((), False)})
    broker.port = squatter.port
    broker.launch()
    assert broker.proc is not None
    assert broker.proc.wait(30) == 2
    log = broker.log()
    uid = pwd.getpwnam(student).pw_uid
    assert f"uid {uid} ({student}) listens on 127.0.0.1:{squatter.port}" in log, log
    assert "stop that process" in log


# -- the lookup, on this process's own sockets (no process started) ------------------------
def diag_owner(src: tuple[Any, ...], dst: tuple[Any, ...]) -> int | None:
    """sock_diag's answer; the test is skipped where this kernel has no sock_diag for TCP."""
    try:
        return listeners._diag_owner(src, dst)
    except OSError as exc:
        pytest.skip(f"no sock_diag here ({exc}); /proc/net/tcp is checked alone")


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_server_end_of_a_connection_is_found(family: int, host: str) -> None:
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp here")
    with socket.socket(family) as srv:
        try:
            srv.bind((host, 0))
        except OSError:
            pytest.skip(f"no {host} here")
        srv.listen(1)
        port = srv.getsockname()[1]
        assert (host, os.geteuid()) in listeners.listening_on(port)
        with socket.create_connection((host, port)) as conn:
            assert listeners.server_owner(conn) == os.geteuid()
            theirs, ours = conn.getpeername(), conn.getsockname()
            assert listeners._table_owner(theirs, ours) == os.geteuid()  # without netlink
            assert diag_owner(theirs, ours) == os.geteuid()
            with socket.socket(family) as unused:  # a port nobody listens on
                unused.bind((host, 0))
                nobody = (host, unused.getsockname()[1])
            assert diag_owner(nobody, ours) is None
            # a listener on the server's port answers for no connection of another machine
            assert diag_owner((host, port), (ours[0], nobody[1], *ours[2:])) is None
            assert listeners._table_owner((host, port), (ours[0], nobody[1], *ours[2:])) is None
            listeners.check_connection(conn, listeners.Owners(), "here")  # our own: trusted
            with pytest.raises(errors.BrokerUnavailable, match="not to the GPU lease broker"):
                listeners.check_connection(conn, listeners.Owners(frozenset({4242})), "here")


def test_a_dual_stack_listener_is_found_for_an_ipv4_client() -> None:
    if not socket.has_dualstack_ipv6() or not os.path.exists("/proc/net/tcp6"):
        pytest.skip("no dual-stack sockets here")
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as srv:
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as conn:
            assert listeners.server_owner(conn) == os.geteuid()
            assert listeners._table_owner(conn.getpeername(), conn.getsockname()) == os.geteuid()


def test_owners() -> None:
    assert listeners.Owners.parse(None).uids is None
    assert listeners.Owners.parse("0, root").uids == frozenset({0})
    assert listeners.Owners.parse(7).trusts(7) and not listeners.Owners.parse(7).trusts(0)
    default = listeners.Owners()
    assert default.trusts(0) and default.trusts(os.geteuid()) and default.trusts(100)
    assert not default.trusts(listeners.uid_min() + 4242) or os.geteuid() == 4242
    with pytest.raises(errors.InvalidRequest, match="GPU_LEASE_BROKER_UID names 'nobody-here"):
        listeners.Owners.parse("nobody-here-xyz")


def test_login_defs(tmp_path: Path) -> None:
    defs = tmp_path / "login.defs"
    defs.write_text("# x\nUID_MIN\t\t 500\n")
    assert listeners.uid_min.__wrapped__(str(defs)) == 500
    assert listeners.uid_min.__wrapped__(str(tmp_path / "missing")) == 1000
