"""The secret a lease's kernel carries, which proves the kernel to the node agent: a
renewal's pid is only a claim until the root agent finds this secret in the process.

The provisioner makes one random secret per lease (``secrets.token_urlsafe(32)``), starts
the kernel with it in ``GPU_LEASE_KERNEL_SECRET`` (its children inherit it; each restart of
the kernel gets the same one), and its renewals report only the secret's sha256
(``proof``). The root agent finds the secret in ``/proc/<pid>/environ`` and compares. The
secret stays in the server's memory: it is never logged, nor written to kernel.json, the
state file or the saved provisioner info (which keeps the proof, so a restored server
renews with it).

Who calls this: the lease keeper (:mod:`.lease_keeper`) for each renewal, and the
provisioner's ``pre_launch`` and ``load_provisioner_info``.
"""

from __future__ import annotations

import secrets

from ..wire import kernel_proof


class KernelSecret:
    """One kernel's secret and proof, per lease id."""

    def __init__(self) -> None:
        self._secret: tuple[str, str] | None = None
        self._proof: tuple[str, str] | None = None
        #: the broker refused ``proof`` (older than kernel proofs): renewals leave it out
        self.broker_without_proofs = False

    def for_lease(self, lease_id: str) -> str:
        """The secret of ``lease_id``'s kernel, made on first use and kept for its life.
        Called by the provisioner's ``pre_launch`` (each start and restart)."""
        if self._secret is None or self._secret[0] != lease_id:
            self._secret = (lease_id, secrets.token_urlsafe(32))
            self._proof = (lease_id, kernel_proof(self._secret[1]))
        return self._secret[1]

    def proof(self, lease_id: str) -> str | None:
        """The ``proof`` of ``lease_id``'s kernel (None: no secret made for it)."""
        return self._proof[1] if self._proof is not None and self._proof[0] == lease_id else None

    def renewal_proof(self, lease_id: str) -> str | None:
        """What a renewal sends: the proof, unless the broker is older than proofs."""
        return None if self.broker_without_proofs else self.proof(lease_id)

    def restore(self, lease_id: str, proof: str | None) -> None:
        """A restored server's saved proof (the kernel keeps its secret; this server never
        had it). Called by ``load_provisioner_info``."""
        if proof:
            self._proof = (lease_id, proof)
