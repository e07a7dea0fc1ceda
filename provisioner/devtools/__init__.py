"""Developer tools: run from a checkout, never imported by the runtime.

``demo`` (``python -m provisioner.devtools.demo``, ``make demo``) and ``testing`` (a
real broker subprocess for ``tests/`` and ``benchmarks/``) read the checkout
(``hub_config/``, ``kernelspecs/``, ``examples/``, ``node_modules/``); ``simulate`` is
the trace simulator over the pure core (``benchmarks/simulate.py``,
``tests/test_simulate.py``). Modules here may import the runtime package; nothing
outside ``provisioner/devtools/`` imports them (see ``docs/developers.md``).
"""
