"""The old import path of the broker's authenticators, kept for sites' configurations.

``c.GPULeaseBroker.authenticator_class = "provisioner.broker.auth.HubTokens"`` and
subclasses of ``provisioner.broker.auth.Authenticator`` keep working; the classes live in
:mod:`provisioner.broker.web.auth` (docs/design.md, "Code layout").
"""

from .web.auth import *  # noqa: F403
from .web.auth import __all__  # noqa: F401
