"""The broker client: the only HTTP caller on the kernel, lab, node and CLI side.

This is the package's public surface; import from here (``from provisioner.client import
BrokerClient, broker_env``). Its modules, each one job:

- :mod:`.http`: :class:`BrokerClient`, the transport core (retries, backoff, the broker
  re-resolved after a 503, answers translated into :mod:`provisioner.errors`), and
  :func:`broker_env`, the one reader of the variables that name the broker and its token;
- :mod:`.answers`: the broker's answers typed once where they enter:
  :class:`GrantedLease` (every field of the API's lease), :class:`ResumeAnswer`;
- :mod:`.calls`: what the call groups use of the core (:class:`~.calls.Core`) and how an id
  becomes a path segment;
- :mod:`.leases`, :mod:`.quotas`, :mod:`.nodes`: the call groups ``client.leases``,
  ``client.quotas`` and ``client.nodes``, one per broker service.
"""

from __future__ import annotations

from ..wire import Renewal
from .answers import PARK_STATES, GrantedLease, LeasedGPU, ResumeAnswer, ResumePlace, short_id
from .http import (
    API_PREFIX,
    DEFAULT_USER_AGENT,
    HUB_TOKEN_ENV,
    TOKEN_ENV,
    URL_ENV,
    BrokerClient,
    BrokerEnv,
    broker_env,
    normalize_url,
)
from .leases import LeaseCalls, QueuedCallback, no_capacity_message
from .nodes import NodeCalls
from .quotas import QuotaCalls, quota_path
from .sessions import SessionCalls

__all__ = [
    "API_PREFIX",
    "BrokerClient",
    "BrokerEnv",
    "DEFAULT_USER_AGENT",
    "GrantedLease",
    "HUB_TOKEN_ENV",
    "LeaseCalls",
    "LeasedGPU",
    "NodeCalls",
    "SessionCalls",
    "PARK_STATES",
    "QueuedCallback",
    "QuotaCalls",
    "Renewal",
    "ResumeAnswer",
    "ResumePlace",
    "TOKEN_ENV",
    "URL_ENV",
    "broker_env",
    "no_capacity_message",
    "normalize_url",
    "quota_path",
    "short_id",
]
