"""A no-op tornado app with the broker's lease routes: the HTTP ceiling the benchmarks divide by.

    python benchmarks/noop_broker.py --port 8765

It answers what the broker answers, with no decision, no database and no auth check
beyond reading the ``Authorization`` header: ``POST /api/v1/leases`` 201 with a lease-shaped
JSON body (a fresh id), ``DELETE /api/v1/leases/{id}`` 204, ``POST
/api/v1/leases/{id}/renew`` 200, ``GET /api/v1/health`` 200. Like the broker, it reads
the JSON body, logs every request at INFO (tornado's access log, to stderr) and runs one
asyncio event loop. ``broker_throughput.py`` drives it with the same load generator in
the same run (the ceiling), ``broker_startup.py`` times its start (the start-up
baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import signal
import time

import tornado.web


class Leases(tornado.web.RequestHandler):
    def post(self) -> None:
        self.request.headers.get("Authorization")
        body = json.loads(self.request.body or b"{}")
        now = time.time()
        self.set_status(201)
        self.set_header("Content-Type", "application/json")
        self.finish(
            json.dumps(
                {
                    "id": secrets.token_urlsafe(16),
                    "kernel_id": body.get("kernel_id"),
                    "fraction": body.get("fraction"),
                    "state": "active",
                    "created_at": now,
                    "expires_at": now + 90.0,
                }
            )
        )


class Lease(tornado.web.RequestHandler):
    def delete(self, lease_id: str) -> None:
        self.request.headers.get("Authorization")
        self.set_status(204)
        self.finish()


class Renew(tornado.web.RequestHandler):
    def post(self, lease_id: str) -> None:
        self.request.headers.get("Authorization")
        json.loads(self.request.body or b"{}")
        now = time.time()
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"id": lease_id, "state": "active", "expires_at": now + 90.0}))


class Health(tornado.web.RequestHandler):
    def get(self) -> None:
        self.finish({"status": "ok"})


async def serve(port: int) -> None:
    app = tornado.web.Application(
        [
            (r"/api/v1/leases", Leases),
            (r"/api/v1/leases/([^/]+)", Lease),
            (r"/api/v1/leases/([^/]+)/renew", Renew),
            (r"/api/v1/health", Health),
        ]
    )
    app.listen(port, "127.0.0.1", xheaders=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(levelname)1.1s %(asctime)s] %(message)s")
    asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
