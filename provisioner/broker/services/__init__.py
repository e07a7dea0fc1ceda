"""The broker's services: the state held in memory (``service_core.ServiceCore``) and the use
cases that change or read it (leases, nodes, quotas, queries, resume, parking, the reaper), put
together by ``broker_service.BrokerService``.

They use the pure rules and the store; they know nothing of HTTP (``tests/test_layout.py``
checks it).
"""
