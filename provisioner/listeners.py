"""Who is at the other end of a TCP connection on this machine, before a token goes there.

The broker of a one-machine hub listens on ``127.0.0.1:10101``. Any account may bind a
free port, so a student's process that binds it while the broker is down (a restart, an
upgrade, a crash) would receive every server's ``Authorization: token ...``.
:class:`BrokerClient <provisioner.client.BrokerClient>` therefore checks each
new connection, after it is made and before a byte is sent on it: where the server's end
of the connection is in this machine's network namespace (always so for a loopback
address), its owner (an accepted socket keeps its listener's uid) must be one the client
trusts (:class:`Owners`). A connection to anyone else is closed and :class:`errors.BrokerUnavailable` says whose
it was and what to do. Where the server's end cannot be seen (another machine, another
network namespace, no ``/proc``) nothing is checked: TLS (JupyterHub's ``internal_ssl``)
or the network's policy protects those (docs/admins.md, "Network and ports").

The check runs once per connection (a kept-alive connection stays checked): one
sock_diag netlink lookup of the server's end by its address and port, as ``ss`` makes
(about 20 µs), else a search of the two tables (milliseconds: the kernel walks its
whole connection hash to print them). :func:`listening_on` names the
owners of a port's listening sockets for the broker's "Address already in use" exit.

Nothing is read at import; ``/etc/login.defs`` is read once, on first use.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import os
import pwd
import socket
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpcore
import httpx

from . import errors

log = logging.getLogger("gpu_lease.client")

#: the accounts (uids or names, comma-separated) the broker's listener may belong to
BROKER_UID_ENV = "GPU_LEASE_BROKER_UID"
#: the kernel's TCP tables of this network namespace
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
#: ``st`` of a listening socket in those tables
LISTEN = "0A"


@functools.cache
def uid_min(path: str = "/etc/login.defs") -> int:
    """``UID_MIN`` of ``/etc/login.defs`` (the first uid of people's accounts), else 1000."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 1000
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "UID_MIN" and parts[1].isdigit():
            return int(parts[1])
    return 1000


def account(uid: int) -> str:
    """``"uid 1002 (s002)"``, or ``"uid 1002"`` for a uid without an account here."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True)
class Owners:
    """The accounts whose listener may receive the token.

    ``uids`` given (``GPU_LEASE_BROKER_UID``, or the client's ``broker_uid``): exactly
    those. Else the default: root, a system account (below ``UID_MIN``) or the caller's
    own uid (a listener of one's own account can only take one's own token).
    """

    uids: frozenset[int] | None = None

    @classmethod
    def parse(cls, value: str | int | Iterable[int | str] | None) -> Owners:
        """Owners from a uid, a name, a comma-separated list of them, or ``None`` (the default).

        Raises :class:`errors.InvalidRequest` for a name without an account or a bad uid.
        """
        if value is None or (isinstance(value, str) and not value.strip()):
            return cls()
        items: list[int | str]
        if isinstance(value, str):
            items = list(value.split(","))
        elif isinstance(value, int):
            items = [value]
        else:
            items = list(value)
        uids: set[int] = set()
        for item in items:
            text = str(item).strip()
            try:
                uids.add(int(text) if text.isdigit() else pwd.getpwnam(text).pw_uid)
            except KeyError:
                raise errors.InvalidRequest(
                    f"{BROKER_UID_ENV} names {text!r}, which is no account here: give the uid "
                    "or name of the account the GPU lease broker runs as (several: comma-separated)."
                ) from None
        return cls(frozenset(uids))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Owners:
        """The owners ``GPU_LEASE_BROKER_UID`` names, read now; the default where it is unset."""
        env = os.environ if environ is None else environ
        return cls.parse(env.get(BROKER_UID_ENV))

    def trusts(self, uid: int) -> bool:
        if self.uids is not None:
            return uid in self.uids
        return uid == 0 or uid < uid_min() or uid == os.geteuid()

    def describe(self) -> str:
        """The trusted accounts in words, for messages."""
        if self.uids is not None:
            return f"{BROKER_UID_ENV}: " + ", ".join(account(u) for u in sorted(self.uids))
        return f"root, a system account (uid below {uid_min()}) or your own"


# -- the tables ----------------------------------------------------------------------------
def _hex_address(ip: str) -> list[str]:
    """How ``/proc/net/tcp{,6}`` spell ``ip``: each 32-bit word in the host's byte order.

    An IPv4 address is also given as an IPv6 socket shows it (``::ffff:a.b.c.d``).
    """
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    forms = [addr.packed]
    if isinstance(addr, ipaddress.IPv4Address):
        forms.append(ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + addr.packed).packed)
    return [
        "".join(f"{int.from_bytes(b[i : i + 4], sys.byteorder):08X}" for i in range(0, len(b), 4))
        for b in forms
    ]


def _read_tables() -> list[str] | None:
    """The lines of both tables; ``None`` where this machine has no such tables."""
    lines: list[str] = []
    seen = False
    for table in TABLES:
        try:
            lines += table.read_text(encoding="ascii", errors="replace").splitlines()[1:]
            seen = True
        except OSError:
            continue
    return lines if seen else None


def server_owner(sock: socket.socket) -> int | None:
    """The uid owning the server's end of the connected TCP socket ``sock``, or ``None``
    where that end is not in this network namespace (or cannot be looked up).

    Asked of the kernel by its 4-tuple with sock_diag (netlink, as ``ss`` does: one
    lookup); where netlink is closed, the ``/proc/net/tcp{,6}`` tables are searched, which
    walks the kernel's whole connection hash (milliseconds)."""
    try:
        ours = sock.getsockname()
        theirs = sock.getpeername()
    except OSError:
        return None
    try:
        return _diag_owner(theirs, ours)
    except (OSError, struct.error):  # no sock_diag here (seccomp, gVisor): the tables
        return _table_owner(theirs, ours)


def _table_owner(src: tuple[Any, ...], dst: tuple[Any, ...]) -> int | None:
    """:func:`_diag_owner` from the ``/proc/net/tcp{,6}`` tables; ``None`` where there are none."""
    lines = _read_tables()
    if lines is None:
        return None
    local = {f"{h}:{src[1]:04X}" for h in _hex_address(src[0])}
    remote = {f"{h}:{dst[1]:04X}" for h in _hex_address(dst[0])}
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] in local and fields[2] in remote:
            return int(fields[7])
    return None


#: netlink's sock_diag: the message type, request flag, error message type, "no cookie"
_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 20, 1, 2
_NOCOOKIE = 0xFFFFFFFF
_NETLINK_SOCK_DIAG = 4
#: ``idiag_state`` of a listening socket
_TCP_LISTEN = 10


def _diag_owner(src: tuple[Any, ...], dst: tuple[Any, ...]) -> int | None:
    """The uid of the TCP socket bound to ``src`` and connected to ``dst`` (exact lookup);
    ``None`` where there is none (the kernel then answers a listener on ``src``'s port, if
    any, which is not that socket); OSError where sock_diag cannot be asked."""
    addr = ipaddress.ip_address(src[0].split("%", 1)[0])
    peer = ipaddress.ip_address(dst[0].split("%", 1)[0])
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    pad = b"\0" * (16 - len(addr.packed))
    sockid = (
        struct.pack(">HH", src[1], dst[1])
        + addr.packed
        + pad
        + peer.packed
        + b"\0" * (16 - len(peer.packed))
        + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE)
    )
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(header + body, (0, 0))
        answer = nl.recv(65536)
    length, kind = struct.unpack_from("=IH", answer)
    if kind == _NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", answer, 16)
        if code == -errno.ENOENT:
            return None
        raise OSError(-code, os.strerror(-code))
    if kind != _SOCK_DIAG_BY_FAMILY or length < 88:
        raise OSError(errno.EPROTO, "unexpected sock_diag answer")
    if answer[17] == _TCP_LISTEN:  # no such connection here (a remote server's address and
        return None  # port that a local listener also takes must not stand for that server)
    (uid,) = struct.unpack_from("=I", answer, 16 + 4 + 48 + 12)
    return int(uid)


def listening_on(port: int) -> list[tuple[str, int]]:
    """``(address, uid)`` of each socket listening on TCP ``port`` in this namespace."""
    out: list[tuple[str, int]] = []
    for line in _read_tables() or []:
        fields = line.split()
        if len(fields) <= 7 or fields[3] != LISTEN:
            continue
        address, _, hexport = fields[1].rpartition(":")
        if int(hexport, 16) != port:
            continue
        raw = b"".join(
            int(address[i : i + 8], 16).to_bytes(4, sys.byteorder)
            for i in range(0, len(address), 8)
        )
        out.append((str(ipaddress.ip_address(raw)), int(fields[7])))
    return out


def check_connection(sock: socket.socket, owners: Owners, where: str) -> None:
    """Raise :class:`errors.BrokerUnavailable` unless the server's end of ``sock`` is
    unseen or belongs to one of ``owners``. Called on each new connection, before a byte
    of the request is sent; ``where`` is the URL shown in the message."""
    uid = server_owner(sock)
    if uid is None:  # another machine or namespace; or the server closed it already
        log.debug("the listener of %s is not on this machine: not checked", where)
        return
    if owners.trusts(uid):
        return
    peer = sock.getpeername()
    shown = f"[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"{peer[0]}:{peer[1]}"
    raise errors.BrokerUnavailable(
        f"The listener on {shown} belongs to {account(uid)}, not to the GPU lease broker's "
        f"account ({owners.describe()}), so no token was sent to it: another account took the "
        "broker's port, perhaps while the broker was restarting. Ask your admin to stop that "
        "process and start the broker again (docs/admins.md, 'Network and ports').",
        url=where,
        listener_uid=uid,
    )


# -- the transport -----------------------------------------------------------------------
class _CheckingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, checking each new TCP connection (:func:`check_connection`)."""

    def __init__(self, owners: Owners, where: str) -> None:
        self._inner = httpcore.AnyIOBackend()
        self._owners = owners
        self._where = where

    async def connect_tcp(self, host: str, port: int, *args: Any, **kw: Any) -> Any:
        stream = await self._inner.connect_tcp(host, port, *args, **kw)
        sock = stream.get_extra_info("socket")
        if sock is not None:
            try:
                check_connection(sock, self._owners, self._where)
            except BaseException:
                await stream.aclose()
                raise
        return stream

    async def connect_unix_socket(self, *args: Any, **kw: Any) -> Any:
        return await self._inner.connect_unix_socket(*args, **kw)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def checked_transport(
    owners: Owners, where: str, *, verify: Any, limits: httpx.Limits
) -> httpx.AsyncHTTPTransport:
    """httpx's own transport whose connections are checked before use.

    httpx offers no network-backend option, so its pool is swapped for an httpcore pool
    (httpcore's public API) made with the same settings and :class:`_CheckingBackend`.
    """
    transport = httpx.AsyncHTTPTransport(verify=verify, limits=limits)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=verify,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        http1=True,
        http2=False,
        network_backend=_CheckingBackend(owners, where),
    )
    return transport
