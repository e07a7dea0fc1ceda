"""Who is calling: tokens -> verified identities.

The handlers (``handlers.py``) take the token from the ``Authorization`` header
(:func:`token_from_header`) and ask the app's :class:`Authenticator` for the
identity; ``app.py`` builds the authenticator from ``--auth``:

- :class:`HubTokens` (``--auth hub``): JupyterHub's API identifies the token's
  owner (``jupyterhub.services.auth.HubAuth``); admins are hub admins or holders of
  the ``custom:gpu-lease:admin`` scope; groups are the user's hub groups.
- :class:`StaticTokens` (``--auth static``): a JSON file
  ``{"TOKEN": {"user": "alice", "groups": ["ml101"], "admin": false}}``.

A token never appears in a log line, an error message or a ``repr``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

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


def parse_tokens(data: Any, source: str = "the tokens file") -> dict[bytes, Identity]:
    """Validate a tokens mapping and key it by the tokens' SHA-256 digests.

    Messages name the entry by its position and user, never by its token.
    """
    if not isinstance(data, Mapping):
        raise TokensFileError(
            f"{source} must hold a JSON object mapping each token to "
            '{"user": NAME, "groups": [...], "admin": false}.'
        )
    out: dict[bytes, Identity] = {}
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
        unknown = sorted(set(entry) - {"user", "groups", "admin"})
        if unknown:
            raise TokensFileError(
                f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; "
                "allowed are user, groups and admin."
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
        digest = _digest(token)
        if digest in out:
            raise TokensFileError(f"The token of {where} (user {user!r}) is listed twice.")
        out[digest] = Identity(user=user, groups=frozenset(groups), admin=admin)
    return out


class StaticTokens:
    """``--auth static``: identities from a JSON tokens file.

    The file is read at start (errors raise :class:`TokensFileError`) and again
    whenever its modification time changes, so tokens can be added without a
    restart; a broken edit is logged and the previous tokens stay in force.
    Lookups hash the presented token and look the digest up, so the time taken
    does not depend on how much of a token an attacker guessed.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mtime: float | None = None
        self._tokens = self._load()

    def __repr__(self) -> str:
        return f"StaticTokens({self.path!r}, {len(self._tokens)} token(s))"

    def _load(self) -> dict[bytes, Identity]:
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

    def lookup(self, token: str) -> Identity | None:
        """The token's identity, or None. Constant-time in what an attacker can learn:
        the dict is keyed by SHA-256 digests, so how far a comparison runs depends on
        the digest of the guess, which says nothing about any real token's bytes."""
        self._maybe_reload()
        return self._tokens.get(_digest(token))

    async def identify(self, token: str) -> Identity:
        ident = self.lookup(token)
        if ident is None:
            raise NotAuthenticated(f"The token is not valid for the GPU lease broker. {_HOW}")
        return ident


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
        cache_max_age: int = 60,
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
        return identity_from_hub_model(model)


__all__ = [
    "ADMIN_SCOPE",
    "AuthUnavailable",
    "Authenticator",
    "HubTokens",
    "StaticTokens",
    "TokensFileError",
    "identity_from_hub_model",
    "parse_tokens",
    "token_from_header",
]
