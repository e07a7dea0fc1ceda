"""Browser login to the dashboard with JupyterHub OAuth (``--auth hub`` as a hub service).

Imported only by :class:`~provisioner.broker.web.auth.HubTokens` when the hub gave the
service an OAuth client, so a broker with static tokens never imports jupyterhub
(about a second of start-up). Two pieces, which ``routes.make_app`` asks the
authenticator for:

- :func:`with_hub_login` — a handler class with JupyterHub's ``HubOAuthenticated``
  mixed in: the hub's login URL (with the OAuth state cookie), its XSRF token, and its
  check of that token before the login cookie is accepted. The mixin comes first in
  the method order; of our methods it would hide only ``get_current_user``, which is
  restored (the broker's identity comes from ``@api``, never from the hub's blocking
  lookup).
- :func:`oauth_callback_route` — ``{base_url}oauth_callback``, where the hub sends
  the browser back with the OAuth code.
"""

from __future__ import annotations

import re
from typing import Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from tornado import web

from ...wire import NO_FRAMES


def with_hub_login(handler: type[web.RequestHandler], hub_auth: Any) -> type[web.RequestHandler]:
    """``handler`` (same name, same behaviour) that also speaks JupyterHub's OAuth login.

    ``hub_auth`` is the broker's ``HubOAuth``. Called once per route by
    ``routes.make_app`` through ``HubTokens.wrap_handler``.
    """
    return type(
        handler.__name__,
        (HubOAuthenticated, handler),
        {
            "__module__": handler.__module__,
            "__doc__": handler.__doc__,
            "_hub_auth": hub_auth,  # HubOAuthenticated.hub_auth reads it
            "get_current_user": handler.get_current_user,
        },
    )


def oauth_callback_route(base_url: str, hub_auth: Any) -> tuple[str, type[web.RequestHandler]]:
    """``({base_url}oauth_callback/?, handler)``: JupyterHub's OAuth callback for ``hub_auth``."""
    callback = type(
        "OAuthCallbackHandler",
        (HubOAuthCallbackHandler,),
        {
            "__module__": __name__,
            "__doc__": "``GET {p}oauth_callback``: JupyterHub's OAuth callback.",
            "_hub_auth": hub_auth,
            "set_default_headers": _no_frames,
        },
    )
    return re.escape(base_url) + r"oauth_callback/?", callback


def _no_frames(handler: web.RequestHandler) -> None:
    """The callback's pages (its errors) may not be framed either (``wire.NO_FRAMES``)."""
    for name, value in NO_FRAMES.items():
        handler.set_header(name, value)


__all__ = ["oauth_callback_route", "with_hub_login"]
