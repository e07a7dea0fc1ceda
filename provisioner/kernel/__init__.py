"""The kernel side of a GPU lease.

- ``provisioner.py`` — ``GPULeaseProvisioner``, the jupyter_client provisioner: its hooks
  say *when* the lease is taken, kept and given back; the modules below do the work.
- ``lease_keeper.py`` — the lease's state machine: acquire (waiting in the queue),
  renew, take an expired lease back, release.
- ``queue_wait.py`` — the acquire while it waits in the broker's queue; "Stop waiting".
- ``parked.py`` — a parked lease's way back: the kernel's resume request, the resume calls.
- ``loops.py`` — which event loop runs the renewals, and stopping a task on any loop.
- ``broker_clients.py`` — the broker clients, made again when the server's token rotates.
- ``state_file.py`` — the file the ``%gpu`` magic reads inside the kernel.
- ``death_watch.py`` — noticing a kernel that died for good (no ``cleanup`` comes then).
- ``refusals.py`` — a broker refusal as the sentence JupyterLab's start dialog shows.
- ``env.py`` — pure: a granted lease (the client's typed ``GrantedLease``) -> the kernel's environment, and the kernelspec
  argv rewritten to start under the launcher.
- ``server.py`` — jupyter_server's kernel manager, with refused kernel starts forgotten.
- ``specs.py`` — jupyter_server's kernelspec manager: only the GPU kernels the user may start.
- ``startup/`` — files that run *inside* the kernel process (the launcher, the
  framework cap appliers, the ``%gpu`` IPython extension). They never import this
  package, because the kernel's Python may be another environment.
"""
