"""The server extension's REST endpoints, under the Jupyter server's base URL.

==============================================================  ==============================
``GET    {base_url}gpu-lease/api/kernels``                       this server's GPU kernels
``DELETE {base_url}gpu-lease/api/kernels/{kernel_id}/request``   stop waiting for a GPU
``POST   {base_url}gpu-lease/api/kernels/{kernel_id}/session``   re-attach to a waiting kernel
``GET    {base_url}gpu-lease/api/kernelspecs/{name}``             why a kernel is not for you
``GET    {base_url}gpu-lease/api/kernelspecs/{name}/outlook``     what starting it would take
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

from .board import GPULeaseLab, StartFailed

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


class SessionHandler(_Base):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        """``{path, name, type}`` of the notebook -> 200 and its session once the waiting
        kernel has started; 202 ``{"state": "waiting"}`` after 30 s (ask again); 409 with
        the start's error when it did not start; 404 for no kernel of this server."""
        body = self.get_json_body() or {}
        where = {k: body.get(k) for k in ("path", "name", "type")}
        if not all(isinstance(v, str) and v for v in where.values()):
            raise web.HTTPError(
                400, 'Send {"path", "name", "type"} of the notebook\'s session, as strings.'
            )
        try:
            session = await self.lab.attach(kernel_id, where)  # type: ignore[arg-type]
        except KeyError:
            raise web.HTTPError(
                404, f"Kernel {kernel_id} is no kernel of this server: start a kernel anew."
            ) from None
        except StartFailed as exc:
            raise web.HTTPError(409, str(exc)) from None
        if session is None:
            self.set_status(202)
            self.finish(json.dumps({"state": "waiting"}))
            return
        self.finish(json.dumps(session, default=str))


class KernelspecHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self, name: str) -> None:
        """``{name, display_name, startable, message?}``; 404 if this server has no such
        kernelspec or does not filter kernels (no ``GPULeaseKernelSpecManager``)."""
        answer = await self.lab.kernelspec(name)
        if answer is None:
            raise web.HTTPError(404, f"No kernelspec {name!r} on this server.")
        self.finish(json.dumps(answer))


class OutlookHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self, name: str) -> None:
        """``{name, display_name, fraction, gpu_name, free_now, position, queue_length}``;
        404 if this server offers no GPU kernelspec of that name."""
        answer = await self.lab.outlook(name)
        if answer is None:
            raise web.HTTPError(404, f"No GPU kernelspec {name!r} on this server.")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(answer))


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
            (api + r"/([^/]+)/session/?", SessionHandler),
            (
                url_path_join(base, "gpu-lease", "api", "kernelspecs") + r"/([^/]+)/outlook/?",
                OutlookHandler,
            ),
            (
                url_path_join(base, "gpu-lease", "api", "kernelspecs") + r"/([^/]+)/?",
                KernelspecHandler,
            ),
        ],
    )


__all__ = [
    "KernelsHandler",
    "KernelspecHandler",
    "OutlookHandler",
    "RequestHandler",
    "SessionHandler",
    "setup_handlers",
]
