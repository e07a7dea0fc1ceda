"""The kernel's own cgroup (v2) across its launches, for the provisioner.

Made at the kernel's first launch and reused by a restart; the kernel's pid is moved in
right after each launch, before any user code runs, and the cgroup is removed once the
lease has ended (release, death). Where none can be made, the kernel runs on without one,
so without a driver memory limit: said once, and not tried again for this kernel. The
cgroup itself is :mod:`provisioner.node.cgroups`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from ..node import cgroups


class CgroupKeeper:
    """One kernel's cgroup: ``enter`` after each launch, ``drop`` when the lease ended."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.log = log
        #: the cgroup (None: not made yet, or none could be made)
        self.cgroup: cgroups.KernelCgroup | None = None
        self._gave_up = False

    @property
    def path(self) -> str | None:
        """The cgroup's path from the v2 root (what the broker is told), or None."""
        return self.cgroup.path if self.cgroup is not None else None

    def enter(self, kernel_id: object, pid: int | None, parent: str) -> None:
        """Move the kernel just launched (``pid``) into its cgroup under ``parent``
        (``c.GPULeaseProvisioner.cgroup_parent``; ``off``: none)."""
        if self._gave_up or parent.strip().lower() == "off" or not pid:
            return
        if self.cgroup is None:
            self.cgroup, why = cgroups.create(f"kernel-{kernel_id}", parent)
            if self.cgroup is None:
                self.log.warning(
                    "Kernel %s runs without a cgroup of its own, so without a driver memory "
                    "limit: %s.",
                    kernel_id,
                    why,
                )
                self._gave_up = True  # said once; the framework caps still hold
                return
        try:
            self.cgroup.add(pid)
        except OSError as exc:
            self.log.warning(
                "Could not move kernel %s (pid %s) into cgroup %s (%s); it gets no driver "
                "memory limit.",
                kernel_id,
                pid,
                self.cgroup.path,
                exc.strerror,
            )
            self.drop(kernel_id)

    def drop(self, kernel_id: object) -> None:
        """Remove the kernel's cgroup once its processes are gone (release, death)."""
        if self.cgroup is not None:
            why = self.cgroup.remove()
            if why is None:
                self.cgroup = None
            else:
                self.log.info("Kernel %s: %s.", kernel_id, why)


__all__ = ["CgroupKeeper"]
