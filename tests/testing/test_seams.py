"""The public seams tests script faults with: lensemble_flwr.testing, the in-process
network's inject / take_offline / bring_online / call_at / on_deliver, the barrier's
faults, the store's on_write. (The user guide's section on them runs with the rest of the
guide: tests/docs/test_doc_snippets.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import ClaimantDied
from lensemble_flwr.protocol.messages import MessageKind
from lensemble_flwr.shared_folder.barrier import FolderBarrier, SittingKey
from lensemble_flwr.testing import BarrierFaults, DeliveryLog, FaultPlan, ManualClock
from lensemble_flwr.transports.base import COORDINATOR
from lensemble_flwr.transports.inprocess import InProcessNetwork


class Node:
    """A participant that answers nothing and keeps what reaches it."""

    def __init__(self, participant_id: str) -> None:
        self.participant_id = participant_id
        self.got: list[Any] = []

    def handle(self, payload: Any) -> None:
        self.got.append(payload)


def network_of(*pids: str, faults: FaultPlan | None = None) -> tuple[InProcessNetwork, dict]:
    network = InProcessNetwork(faults=faults)  # latency 0.01 s, compute 1 s
    nodes = {pid: Node(pid) for pid in pids}
    for node in nodes.values():
        network.attach(node)
    return network, nodes


def drain(network: InProcessNetwork, timeout_s: float = 100.0) -> list[tuple[float, Any]]:
    """What reaches the coordinator until ``timeout_s`` passes with nothing, and when."""
    got = []
    while (payload := network.coordinator.recv(timeout_s=timeout_s)) is not None:
        got.append((network.clock.time, payload))
    return got


def update(pid: str, round: int = 1, **fields: Any) -> dict[str, Any]:
    return {"kind": "update", "round": round, "sender": pid, **fields}


# -- InProcessNetwork ------------------------------------------------------------------
def test_an_injected_payload_travels_like_a_sent_one() -> None:
    network, _ = network_of("p01")
    network.inject("p01", COORDINATOR, update("p01"))  # latency + p01's compute time
    network.inject("p01", COORDINATOR, {"junk": True})  # not an update: latency only
    assert drain(network) == [
        (pytest.approx(0.01), {"junk": True}),  # routed; rejecting it is the recipient's job
        (pytest.approx(1.01), update("p01")),
    ]


def test_a_duplicate_arrives_right_behind_the_original_once() -> None:
    faults = (
        FaultPlan()
        .duplicate("p01", round=1)
        .corrupt("p01", round=1, kind="update", mutate=lambda p: {**p, "bad": True})
    )
    network, _ = network_of("p01", "p02", faults=faults)
    network.inject("p01", COORDINATOR, update("p01", x=1))
    network.inject("p02", COORDINATOR, update("p02"))  # another participant: no copy
    network.inject("p01", COORDINATOR, update("p01", x=2))  # the fault fired already
    got = drain(network)
    assert [p for _, p in got] == [
        update("p01", x=1, bad=True),  # the corruption alters the first copy only
        update("p01", x=1),
        update("p02"),
        update("p01", x=2),
    ]
    assert got[0][0] == got[1][0]
    assert faults.duplicates == []


def test_a_participant_taken_offline_neither_sends_nor_receives_until_it_is_back() -> None:
    network, nodes = network_of("p01", "p02")
    network.inject(COORDINATOR, "p01", {"kind": "round-close", "round": 1})  # in flight
    network.take_offline("p01")
    assert network.online() == ["p02"]
    assert network.coordinator.peers() == ("p02",)
    network.inject("p01", COORDINATOR, update("p01"))
    assert drain(network) == [] and nodes["p01"].got == []  # both lost
    network.bring_online("p01")
    assert network.online() == ["p01", "p02"]
    network.inject(COORDINATOR, "p01", {"kind": "round-close", "round": 2})
    network.inject("p01", COORDINATOR, update("p01", round=2))
    assert [p for _, p in drain(network)] == [update("p01", round=2)]
    assert nodes["p01"].got == [{"kind": "round-close", "round": 2}]
    with pytest.raises(ValueError, match="coordinator"):
        network.take_offline(COORDINATOR)


def test_call_at_runs_at_its_simulated_time_between_deliveries() -> None:
    network, _ = network_of("p01")
    ran: list[tuple[str, float]] = []
    network.call_at(2.0, lambda: ran.append(("late", network.clock.time)))
    network.call_at(0.5, lambda: ran.append(("early", network.clock.time)))
    network.inject("p01", COORDINATOR, update("p01"))  # arrives at 1.01
    assert network.coordinator.recv(timeout_s=10.0) == update("p01")
    assert ran == [("early", 0.5)] and network.clock.time == pytest.approx(1.01)
    assert network.coordinator.recv(timeout_s=0.5) is None  # nothing due by 1.51
    assert ran == [("early", 0.5)]
    assert network.coordinator.recv(timeout_s=5.0) is None
    assert ran == [("early", 0.5), ("late", 2.0)]
    assert network.clock.time == pytest.approx(6.51)  # the wait still ends at its deadline


def test_a_call_can_attach_a_participant_and_flush_leaves_later_calls_alone() -> None:
    network, _ = network_of("p01")
    late = Node("p09")
    network.call_at(3.0, lambda: network.attach(late))
    network.call_at(50.0, lambda: pytest.fail("ran at flush"))
    network.inject("p01", COORDINATOR, update("p01"))
    network.inject(COORDINATOR, "p09", {"kind": "round-open", "round": 1})
    network.flush()
    assert late.got == [] and network.online() == ["p01"]  # flush ran no call
    assert network.coordinator.recv(timeout_s=0.0) == update("p01")  # flushed to the inbox
    assert network.coordinator.recv(timeout_s=3.0) is None  # the call at 3.0 runs
    assert network.online() == ["p01", "p09"]


def test_on_deliver_sees_every_delivery_in_order_before_its_recipient() -> None:
    network, nodes = network_of("p01", "p02")
    seen: list[tuple[str, str, Any, int]] = []

    def observe(source: str, dest: str, payload: Any) -> None:
        seen.append((source, dest, payload, len(nodes["p01"].got)))

    assert network.on_deliver(observe) is observe  # so it can decorate
    network.take_offline("p02")
    network.inject(COORDINATOR, "p01", {"kind": "round-open", "round": 1})
    network.inject(COORDINATOR, "p02", {"kind": "round-open", "round": 1})
    network.inject("p01", COORDINATOR, update("p01"))
    drain(network)
    assert seen == [
        (COORDINATOR, "p01", {"kind": "round-open", "round": 1}, 0),  # before p01 has it
        ("p01", COORDINATOR, update("p01"), 1),
    ]  # nothing was sent to p02 (offline when it was posted)


def test_a_delivery_log_keeps_and_filters_what_is_delivered() -> None:
    network, _ = network_of("p01", "p02")
    to_coordinator = DeliveryLog(network, dest=COORDINATOR)
    everything = DeliveryLog(network)
    network.inject(COORDINATOR, "p01", {"kind": "round-open", "round": 1})
    network.inject("p01", COORDINATOR, update("p01"))
    network.inject("p02", COORDINATOR, update("p02", round=2))
    network.inject("p02", COORDINATOR, {"junk": True})
    drain(network)
    assert len(everything) == 4 and len(to_coordinator) == 3
    assert [d.dest for d in everything] == ["p01", COORDINATOR, COORDINATOR, COORDINATOR]
    updates = to_coordinator.payloads(MessageKind.UPDATE)
    assert updates == [update("p01"), update("p02", round=2)]
    assert to_coordinator.payloads(MessageKind.UPDATE, round=2) == [update("p02", round=2)]
    assert to_coordinator.payloads("update") == updates  # the wire string names it too
    with pytest.raises(ValueError):
        to_coordinator.payloads("updates")  # a kind that does not exist is an error, not []
    assert to_coordinator.payloads(source="p02") == [{"junk": True}, update("p02", round=2)]
    assert to_coordinator.payloads(round=1, source="p02") == []
    times = [(d.source, d.time) for d in to_coordinator.deliveries]
    assert times == [("p02", 0.01), ("p01", 1.01), ("p02", 1.01)]


# -- ManualClock ---------------------------------------------------------------------------
def test_a_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(10.0)
    assert clock() == 10.0
    clock.sleep(0.5)
    clock.advance(2.0)
    assert (clock(), clock.sleeps) == (12.5, [0.5])
    with pytest.raises(ValueError):
        clock.sleep(-1)
    with pytest.raises(ValueError):
        clock.advance(-1)


# -- BarrierFaults -------------------------------------------------------------------------
def barrier(store: Store, who: str, clock: ManualClock, **kwargs: Any) -> FolderBarrier:
    timeouts = {"round_timeout": 5.0, "publish_timeout": 2.0}
    return FolderBarrier(store, identity=who, clock=clock, sleep=clock.sleep, **timeouts, **kwargs)


def test_a_lost_publication_leaves_the_others_waiting_for_a_claimant_that_kept_it(
    tmp_path: Path,
) -> None:
    clock, store, key = ManualClock(), Store(tmp_path), SittingKey(1, 1)
    lost: list[str] = []

    def lose(name: str) -> bool:
        lost.append(name)
        return name.endswith("/outcome")

    a = barrier(store, "A", clock, faults=BarrierFaults(lose=lose))
    assert a.start(lambda: b"genesis") == b"genesis"  # not lost: it was published
    a.deposit(key, "a", b"from a")
    assert a.gather(key, ["a"], lambda s: b"decided") == b"decided"  # A goes on with it
    assert lost == ["barrier/genesis", f"{key.name}/outcome"]
    assert a.outcome(key) is None
    b = barrier(store, "B", clock)
    assert b.start(lambda: pytest.fail("created twice")) == b"genesis"
    with pytest.raises(ClaimantDied, match="A claimed it"):
        b.gather(key, ["a"], lambda s: pytest.fail("the claim was taken over"))


def test_on_claim_sees_every_claim_won_before_it_is_acted_on(tmp_path: Path) -> None:
    clock, store, key = ManualClock(), Store(tmp_path), SittingKey(3, 3)
    claims: list[str] = []

    class Died(BaseException):
        pass

    def die_deciding(name: str) -> None:
        claims.append(name)
        if name.endswith("/decision"):
            raise Died

    a = barrier(store, "A", clock)
    a.faults = BarrierFaults(on_claim=die_deciding)
    a.start(lambda: b"genesis")
    a.deposit(key, "a", b"from a")
    with pytest.raises(Died):
        a.gather(key, ["a"], lambda s: pytest.fail("decided after dying"))
    assert claims == ["barrier/start", f"{key.name}/decision"]
    with pytest.raises(ClaimantDied, match="round 3 sitting 3: A claimed it"):
        barrier(store, "B", clock).gather(key, ["a"], lambda s: pytest.fail("taken over"))


# -- Store(on_write=...) -------------------------------------------------------------------
def test_on_write_sees_every_write_before_it_is_published(tmp_path: Path) -> None:
    writes: list[tuple[str, str, bytes]] = []
    store = Store(tmp_path, on_write=lambda *w: writes.append(w))
    digest = store.put(b"data")
    store.put(b"data")  # already stored: nothing is written
    store.bind("a/name", digest)
    assert store.claim("a/claim", digest) and not store.claim("a/claim", digest)
    line = digest.encode() + b"\n"
    assert writes == [
        ("blob", digest, b"data"),
        ("name", "a/name", line),
        ("name", "a/claim", line),
        ("name", "a/claim", line),  # a claim that finds the name taken writes nothing
    ]


def test_a_write_hook_that_raises_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    store = Store(tmp_path)
    digest = store.put(b"kept")

    def refuse(kind: str, key: str, data: bytes) -> None:
        raise OSError(f"no {kind} {key}")

    store.on_write = refuse
    with pytest.raises(OSError, match="no blob"):
        store.put(b"new")
    with pytest.raises(OSError, match="no name a/name"):
        store.bind("a/name", digest)
    with pytest.raises(OSError, match="no name a/claim"):
        store.claim("a/claim", digest)
    assert store.put(b"kept") == digest  # stored already: the hook is not called
    fresh = Store(tmp_path)
    assert fresh.bound() == [] and not any((tmp_path / "tmp").iterdir())
    assert sorted(p.name for p in (tmp_path / "blobs").rglob("*") if p.is_file()) == [digest]


# -- the package -----------------------------------------------------------------------
def test_the_testing_package_imports_neither_flwr_nor_torch() -> None:
    code = (
        "import sys, lensemble_flwr.testing as t; "
        "print(sorted(m for m in ('flwr', 'torch') if m in sys.modules), t.__all__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert out.startswith("[] ["), out
