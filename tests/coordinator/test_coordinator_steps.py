"""The steps every feeder drives (begin_attempt, invite, receive, advance, conclude,
conclude_collected): each refuses to be driven out of order, and refusing changes nothing;
a failure to write the manifest after the commit point leaves the round committed."""

from __future__ import annotations

from pathlib import Path

import pytest
from federation_helpers import federation, small_config
from flwr.app import ConfigRecord

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator import durable
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import (
    ConfigError,
    FaultToleranceExceeded,
    IllegalTransition,
    StoreError,
)
from lensemble_flwr.protocol.messages import MessageKind, kind_of
from lensemble_flwr.protocol.round import RoundEvent, RoundState
from lensemble_flwr.provenance.ledger import Ledger, RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.secagg.membership import Membership
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.strategies.records import arrays_to_record
from lensemble_flwr.transports.faults import FaultPlan
from tests.strategies.test_grid_transport import _serverapp_identity  # noqa: F401  (autouse)
from tests.strategies.test_lensemble import stock_loop_federation


def lone_coordinator(tmp: Path, **config) -> Coordinator:
    return Coordinator(
        small_config(min_participants=1, **config),
        initial_params=initial_params(),
        store=Store(tmp / "run"),
        run_id="run",
    )


def test_the_steps_refuse_to_run_out_of_order(tmp_path: Path) -> None:
    coordinator = lone_coordinator(tmp_path)
    with pytest.raises(IllegalTransition, match="no round attempt has begun"):
        coordinator.receive({"kind": "update"})
    with pytest.raises(ConfigError, match="needs a transport"):
        coordinator.run(1)  # the blocking loop needs one
    attempt = coordinator.begin_attempt()
    with pytest.raises(IllegalTransition, match="has not ended"):
        coordinator.begin_attempt()
    with pytest.raises(IllegalTransition, match="cannot conclude a round that is open"):
        coordinator.conclude()
    # refused: the attempt is still OPEN and the manifest holds nothing of it
    assert attempt.phase is RoundState.OPEN and coordinator.manifest.rounds == ()
    for event in (RoundEvent.QUORUM_REACHED, RoundEvent.COLLECTION_CLOSED):
        attempt.machine.fire(event)
    with pytest.raises(IllegalTransition, match="nothing to advance"):
        coordinator.advance([], deadline_passed=True)
    with pytest.raises(IllegalTransition, match="nobody to invite"):
        coordinator.invite(["p00"])
    assert attempt.phase is RoundState.AGGREGATING and attempt.invited == set()


def test_a_batch_feeder_cannot_run_a_masked_round(tmp_path: Path) -> None:
    coordinator = lone_coordinator(tmp_path, secagg_threshold=1)
    attempt = coordinator.begin_attempt()
    with pytest.raises(ConfigError, match="unmask exchange"):
        coordinator.conclude_collected([], ["p00"])
    assert attempt.phase is RoundState.OPEN and coordinator.manifest.rounds == ()


@pytest.mark.parametrize("key", ["zz" * 32, "00" * 31, 7])
def test_a_stored_mask_key_that_is_not_32_bytes_of_hex_does_not_restore(key: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        Membership.restore({"mask_keys": {"p00": key}})
    assert Membership.restore({"mask_keys": {"p00": "ab" * 32}}).mask_keys == {"p00": "ab" * 32}


def test_a_manifest_write_that_fails_after_the_commit_point_keeps_the_round(
    tmp_path: Path,
) -> None:
    """The store refuses the closing manifest entry of round 2, after its ledger record:
    the round stays committed (CLOSED, announced), the federation stops with the store's
    error, and a resumed coordinator completes the manifest from the kept entry."""
    coordinator, network, nodes = federation(tmp_path)
    coordinator.run(1)
    broken = {"armed": True}

    def refuse_the_entry(kind: str, name: str, _data: bytes) -> None:
        if broken["armed"] and kind == "name" and name.startswith("manifest/rounds/00000002"):
            broken["armed"] = False
            raise StoreError("disk full")

    coordinator.store.on_write = refuse_the_entry
    with pytest.raises(StoreError, match="disk full"):
        coordinator.run(1)
    outcome = coordinator.outcomes[-1]
    assert (outcome.round, outcome.state) == (2, RoundState.CLOSED)
    assert coordinator.global_state().round == 2
    assert [r.round for r in Ledger(coordinator.store).records()] == [1, 2]
    network.flush()
    assert {n.last_close.round for n in nodes} == {2}  # announced all the same
    assert [e.round for e in RunManifest.load(coordinator.store).rounds] == [1]
    coordinator.store.on_write = None
    # a participant may rejoin in this window too: round 2 is committed (θ_2)
    assert nodes[0].join(str(coordinator.store.root)).round == 2
    resumed = Coordinator.resume(
        coordinator.config, transport=network.coordinator, store=coordinator.store
    )
    assert [(e.round, e.state) for e in resumed.manifest.rounds] == [
        (1, RoundState.CLOSED),
        (2, RoundState.CLOSED),
    ]
    resumed.run(1)
    assert [r.round for r in verify(coordinator.store)] == [1, 2, 3]


def test_configure_train_again_ends_the_attempt_that_never_got_its_replies(
    tmp_path: Path,
) -> None:
    strategy, grid = stock_loop_federation(tmp_path)
    arrays = arrays_to_record(initial_params())
    first = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    again = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert len(first) == len(again) == 4  # everybody is asked again, by a new attempt
    assert {m.content["config"]["lensemble.attempt"] for m in again} == {2}
    coordinator = strategy.coordinator
    assert coordinator is not None
    (stale,) = coordinator.outcomes
    assert stale.state is RoundState.ABORTED and isinstance(stale.error, FaultToleranceExceeded)
    new, metrics = strategy.aggregate_train(1, grid.send_and_receive(again))
    assert new is not None and metrics is not None and metrics["lensemble.C_t"] == 4.0


def test_a_broken_last_link_is_refused_in_the_commit_window(tmp_path: Path) -> None:
    """In the window where the newest record has no manifest entry yet, join still checks
    that record's own links: a resealed one that points at another chain is refused."""
    from lensemble_flwr.errors import LedgerError
    from lensemble_flwr.provenance.ledger import ledger_name

    coordinator, _network, nodes = federation(tmp_path)
    coordinator.run(1)

    def refuse_the_entry(kind: str, name: str, _data: bytes) -> None:
        if kind == "name" and name.startswith("manifest/rounds/00000002"):
            raise StoreError("disk full")

    coordinator.store.on_write = refuse_the_entry
    with pytest.raises(StoreError):
        coordinator.run(1)
    coordinator.store.on_write = None
    store = coordinator.store
    head = Ledger(store).head()
    assert head is not None and head.round == 2
    forged = head.model_copy(update={"previous_record_hash": "f" * 64, "record_hash": ""})
    store.bind(ledger_name(2), store.put(forged.sealed().model_dump_json().encode()))
    fresh = nodes[1]
    fresh.last_close = None  # no close to compare with: only the chain can tell
    with pytest.raises(LedgerError, match="chain broken"):
        fresh.join(str(store.root))


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"min_participants": 6}, "min-participants"),
        ({"min_participants": 3, "secagg_threshold": 5}, "secagg-threshold"),
    ],
    ids=["min-participants", "secagg-threshold"],
)
def test_a_quorum_the_declared_federation_cannot_reach_fails_before_any_attempt(
    tmp_path: Path, config: dict, key: str
) -> None:
    """Four participants, a quorum above four: it used to take every attempt of round 0
    to find out; now the first step refuses, naming both numbers, and starts nothing."""
    coordinator, network, _ = federation(tmp_path, config=small_config(**config))
    network.declared_size = 4  # the federation is these four, and nobody else
    quorum = coordinator.config.federation.quorum
    with pytest.raises(ConfigError, match=f"K = {quorum} .* has 4 participants") as refused:
        coordinator.run(1)
    assert refused.value.field == key
    assert coordinator.manifest.rounds == () and coordinator.attempt is None
    assert durable.started_attempts(coordinator.store, 1) == []


def test_a_federation_that_declares_nothing_names_ready_and_reachable_at_the_open_deadline(
    tmp_path: Path,
) -> None:
    """A network that declares no size (participants may attach at any time, as on a
    deployment): the attempt runs to its open deadline, and the error names both numbers."""
    coordinator, _network, _ = federation(tmp_path, config=small_config(min_participants=6))
    outcome = coordinator.run_attempt()
    assert outcome.state is RoundState.ABORTED
    assert isinstance(outcome.error, FaultToleranceExceeded)
    assert "4 of quorum 6 participants ready" in str(outcome.error)
    assert "of 4 reachable" in str(outcome.error)


def test_an_attempt_opened_ahead_is_continued_not_begun_again(tmp_path: Path) -> None:
    """open_attempt delivers the next attempt's RoundOpens at once; the next run carries
    that attempt to its close (attempt 1, one RoundOpen per participant)."""
    coordinator, network, participants = federation(tmp_path)
    opens: list[tuple[str, int, int]] = []
    network.on_deliver(
        lambda source, dest, payload: opens.append((dest, payload["round"], payload["attempt"]))
        if kind_of(payload) is MessageKind.ROUND_OPEN
        else None
    )
    coordinator.run(1)
    coordinator.open_attempt()
    assert coordinator.round_state() is RoundState.OPEN
    assert coordinator.attempt is not None and coordinator.attempt.round == 2
    coordinator.run(1)
    assert [(o.round, o.attempt, o.state) for o in coordinator.outcomes] == [
        (1, 1, RoundState.CLOSED),
        (2, 1, RoundState.CLOSED),
    ]
    everyone = sorted(p.participant_id for p in participants)
    assert sorted(dest for dest, r, _ in opens if r == 2) == everyone
    assert {attempt for _, r, attempt in opens if r == 2} == {1}


def test_an_attempt_opened_ahead_that_fails_to_go_out_counts_against_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error delivering the RoundOpens ends the opened attempt ABORTED; the next run
    takes that outcome as its attempt's (here the last one allowed: the run stops)."""
    coordinator, network, _ = federation(tmp_path, config=small_config(max_round_attempts=1))
    coordinator.run(1)

    def link_down(peer: str, message: object) -> None:
        raise FaultToleranceExceeded("the link is down")

    send = network.coordinator.send
    monkeypatch.setattr(network.coordinator, "send", link_down)
    coordinator.open_attempt()
    assert coordinator.round_state() is RoundState.ABORTED
    monkeypatch.setattr(network.coordinator, "send", send)  # the link is back
    with pytest.raises(FaultToleranceExceeded, match="the link is down"):
        coordinator.run(1)
    assert [(o.round, o.attempt, o.state) for o in coordinator.outcomes] == [
        (1, 1, RoundState.CLOSED),
        (2, 1, RoundState.ABORTED),
    ]
    assert coordinator.global_state().round == 1


def test_a_round_short_at_its_collect_deadline_names_who_did_not_answer(
    tmp_path: Path,
) -> None:
    """The error (and so a Flower run's final status) names the participants the round
    waited for in vain, not only how many updates it had."""
    faults = FaultPlan().delay("p02", round=1, seconds=100.0).delay("p03", round=1, seconds=100.0)
    coordinator, _, _ = federation(
        tmp_path, faults=faults, config=small_config(max_round_attempts=1)
    )
    with pytest.raises(FaultToleranceExceeded) as raised:
        coordinator.run(1)
    assert str(raised.value) == (
        "2 updates by the collect deadline (10 s, lensemble.collect-timeout; no answer "
        "from p02, p03), quorum 3"
    )
