"""``python -m provisioner.devtools.fastexit MODULE [ARGS]``: run ``python -m MODULE ARGS``,
skipping the interpreter's teardown at exit.

The demo runs JupyterHub, the broker and every single-user server through it. Each
still stops as it always does (a server shuts its kernels down, which releases their
GPU leases; the broker closes its database; JupyterHub stops its proxy) and every
``atexit`` handler still runs; then, instead of letting Python tear down its modules and
collect its heap, this module ends the process with :func:`os._exit` and the same exit
status. That teardown was most of the time these processes took to stop: with
JupyterLab loaded, 1.5 to 3 s of CPU per server (0.04 s without it), which 60 servers
stopping at once on two cores turned into a minute. ``make demo`` sets
``GPU_LEASE_FAST_EXIT=1`` for ``hub_config/jupyterhub_config.py``; a production hub runs
the stock commands.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

_status = 0


def _skip_teardown() -> None:
    # registered before anything else, so it runs last of the atexit handlers
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_status)


def main() -> None:
    """Run ``sys.argv[1]`` as ``__main__`` with the remaining arguments."""
    global _status
    if len(sys.argv) < 2:
        sys.exit("usage: python -m provisioner.devtools.fastexit MODULE [ARGS]")
    atexit.register(_skip_teardown)
    module = sys.argv.pop(1)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        _status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException:
        _status = 1
        raise
    _exit_now()


def _exit_now() -> None:
    """The module is done: run the ``atexit`` handlers now (the last, ``_skip_teardown``,
    ends the process) instead of leaving them to the interpreter's exit.

    The interpreter runs them only after it has joined every non-daemon thread, and a
    single-user server can leave one that never ends: an idle AnyIO worker thread (its
    ``to_thread`` pool ends a worker only when the task that started it ends, and that
    task may never end once the event loop has stopped). The server had stopped (its
    kernels shut down, their leases released), yet the process then sat until JupyterHub
    killed it, 60 s later (seen in tests/test_browser_lab.py as "server took 60.5 seconds
    to stop", about one run in two).
    """
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()
    _skip_teardown()


if __name__ == "__main__":
    main()
