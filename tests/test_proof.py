"""The agent's proof of a claimed kernel (``provisioner/node/proof.py``) on a
made-up ``/proc`` tree: the secret in the start environment, the account's uid, a pid
reused by another process (its start time), the cgroup accepted for a driver limit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from provisioner.node import proof
from provisioner.node.proof import Claim, Prover, cgroup_accepted
from provisioner.wire import KERNEL_SECRET_ENV, kernel_proof

SECRET = "s3cret-of-the-lease"
PROOF = kernel_proof(SECRET)


def fake_process(
    proc: Path,
    pid: int,
    *,
    env: dict[str, str] | None = None,
    uid: int = 1000,
    start: int = 4242,
    ppid: int = 1,
    cgroup: str = "/user.slice",
    nspid: tuple[int, ...] | None = None,
) -> None:
    d = proc / str(pid)
    (d / "ns").mkdir(parents=True, exist_ok=True)
    environ = b"".join(f"{k}={v}".encode() + b"\0" for k, v in (env or {}).items())
    (d / "environ").write_bytes(environ)
    fields = ["S", str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 10
    (d / "stat").write_text(f"{pid} (python3 x) " + " ".join(fields) + "\n")
    ns = " ".join(str(x) for x in (nspid or (pid,)))
    (d / "status").write_text(f"Name:\tpython3\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nNSpid:\t{ns}\n")
    (d / "cgroup").write_text(f"0::{cgroup}\n")
    (d / "ns" / "pid").touch()


def claim(pid: int, *, user: str = "", pid_ns: int | None = None, **more: object) -> Claim:
    return Claim(
        "lease-1", pid, pid_ns, str(more.pop("proof", PROOF)), user, "k1", "GPU-1", 900, **more
    )  # type: ignore[arg-type]


def test_a_process_with_the_secret_is_proven_and_one_without_is_not(tmp_path: Path) -> None:
    fake_process(tmp_path, 100, env={"HOME": "/x", KERNEL_SECRET_ENV: SECRET})
    fake_process(tmp_path, 200, env={"HOME": "/x"})
    fake_process(tmp_path, 300, env={KERNEL_SECRET_ENV: "another lease's secret"})
    prover = Prover(check_account="no", proc=str(tmp_path))
    proven, refused = prover.prove([claim(100)])
    assert proven["lease-1"].host_pid == 100 and proven["lease-1"].uid == 1000
    assert refused == {}
    for pid in (200, 300, 999):
        proven, refused = prover.prove([claim(pid)])
        assert proven == {}
        assert list(refused) == ["lease-1"]
    assert "no process 999" in refused["lease-1"]
    # a renewal without proof (an older provisioner, or a claim made by hand)
    proven, refused = prover.prove([Claim("lease-1", 100, None, None)])
    assert proven == {} and "no proof" in refused["lease-1"]


def test_the_secret_never_shows_in_a_refusal_or_a_report(tmp_path: Path) -> None:
    fake_process(tmp_path, 100, env={KERNEL_SECRET_ENV: SECRET})
    proven, _ = Prover(check_account="no", proc=str(tmp_path)).prove([claim(100)])
    _, refused = Prover(check_account="no", proc=str(tmp_path)).prove(
        [claim(100, proof=kernel_proof("guess"))]
    )
    text = repr(proven["lease-1"].report()) + repr(refused)
    assert SECRET not in text and PROOF not in text


def test_the_account_uid_must_match_where_the_user_has_an_account(tmp_path: Path) -> None:
    root = "root"  # an account every test machine has: uid 0
    fake_process(tmp_path, 100, env={KERNEL_SECRET_ENV: SECRET}, uid=1000)
    fake_process(tmp_path, 101, env={KERNEL_SECRET_ENV: SECRET}, uid=0)
    auto = Prover(proc=str(tmp_path))
    proven, refused = auto.prove([claim(100, user=root)])
    assert proven == {} and "runs as uid 1000, not as 'root' (uid 0)" in refused["lease-1"]
    assert list(auto.prove([claim(101, user=root)])[0]) == ["lease-1"]
    # a user without an account here (a pod's uid 1000): the secret decides ...
    nobody = "no-such-account-glp"
    assert list(auto.prove([claim(100, user=nobody)])[0]) == ["lease-1"]
    # ... unless the agent requires one; or the uid check is off
    strict = Prover(check_account="yes", proc=str(tmp_path))
    assert "no Unix account" in strict.prove([claim(100, user=nobody)])[1]["lease-1"]
    off = Prover(check_account="no", proc=str(tmp_path))
    assert list(off.prove([claim(100, user=root)])[0]) == ["lease-1"]


def test_a_verdict_is_cached_until_the_pid_is_reused(tmp_path: Path) -> None:
    fake_process(tmp_path, 100, env={KERNEL_SECRET_ENV: SECRET}, start=10)
    prover = Prover(check_account="no", proc=str(tmp_path))
    assert list(prover.prove([claim(100)])[0]) == ["lease-1"]
    # the environ is not read again for the same process ...
    (tmp_path / "100" / "environ").write_bytes(b"")
    assert list(prover.prove([claim(100)])[0]) == ["lease-1"]
    # ... but a process that reuses the pid (another start time) is checked afresh
    fake_process(tmp_path, 100, env={"PATH": "/bin"}, start=11)
    proven, refused = prover.prove([claim(100)])
    assert proven == {} and "does not carry" in refused["lease-1"]


def test_a_namespaced_claim_resolves_through_nspid_and_namespace(tmp_path: Path) -> None:
    # two "pods", each with its kernel as pid 7 of its own namespace
    fake_process(tmp_path, 500, env={KERNEL_SECRET_ENV: SECRET}, nspid=(500, 7))
    fake_process(tmp_path, 600, env={KERNEL_SECRET_ENV: "the other pod's"}, nspid=(600, 7))
    ns_a = os.stat(tmp_path / "500" / "ns" / "pid").st_ino
    ns_b = os.stat(tmp_path / "600" / "ns" / "pid").st_ino
    prover = Prover(check_account="no", proc=str(tmp_path))
    proven, _ = prover.prove([claim(7, pid_ns=ns_a)])
    assert proven["lease-1"].host_pid == 500
    proven, refused = prover.prove([claim(7, pid_ns=ns_b)])
    assert proven == {} and "process 600 does not carry" in refused["lease-1"]


def test_two_leases_cannot_prove_the_same_process(tmp_path: Path) -> None:
    fake_process(tmp_path, 100, env={KERNEL_SECRET_ENV: SECRET})
    first = claim(100)
    second = Claim("lease-2", 100, None, PROOF, "", "k2", "GPU-1", 900)
    proven, refused = Prover(check_account="no", proc=str(tmp_path)).prove([second, first])
    assert list(proven) == ["lease-1"] and "already lease lease-" in refused["lease-2"]


@pytest.mark.parametrize(
    ("cgroup", "parents", "accepted"),
    [
        ("/system.slice/jupyterhub.service/gpu-lease/kernel-k1", [], True),
        ("/gpu-lease/kernel-k1", [], True),
        ("/gpu-lease/kernel-k2", [], False),  # another kernel's name
        ("/user.slice", [], False),
        ("/", [], False),
        ("/x/kernel-k1", [], False),  # not under gpu-lease
        (None, [], False),
        ("/kernels/k1", ["/kernels"], True),
        ("/kernels", ["/kernels"], False),  # the parent itself
        ("/kernelsX/k1", ["/kernels"], False),
        ("/user.slice", ["/kernels", "/other/"], False),
    ],
)
def test_which_cgroup_may_carry_a_driver_limit(
    cgroup: str | None, parents: list[str], accepted: bool
) -> None:
    assert cgroup_accepted(cgroup, "k1", parents) is accepted


def test_a_process_that_left_a_limited_cgroup_escapes_and_one_inside_counts(
    tmp_path: Path,
) -> None:
    kernel = "/srv/gpu-lease/kernel-k1"
    fake_process(tmp_path, 100, env={KERNEL_SECRET_ENV: SECRET}, cgroup=kernel)
    fake_process(tmp_path, 101, ppid=100, cgroup=kernel)
    fake_process(tmp_path, 102, ppid=100, cgroup="/")  # moved itself out
    fake_process(tmp_path, 103, ppid=1, cgroup=kernel + "/sub")  # double-forked, inside
    proven, _ = Prover(check_account="no", proc=str(tmp_path)).prove([claim(100)])
    members = {100: [101, 102]}
    assert proof.escapes(members, proven, {kernel}, str(tmp_path)) == {"lease-1": [102]}
    assert proof.escapes(members, proven, set(), str(tmp_path)) == {}  # no limit: no escape
    lookup = proof.by_cgroup(proven, str(tmp_path))
    assert lookup(103) == 100 and lookup(102) is None


def test_the_broker_keeps_only_what_a_proving_agent_proved() -> None:
    """``KernelPlaces`` (broker, pure): the claim handed to the agent carries the proof and
    the lease's memory; what the agent proved (uid, cgroup) replaces the claim; a refusal
    is new once; ``proven_uids`` names only proven kernels (the MPS owners' source)."""
    from provisioner.broker.rules.kernel_places import KernelPlaces
    from provisioner.model import Lease
    from provisioner.node_report import NodeProofs, ProvenKernel

    def lease(i: str, mps_uid: int | None = None) -> Lease:
        return Lease(
            i, "alice", f"k{i}", "GPU-1", 100_000, 1126, "active", 0, 0, 60, pid=7, mps_uid=mps_uid
        )

    leases = [lease("a"), lease("b", 1000)]
    places = KernelPlaces()
    places.renewed("a", 4026531001, "/user.slice", PROOF)
    places.renewed("b", 4026531002, None, None)
    named = places.kernels(leases, 512)
    assert [(k["lease_id"], k["proof"], k["memory_mb"], k["enforcement"]) for k in named] == [
        ("a", PROOF, 1638, "cooperative"),
        ("b", None, 1638, "mps"),
    ]
    said = NodeProofs({"a": ProvenKernel("a", 30001, 1000, "/gpu-lease/kernel-ka")}, {"b": "no"})
    assert places.agent_said(leases, said) == [("b", "no")]
    assert places.agent_said(leases, said) == []  # the same refusal: not new
    assert places.proven_uids() == {"a": 1000}
    places.driver_limited["n"] = {"/user.slice", "/gpu-lease/kernel-ka"}
    assert places.driver_limited_on("n", "a")  # on the proven cgroup, not the claimed one
    places.driver_limited["n"] = {"/user.slice"}
    assert not places.driver_limited_on("n", "a") and not places.driver_limited_on("n", "b")
    assert places.by_host_pid(leases, None, said) == {30001: leases[0]}
    places.forget_ended({"b"})
    assert places.proven_uids() == {} and "a" not in places.places


def test_park_orders_run_only_for_proven_kernels_and_fail_at_once_for_refused_ones() -> None:
    """A park order names the kernel by its claim; the agent runs it on the proven host pid,
    and settles one for a refused claim as failed at once (the broker reclaims the lease
    instead of waiting for its park_timeout); nothing is checkpointed for it."""
    from provisioner.node.parking import Parker, proven_orders

    good = Claim("lease-1", 7, 4026531001, PROOF, "", "k1", "GPU-1", 900)
    proven = {"lease-1": proof.Proven(good, 30001, 1000, None, False)}
    order = {"action": "park", "gpu_uuid": "GPU-1", "memory_mb": 900}
    orders = [
        {**order, "lease_id": "lease-1", "pid": 7, "pid_ns": 4026531001},
        {**order, "lease_id": "lease-2", "pid": 30001, "pid_ns": None},  # claims lease-1's
    ]
    run, fail = proven_orders(orders, proven, {"lease-2": "process 30001 does not carry …"})
    assert run == [{**orders[0], "pid": 30001, "pid_ns": None}]
    assert fail == [(orders[1], "process 30001 does not carry …")]
    parker = Parker(None, "no driver here", list, lambda uuid: None)
    parker.refuse(*fail[0])
    (outcome,) = parker.outcomes()
    assert (outcome["lease_id"], outcome["outcome"]) == ("lease-2", "failed")
    assert outcome["message"].startswith("the node agent did not prove this lease's kernel")
    assert parker.ready.is_set()


# -- processes outside MPS (a kernel that unset CUDA_MPS_PIPE_DIRECTORY) --------------------


def _mps_kernel(lease_id: str, host: int, enforcement: str = "mps") -> proof.Proven:
    c = Claim(lease_id, host, None, PROOF, "", "k", "GPU-1", 900, enforcement)
    return proof.Proven(c, host, 1000, None, False)


MPS_PROVEN = {
    "L-mps": _mps_kernel("L-mps", 100),
    "L-coop": _mps_kernel("L-coop", 200, "cooperative"),
}
MPS_MEMBERS = {100: [101, 102], 200: [201]}


@pytest.mark.parametrize(
    "samples, clients, outside",
    [
        # both of the MPS kernel's processes are clients: nobody is outside
        ([(101, "GPU-1", 300), (102, "GPU-1", 300)], {"GPU-1": frozenset({101, 102})}, {}),
        # 102 is no client of GPU-1's server: outside (and only the MPS lease is judged)
        (
            [(101, "GPU-1", 300), (102, "GPU-1", 500), (201, "GPU-1", 9)],
            {"GPU-1": frozenset({101})},
            {"L-mps": [(102, "GPU-1")]},
        ),
        # no server runs: no process is its client
        ([(101, "GPU-1", 300)], {"GPU-1": frozenset()}, {"L-mps": [(101, "GPU-1")]}),
        # the daemon is down or did not answer (None), or is not this agent's (absent)
        ([(101, "GPU-1", 300)], {"GPU-1": None}, {}),
        ([(101, "GPU-2", 300)], {"GPU-1": frozenset()}, {}),
        # a client on one GPU is judged per GPU (MIG or two GPUs list a pid twice)
        (
            [(101, "GPU-1", 300), (101, "GPU-2", 10)],
            {"GPU-1": frozenset({101}), "GPU-2": frozenset()},
            {"L-mps": [(101, "GPU-2")]},
        ),
        # a process of no kernel is the unleased reaper's, not this check's
        ([(999, "GPU-1", 300)], {"GPU-1": frozenset()}, {}),
    ],
)
def test_which_mps_kernel_processes_run_outside_mps(
    samples: list[tuple[int, str, int]],
    clients: dict[str, frozenset[int] | None],
    outside: dict[str, list[tuple[int, str]]],
) -> None:
    assert proof.outside_mps(samples, MPS_MEMBERS, MPS_PROVEN, clients) == outside


def test_a_process_outside_mps_counts_only_in_two_consecutive_samples(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One sample may catch a client that exits (or is being replaced) between NVML's sample
    and the daemon's client list; a process outside MPS is so for its life, so the next
    sample finds it again. Each is logged once, never with the proof."""
    leavers = proof.MPSLeavers()
    once = {"L-mps": [(102, "GPU-1")]}
    assert leavers(once) == {}
    assert leavers({}) == {}  # gone (or not judged) in between: the streak breaks
    assert leavers(once) == {}
    assert leavers(once) == {"L-mps": [102]}
    assert leavers(once) == {"L-mps": [102]}
    said = [r.getMessage() for r in caplog.records if "outside MPS" in r.getMessage()]
    assert len(said) == 1 and "Kernel process 102 of lease L-mps… runs on GPU GPU-1" in said[0]
    assert PROOF not in caplog.text


def test_the_broker_reads_left_mps_and_refuses_a_bad_one() -> None:
    """The heartbeat's ``left_mps``: pids, like ``escaped``; anything else is
    refused with a sentence, and an entry without it (an agent older than it) has none."""
    from provisioner.broker.web.validation import parse_node_proofs
    from provisioner.errors import InvalidRequest

    entry = {"pid": 7, "pid_ns": None, "host_pid": 30001, "lease_id": "a", "uid": 1000}
    got = parse_node_proofs({"refused": [], "kernels": [{**entry, "left_mps": [30002]}]})
    assert got is not None and got.proven["a"].left_mps == (30002,)
    got = parse_node_proofs({"refused": [], "kernels": [entry]})
    assert got is not None and got.proven["a"].left_mps == ()
    for bad in ("30002", [0], ["x"], {"pid": 1}):
        with pytest.raises(InvalidRequest, match="'left_mps'"):
            parse_node_proofs({"refused": [], "kernels": [{**entry, "left_mps": bad}]})
