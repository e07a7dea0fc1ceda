"""The broker's pure rules: admission, placement, the queue, expiry, idle reclaim, estimates,
node rules, history and where kernels live.

No I/O, no clock of their own (time is passed in), no import of the store, the services or
HTTP: only the standard library, :mod:`provisioner.model`, :mod:`provisioner.wire`,
:mod:`provisioner.errors` and each other (``tests/test_layout.py`` checks it). The simulator
and the property tests run these same functions.
"""
