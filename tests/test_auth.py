"""Tests of provisioner.broker.web.auth: header parsing, the static tokens file, hub identities.

JupyterHub's HubAuth is the one thing substituted (the hub is not ours): ``HubTokens``
takes it as an injectable ``hub_auth``. Real hub round trips are the hub tests' job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from tornado.web import HTTPError

from provisioner.broker.web.auth import (
    HubTokens,
    StaticTokens,
    identity_from_hub_model,
    token_from_header,
)
from provisioner.errors import AuthUnavailable, NotAuthenticated, TokensFileError
from provisioner.model import Identity

SECRET = "s3cret-token-0123456789"


@pytest.mark.parametrize(
    "value, token",
    [
        (None, None),
        ("", None),
        (f"token {SECRET}", SECRET),
        (f"Token {SECRET}", SECRET),
        (f"Bearer {SECRET}", SECRET),
        (f"bearer   {SECRET}  ", SECRET),
    ],
)
def test_token_from_header(value: str | None, token: str | None) -> None:
    assert token_from_header(value) == token


@pytest.mark.parametrize(
    "value", [f"Basic {SECRET}", "token", f"token {SECRET} more", SECRET, "token " + "x" * 5000]
)
def test_token_from_header_refused(value: str) -> None:
    with pytest.raises(NotAuthenticated) as info:
        token_from_header(value)
    assert SECRET not in info.value.message and "Authorization: token" in info.value.message


def write(path: Path, data: Any) -> str:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


async def test_static_tokens(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.json",
        {
            SECRET: {"user": "alice", "groups": ["ml101"]},
            "admin-token-xyz": {"user": "root", "admin": True},
            "scraper-token-xyz": {"user": "prometheus", "metrics": True},
        },
    )
    tokens = StaticTokens(path)
    assert await tokens.identify(SECRET) == Identity("alice", frozenset({"ml101"}), False)
    assert (await tokens.identify("admin-token-xyz")).admin
    scraper = await tokens.identify("scraper-token-xyz")
    assert scraper.metrics and not scraper.admin
    for wrong in (SECRET + "x", SECRET[:-1], "", "admin-token-xy"):
        with pytest.raises(NotAuthenticated) as info:
            await tokens.identify(wrong)
        assert SECRET not in info.value.message
    assert SECRET not in repr(tokens)


async def test_static_tokens_reload_on_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "t.json"
    write(path, {SECRET: {"user": "alice"}})
    tokens = StaticTokens(str(path))
    write(path, {SECRET: {"user": "alice"}, "new-token-123": {"user": "bob"}})
    os.utime(path, (1, 1))
    assert (await tokens.identify("new-token-123")).user == "bob"
    # a broken edit keeps the tokens in force, and says so without quoting them
    write(path, "{ broken " + SECRET)
    os.utime(path, (2, 2))
    assert (await tokens.identify(SECRET)).user == "alice"
    assert "Keeping the previous tokens" in caplog.text and SECRET not in caplog.text


@pytest.mark.parametrize(
    "data, words",
    [
        ([], "JSON object"),
        ({"short": {"user": "a"}}, "at least 8 characters"),
        ({"has space 123": {"user": "a"}}, "without spaces"),
        ({SECRET: "alice"}, "map the token to an object"),
        ({SECRET: {"user": ""}}, "non-empty string 'user'"),
        ({SECRET: {"user": "a", "groups": "ml101"}}, "list of group names"),
        ({SECRET: {"user": "a", "admin": "yes"}}, "true or false"),
        ({SECRET: {"user": "a", "metrics": 1}}, "'metrics' of .* true or false"),
        ({SECRET: {"user": "a", "role": "x"}}, "unknown key"),
        ("{not json " + SECRET, "not valid JSON"),
    ],
)
def test_static_tokens_file_errors(tmp_path: Path, data: Any, words: str) -> None:
    with pytest.raises(TokensFileError, match=words) as info:
        StaticTokens(write(tmp_path / "t.json", data))
    assert SECRET not in info.value.message and "short" not in info.value.message


def test_static_tokens_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TokensFileError, match="--tokens-file"):
        StaticTokens(str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    "model, ident",
    [
        ({"name": "alice", "groups": ["ml101"]}, Identity("alice", frozenset({"ml101"}), False)),
        ({"name": "root", "admin": True}, Identity("root", frozenset(), True)),
        (
            {"name": "ta", "admin": False, "scopes": ["custom:gpu-lease:admin", "read:users"]},
            Identity("ta", frozenset(), True),
        ),
        ({"name": "bob", "groups": None, "scopes": None}, Identity("bob", frozenset(), False)),
        (  # a Prometheus service's token: may read /metrics, nothing more
            {"name": "prometheus", "kind": "service", "scopes": ["read:metrics"]},
            Identity("prometheus", frozenset(), False, metrics=True),
        ),
    ],
)
def test_identity_from_hub_model(model: dict[str, Any], ident: Identity) -> None:
    assert identity_from_hub_model(model) == ident


class FakeHubAuth:
    """Plays jupyterhub.services.auth.HubAuth.user_for_token(token, use_cache, sync=False)."""

    api_url = "http://hub.test/hub/api"

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[str, bool, bool]] = []

    async def user_for_token(self, token: str, use_cache: bool = True, *, sync: bool = True) -> Any:
        self.calls.append((token, use_cache, sync))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


async def test_hub_tokens() -> None:
    hub = FakeHubAuth({"name": "alice", "groups": ["ml101"], "scopes": []})
    ident = await HubTokens(hub_auth=hub).identify(SECRET)
    assert ident == Identity("alice", frozenset({"ml101"}), False)
    assert hub.calls == [(SECRET, True, False)]
    with pytest.raises(NotAuthenticated):
        await HubTokens(hub_auth=FakeHubAuth(None)).identify(SECRET)
    for exc in (HTTPError(500, "hub down"), ConnectionRefusedError()):
        with pytest.raises(AuthUnavailable) as info:
            await HubTokens(hub_auth=FakeHubAuth(exc)).identify(SECRET)
        assert info.value.status == 503 and SECRET not in info.value.message


def test_hub_tokens_need_the_service_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    with pytest.raises(TokensFileError, match="JUPYTERHUB_API_TOKEN"):
        HubTokens()
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "service-token")
    monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")
    tokens = HubTokens(cache_max_age=60)
    assert tokens.hub_auth.api_url == "http://127.0.0.1:8081/hub/api"
    assert tokens.hub_auth.cache_max_age == 60
    assert "service-token" not in repr(tokens)


async def test_hub_tokens_identify_node_agents_from_their_own_file(tmp_path: Path) -> None:
    """Agents are not hub users; under --auth hub their tokens come from a tokens
    file that may hold nothing else, and are never sent to the hub."""
    path = tmp_path / "agents.json"
    path.write_text(json.dumps({"agent-secret": {"agent": True, "node": "gpu-a"}}))
    hub = FakeHubAuth({"name": "alice", "groups": [], "scopes": []})
    tokens = HubTokens(hub_auth=hub, agent_tokens=StaticTokens(str(path)))
    assert await tokens.identify("agent-secret") == Identity("agent:gpu-a", node="gpu-a")
    assert hub.calls == []  # the agent's token never went to the hub
    assert (await tokens.identify(SECRET)).user == "alice"  # anyone else: the hub decides
    assert hub.calls == [(SECRET, True, False)]
    # a user's token in that file would let the file, not the hub, say who a user is
    path.write_text(
        json.dumps(
            {
                "agent-secret": {"agent": True, "node": "gpu-a"},
                "user-secret": {"user": "mallory", "admin": True},
            }
        )
    )
    with pytest.raises(TokensFileError, match="may hold only node agents' tokens") as info:
        HubTokens.for_broker(tokens_file=str(path))
    assert "secret" not in info.value.message
    # ... and one added while the broker runs is not honoured either
    assert (await tokens.identify("user-secret")).user == "alice"
