"""The kernel side of a GPU lease.

- ``env.py`` — pure: a broker lease -> the kernel's environment, and the kernelspec
  argv rewritten to start under the launcher.
- ``startup/`` — files that run *inside* the kernel process (the launcher, the
  framework cap appliers, the ``%gpu`` IPython extension). They never import this
  package, because the kernel's Python may be another environment.
- ``provisioner.py`` — ``GPULeaseProvisioner``, the jupyter_client provisioner that
  acquires, renews and releases the lease around the kernel's life.
"""
