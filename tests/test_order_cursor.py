"""The pieces of the orders long-poll that need no broker: the cursor of a node's due
orders (``services/node_orders.py``) and the long-polls' table (``services/long_polls.py``).
The long-poll itself, on a real broker: ``test_node_orders.py``."""

from __future__ import annotations

from provisioner.broker.services.long_polls import LongPolls
from provisioner.broker.services.node_orders import orders_cursor

PARK = {
    "lease_id": "L1",
    "action": "park",
    "pid": 7,
    "pid_ns": None,
    "gpu_uuid": "G",
    "memory_mb": 1,
}
RESUME = {**PARK, "lease_id": "L2", "action": "resume"}


def test_the_cursor_is_the_orders_and_when_each_was_issued() -> None:
    assert orders_cursor([(PARK, 1.0), (RESUME, 2.0)]) == orders_cursor(
        [(RESUME, 2.0), (PARK, 1.0)]
    )
    assert orders_cursor([(PARK, 1.0)]) != orders_cursor([])
    # parked, resumed and parked again: the same order, issued anew
    assert orders_cursor([(PARK, 1.0)]) != orders_cursor([(PARK, 5.0)])
    assert orders_cursor([(PARK, 1.0)]) != orders_cursor([({**PARK, "action": "resume"}, 1.0)])


async def test_an_orders_long_poll_is_counted_and_woken_for_its_node_only() -> None:
    polls = LongPolls()
    with polls.for_orders("gpu-a") as waiter, polls.for_orders("gpu-a") as same:
        assert waiter is same and polls.waiting == 2
        polls.wake_orders(["gpu-b"])
        assert not waiter.event.is_set()
        polls.wake_orders(["gpu-a"])
        assert waiter.event.is_set()
        waiter.event.clear()
        polls.wake_all()  # a broker that stops serving: every long-poll answers 503
        assert waiter.event.is_set()
    assert polls.waiting == 0 and polls.orders == {}
