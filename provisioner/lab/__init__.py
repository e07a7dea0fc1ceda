"""The jupyter_server extension behind JupyterLab's GPU lease status (docs/developers.md, "In JupyterLab").

Enabled on ``pip install`` by ``jupyter-config/server-config/jupyter_gpu_lease.json``
(installed into ``etc/jupyter/jupyter_server_config.d``); the prebuilt JupyterLab
extension it serves lives in ``provisioner/labextension`` (built from ``src/`` by the
package build) and is installed into ``share/jupyter/labextensions/jupyter-gpu-lease``.

- ``board.py`` -- :class:`GPULeaseLab`: the server's GPU kernels as the browser sees them,
  read from the provisioners' board (:mod:`provisioner.kernel.status`) plus at most one
  aggregated ``GET /api/v1/queue`` per ``queue_refresh_interval`` while a kernel waits;
- ``handlers.py`` -- ``GET {base_url}gpu-lease/api/kernels`` and
  ``DELETE {base_url}gpu-lease/api/kernels/{kernel_id}/request``.
"""

from __future__ import annotations

from typing import Any


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where ``jupyter labextension`` finds the prebuilt extension in a development checkout."""
    return [{"src": "../labextension", "dest": "jupyter-gpu-lease"}]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """Called by jupyter_server when it finds ``provisioner.lab`` enabled in its config."""
    return [{"module": "provisioner.lab"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Register the handlers under the server's base URL. Called once at server start."""
    from .board import GPULeaseLab
    from .handlers import setup_handlers

    lab = GPULeaseLab(parent=serverapp, log=serverapp.log)
    setup_handlers(serverapp.web_app, lab)
    serverapp.log.info(
        "jupyter-gpu-lease: GPU lease status at %sgpu-lease/api/kernels", serverapp.base_url
    )
