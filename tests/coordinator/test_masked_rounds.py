"""Masked rounds on the in-process transport: the coordinator only ever sees masked
updates, and the revealed sum is bitwise the plaintext sum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import SecureAggregationError
from lensemble_flwr.protocol.messages import MessageKind, kind_of
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.testing import DeliveryLog, FaultPlan
from lensemble_flwr.transports.base import COORDINATOR
from lensemble_flwr.transports.inprocess import InProcessNetwork
from tests.strategies.test_grid_transport import _serverapp_identity  # noqa: F401  (autouse)


def masked_config(**federation):
    return small_config(secagg_threshold=3, min_participants=3, **federation)


def payloads_to_coordinator(network, kind: MessageKind) -> list[dict]:
    return [p for p in SEEN[network].payloads() if kind_of(p) is kind]


def payloads_to_coordinator_of(log: DeliveryLog, kind: MessageKind) -> list[dict]:
    return [p for p in log.payloads(kind) if isinstance(p, dict) and p.get("sender") != COORDINATOR]


SEEN: dict[InProcessNetwork, DeliveryLog] = {}  # what each run's coordinator received


def run(tmp: Path, name: str, config, rounds: int, faults: FaultPlan | None = None):
    coordinator, network, nodes = federation(tmp, config=config, name=name, faults=faults)
    SEEN[network] = DeliveryLog(network, dest=COORDINATOR)
    coordinator.run(rounds)
    return coordinator, network, nodes


def test_the_revealed_sum_is_bitwise_the_plaintext_sum(tmp_path: Path) -> None:
    plain, _, _ = run(tmp_path, "plain", small_config(min_participants=3), 3)
    masked, _network, _ = run(tmp_path, "masked", masked_config(), 3)
    assert all(o.state is RoundState.CLOSED for o in masked.outcomes)
    # same releases, same integers, same sum: the same global state, bit for bit
    assert masked.global_state().params_hash == plain.global_state().params_hash
    plain_records = Ledger(Store(tmp_path / "plain")).records()
    masked_records = verify(Store(tmp_path / "masked"))
    from lensemble_flwr.provenance.ledger import RunManifest

    assert all(e.secure_sum for e in RunManifest.load(Store(tmp_path / "masked")).rounds)
    assert not any(e.secure_sum for e in RunManifest.load(Store(tmp_path / "plain")).rounds)
    assert [r.new_global_hash for r in masked_records] == [r.new_global_hash for r in plain_records]


def test_the_coordinator_never_holds_an_individual_plaintext_update(tmp_path: Path) -> None:
    _, network, _nodes = run(tmp_path, "masked", masked_config(), 2)
    updates = payloads_to_coordinator(network, MessageKind.UPDATE)
    assert len(updates) == 8
    for update in updates:
        assert update["masked"] is True
        assert all(a.dtype == np.int64 for a in update["delta"].values())
        # a masked input looks nothing like a fixed-point delta: those are below 2**40 in
        # magnitude here, a uniform word mod 2**64 is with probability 2**-23 per value
        small = sum(int((np.abs(a) < 2**40).sum()) for a in update["delta"].values())
        assert small == 0
    assert payloads_to_coordinator(network, MessageKind.UNMASK_RESPONSE)


def test_a_steady_state_masked_round_is_two_exchanges(tmp_path: Path) -> None:
    _, network, _ = run(tmp_path, "masked", masked_config(), 3)
    to_nodes = [d for d in network.delivered if d[2] != "coordinator"]
    per_round = {}
    for _, _, dest, kind, rnd in to_nodes:
        if kind in (MessageKind.ROUND_OPEN, MessageKind.UNMASK_REQUEST):
            per_round.setdefault(rnd, {}).setdefault(dest, 0)
            per_round[rnd][dest] += 1
    # round 1 also sets up keys: RoundOpen, RoundOpen with the members, unmask
    assert max(per_round[1].values()) == 3
    assert all(max(per_round[r].values()) == 2 for r in (2, 3))


@pytest.mark.parametrize("dropped_in", [1, 2], ids=["first round", "a later round"])
def test_a_member_dropping_before_its_masked_input_is_unmasked_around(
    tmp_path: Path, dropped_in: int
) -> None:
    """In the first round of a member set too: nothing the dropped member should have
    sent is needed, the survivors disclose their pairwise seeds with it (of that round)."""
    plain, _, _ = run(
        tmp_path,
        "plain",
        small_config(min_participants=3),
        2,
        faults=FaultPlan().drop("p02", round=dropped_in, at=RoundState.COLLECTING),
    )
    faults = FaultPlan().drop("p02", round=dropped_in, at=RoundState.COLLECTING)
    masked, network, _ = run(tmp_path, "masked", masked_config(), 2, faults=faults)
    # p02 never comes back: 3 contributors from the round it dropped in
    assert [o.count for o in masked.outcomes] == ([3, 3] if dropped_in == 1 else [4, 3])
    assert all(o.state is RoundState.CLOSED for o in masked.outcomes)
    assert masked.global_state().params_hash == plain.global_state().params_hash
    responses = payloads_to_coordinator(network, MessageKind.UNMASK_RESPONSE)
    dropped_round = [p for p in responses if p["round"] == dropped_in]
    assert dropped_round and all(set(p["pair_seeds"]) == {"p02"} for p in dropped_round)


def test_too_few_disclosures_abort_with_a_secure_aggregation_error(tmp_path: Path) -> None:
    def garble(payload: dict) -> dict:
        payload["b_shares"] = {"p00": "not-a-share"}
        return payload

    faults = FaultPlan().corrupt("p00", round=1, kind=MessageKind.UNMASK_RESPONSE, mutate=garble)
    config = small_config(secagg_threshold=4, min_participants=4)
    coordinator, _, _ = run(tmp_path, "masked", config, 1, faults=faults)
    first, second = coordinator.outcomes
    assert first.state is RoundState.ABORTED and isinstance(first.error, SecureAggregationError)
    assert second.state is RoundState.CLOSED  # retried, and the retry closes
    assert Ledger(Store(tmp_path / "masked")).records()[0].attempt == 2


def test_masked_rounds_over_a_flower_grid(tmp_path: Path) -> None:
    """The same masked rounds through GridTransport and ClientApp participants (no Ray):
    keys live in each node's Context, the unmask exchange is a train instruction."""
    from flwr.app import Context, RecordDict

    from lensemble_flwr.coordinator.coordinator import Coordinator
    from lensemble_flwr.simulations.toy import initial_params
    from tests.strategies.test_grid_transport import (
        NODES,
        FakeClock,
        FakeGrid,
        clientapp_node,
        make_transport,
    )

    config = masked_config()
    clock = FakeClock()
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    grid = FakeGrid(clock, {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)})
    fed = config.federation
    transport = make_transport(grid, clock, message_ttl=fed.open_timeout + fed.collect_timeout)
    coordinator = Coordinator(
        config,
        transport=transport,
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
        run_id="flwr-1",
    )
    coordinator.run(2)
    assert [o.count for o in coordinator.outcomes] == [4, 4]
    verify(Store(tmp_path / "run"))
    assert transport.exchanges(2) == 2  # RoundOpen -> masked update, unmask -> shares
    assert grid.stored == {} and transport.dropped == []


def test_a_masked_round_with_a_drop_over_a_flower_grid_checks_the_survivors(
    tmp_path: Path,
) -> None:
    """A member that stops answering once it is listed in round 2: the survivors get the
    survivor check as a train instruction of its own and attest through their ClientApp;
    that round is three exchanges (a round without a drop stays at two:
    ``test_masked_rounds_over_a_flower_grid``)."""
    from flwr.app import Context, Message, RecordDict

    from lensemble_flwr.strategies import records
    from tests.strategies.test_grid_transport import (
        NODES,
        FakeClock,
        FakeGrid,
        clientapp_node,
        make_transport,
    )

    config = masked_config()
    clock = FakeClock()
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    nodes = {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)}
    answer = nodes[NODES[0]]

    def silent_in_round_two(message: Message) -> Message | None:
        for payload in records.decode_instruction(message.content):
            if payload.get("round") == 2 and payload.get("secagg_members"):
                return None  # listed, then gone: its masked update never comes
        return answer(message)

    nodes[NODES[0]] = silent_in_round_two
    grid = FakeGrid(clock, nodes)
    fed = config.federation
    transport = make_transport(grid, clock, message_ttl=fed.open_timeout + fed.collect_timeout)
    coordinator = Coordinator(
        config,
        transport=transport,
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
        run_id="flwr-1",
    )
    coordinator.run(2)
    assert [o.count for o in coordinator.outcomes] == [4, 3]
    verify(Store(tmp_path / "run"))
    checks = [
        i for i, _ in grid.delivered if records.CHECK_RECORD in records.records_of(
            i.content, records.ConfigRecord
        )
    ]  # fmt: skip
    assert len(checks) == 3 and {int(i.metadata.group_id) for i in checks} == {2}
    assert transport.exchanges(1) == 3  # keys, members, unmask
    assert transport.exchanges(2) == 3  # members, survivor check, unmask


def test_a_member_that_dropped_over_a_flower_grid_masks_again_the_next_round(
    tmp_path: Path,
) -> None:
    """node-11 goes silent once it is listed in round 2 and answers again in round 3:
    round 3 takes it back with a fresh mask key and closes on its first attempt."""
    from flwr.app import Context, Message, RecordDict

    from lensemble_flwr.strategies import records
    from tests.strategies.test_grid_transport import (
        NODES,
        FakeClock,
        FakeGrid,
        clientapp_node,
        make_transport,
    )

    config = masked_config()
    clock = FakeClock()
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    nodes = {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)}
    answer = nodes[NODES[0]]

    def silent_in_round_two(message: Message) -> Message | None:
        for payload in records.decode_instruction(message.content):
            if payload.get("round") == 2 and payload.get("secagg_members"):
                return None
        return answer(message)

    nodes[NODES[0]] = silent_in_round_two
    grid = FakeGrid(clock, nodes)
    fed = config.federation
    transport = make_transport(grid, clock, message_ttl=fed.open_timeout + fed.collect_timeout)
    coordinator = Coordinator(
        config,
        transport=transport,
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
        run_id="flwr-1",
    )
    coordinator.run(3)
    # one attempt per round: nobody refuses round 3 while node-11 commits again
    assert [o.state for o in coordinator.outcomes] == [RoundState.CLOSED] * 3
    assert [o.count for o in coordinator.outcomes] == [4, 3, 4]
    assert [(e.round, e.attempt) for e in coordinator.manifest.rounds] == [(1, 1), (2, 1), (3, 1)]
    assert not any(e.refused for e in coordinator.manifest.rounds)
    verify(Store(tmp_path / "run"))
    opens: dict[int, list[dict]] = {}
    for instruction, _ in grid.delivered:
        for payload in records.decode_instruction(instruction.content):
            if payload.get("round") == 3 and kind_of(payload) is MessageKind.ROUND_OPEN:
                opens.setdefault(instruction.metadata.dst_node_id, []).append(payload)
    # node-11 is asked for a fresh key, then gets the members; the others only the members
    assert [(bool(p["needs_commitment"]), bool(p["secagg_members"])) for p in opens[11]] == [
        (True, False),
        (False, True),
    ]
    assert all([bool(p["secagg_members"]) for p in opens[n]] == [True] for n in NODES[1:])
    assert transport.exchanges(3) == 3  # node-11: commitment, members, unmask


def test_every_round_attempt_masks_with_fresh_keys(tmp_path: Path) -> None:
    """A mask key serves one attempt: each member set lists keys never listed before, and
    a member whose key was spent without a successor (it dropped) commits a new one."""
    faults = FaultPlan().drop("p02", round=2, at=RoundState.COLLECTING).rejoin("p02", round=3)
    coordinator, network, _ = run(tmp_path, "masked", masked_config(), 4, faults=faults)
    assert all(o.state is RoundState.CLOSED for o in coordinator.outcomes)
    assert "p02" in coordinator.outcomes[-1].contributors  # it masks again, with a new key
    keys_per_attempt: dict[tuple[int, int], set[str]] = {}
    for update in payloads_to_coordinator(network, MessageKind.UPDATE):
        keys_per_attempt.setdefault((update["round"], update["attempt"]), set()).add(
            update["next_mask_key"]
        )
    announced = [k for keys in keys_per_attempt.values() for k in keys]
    commitments = [
        p["mask_key"] for p in payloads_to_coordinator(network, MessageKind.COMMITMENT)
    ]
    assert len(set(announced + commitments)) == len(announced) + len(commitments)  # all fresh
    assert len(commitments) == 5  # four at the start, p02 once more after it dropped
    verify(Store(tmp_path / "masked"))


def test_keyed_members_wait_for_the_member_list_while_a_rejoiner_commits(
    tmp_path: Path,
) -> None:
    """In process: p02 goes silent in round 2 (its key spent) and is reachable again when
    round 3 begins; only p02 is asked for a fresh key, and the others, still keyed, get
    one RoundOpen each (the one that lists the members), not one that asks nothing."""
    faults = FaultPlan().drop("p02", round=2, at=RoundState.COLLECTING)
    coordinator, network, _ = federation(tmp_path, config=masked_config(), faults=faults)
    everything = DeliveryLog(network)
    coordinator.run(2)
    network.bring_online("p02")  # as a Flower node that answers again: its state is kept
    coordinator.run(1)
    assert [(o.state, o.count) for o in coordinator.outcomes] == [
        (RoundState.CLOSED, 4),
        (RoundState.CLOSED, 3),
        (RoundState.CLOSED, 4),
    ]
    opens: dict[str, list[tuple[bool, bool]]] = {}
    for d in everything.deliveries:
        if kind_of(d.payload) is MessageKind.ROUND_OPEN and d.payload["round"] == 3:
            asked = (bool(d.payload["needs_commitment"]), bool(d.payload["secagg_members"]))
            opens.setdefault(d.dest, []).append(asked)
    assert opens.pop("p02") == [(True, False), (False, True)]
    assert opens == {p: [(False, True)] for p in ("p00", "p01", "p03")}


def test_a_keyed_participant_that_appears_after_the_members_are_fixed_waits(
    tmp_path: Path,
) -> None:
    """p03 is unreachable when round 3's members are fixed and comes back while they
    train: it is sent nothing in round 3 (nothing in it is for a non-member that holds a
    key) and masks in round 4 with the key it announced in round 2, with no commitment."""
    coordinator, network, _ = federation(tmp_path, config=masked_config())
    everything = DeliveryLog(network)
    coordinator.run(2)
    network.take_offline("p03")
    network.call_at(network.clock.time + 0.5, lambda: network.bring_online("p03"))
    coordinator.run(2)
    assert [(o.state, o.count) for o in coordinator.outcomes][2:] == [
        (RoundState.CLOSED, 3),
        (RoundState.CLOSED, 4),
    ]
    to_p03 = {(kind_of(d.payload), d.payload["round"]) for d in everything.deliveries
              if d.dest == "p03"}  # fmt: skip
    assert (MessageKind.ROUND_OPEN, 3) not in to_p03 and (MessageKind.ROUND_OPEN, 4) in to_p03
    assert "p03" not in coordinator.manifest.rounds[2].invited
    commitments = payloads_to_coordinator_of(everything, MessageKind.COMMITMENT)
    assert [p["participant_id"] for p in commitments].count("p03") == 1  # round 1 only


def test_a_sparse_neighbour_graph_reveals_bitwise_the_plaintext_sum(tmp_path: Path) -> None:
    plain, _, _ = run(tmp_path, "plain", small_config(min_participants=3), 3)
    sparse_config = small_config(secagg_threshold=3, min_participants=3, secagg_neighbours=2)
    sparse, network, _ = run(tmp_path, "sparse", sparse_config, 3)
    assert sparse.global_state().params_hash == plain.global_state().params_hash
    opens = [p for p in payloads_to_coordinator(network, MessageKind.UPDATE)]
    assert opens and all(p["masked"] for p in opens)
    assert all(e.secure_sum for e in sparse.manifest.rounds)


def test_a_participant_refuses_a_sparser_graph_than_it_agreed_to(tmp_path: Path) -> None:
    config = small_config(secagg_threshold=3, min_participants=3)  # full graph agreed
    _, network, _ = federation(tmp_path, config=config, name="run")
    sparser = config.model_copy(
        update={"federation": config.federation.model_copy(update={"secagg_neighbours": 2})}
    )
    coordinator = Coordinator(  # the coordinator asks for degree 2
        sparser,
        transport=network.coordinator,
        initial_params=initial_params(),
        store=Store(tmp_path / "sparser"),
    )
    outcome = coordinator.run_attempt()
    assert outcome.state is RoundState.ABORTED
    entry = coordinator.manifest.rounds[-1]
    assert entry.refused and not entry.contributors  # it aborts once quorum is out of reach
    assert all("neighbour graph of degree 2" in r for r in entry.refused.values())


def test_a_member_update_that_is_refused_announces_no_mask_key(tmp_path: Path) -> None:
    """p01's first masked update has the wrong layout: it is refused (the attempt aborts,
    as a masked sum cannot go on without knowing) and the next mask key it carried is not
    kept — the refused message changed nothing. p01's listed key is spent, so the retry
    has it commit a fresh one, and closes with everyone."""

    def drop_an_array(payload: dict) -> dict:
        payload["delta"] = dict(list(payload["delta"].items())[1:])
        return payload

    faults = FaultPlan().corrupt("p01", round=1, kind=MessageKind.UPDATE, mutate=drop_an_array)
    coordinator, _, _ = federation(tmp_path, config=masked_config(), faults=faults)
    kept: list[tuple[RoundState, set[str]]] = []

    def watch(machine) -> None:
        if machine.state in (RoundState.ABORTED, RoundState.AGGREGATING):
            kept.append((machine.state, set(coordinator.registry.membership.mask_keys)))

    coordinator.on_transition = watch
    coordinator.run(1)
    first, second = coordinator.outcomes
    assert first.state is RoundState.ABORTED and "wrong layout" in (first.reason or "")
    assert kept[0][0] is RoundState.ABORTED and "p01" not in kept[0][1]
    assert second.state is RoundState.CLOSED and second.count == 4
    assert kept[-1] == (RoundState.AGGREGATING, {"p00", "p01", "p02", "p03"})
