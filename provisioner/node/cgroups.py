"""A cgroup (v2) of its own for each GPU kernel: what a driver memory limit is set on.

Who creates it: the **provisioner**, as the server's user, at launch (it moves the kernel's
pid in right after starting it, before any user code runs), and removes it at release.
It needs a writable cgroup v2 directory to create it under:

- ``parent`` given (``c.GPULeaseProvisioner.cgroup_parent``): that path, from the v2
  hierarchy's root;
- otherwise the server's own cgroup (``/proc/self/cgroup``, line ``0::``) with
  ``gpu-lease`` under it. On a per-user hub the server's unit must be delegated to its
  user (systemd ``Delegate=yes``, e.g. SystemdSpawner's ``unit_extra_properties``), which
  makes that subtree the user's to write; a server running as root can always write.

The v2 hierarchy is found in ``/proc/self/mountinfo`` (``cgroup2``; at ``/sys/fs/cgroup``
on a unified host, ``/sys/fs/cgroup/unified`` on a hybrid one). Where there is none, or the
directory is not writable, :func:`create` returns None with the reason, and the kernel runs
without a cgroup of its own (so without a driver memory limit): nothing else changes.
Empty kernel cgroups left by a server that was killed are removed by the next
:func:`create` under the same parent (:func:`prune_stale`).
The node agent (root) then sets the driver's limit on the cgroup; see
:mod:`.driver_limits`.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal ``\\040``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def v2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Where the cgroup v2 hierarchy is mounted (None if it is not)."""
    try:
        with open(mountinfo) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    return _unescape(left.split()[4])
    except OSError:
        return None
    return None


def own_cgroup(path: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup v2 path (the ``0::`` line), e.g. ``/system.slice/x.service``."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip() or "/"
    except OSError:
        return None
    return None


def cgroup_of(pid: int, proc: str = "/proc") -> str | None:
    """``pid``'s cgroup v2 path (None if it is gone)."""
    return own_cgroup(f"{proc}/{pid}/cgroup")


@dataclass(frozen=True)
class KernelCgroup:
    """One kernel's cgroup: ``path`` from the v2 root (what the driver and the broker are
    told) and ``mount`` (where the v2 hierarchy is mounted)."""

    path: str
    mount: str

    @property
    def directory(self) -> str:
        return os.path.join(self.mount, self.path.lstrip("/"))

    def add(self, pid: int) -> None:
        """Move ``pid`` into this cgroup (raises OSError)."""
        with open(os.path.join(self.directory, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def remove(self) -> str | None:
        """Remove the cgroup; its processes must be gone. Returns why not, or None."""
        try:
            os.rmdir(self.directory)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return f"cgroup {self.path} still has processes; it stays until they exit"
            return f"cannot remove cgroup {self.path}: {exc.strerror}"
        return None


#: an empty kernel cgroup older than this (s) was left by a server that died: removed
STALE_AFTER = 60.0


def prune_stale(directory: str, now: float | None = None) -> list[str]:
    """Remove the empty ``kernel-*`` cgroups under ``directory`` older than
    :data:`STALE_AFTER` (left by a server killed before it could release); returns their
    names. A young empty one may be a kernel being moved in right now: it stays."""
    now = time.time() if now is None else now
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith("kernel-")]
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(os.path.join(path, "cgroup.events")) as f:
                populated = "populated 1" in f.read()
            if populated or now - os.stat(path).st_mtime < STALE_AFTER:
                continue
            os.rmdir(path)
        except OSError:
            continue
        removed.append(name)
    return removed


def create(
    name: str, parent: str = "", mountinfo: str = "/proc/self/mountinfo"
) -> tuple[KernelCgroup | None, str]:
    """Make the cgroup ``<parent>/<name>`` (see the module docstring for ``parent``).

    Returns the cgroup and ``""``, or None and the reason (a sentence that says what to do).
    """
    mount = v2_mount(mountinfo)
    if mount is None:
        return None, (
            "no cgroup v2 hierarchy is mounted on this node (no cgroup2 line in "
            "/proc/self/mountinfo): mount one to get driver memory limits per kernel"
        )
    if not parent:
        own = own_cgroup()
        if own is None:
            return None, "this process is in no cgroup v2 (/proc/self/cgroup has no 0:: line)"
        parent = own.rstrip("/") + "/gpu-lease"
    path = "/" + "/".join(p for p in (parent.strip("/"), _SAFE.sub("-", name)) if p)
    group = KernelCgroup(path, mount)
    prune_stale(os.path.dirname(group.directory))
    try:
        os.makedirs(group.directory, exist_ok=True)
    except OSError as exc:
        return None, (
            f"cannot create cgroup {path} under {mount} as uid {os.getuid()} "
            f"({exc.strerror}): delegate a cgroup subtree to the server's user (systemd "
            "Delegate=yes) or set c.GPULeaseProvisioner.cgroup_parent to a writable one"
        )
    return group, ""
