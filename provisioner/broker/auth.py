"""Who is calling: tokens -> verified identities.

The handlers (``handlers.py``) take the token from the ``Authorization`` header
(:func:`token_from_header`) and ask the app's :class:`Authenticator` for the
identity; ``app.py`` builds the authenticator from ``--auth``:

- :class:`HubTokens` (``--auth hub``): JupyterHub's API identifies the token's
  owner (``jupyterhub.services.auth.HubAuth``); admins are hub admins or holders of
  the ``custom:gpu-lease:admin`` scope; groups are the user's hub groups.
- :class:`StaticTokens` (``--auth static``): a JSON file
  ``{"TOKEN": {"user": "alice", "groups": ["ml101"], "admin": false}}``; an entry
  may add ``"expires_at"`` (POSIX seconds or ISO 8601, no zone = UTC), after which
  the token is refused with 401.

A token never appears in a log line, an error message or a ``repr``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, NamedTuple, Protocol

from ..errors import GPULeaseError, NotAuthenticated
from ..model import Identity

log = logging.getLogger("gpu_lease.broker.auth")

#: the scope that makes a JupyterHub user a GPU lease admin
ADMIN_SCOPE = "custom:gpu-lease:admin"
MAX_TOKEN_CHARS = 4096

_HOW = (
    "Send your JupyterHub API token (or the token your administrator gave you) "
    "as 'Authorization: token <TOKEN>'."
)


class AuthUnavailable(GPULeaseError):
    """503: the identity provider (JupyterHub's API) could not be asked; retry later."""

    code = "auth_unavailable"
    status = 503


class TokensFileError(GPULeaseError):
    """The static tokens file is missing or malformed (a start-up error)."""

    code = "invalid_tokens_file"
    status = 500


class Authenticator(Protocol):
    """Turns a bearer token into a verified :class:`~provisioner.model.Identity`.

    Called by the handlers' base class once per authenticated request.
    """

    async def identify(self, token: str) -> Identity:
        """The token's owner; raises :class:`~provisioner.errors.NotAuthenticated`."""
        ...


def token_from_header(value: str | None) -> str | None:
    """``"token T"`` or ``"Bearer T"`` -> ``T``; ``None`` when there is no header.

    Raises ``NotAuthenticated`` for any other shape (the value itself is never echoed).
    """
    if value is None or not value.strip():
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() not in ("token", "bearer") or not token or " " in token:
        raise NotAuthenticated(f"The Authorization header is not understood. {_HOW}")
    if len(token) > MAX_TOKEN_CHARS:
        raise NotAuthenticated(f"The token is too long to be valid. {_HOW}")
    return token


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class StaticToken(NamedTuple):
    """One entry of a tokens file: who the token is, and until when (None: no expiry)."""

    identity: Identity
    expires_at: float | None = None


def parse_expiry(value: Any, where: str) -> float | None:
    """``expires_at`` of a tokens-file entry -> POSIX seconds (None: the token never expires).

    Accepts POSIX seconds (a JSON number) or an ISO 8601 date or time such as
    ``"2025-01-31"`` or ``"2025-01-31T18:00:00Z"`` (without a zone: UTC).
    """
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise TokensFileError(f"'expires_at' of {where} must be a finite POSIX time.")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        iso = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
        try:
            when = datetime.fromisoformat(iso)
        except ValueError:
            pass
        else:
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            return when.timestamp()
    raise TokensFileError(
        f"'expires_at' of {where} must be POSIX seconds or an ISO 8601 time such as "
        '"2025-01-31T18:00:00Z".'
    )


def parse_tokens(data: Any, source: str = "the tokens file") -> dict[bytes, StaticToken]:
    """Validate a tokens mapping and key it by the tokens' SHA-256 digests.

    Messages name the entry by its position and user, never by its token.
    """
    if not isinstance(data, Mapping):
        raise TokensFileError(
            f"{source} must hold a JSON object mapping each token to "
            '{"user": NAME, "groups": [...], "admin": false}.'
        )
    out: dict[bytes, StaticToken] = {}
    for n, (token, entry) in enumerate(data.items(), start=1):
        where = f"entry {n} of {source}"
        if not isinstance(token, str) or len(token) < 8 or any(c.isspace() for c in token):
            raise TokensFileError(
                f"The token of {where} must be a string of at least 8 characters without "
                "spaces; generate one with `openssl rand -hex 32`."
            )
        if not isinstance(entry, Mapping):
            raise TokensFileError(
                f"{where} must map the token to an object such as "
                '{"user": "alice", "groups": ["ml101"], "admin": false}.'
            )
        unknown = sorted(set(entry) - {"user", "groups", "admin", "expires_at"})
        if unknown:
            raise TokensFileError(
                f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; "
                "allowed are user, groups, admin and expires_at."
            )
        user = entry.get("user")
        if not isinstance(user, str) or not user.strip():
            raise TokensFileError(f"{where} needs a non-empty string 'user'.")
        groups = entry.get("groups", [])
        if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
            raise TokensFileError(
                f"'groups' of {where} (user {user!r}) must be a list of group names."
            )
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise TokensFileError(f"'admin' of {where} (user {user!r}) must be true or false.")
        expires_at = parse_expiry(entry.get("expires_at"), f"{where} (user {user!r})")
        digest = _digest(token)
        if digest in out:
            raise TokensFileError(f"The token of {where} (user {user!r}) is listed twice.")
        out[digest] = StaticToken(
            Identity(user=user, groups=frozenset(groups), admin=admin), expires_at
        )
    return out


class StaticTokens:
    """``--auth static``: identities from a JSON tokens file.

    The file is read at start (errors raise :class:`TokensFileError`) and again
    whenever its modification time changes, so tokens can be added without a
    restart; a broken edit is logged and the previous tokens stay in force.
    Lookups hash the presented token and look the digest up, so the time taken
    does not depend on how much of a token an attacker guessed. An entry's optional
    ``expires_at`` is checked against ``clock()`` on every request.
    """

    def __init__(self, path: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self._mtime: float | None = None
        self._tokens = self._load()

    def __repr__(self) -> str:
        return f"StaticTokens({self.path!r}, {len(self._tokens)} token(s))"

    def _load(self) -> dict[bytes, StaticToken]:
        try:
            mtime = os.stat(self.path).st_mtime
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError as exc:
            raise TokensFileError(
                f"The tokens file {self.path!r} does not exist; create it or give another "
                "path with --tokens-file."
            ) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise TokensFileError(f"Cannot read the tokens file {self.path!r}: {exc}.") from exc
        except ValueError as exc:
            # json's message quotes a position, never the document's text
            raise TokensFileError(
                f"The tokens file {self.path!r} is not valid JSON ({type(exc).__name__} at "
                f"line {getattr(exc, 'lineno', '?')}); fix it and restart the broker."
            ) from exc
        tokens = parse_tokens(data, f"the tokens file {self.path!r}")
        self._mtime = mtime
        return tokens

    def _maybe_reload(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        try:
            self._tokens = self._load()
            log.info("Reloaded %d token(s) from %s", len(self._tokens), self.path)
        except TokensFileError as exc:
            self._mtime = mtime
            log.error("Keeping the previous tokens: %s", exc.message)

    def _entry(self, token: str) -> StaticToken | None:
        self._maybe_reload()
        return self._tokens.get(_digest(token))

    def lookup(self, token: str) -> Identity | None:
        """The token's identity, or None (unknown or expired). Constant-time in what an
        attacker can learn: the dict is keyed by SHA-256 digests, so how far a comparison
        runs depends on the digest of the guess, which says nothing about any real token's
        bytes."""
        entry = self._entry(token)
        if entry is None or _expired(entry, self.clock()):
            return None
        return entry.identity

    async def identify(self, token: str) -> Identity:
        entry = self._entry(token)
        if entry is None:
            raise NotAuthenticated(f"The token is not valid for the GPU lease broker. {_HOW}")
        if _expired(entry, self.clock()):
            when = datetime.fromtimestamp(entry.expires_at or 0.0, timezone.utc)
            raise NotAuthenticated(
                f"This token expired at {when:%Y-%m-%d %H:%M:%S} UTC; ask your administrator "
                "for a new one (or for a later expires_at in the tokens file)."
            )
        return entry.identity


def _expired(entry: StaticToken, now: float) -> bool:
    return entry.expires_at is not None and now >= entry.expires_at


def identity_from_hub_model(model: Mapping[str, Any]) -> Identity:
    """A JupyterHub ``/hub/api/user`` model -> Identity (admin by flag or by scope)."""
    name = model.get("name")
    if not isinstance(name, str) or not name:
        raise NotAuthenticated(f"JupyterHub identified no user for this token. {_HOW}")
    scopes = model.get("scopes") or []
    groups = model.get("groups") or []
    admin = bool(model.get("admin")) or ADMIN_SCOPE in scopes
    return Identity(
        user=name, groups=frozenset(g for g in groups if isinstance(g, str)), admin=admin
    )


class HubTokens:
    """``--auth hub``: ask JupyterHub who owns the token (cached ``cache_max_age`` s).

    ``api_url`` and ``api_token`` default to ``JUPYTERHUB_API_URL`` and
    ``JUPYTERHUB_API_TOKEN``, which the hub sets for a managed service. The
    service's own token needs no special scope to identify tokens; each user's
    token needs ``access:services!service=gpu-lease`` and, for course kernels,
    ``read:users:groups`` on itself so the model lists the user's groups.
    """

    def __init__(
        self,
        api_url: str | None = None,
        api_token: str | None = None,
        cache_max_age: int = 300,
        hub_auth: Any = None,
    ) -> None:
        if hub_auth is None:
            from jupyterhub.services.auth import HubAuth

            api_token = api_token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
            if not api_token:
                raise TokensFileError(
                    "--auth hub needs the JUPYTERHUB_API_TOKEN environment variable "
                    "(JupyterHub sets it for a managed service); run the broker as a "
                    "JupyterHub service or use --auth static --tokens-file FILE."
                )
            kwargs: dict[str, Any] = {"api_token": api_token, "cache_max_age": cache_max_age}
            url = api_url or os.environ.get("JUPYTERHUB_API_URL")
            if url:
                kwargs["api_url"] = url
            hub_auth = HubAuth(**kwargs)
        self.hub_auth = hub_auth

    def __repr__(self) -> str:
        return f"HubTokens({getattr(self.hub_auth, 'api_url', '?')!r})"

    @property
    def browser_login(self) -> bool:
        """Whether browsers can log in with hub OAuth (``hub_auth`` is a ``HubOAuth``)."""
        from jupyterhub.services.auth import HubOAuth

        return isinstance(self.hub_auth, HubOAuth)

    async def identify_browser(self, handler: Any) -> Identity | None:
        """The user of a browser request without ``Authorization``, from the hub OAuth cookie.

        Called by the handlers' base class when ``--auth hub`` and the request has no
        token header. JupyterHub's ``HubOAuth.get_user`` accepts the cookie only if the
        request passes its XSRF check (a page view, or ``X-XSRFToken`` from the
        dashboard page); otherwise, or without a cookie, this returns None. A user
        without the service's access scope raises ``Forbidden``.
        """
        from tornado.web import HTTPError

        from ..errors import Forbidden

        if not self.browser_login:
            return None
        try:
            model = await self.hub_auth.get_user(handler, sync=False)
        except HTTPError as exc:
            raise AuthUnavailable(
                f"JupyterHub could not be asked who is logged in (HTTP {exc.status_code}); "
                "reload the page in a moment."
            ) from exc
        except OSError as exc:
            raise AuthUnavailable(
                "JupyterHub's API cannot be reached to check your login; reload the page in "
                "a moment, and if this persists check that the hub is running."
            ) from exc
        if not model:
            return None
        needed = self.hub_auth.access_scopes
        if needed and not self.hub_auth.check_scopes(needed, model):
            raise Forbidden(
                f"JupyterHub user {model.get('name')!r} may not use the GPU lease service: "
                f"ask the hub admin for the scope {sorted(needed)[0]}."
            )
        return identity_from_hub_model(model)

    async def identify(self, token: str) -> Identity:
        from tornado.web import HTTPError

        try:
            model = await self.hub_auth.user_for_token(token, use_cache=True, sync=False)
        except HTTPError as exc:
            raise AuthUnavailable(
                "JupyterHub could not be asked who owns this token "
                f"(HTTP {exc.status_code}); retry in a moment, and if this persists "
                "check that the hub is running.",
            ) from exc
        except OSError as exc:
            raise AuthUnavailable(
                "JupyterHub's API cannot be reached to verify the token; retry in a moment, "
                "and if this persists check that the hub is running."
            ) from exc
        if not model:
            raise NotAuthenticated(f"JupyterHub does not know this token. {_HOW}")
        # a token the hub scoped away from this service (e.g. one made for another
        # service) must not act here, even though /hub/api/user answers for any token
        needed = getattr(self.hub_auth, "access_scopes", None)
        if needed and not self.hub_auth.check_scopes(needed, model):
            from ..errors import Forbidden

            raise Forbidden(
                f"This token of JupyterHub user {model.get('name')!r} does not grant access "
                f"to the GPU lease service: it needs the scope {max(needed, key=len)} (ask the "
                "hub admin to add it to c.Spawner.server_token_scopes or the user's role)."
            )
        return identity_from_hub_model(model)


def make_hub_oauth(
    base_url: str,
    *,
    cache_max_age: int = 300,
    api_url: str | None = None,
    api_token: str | None = None,
    service_name: str | None = None,
    **kwargs: Any,
) -> Any:
    """A ``jupyterhub.services.auth.HubOAuth`` for the dashboard's browser login, or None.

    Called by ``app.py`` for ``--auth hub``. It needs what JupyterHub gives a managed
    service that has a URL: ``JUPYTERHUB_API_TOKEN`` and ``JUPYTERHUB_CLIENT_ID`` (and
    ``JUPYTERHUB_OAUTH_CALLBACK_URL``, else ``{base_url}oauth_callback``). Without a
    client id there is no browser login (None) and the API still takes tokens.
    ``kwargs`` go to ``HubOAuth`` (e.g. ``oauth_client_id``, ``hub_host``).
    """
    from jupyterhub.services.auth import HubOAuth

    api_token = api_token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
    client_id = kwargs.pop("oauth_client_id", None) or os.environ.get("JUPYTERHUB_CLIENT_ID", "")
    if not api_token or not client_id:
        return None
    options: dict[str, Any] = {
        "api_token": api_token,
        "oauth_client_id": client_id,
        "cache_max_age": cache_max_age,
        "base_url": base_url,
        **kwargs,
    }
    url = api_url or os.environ.get("JUPYTERHUB_API_URL")
    if url:
        options["api_url"] = url
    oauth = HubOAuth(**options)
    if not oauth.access_scopes:
        name = service_name or os.environ.get("JUPYTERHUB_SERVICE_NAME") or "gpu-lease"
        oauth.access_scopes = {f"access:services!service={name}"}
    return oauth


__all__ = [
    "ADMIN_SCOPE",
    "AuthUnavailable",
    "Authenticator",
    "HubTokens",
    "StaticToken",
    "StaticTokens",
    "TokensFileError",
    "identity_from_hub_model",
    "make_hub_oauth",
    "parse_expiry",
    "parse_tokens",
    "token_from_header",
]
