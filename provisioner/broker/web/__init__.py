"""HTTP: REST API v1's handlers and route table, request validation, authentication, the hub
login of the dashboard, the OpenAPI document and ``/metrics``.

The only subpackage with HTTP status codes; it calls the services and the pure rules, never
the store (``tests/test_layout.py`` checks it).
"""
