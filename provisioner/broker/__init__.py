"""The broker: one process that decides every lease of the pool.

Its subpackages are layers, each allowed to import only those below it
(``tests/test_layout.py`` checks every rule):

* :mod:`.rules`: the pure allocation rules (standard library and the shared base only);
* :mod:`.store`: persistence, the only SQL;
* :mod:`.services`: the state in memory and the use cases (rules + store);
* :mod:`.web`: HTTP (services + rules, never the store);
* :mod:`.fronts`: ``--http-processes``, HTTP in front processes;
* the top: ``app`` (``gpu-lease broker``, ``python -m provisioner.broker.app``), ``options``
  (every ``c.GPULeaseBroker`` trait), ``courses`` (the courses file) and ``startup`` (the
  steps of a run), which read the site's configuration and put the layers together.
"""
