"""Who is calling: tokens -> verified identities.

The handlers (``handlers.py``) take the token from the ``Authorization`` header
(:func:`token_from_header`) and ask the app's :class:`Authenticator` for the
identity. Authenticators are traitlets ``Configurable`` classes; the broker builds
the one its ``authenticator_class`` names (``--auth hub|static`` are short names of
the two built in here, :data:`AUTHENTICATORS`) with :meth:`Authenticator.for_broker`:

- :class:`HubTokens` (``--auth hub``): JupyterHub's API identifies the token's
  owner (``jupyterhub.services.auth.HubAuth``); admins are hub admins or holders of
  the ``custom:gpu-lease:admin`` scope; holders of ``read:metrics`` may read
  ``/metrics``; groups are the user's hub groups. As a hub
  service with an OAuth client it also logs browsers in to the dashboard.
- :class:`StaticTokens` (``--auth static``): a JSON file
  ``{"TOKEN": {"user": "alice", "groups": ["ml101"], "admin": false}}``; an entry
  may add ``"expires_at"`` (POSIX seconds or ISO 8601, no zone = UTC), after which
  the token is refused with 401, and ``"metrics": true`` (a scraper's token: it may
  read ``/metrics``, as an admin's may). A node agent's entry is ``{"agent": true, "node":
  "gpu-a"}``: that token may call only the node routes, and only for its node.

jupyterhub is imported only by :class:`HubTokens` (and ``hub_login.py``), so a
broker with static tokens starts without it. A token never appears in a log line,
an error message or a ``repr``.
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
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple
from urllib.parse import quote

from traitlets.config import LoggingConfigurable

from ...errors import AuthUnavailable, NotAuthenticated, TokensFileError
from ...model import Identity

log = logging.getLogger("gpu_lease.broker.auth")

#: the scope that makes a JupyterHub user a GPU lease admin
ADMIN_SCOPE = "custom:gpu-lease:admin"
#: JupyterHub's own scope for reading metrics: its holder may read the broker's /metrics
METRICS_SCOPE = "read:metrics"
MAX_TOKEN_CHARS = 4096
#: seconds a token's JupyterHub identity is cached (as JupyterHub's own HubAuth)
HUB_CACHE_MAX_AGE = 300

if TYPE_CHECKING:
    from tornado.web import RequestHandler

_HOW = (
    "Send your JupyterHub API token (or the token your administrator gave you) "
    "as 'Authorization: token <TOKEN>'."
)


class Authenticator(LoggingConfigurable):
    """Turns a bearer token into a verified :class:`~provisioner.model.Identity`.

    Subclass it and name the subclass in ``c.GPULeaseBroker.authenticator_class`` to
    identify callers another way; its own traits are configured as ``c.<ClassName>.*``.
    """

    #: the ``--auth`` value that selects this class (built-in authenticators only)
    auth_name: ClassVar[str] = ""

    @classmethod
    def for_broker(
        cls,
        *,
        parent: Any = None,
        tokens_file: str = "",
        cache_max_age: int = HUB_CACHE_MAX_AGE,
        base_url: str = "/",
    ) -> Authenticator:
        """The authenticator the broker uses, built from its settings.

        Called once by ``GPULeaseBroker.make_authenticator()`` at start, with the
        broker's ``tokens_file``, ``hub_cache_max_age`` and ``base_url``; each class
        takes what it needs. Raises :class:`~provisioner.errors.GPULeaseError` (the
        broker exits 2 with its message) when a setting is missing or wrong.
        """
        return cls(parent=parent)

    @property
    def browser_login(self) -> bool:
        """Whether browsers log in (to the dashboard) without a token. Default: False."""
        return False

    async def identify(self, token: str) -> Identity:
        """The token's owner; raises :class:`~provisioner.errors.NotAuthenticated`.

        Called by the handlers' base class once per authenticated request.
        """
        raise NotImplementedError

    async def identify_browser(self, handler: RequestHandler) -> Identity | None:
        """The logged-in user of a browser request without a token, or None.

        Called by the handlers' base class only when :attr:`browser_login` is true.
        """
        return None

    def wrap_handler(self, handler: type[RequestHandler]) -> type[RequestHandler]:
        """The handler class to serve ``handler``'s route (with browser login: one that
        also reads the login cookie). Called by ``routes.make_app`` for each route."""
        return handler

    def login_routes(self, base_url: str) -> list[tuple[str, type[RequestHandler]]]:
        """Extra URL patterns browser login needs (e.g. an OAuth callback); called by
        ``routes.make_app``."""
        return []

    async def groups_of(self, user: str) -> tuple[frozenset[str], str]:
        """The groups ``user`` acquires with, and where they come from (for a sentence).

        Called for an admin's ``GET /api/v1/quotas/users/{name}?effective=1``: the
        effective quota of someone else depends on their groups, which the broker
        otherwise learns only from that user's own token. An authenticator that
        cannot tell says so in the source (no groups).
        """
        return frozenset(), f"{type(self).__name__} cannot list a user's groups"


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


#: the keys of a person's (or a scraper's) entry in the tokens file
_KEYS = ("user", "groups", "admin", "metrics", "expires_at")


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
        unknown = sorted(set(entry) - {*_KEYS, "agent", "node"})
        if unknown:
            raise TokensFileError(
                f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; "
                "allowed are user, groups, admin, metrics, expires_at, agent and node."
            )
        if entry.get("agent", False) is not False or "node" in entry:
            out_agent = _agent_entry(entry, where)
            digest = _digest(token)
            if digest in out:
                raise TokensFileError(f"The token of {where} is listed twice.")
            out[digest] = StaticToken(out_agent, parse_expiry(entry.get("expires_at"), where))
            continue
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
        metrics = entry.get("metrics", False)
        if not isinstance(metrics, bool):
            raise TokensFileError(f"'metrics' of {where} (user {user!r}) must be true or false.")
        expires_at = parse_expiry(entry.get("expires_at"), f"{where} (user {user!r})")
        digest = _digest(token)
        if digest in out:
            raise TokensFileError(f"The token of {where} (user {user!r}) is listed twice.")
        out[digest] = StaticToken(
            Identity(user=user, groups=frozenset(groups), admin=admin, metrics=metrics),
            expires_at,
        )
    return out


def _agent_entry(entry: Mapping[str, Any], where: str) -> Identity:
    """``{"agent": true, "node": "gpu-a"}``: a node agent's token (node routes of that node only)."""
    node = entry.get("node")
    if entry.get("agent") is not True or not isinstance(node, str) or not node.strip():
        raise TokensFileError(
            f'{where} is a node agent\'s token: write {{"agent": true, "node": "NODE"}} '
            "with the node's name (as the agent's --node gives it)."
        )
    if entry.get("admin") or entry.get("groups"):
        raise TokensFileError(
            f"{where} is a node agent's token; it cannot also be an admin or in groups."
        )
    user = entry.get("user", f"agent:{node}")
    if not isinstance(user, str) or not user.strip():
        raise TokensFileError(f"{where} needs a non-empty string 'user' (or none).")
    return Identity(user=user, node=node)


class StaticTokens(Authenticator):
    """``--auth static``: identities from a JSON tokens file.

    The file is read at start (errors raise :class:`TokensFileError`) and again
    whenever its modification time changes, so tokens can be added without a
    restart; a broken edit is logged and the previous tokens stay in force.
    Lookups hash the presented token and look the digest up, so the time taken
    does not depend on how much of a token an attacker guessed. An entry's optional
    ``expires_at`` is checked against ``clock()`` on every request.
    """

    auth_name = "static"

    def __init__(self, path: str, clock: Callable[[], float] = time.time, **traits: Any) -> None:
        super().__init__(**traits)
        self.path = path
        self.clock = clock
        self._mtime: float | None = None
        self._tokens = self._load()

    @classmethod
    def for_broker(cls, *, parent: Any = None, tokens_file: str = "", **_: Any) -> StaticTokens:
        """Needs ``tokens_file`` (``--tokens-file``)."""
        if not tokens_file:
            raise TokensFileError(
                "--auth static needs a tokens file: give --tokens-file FILE with "
                '{"TOKEN": {"user": "alice", "groups": [], "admin": false}}.'
            )
        return cls(tokens_file, parent=parent)

    def __repr__(self) -> str:
        return f"StaticTokens({self.path!r}, {len(self._tokens)} token(s))"

    def _load(self) -> dict[bytes, StaticToken]:
        try:
            st = os.stat(self.path)
            mtime = st.st_mtime
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
        if st.st_mode & 0o007:
            log.warning(
                "The tokens file %s is readable by every account on this machine (mode %o): "
                "chmod 600 it, owned by the broker's account.",
                self.path,
                st.st_mode & 0o777,
            )
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

    async def groups_of(self, user: str) -> tuple[frozenset[str], str]:
        """The groups of ``user``'s unexpired tokens in the file (their union, should the
        entries differ: each token acquires with its own entry's groups)."""
        self._maybe_reload()
        now = self.clock()
        entries = [
            e.identity.groups
            for e in self._tokens.values()
            if e.identity.user == user and not _expired(e, now)
        ]
        if not entries:
            return frozenset(), "the tokens file has no valid token for this user"
        union = frozenset().union(*entries)
        if any(groups != union for groups in entries):
            return union, "the tokens file (the union: this user's tokens list different groups)"
        return union, "the tokens file"


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
        user=name,
        groups=frozenset(g for g in groups if isinstance(g, str)),
        admin=admin,
        metrics=METRICS_SCOPE in scopes,
    )


class HubTokens(Authenticator):
    """``--auth hub``: ask JupyterHub who owns the token (cached ``cache_max_age`` s).

    ``api_url`` and ``api_token`` default to ``JUPYTERHUB_API_URL`` and
    ``JUPYTERHUB_API_TOKEN``, which the hub sets for a managed service. The
    service's own token needs no special scope to identify tokens; each user's
    token needs ``access:services!service=gpu-lease`` and, for course kernels,
    ``read:users:groups`` on itself so the model lists the user's groups.

    Node agents are not hub users: ``agent_tokens`` (a :class:`StaticTokens` of a tokens
    file that holds only ``{"agent": true, "node": ...}`` entries, ``--tokens-file``
    beside ``--auth hub``) identifies them first, without asking the hub.
    """

    auth_name = "hub"

    def __init__(
        self,
        api_url: str | None = None,
        api_token: str | None = None,
        cache_max_age: int = HUB_CACHE_MAX_AGE,
        hub_auth: Any = None,
        agent_tokens: StaticTokens | None = None,
        **traits: Any,
    ) -> None:
        super().__init__(**traits)
        self.agent_tokens = agent_tokens
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

    @classmethod
    def for_broker(
        cls,
        *,
        parent: Any = None,
        cache_max_age: int = HUB_CACHE_MAX_AGE,
        base_url: str = "/",
        tokens_file: str = "",
        **_: Any,
    ) -> HubTokens:
        """As a hub service with a URL, browsers also log in to the dashboard (hub OAuth).
        ``tokens_file`` (optional): the node agents' tokens, and nothing else."""
        agents = None
        if tokens_file:
            agents = StaticTokens(tokens_file, parent=parent)
            people = [e.identity.user for e in agents._tokens.values() if e.identity.node is None]
            if people:
                raise TokensFileError(
                    f"With --auth hub the tokens file {tokens_file!r} may hold only node "
                    f'agents\' tokens ({{"agent": true, "node": "NODE"}}); it names '
                    f"{len(people)} user token(s): users are identified by JupyterHub."
                )
        oauth = make_hub_oauth(base_url, cache_max_age=cache_max_age)
        return cls(cache_max_age=cache_max_age, hub_auth=oauth, parent=parent, agent_tokens=agents)

    def __repr__(self) -> str:
        return f"HubTokens({getattr(self.hub_auth, 'api_url', '?')!r})"

    @property
    def browser_login(self) -> bool:
        """Whether browsers can log in with hub OAuth (``hub_auth`` is a ``HubOAuth``)."""
        from jupyterhub.services.auth import HubOAuth

        return isinstance(self.hub_auth, HubOAuth)

    def wrap_handler(self, handler: type[RequestHandler]) -> type[RequestHandler]:
        """``handler`` with JupyterHub's ``HubOAuthenticated`` (login URL, XSRF, cookie)."""
        from .hub_login import with_hub_login

        return with_hub_login(handler, self.hub_auth)

    def login_routes(self, base_url: str) -> list[tuple[str, type[RequestHandler]]]:
        """The OAuth callback ``{base_url}oauth_callback`` (with browser login only)."""
        if not self.browser_login:
            return []
        from .hub_login import oauth_callback_route

        return [oauth_callback_route(base_url, self.hub_auth)]

    async def identify_browser(self, handler: RequestHandler) -> Identity | None:
        """The user of a browser request without ``Authorization``, from the hub OAuth cookie.

        Called by the handlers' base class when ``--auth hub`` and the request has no
        token header. JupyterHub's ``HubOAuth.get_user`` accepts the cookie only if the
        request passes its XSRF check (a page view, or ``X-XSRFToken`` from the
        dashboard page); otherwise, or without a cookie, this returns None. A user
        without the service's access scope raises ``Forbidden``.
        """
        from tornado.web import HTTPError

        from ...errors import Forbidden

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

        if self.agent_tokens is not None:
            agent = self.agent_tokens.lookup(token)
            if agent is not None and agent.node is not None:
                return agent
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
            from ...errors import Forbidden

            raise Forbidden(
                f"This token of JupyterHub user {model.get('name')!r} does not grant access "
                f"to the GPU lease service: it needs the scope {max(needed, key=len)} (ask the "
                "hub admin to add it to c.Spawner.server_token_scopes or the user's role)."
            )
        return identity_from_hub_model(model)

    async def groups_of(self, user: str) -> tuple[frozenset[str], str]:
        """The user's hub groups, from ``GET /hub/api/users/{name}`` with the service's own
        token, which needs ``read:users:groups`` (hub_config grants it to the broker)."""
        import httpx

        from ...errors import Forbidden, UserNotFound

        api_url = str(getattr(self.hub_auth, "api_url", "")).rstrip("/")
        token = str(getattr(self.hub_auth, "api_token", ""))
        url = f"{api_url}/users/{quote(user, safe='')}"
        try:
            async with httpx.AsyncClient(timeout=10.0) as http:
                r = await http.get(url, headers={"Authorization": f"token {token}"})
        except httpx.HTTPError as exc:
            raise AuthUnavailable(
                "JupyterHub's API cannot be reached to look up the user's groups; retry in a "
                "moment, and if this persists check that the hub is running."
            ) from exc
        if r.status_code == 404:
            raise UserNotFound(f"JupyterHub has no user named {user!r}.")
        if r.status_code == 403:
            raise Forbidden(
                "The broker may not read users' groups from JupyterHub: give the service "
                "gpu-lease the scope read:users:groups (hub_config/jupyterhub_config.py's "
                "role gpu-lease-broker does)."
            )
        try:
            model = r.json() if r.status_code == 200 else None
        except ValueError:
            model = None
        if not isinstance(model, dict):
            raise AuthUnavailable(
                f"JupyterHub answered HTTP {r.status_code} when asked for a user's groups; "
                "retry in a moment."
            )
        groups = model.get("groups")
        if not isinstance(groups, list):
            raise Forbidden(
                "JupyterHub did not list the user's groups: give the service gpu-lease the "
                "scope read:users:groups (hub_config/jupyterhub_config.py's role "
                "gpu-lease-broker does)."
            )
        return frozenset(g for g in groups if isinstance(g, str)), "JupyterHub"


def make_hub_oauth(
    base_url: str,
    *,
    cache_max_age: int = HUB_CACHE_MAX_AGE,
    api_url: str | None = None,
    api_token: str | None = None,
    service_name: str | None = None,
    **kwargs: Any,
) -> Any:
    """A ``jupyterhub.services.auth.HubOAuth`` for the dashboard's browser login, or None.

    Called by :meth:`HubTokens.for_broker` (``--auth hub``). It needs what JupyterHub gives a managed
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


#: the built-in authenticators by their ``--auth`` names
AUTHENTICATORS: dict[str, type[Authenticator]] = {
    cls.auth_name: cls for cls in (HubTokens, StaticTokens)
}

__all__ = [
    "ADMIN_SCOPE",
    "AUTHENTICATORS",
    "AuthUnavailable",
    "Authenticator",
    "HUB_CACHE_MAX_AGE",
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
