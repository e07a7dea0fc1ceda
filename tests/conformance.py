"""Every answer a test gets from a broker, checked against the OpenAPI document it serves.

A :class:`Conformance` belongs to each broker of ``tests/conftest.py``: the clients the
API tests use (``broker.client()``, or any httpx client given ``event_hooks=
broker.conformance.hooks()`` / ``sync_hooks()``) record each response; when the broker's
test ends (``Broker.running``), each recorded answer to a documented operation is
validated with openapi-core against the document the broker served
(``GET /api/v1/openapi.json``), and any mismatch fails the test: a field whose values or
nullability the document and the broker disagree on cannot pass ``make test``.

Answers to undocumented URLs (the dashboard, the JSON index, unknown paths, a method a
path does not take) are not checked: the document does not describe them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import httpx
from openapi_core import OpenAPI
from openapi_core.templating.paths.exceptions import PathError
from openapi_core.testing import MockRequest, MockResponse


@dataclass(frozen=True)
class Answer:
    """One request and its response, as recorded."""

    method: str
    host_url: str
    path: str
    query: tuple[tuple[str, str], ...]
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, response: httpx.Response) -> Answer:
        url = response.request.url
        return cls(
            method=response.request.method,
            host_url=f"{url.scheme}://{url.netloc.decode()}",
            path=url.path,
            query=tuple(parse_qsl(url.query.decode(), keep_blank_values=True)),
            status=response.status_code,
            content_type=response.headers.get("Content-Type", "").split(";")[0].strip(),
            body=response.content,
            headers=tuple(response.headers.items()),
        )

    def __str__(self) -> str:
        query = "&".join(f"{k}={v}" for k, v in self.query)
        return f"{self.method} {self.path}{'?' + query if query else ''} -> {self.status}"


class Conformance:
    """Recorded answers of one broker, and their check against a document."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []

    # -- recording (httpx event hooks) ---------------------------------------------------
    def hooks(self) -> dict[str, list[Any]]:
        """``event_hooks`` for an ``httpx.AsyncClient``."""
        return {"response": [self._record_async]}

    def sync_hooks(self) -> dict[str, list[Any]]:
        """``event_hooks`` for an ``httpx.Client``."""
        return {"response": [self._record]}

    async def _record_async(self, response: httpx.Response) -> None:
        await response.aread()
        self.answers.append(Answer.of(response))

    def _record(self, response: httpx.Response) -> None:
        response.read()
        self.answers.append(Answer.of(response))

    # -- checking --------------------------------------------------------------------------
    def problems(self, document: dict[str, Any]) -> tuple[int, list[str]]:
        """``(answers checked, one line per answer the document refuses)``."""
        api = OpenAPI.from_dict(document)
        checked, out = 0, []
        for answer in self.answers:
            request = MockRequest(
                answer.host_url,
                answer.method,
                answer.path,
                args=dict(answer.query),
                headers=dict(answer.headers),
            )
            response = MockResponse(
                answer.body,
                status_code=answer.status,
                headers=dict(answer.headers),
                content_type=answer.content_type or "application/json",
            )
            try:
                errors = list(api.iter_response_errors(request, response))
            except PathError:
                continue  # not a documented operation
            if any(isinstance(e, PathError) for e in errors):
                continue
            checked += 1
            for error in errors:
                cause = error.__cause__ or error.__context__
                details = getattr(error, "schema_errors", None) or ([cause] if cause else [])
                why = "; ".join(_brief(d) for d in details) or str(error)
                out.append(f"{answer}: {type(error).__name__}: {why} (body {answer.body[:300]!r})")
        return checked, out


def _brief(error: Any) -> str:
    path = "/".join(str(p) for p in getattr(error, "absolute_path", ()) or ())
    message = getattr(error, "message", None) or str(error)
    return f"at /{path}: {message}" if path else str(message)


def served_document(url: str) -> dict[str, Any]:
    """The OpenAPI document the broker at ``url`` (its base URL) serves."""
    r = httpx.get(f"{url}/api/v1/openapi.json", timeout=30.0)
    r.raise_for_status()
    return dict(r.json())
