"""Our provisioner as jupyter_client's *default* provisioner, for the upstream suites.

jupyter_client makes the default provisioner (``JUPYTER_DEFAULT_PROVISIONER_NAME``) with
an empty ``config`` for every kernelspec that names none, so a kernel started by
jupyter_client's or jupyter_server's own tests asks for no fraction; a deployment's
kernelspec always gives one (``gpu-lease kernelspec install --fraction``). This is
:class:`~provisioner.kernel.provisioner.GPULeaseProvisioner` itself with only that
default given: 0.05 of a GPU, so that every kernel those suites start at once fits the
runner's pool. It is registered (entry point ``gpu-lease-upstream-default``) by the
``.dist-info`` beside it, found on ``PYTHONPATH`` only while ``run_upstream.py`` runs.
"""

from __future__ import annotations

from typing import Any

from provisioner.kernel.provisioner import GPULeaseProvisioner

#: the fraction of a GPU each kernel of the upstream suites leases
FRACTION = 0.05


class UpstreamDefaultProvisioner(GPULeaseProvisioner):
    """:class:`GPULeaseProvisioner` whose ``fraction`` defaults to :data:`FRACTION`."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("fraction", FRACTION)
        super().__init__(**kwargs)
