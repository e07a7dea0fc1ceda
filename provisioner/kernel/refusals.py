"""A broker's refusal, shown to the student in JupyterLab's "Error Starting Kernel".

``GPULeaseProvisioner.pre_launch`` raises our errors (``NoCapacity``, ``QuotaExceeded``,
``BrokerUnavailable``, ...) through :func:`for_jupyter_server`. jupyter_server's REST
API (``POST /api/kernels``, ``/api/sessions``) answers any exception that is not a
tornado ``HTTPError`` with "Unhandled error", so without this the student would never
read the broker's sentence; and the sentence must fit the dialog. Only this module knows
about tornado.
"""

from __future__ import annotations

import asyncio
import os
import re
import textwrap
import time
from typing import Any, cast

from ..errors import GPULeaseError, InvalidRequest
from ..wire import lease_digest, mps_covered_file, pipe_directory

_SERVER_ERRORS: dict[type, type] = {}


def for_jupyter_server(exc: GPULeaseError) -> GPULeaseError:
    """``exc`` as an instance of its own class *and* of tornado's ``HTTPError``.

    Called by ``pre_launch`` when the broker refuses or cannot be reached. Its status is
    ours (403 quota/course, 422 never fits, 503 broker down, ...) and every text
    jupyter_server may show is :func:`for_dialog`'s: ``POST /api/kernels`` answers with
    ``log_message``, while ``POST /api/sessions`` (what JupyterLab calls) re-raises any
    error as ``HTTPError(500, str(exc))``, so ``str()`` is that text too. ``log_message``
    is a plain property here: tornado's (6.5+) doubles every ``%`` of a message without
    arguments, for a log format the message never goes through. Callers that catch our
    errors (``except NoCapacity``) still do.
    """
    from tornado.web import HTTPError

    cls = type(exc)
    mixed = _SERVER_ERRORS.get(cls)
    if mixed is None:
        mixed = type(
            cls.__name__,
            (cls, HTTPError),
            {
                "__module__": cls.__module__,
                "__str__": lambda self: self.shown,
                "log_message": property(lambda self: self.shown),
                "get_message": lambda self: self.shown,
            },
        )
        _SERVER_ERRORS[cls] = mixed
    out: Any = Exception.__new__(mixed)
    out.__dict__.update(exc.__dict__)
    out.args = ()  # tornado formats log_message % args when it logs the error
    out.status_code = exc.status if 400 <= exc.status < 600 else 500
    out.shown = for_dialog(exc.message)
    out.reason = None
    return cast(GPULeaseError, out)


#: characters per line: JupyterLab's dialog is 1000 px wide from a 1040 px window up, its
#: ``<pre>`` 952 px, ~7.8 px per character of the 13 px code font: 122 fit, 100 leave room
WIDTH = 100


def for_dialog(message: str, width: int = WIDTH) -> str:
    """The message as JupyterLab's "Error Starting Kernel" shows it whole.

    That dialog puts the text in an unwrapped ``<pre>``, which cut the broker's advice off
    after ~120 characters: one sentence per line, long ones wrapped at ``width``. A
    ``%`` is spelled out ("100 percent"; any other becomes the full-width sign): on the
    ``/api/sessions`` path tornado doubles it ("100%%") and we cannot stop that.
    """
    text = re.sub(r"(?<=\d)%", " percent", message.strip()).replace("%", "\uff05")
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)
    return "\n".join(
        textwrap.fill(s, width, break_long_words=False, break_on_hyphens=False) for s in sentences
    )


def no_fraction(spec_name: str) -> InvalidRequest:
    """The refusal of a GPU kernelspec that sets no fraction (before asking the broker)."""
    return InvalidRequest(
        f"The kernelspec {spec_name!r} sets no GPU fraction: add "
        '"config": {"fraction": 0.02} under metadata.kernel_provisioner in its '
        "kernel.json (or reinstall it with `gpu-lease kernelspec install --fraction`)."
    )


def check_mps_daemon(mps_dir: str, gpu_uuid: str) -> None:
    """Refuse (as :func:`for_jupyter_server`) to start an ``enforcement=mps`` kernel whose
    GPU has no MPS control daemon under ``mps_dir`` on this node.

    Seen on an H200: a CUDA process whose ``CUDA_MPS_PIPE_DIRECTORY`` holds no daemon's
    ``control`` pipe runs *without* MPS, silently, and so without its memory limit.
    """
    pipe = pipe_directory(mps_dir, gpu_uuid)
    if os.path.exists(os.path.join(pipe, "control")):
        return
    raise for_jupyter_server(
        InvalidRequest(
            f"This kernel's GPU memory limit is enforced by MPS, but no MPS control daemon "
            f"runs for GPU {gpu_uuid} on this node ({pipe} has no 'control' pipe): "
            "the kernel would run without its limit, so it was not started. Ask your "
            "administrator to run `gpu-lease agent --mps` on this node, with the same "
            "MPS directory as the provisioner's mps_dir."
        )
    )


def _read(path: str) -> str:
    """A small local file's text (read from the event loop: it is a few lines in tmpfs)."""
    with open(path) as f:
        return f.read()


async def wait_for_mps_limit(
    mps_dir: str, gpu_uuid: str, lease_id: str, timeout: float, poll: float = 0.1
) -> bool | None:
    """Wait until the node agent says the MPS limits in force on ``gpu_uuid`` cover
    ``lease_id`` (its :func:`~provisioner.wire.mps_covered_file` lists the lease's digest):
    an MPS client keeps the limit of its first CUDA call for its life, so a kernel started
    before the agent has learnt of its lease would be held to the GPU's tighter one.
    True when covered, False after ``timeout`` s, None when the agent writes no such file
    (an agent older than daemon-side MPS limits: nothing to wait for)."""
    path = mps_covered_file(mps_dir, gpu_uuid)
    digest = lease_digest(lease_id)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if digest in _read(path).split():
                return True
        except FileNotFoundError:
            return None
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll)


__all__ = [
    "check_mps_daemon",
    "wait_for_mps_limit",
    "for_dialog",
    "for_jupyter_server",
    "no_fraction",
]
