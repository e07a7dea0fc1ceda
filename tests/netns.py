"""Network namespaces as test machines: a head (the broker and the students' servers) and
GPU nodes, each joined to the head by a veth pair on a /30 of ``10.213.0.0/16``
(addresses exist only inside the namespaces a test makes; the root namespace carries no
traffic of theirs).

:meth:`Cluster.inside` moves *the calling thread* into a namespace (``setns``: a network
namespace is per thread in Linux) and back: sockets it opens and processes it starts then
live there, so the test's own HTTP calls, a broker started with ``subprocess``, a kernel
manager and a browser see the head's network, not this machine's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True)


def needs_netns() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("makes network namespaces: run as root with iproute2 (CI does)")


@dataclass
class Cluster:
    """``head`` and ``nodes`` (name -> namespace), with each node's address and the head's
    address on that node's link."""

    nodes: list[str]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    #: short name -> namespace name
    ns: dict[str, str] = field(default_factory=dict)
    #: node -> (head's address on its link, the node's address)
    link: dict[str, tuple[str, str]] = field(default_factory=dict)

    def up(self) -> Cluster:
        base = int(self.tag[:2], 16) % 200 + 20  # 10.213.<base+i>.0/30 per node
        self.ns["head"] = f"gl{self.tag}h"
        ip("netns", "add", self.ns["head"])
        ip("link", "set", "lo", "up", ns=self.ns["head"])
        for i, node in enumerate(self.nodes):
            name = self.ns[node] = f"gl{self.tag}n{i}"
            ip("netns", "add", name)
            ip("link", "set", "lo", "up", ns=name)
            here, there = f"gh{self.tag}{i}", f"gn{self.tag}{i}"
            ip(
                "link",
                "add",
                here,
                "netns",
                self.ns["head"],
                "type",
                "veth",
                "peer",
                "name",
                there,
                "netns",
                name,
            )
            head_ip, node_ip = f"10.213.{base + i}.1", f"10.213.{base + i}.2"
            ip("addr", "add", f"{head_ip}/30", "dev", here, ns=self.ns["head"])
            ip("addr", "add", f"{node_ip}/30", "dev", there, ns=name)
            ip("link", "set", here, "up", ns=self.ns["head"])
            ip("link", "set", there, "up", ns=name)
            self.link[node] = (head_ip, node_ip)
        return self

    def cut(self, node: str, up: bool = False) -> None:
        """Take the link between the head and ``node`` down (or up again)."""
        i = self.nodes.index(node)
        ip("link", "set", f"gh{self.tag}{i}", "up" if up else "down", ns=self.ns["head"])

    @contextlib.contextmanager
    def inside(self, where: str) -> Iterator[None]:
        """The calling thread in ``where``'s namespace until the block ends."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.ns[where]}", os.O_RDONLY)
        try:
            _setns(target)
            yield
        finally:
            _setns(back)
            os.close(target)
            os.close(back)

    def down(self) -> None:
        for name in self.ns.values():
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


__all__ = ["Cluster", "needs_netns"]
