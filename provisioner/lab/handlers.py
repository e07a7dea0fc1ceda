"""The server extension's REST endpoints, under the Jupyter server's base URL.

==============================================================  ==============================
``GET    {base_url}gpu-lease/api/kernels``                       this server's GPU kernels
``DELETE {base_url}gpu-lease/api/kernels/{kernel_id}/request``   stop waiting for a GPU
==============================================================  ==============================

Both are jupyter_server ``APIHandler``s: the caller is authenticated as this server's
user (behind JupyterHub: the hub's OAuth cookie, or a token with access to this server)
and authorized for the ``kernels`` resource (read, resp. write), as jupyter_server's own
kernel endpoints are. The broker is asked with the server's own token; nothing of it
reaches the browser.
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .board import GPULeaseLab

AUTH_RESOURCE = "kernels"


class _Base(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def lab(self) -> GPULeaseLab:
        lab: GPULeaseLab = self.settings["gpu_lease_lab"]
        return lab


class KernelsHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        """``{"kernels": [{kernel_id, state, fraction, lease?, position?, waiting?, ...}]}``."""
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps({"kernels": await self.lab.kernels()}))


class RequestHandler(_Base):
    @web.authenticated
    @authorized
    async def delete(self, kernel_id: str) -> None:
        """Cancel the kernel's waiting GPU request: 204, or 404 if it is not waiting."""
        if not await self.lab.stop_waiting(kernel_id):
            raise web.HTTPError(
                404,
                f"Kernel {kernel_id} is not waiting for a GPU (it holds one, ended, or never "
                "asked).",
            )
        self.set_status(204)
        self.finish()


def setup_handlers(web_app: Any, lab: GPULeaseLab) -> None:
    """Called by ``_load_jupyter_server_extension`` when the server starts."""
    base = web_app.settings["base_url"]
    web_app.settings["gpu_lease_lab"] = lab
    api = url_path_join(base, "gpu-lease", "api", "kernels")
    web_app.add_handlers(
        ".*$",
        [
            (api + "/?", KernelsHandler),
            (api + r"/([^/]+)/request/?", RequestHandler),
        ],
    )


__all__ = ["KernelsHandler", "RequestHandler", "setup_handlers"]
