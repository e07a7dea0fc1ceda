"""The checks of one JSON value: what both the broker's request validation
(``broker/web/validation.py``) and the node report (:mod:`provisioner.node_report`) refuse.

Each refusal is an :class:`~provisioner.errors.InvalidRequest` (400) whose message is a
sentence that names the field and says what to send. Pure, nothing happens at import.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import InvalidRequest
from .model import brief as show
from .wire import CGROUP_PATTERN, MAX_CGROUP_CHARS, MAX_ID_CHARS

_CGROUP_PATH = re.compile(CGROUP_PATTERN)


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for a message (``null``, ``array``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def check_fields(body: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    """400 naming every field of ``body`` that is not in ``allowed``."""
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        names = ", ".join(repr(k[:64]) for k in unknown[:10])
        raise InvalidRequest(
            f"Unknown field(s) in the {what}: {names}. Allowed fields are "
            f"{', '.join(allowed)}; remove the others.",
            fields=[k[:64] for k in unknown[:10]],
        )


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def text(value: Any, name: str, *, max_chars: int = MAX_ID_CHARS) -> str:
    """A non-empty printable string of at most ``max_chars`` characters."""
    if not isinstance(value, str):
        raise InvalidRequest(
            f"{name!r} must be a string, not a JSON {json_type(value)}; send it in quotes."
        )
    if not value:
        raise InvalidRequest(f"{name!r} must not be empty.")
    if len(value) > max_chars:
        raise InvalidRequest(
            f"{name!r} has {len(value)} characters; send at most {max_chars}.",
        )
    if not value.isprintable():
        raise InvalidRequest(
            f"{name!r} contains control or other unprintable characters; send printable text only."
        )
    return value


def whole(value: Any, name: str, *, low: int, high: int) -> int:
    """A whole number in ``[low, high]`` (a float with no fraction is taken)."""
    if not isinstance(value, int) or isinstance(value, bool):
        if isinstance(value, float) and value.is_integer() and low <= value <= high:
            return int(value)
        raise InvalidRequest(
            f"{name!r} must be a whole number, not a JSON {json_type(value)} ({show(value)})."
        )
    if not low <= value <= high:
        raise InvalidRequest(f"{name!r} must be between {low} and {high}, not {show(value)}.")
    return value


def number(value: Any, name: str, *, low: float, high: float) -> float:
    """A finite number in ``[low, high]``."""
    if not is_number(value):
        raise InvalidRequest(f"{name!r} must be a number, not a JSON {json_type(value)}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{name!r} must be a finite number.")
    if not low <= value <= high:
        raise InvalidRequest(f"{name!r} must be between {low:g} and {high:g}, not {show(value)}.")
    return float(value)


def json_object(value: Any, what: str) -> dict[str, Any]:
    """An entry of the array ``what`` that must be an object."""
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"Each entry of {what} must be a JSON object, not a {json_type(value)}."
        )
    return value


def json_list(body: dict[str, Any], name: str, most: int) -> list[Any]:
    """``body[name]``, an array of at most ``most`` entries."""
    value = body.get(name)
    if not isinstance(value, list):
        raise InvalidRequest(f"{name!r} must be a JSON array, not a JSON {json_type(value)}.")
    if len(value) > most:
        raise InvalidRequest(f"{name!r} has {len(value)} entries; send at most {most}.")
    return value


def cgroup(value: Any) -> str:
    """A kernel's cgroup v2 path from the hierarchy's root, e.g. ``/gpu-lease/k-1f2e``."""
    path = text(value, "cgroup", max_chars=MAX_CGROUP_CHARS)
    if not _CGROUP_PATH.match(path) or any(part in (".", "..") for part in path.split("/")):
        raise InvalidRequest(
            "'cgroup' must be the kernel's cgroup v2 path from the hierarchy's root, such as "
            "/gpu-lease/kernel-1f2e (letters, digits and ._@:+=,- between slashes)."
        )
    return path


__all__ = [
    "cgroup",
    "check_fields",
    "is_number",
    "json_list",
    "json_object",
    "json_type",
    "number",
    "show",
    "text",
    "whole",
]
