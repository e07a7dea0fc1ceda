"""The sentences a student reads when a GPU kernel does not start: table tests.

Every refusal the broker makes (quota, course, can never fit) and the provisioner's
queue-timeout sentence, built from plain data with the pure core
(:mod:`provisioner.broker.rules.scheduling`, :mod:`provisioner.broker.rules.admission`) and :func:`provisioner.client.leases.no_capacity_message`. Each
row says what the sentence must say and what it must not (defects once found: a remedy
that does not apply, the place in the queue said twice, a GPU named by its UUID).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from provisioner.broker.rules import admission, scheduling
from provisioner.broker.rules.policy import Ask, Policy
from provisioner.client import no_capacity_message
from provisioner.errors import CannotFit, Forbidden, GPULeaseError, QuotaExceeded
from provisioner.model import GPU, PPM, Lease, PoolState, Quota, QuotaBook, Request, never_allowed

V100 = GPU("GPU-5b1e0c4d-aaaa-bbbb-cccc-0123456789ab", "local", "V100", 32768, 0)
A100 = GPU("GPU-9f8e7d6c-aaaa-bbbb-cccc-0123456789ab", "local", "A100", 81920, 1)
UUID_BITS = re.compile(r"[0-9a-f]{8}")


def lease(user: str, kernel: str, ppm: int, gpu: GPU = V100) -> Lease:
    return Lease(f"l-{user}-{kernel}", user, kernel, gpu.uuid, ppm, 0, "active", 0, 0, 90)


def state_with(*leases: Lease, gpus: tuple[GPU, ...] = (V100,)) -> PoolState:
    return PoolState.build(list(gpus), leases)


def refusal(state: PoolState, ask: Ask, quota: Quota = Quota(), used: float = 0.0) -> str:
    with pytest.raises(GPULeaseError) as info:
        scheduling.decide_acquire(state, ask, quota, 0.0, Policy(), lambda: "new", used)
    return info.value.message


# -- quotas ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "held, ask_ppm, quota, says, never",
    [
        # max_leases = 0: nothing to shut down, say so
        ((), 20_000, Quota(max_leases=0), ["allows no GPU kernels", "max_leases is 0",
                                           "kernel without a GPU"], ["Shut down", "0 GPU kernel"]),
        ((), 20_000, Quota(max_fraction_ppm=0), ["allows no GPU kernels", "max_fraction is 0"],
         ["Shut down"]),
        # the limit is reached by kernels held: shut one down
        ((20_000, 20_000), 20_000, Quota(max_leases=2),
         ["already hold or wait for 2 GPU kernels", "(2)", "Shut down a GPU kernel"], ["(s)"]),
        ((20_000,), 20_000, Quota(max_leases=1),
         ["already hold or wait for 1 GPU kernel,", "Shut down a GPU kernel"], ["(s)"]),
        # per-kernel limit: a smaller kernel is the remedy, not shutting one down
        ((), 100_000, Quota(max_lease_fraction_ppm=50_000),
         ["0.1 is above your per-kernel limit of 0.05", "at most 0.05"], ["Shut down"]),
        # the ask alone is above the total: nothing to shut down either
        ((), 250_000, Quota(max_fraction_ppm=100_000),
         ["0.25 is above your limit of 0.1", "at most 0.1"], ["Shut down"]),
        # held + ask above the total: shut one down
        ((50_000,), 60_000, Quota(max_fraction_ppm=100_000),
         ["bring your GPU share to 0.11", "limit of 0.1", "0.05 in 1 GPU kernel",
          "Shut down a GPU kernel"], []),
        ((), 20_000, Quota(budget_fraction_hours=0.0), ["allows no GPU time"], ["Shut down"]),
    ],
)  # fmt: skip
def test_quota_refusals(
    held: tuple[int, ...], ask_ppm: int, quota: Quota, says: list[str], never: list[str]
) -> None:
    state = state_with(*(lease("alice", f"k{i}", p) for i, p in enumerate(held)))
    message = refusal(state, Ask("alice", "new", ask_ppm), quota)
    for words in says:
        assert words in message, message
    for words in never:
        assert words not in message, message


@pytest.mark.parametrize(
    "quota, ppm, why",
    [
        (Quota(), 1_000_000, None),
        (Quota(max_leases=0), 20_000, "max_leases"),
        (Quota(max_leases=1), 20_000, None),  # held kernels may end: not "never"
        (Quota(max_fraction_ppm=0), 20_000, "max_fraction"),
        (Quota(max_fraction_ppm=50_000), 100_000, "max_fraction"),
        (Quota(max_lease_fraction_ppm=50_000), 50_000, None),
        (Quota(max_lease_fraction_ppm=50_000), 100_000, "max_lease_fraction"),
        (Quota(budget_fraction_hours=0.0), 20_000, "budget_fraction_hours"),
        (Quota(budget_fraction_hours=1.0), 20_000, None),
    ],
)
def test_never_allowed_matches_admission(quota: Quota, ppm: int, why: str | None) -> None:
    assert never_allowed(quota, ppm) == why
    if why is not None:  # admission refuses it on an empty pool, for that very quota
        with pytest.raises(QuotaExceeded) as info:
            admission.admit(state_with(), Ask("alice", "k", ppm), quota)
        assert info.value.details["quota"] == why


def test_course_refusal() -> None:
    message = refusal(state_with(), Ask("guest", "k", 50_000, group="ml101"))
    assert "reserved for course 'ml101'" in message and "not a member" in message
    with pytest.raises(Forbidden):
        admission.check_course(Ask("guest", "k", 50_000, group="ml101", groups=frozenset({"cs50"})))


@pytest.mark.parametrize(
    "ppm, says",
    [
        (10_000, ["0.01 gives at most 327 MiB", "V100 (32768 MiB)", "512 MiB",
                  "smallest fraction that works is 0.015656"]),
    ],
)  # fmt: skip
def test_cannot_fit_names_the_smallest_fraction(ppm: int, says: list[str]) -> None:
    with pytest.raises(CannotFit) as info:
        scheduling.decide_acquire(
            state_with(), Ask("a", "k", ppm), Quota(), 0, Policy(), lambda: "x"
        )
    for words in says:
        assert words in info.value.message, info.value.message


# -- waiting -------------------------------------------------------------------------------
def queued_reason(state: PoolState, ppm: int, policy: Policy = Policy()) -> str:
    decision = scheduling.decide_acquire(
        state, Ask("late", "k", ppm), Quota(), 1.0, policy, lambda: "r"
    )
    assert isinstance(decision.outcome, scheduling.Queued)
    return decision.outcome.reason


@pytest.mark.parametrize(
    "leases, gpus, ppm, says, never",
    [
        # full: the GPU by index and name, no UUID, no advice (0.02 is the smallest kernel
        # and nothing smaller could start: the GPU has no room at all)
        ([lease("hog", "k", PPM)], (V100,), 20_000,
         ["The GPU you may use is full: GPU 0 (V100) is 100% allocated."], ["smaller", "GPU-"]),
        # 0.01 free, below the smallest fraction that works on a V100 (0.0157): no advice
        ([lease("hog", "k", 990_000)], (V100,), 20_000, ["99% allocated"], ["smaller"]),
        # 0.1 free and 0.25 asked: a smaller kernel could start now
        ([lease("hog", "k", 900_000)], (V100,), 250_000,
         ["GPU 0 (V100) has 0.1 of a GPU free", "smaller GPU fraction may start sooner"], []),
        ([lease("a", "k", PPM), lease("b", "k", PPM, A100)], (V100, A100), 20_000,
         ["The GPUs you may use are full: GPU 0 (V100) is 100% allocated; "
          "GPU 1 (A100) is 100% allocated."], ["GPU-"]),
    ],
)  # fmt: skip
def test_why_waiting(
    leases: list[Lease], gpus: tuple[GPU, ...], ppm: int, says: list[str], never: list[str]
) -> None:
    reason = queued_reason(state_with(*leases, gpus=gpus), ppm)
    for words in says:
        assert words in reason, reason
    for words in never:
        assert words not in reason, reason
    assert not UUID_BITS.search(reason), reason


def test_why_waiting_behind_the_head() -> None:
    """Room for the ask, but the queue's head reserved the GPU: say that, not "full"."""
    state = state_with(lease("hog", "k", 600_000))
    head = Request("h", "big", "k", 800_000, 0.0, 0.0)
    state.queue[head.key] = head
    reason = queued_reason(state, 20_000)
    assert reason.startswith("Requests ahead of yours in the queue are served first"), reason


def test_why_waiting_names_nodes_when_there_are_several() -> None:
    a = GPU("GPU-a", "gpu-a", "H100", 81920, 0)
    b = GPU("GPU-b", "gpu-b", "T4", 16384, 0)
    state = state_with(lease("x", "k", PPM, a), lease("y", "k", PPM, b), gpus=(a, b))
    reason = queued_reason(state, 20_000)
    assert "GPU 0 (H100) on node gpu-a is 100% allocated" in reason, reason


def test_why_waiting_says_another_node_has_room() -> None:
    """A server's kernels may use only its node's GPUs; when that node is full
    while another has room, the student reads that (not just "full")."""
    a = GPU("GPU-a", "node1", "T4", 16384, 0)
    b = GPU("GPU-b", "node2", "T4", 16384, 0)
    state = state_with(lease("x", "k", PPM, b), gpus=(a, b))
    ask = Ask("late", "k", 250_000, node="node2")
    decision = scheduling.decide_acquire(state, ask, Quota(), 1.0, Policy(), lambda: "r")
    assert isinstance(decision.outcome, scheduling.Queued)
    reason = decision.outcome.reason
    assert reason.startswith("The GPU you may use is full: GPU 0 (T4) on node node2"), reason
    assert "Node node1 has room, but your server runs on node node2" in reason, reason
    # not bound to a node, the request is simply placed on node1
    free = scheduling.decide_acquire(state, Ask("late", "k2", 250_000), Quota(), 1.0, Policy(), str)
    assert not isinstance(free.outcome, scheduling.Queued)
    # and a node with room too small for the ask is not offered
    state = state_with(lease("x", "k", PPM, b), lease("y", "k", 900_000, a), gpus=(a, b))
    decision = scheduling.decide_acquire(state, ask, Quota(), 1.0, Policy(), lambda: "r")
    assert isinstance(decision.outcome, scheduling.Queued)
    assert "has room" not in decision.outcome.reason


# -- the queue timeout (the provisioner's sentence) -------------------------------------------
ANSWER: dict[str, Any] = {
    "queued": True,
    "position": 3,
    "queue_length": 7,
    "reason": "The GPU you may use is full: GPU 0 (V100) is 100% allocated.",
    "message": "Your request waits at position 3 of 7 in the GPU queue. The GPU you may use "
    "is full: GPU 0 (V100) is 100% allocated.",
}


@pytest.mark.parametrize(
    "fraction, timeout, answer, says",
    [
        (0.02, 600, ANSWER, ["No GPU became free for this kernel (0.02 of a GPU) within "
                             "10 minutes; it was at position 3 of 7 in the queue.",
                             "GPU 0 (V100) is 100% allocated.", "Try again later"]),
        (0.5, 1.5, {**ANSWER, "queue_length": None}, ["within 1.5 s; it was at position 3 in"]),
        (0.5, 30, {"queued": True}, ["within 30 s.", "Try again later"]),
    ],
)  # fmt: skip
def test_queue_timeout_message(
    fraction: float, timeout: float, answer: dict[str, Any], says: list[str]
) -> None:
    message = no_capacity_message(fraction, timeout, answer)
    for words in says:
        assert words in message, message
    assert message.count("position") <= 1, message  # said once, not twice
    assert "The broker said" not in message and "smaller GPU fraction" not in message


def test_effective_quota_sources() -> None:
    book = QuotaBook(
        default=Quota(max_leases=1, max_lease_fraction_ppm=50_000),
        groups={"cs50": Quota(max_leases=3), "ml101": Quota(max_leases=2, priority=10)},
        users={"bob": Quota(max_lease_fraction_ppm=250_000)},
    )
    eff = admission.quota_sources(book, "bob", {"ml101", "cs50", "unknown"})
    assert eff.quota == Quota(max_leases=3, max_lease_fraction_ppm=250_000, priority=10)
    assert eff.sources == {
        "max_fraction_ppm": "default",
        "max_leases": "group cs50",
        "max_lease_fraction_ppm": "user",
        "budget_fraction_hours": "default",
        "budget_window_s": "default",
        "priority": "group ml101",
    }
    assert admission.effective_quota(book, "bob", {"ml101", "cs50"}) == eff.quota


# -- the kernel side's edge: what jupyter_server shows in "Error Starting Kernel" ---------------
@pytest.mark.parametrize(
    "message, shown",
    [
        ("GPU 0 (V100) is 100% allocated.", "GPU 0 (V100) is 100 percent allocated."),
        ("Use %gpu to see it.", "Use \uff05gpu to see it."),
        (
            "You already hold or wait for 1 GPU kernel, the most your quota allows (1). "
            "Shut down a GPU kernel you no longer use and try again.",
            "You already hold or wait for 1 GPU kernel, the most your quota allows (1).\n"
            "Shut down a GPU kernel you no longer use and try again.",
        ),
    ],
)
def test_for_dialog(message: str, shown: str) -> None:
    from provisioner.kernel.refusals import for_dialog

    assert for_dialog(message) == shown


def test_both_jupyter_server_paths_show_the_dialog_text() -> None:
    """``POST /api/kernels`` reads ``log_message``; ``POST /api/sessions`` (JupyterLab's)
    re-raises ``HTTPError(500, str(exc))``, whose ``log_message`` doubles every ``%`` in
    tornado 6.5+ ("100%% allocated")."""
    from tornado.web import HTTPError

    from provisioner.errors import NoCapacity
    from provisioner.kernel.refusals import for_dialog, for_jupyter_server

    answer = {**ANSWER, "reason": ANSWER["reason"] + " " + "More words here. " * 8}
    exc = for_jupyter_server(NoCapacity(no_capacity_message(0.02, 600, answer)))
    shown = for_dialog(exc.message)
    assert "%" not in shown and max(len(x) for x in shown.split("\n")) <= 100
    assert isinstance(exc, HTTPError) and exc.status_code == 500  # NoCapacity is no HTTP error
    assert exc.log_message == shown and exc.get_message() == shown  # /api/kernels, the log
    assert str(exc) == shown
    assert HTTPError(500, str(exc)).log_message == shown  # /api/sessions
