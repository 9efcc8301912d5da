"""Participant sampling: each round attempt invites a seeded sample of the reachable
participants (FedAvg's ``fraction_train``), records whom it invited in the manifest and the
ledger, and applies the quorum to the sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config
from flwr.app import ConfigRecord

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import FederationConfig
from lensemble_flwr.errors import ConfigError, FaultToleranceExceeded
from lensemble_flwr.provenance.ledger import RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.strategies import LensembleStrategy
from lensemble_flwr.strategies.records import arrays_to_record
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    quickstart_node,
)


def sampled(tmp: Path, name: str = "run", **federation_fields: object):
    config = small_config(**{"min_participants": 2, "sample_fraction": 0.3, **federation_fields})
    return federation(tmp, participants=10, config=config, name=name)


def test_each_round_invites_a_seeded_sample_and_the_ledger_records_it(tmp_path: Path) -> None:
    coordinator, _, _ = sampled(tmp_path)
    coordinator.run(4)
    records = verify(Store(tmp_path / "run"))
    invited = [r.invited for r in records]
    assert all(len(i) == 3 for i in invited)  # int(10 * 0.3), at least K = 2
    assert len(set(invited)) > 1  # a new sample every round
    assert all(set(r.contributors) <= set(r.invited) for r in records)
    manifest = RunManifest.load(Store(tmp_path / "run"))
    assert [e.invited for e in manifest.rounds] == invited
    # the sample is a function of the root seed, the round and the attempt: a second run
    # with the same config samples the same participants
    again, _, _ = sampled(tmp_path, name="again")
    again.run(4)
    assert [r.invited for r in verify(Store(tmp_path / "again"))] == invited


def test_the_quorum_applies_to_the_sample_and_min_raises_it(tmp_path: Path) -> None:
    coordinator, _, _ = sampled(tmp_path, min_participants=4)
    coordinator.run(1)
    (record,) = verify(Store(tmp_path / "run"))
    assert len(record.invited) == 4 and record.count == 4  # the sample is never below K
    bigger, _, _ = sampled(tmp_path, name="bigger", sample_min=6)
    bigger.run(1)
    assert len(verify(Store(tmp_path / "bigger"))[0].invited) == 6


def test_an_unsampled_participant_is_not_invited_and_its_update_is_refused(
    tmp_path: Path,
) -> None:
    """A registered participant left out of the sample could otherwise send an update of
    the current attempt and have it summed: the contributors must be the invited."""
    from lensemble_flwr.coordinator.admission import admit
    from lensemble_flwr.errors import RoundError
    from lensemble_flwr.protocol.messages import Update

    coordinator, _, nodes = sampled(tmp_path)
    coordinator.run(2)  # everyone sampled in rounds 1 and 2 is now registered
    attempt = coordinator.begin_attempt()
    everyone = {n.participant_id for n in nodes}
    coordinator.invite(everyone)
    assert attempt.sample is not None and len(attempt.invited) == 3
    registered = set(coordinator.registry.commitments)
    outsider = sorted((registered & everyone) - attempt.invited)[0]
    update = Update(
        run_id=coordinator.run_id, round=attempt.round, attempt=attempt.number,
        sender=outsider, participant_id=outsider, dataset_root=None,
        delta={n: a * 0 for n, a in attempt.state.params.items()}, l2_norm=0.0,
        num_examples=1,
    )  # fmt: skip
    assert coordinator.advance(attempt.invited, deadline_passed=False)  # OPEN → COLLECTING
    with pytest.raises(RoundError, match="not invited"):
        admit(attempt, update, coordinator.core.ingress, coordinator.mode.admission)
    assert attempt.admitted == set()


@pytest.mark.parametrize(
    ("fields", "key"),
    [({"sample_fraction": 0.0}, "sample_fraction"), ({"sample_fraction": 1.5}, "sample_fraction"),
     ({"sample_min": -1}, "sample_min")],
)  # fmt: skip
def test_a_sampling_setting_out_of_range_is_refused(fields: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        FederationConfig(**fields)


def test_sample_size_is_fedavgs_rule_with_the_quorum_as_a_floor() -> None:
    fed = FederationConfig(sample_fraction=0.3, min_participants=2)
    assert [fed.sample_size(n) for n in (1, 5, 10, 50)] == [1, 2, 3, 15]
    assert FederationConfig().sample_size(7) == 7  # not sampled: everyone


def test_fraction_train_over_fifty_stock_nodes_asks_fifteen_each_round(tmp_path: Path) -> None:
    nodes = {n: quickstart_node for n in range(100, 150)}
    grid = FakeGrid(FakeClock(), nodes)
    strategy = LensembleStrategy(
        small_config(min_participants=2, retry_wait=0.0),
        run_dir=tmp_path / "run",
        fraction_train=0.3,
        fraction_evaluate=0.0,
    )
    assert strategy.config.federation.sample_fraction == 0.3  # the manifest records it
    result = strategy.start(
        grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2,
        train_config=ConfigRecord({"lr": 0.1}),
    )  # fmt: skip
    train_batches = [b for b in grid.pushes if b and b[0].metadata.message_type == "train"]
    assert [len(b) for b in train_batches] == [15, 15]
    assert [result.train_metrics_clientapp[r]["lensemble.C_t"] for r in (1, 2)] == [15.0, 15.0]
    records = verify(Store(tmp_path / "run"))
    assert [len(r.invited) for r in records] == [15, 15]
    assert {m.metadata.dst_node_id for m in train_batches[0]} == {
        int(p.split("-")[1]) for p in records[0].invited
    }
    assert RunManifest.load(Store(tmp_path / "run")).config["sample-fraction"] == 0.3


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"fraction_train": 0.0}, "fraction_train: Input should be greater than 0"),
        ({"fraction_train": 1.5}, "fraction_train: Input should be less than or equal to 1"),
        ({"min_train_nodes": -1}, "min_train_nodes: Input should be greater than or equal"),
        ({"min_available_nodes": -2}, "min_available_nodes: Input should be greater than"),
        ({"fraction_evaluate": 2.0}, "fraction_evaluate: must be in"),
        ({"poll_interval": -1.0}, "poll_interval: must be a finite number of seconds > 0"),
        ({"poll_interval": 0.0}, "poll_interval: must be a finite number of seconds > 0"),
        ({"poll_interval": float("nan")}, "poll_interval: must be a finite number"),
        ({"poll_interval": "0.1"}, "poll_interval: must be a number of seconds"),
        ({"warmup_timeout": -5}, "warmup_timeout: must be a finite number of seconds >= 0"),
        ({"config": 0.5}, "config: must be a LensembleConfig (or None), got 0.5: FedAvg's"),
        ({"config": {"federation": {}}}, "config: must be a LensembleConfig"),
        ({"identities": {"partition-id-0": "not a key"}},
         "identities['partition-id-0']: not an OpenSSH public key"),
        ({"identities": {"partition-id-0": "ssh-foo AAAAB3NzaC1mb28="}},  # unknown key type
         "identities['partition-id-0']: not an OpenSSH public key"),
        ({"weighted_by_key": None}, "weighted_by_key: must be a non-empty string"),
        ({"arrayrecord_key": ""}, "arrayrecord_key: must be a non-empty string"),
        ({"configrecord_key": 3}, "configrecord_key: must be a non-empty string"),
        ({"on_round": 3}, "on_round: must be callable"),
        ({"train_metrics_aggr_fn": "x"}, "train_metrics_aggr_fn: must be callable"),
        ({"evaluate_metrics_aggr_fn": 1}, "evaluate_metrics_aggr_fn: must be callable"),
    ],
)
def test_the_strategys_arguments_are_checked_and_named_as_given(
    arguments: dict, named: str
) -> None:
    """Flower's argument names, not the config fields they set; a negative wait is
    refused here, not as a ValueError from the transport's sleep in round 1."""
    with pytest.raises(ConfigError) as raised:
        LensembleStrategy(**arguments)
    assert str(raised.value).startswith(named)


def test_numpy_numbers_are_seconds_too() -> None:
    strategy = LensembleStrategy(poll_interval=np.float32(0.25), warmup_timeout=np.int64(0))
    assert strategy.poll_interval == pytest.approx(0.25) and strategy.warmup_timeout == 0


def test_the_stock_loop_samples_too(tmp_path: Path) -> None:
    nodes = {n: quickstart_node for n in range(100, 110)}
    grid = FakeGrid(FakeClock(), nodes)
    strategy = LensembleStrategy(
        small_config(min_participants=2), run_dir=tmp_path / "run", fraction_train=0.5,
        fraction_evaluate=0.0,
    )  # fmt: skip
    messages = list(
        strategy.configure_train(1, arrays_to_record(initial_params()), ConfigRecord(), grid)
    )
    assert len(messages) == 5
    new, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert new is not None and metrics["lensemble.C_t"] == 5.0
    assert len(verify(Store(tmp_path / "run"))[0].invited) == 5


def test_evaluation_is_a_seeded_sample_with_a_floor() -> None:
    strategy = LensembleStrategy(
        small_config(), fraction_evaluate=0.1, min_evaluate_nodes=3, run_dir=None
    )
    grid = FakeGrid(FakeClock(), {n: quickstart_node for n in range(100, 120)})
    arrays = arrays_to_record(initial_params())
    first = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    again = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    later = list(strategy.configure_evaluate(2, arrays, ConfigRecord(), grid))
    assert len(first) == 3  # max(int(20 * 0.1), 3)
    assert [m.metadata.dst_node_id for m in first] == [m.metadata.dst_node_id for m in again]
    assert {m.metadata.dst_node_id for m in later} != {m.metadata.dst_node_id for m in first}


# -- Poisson sampling ------------------------------------------------------------------
def test_a_poisson_sample_keeps_each_item_independently_at_the_rate() -> None:
    from lensemble_flwr.canonical import poisson_sample

    items = [f"p{i:03d}" for i in range(200)]
    draws = [set(poisson_sample(items, 0.1, seed, "sample")) for seed in range(400)]
    sizes = [len(d) for d in draws]
    mean, expected_sd = sum(sizes) / len(sizes), (200 * 0.1 * 0.9) ** 0.5
    assert abs(mean - 20.0) < 6 * expected_sd / len(sizes) ** 0.5  # E|S| = qN
    assert min(sizes) < 20 < max(sizes)  # the size varies: it is not a fixed-size sample
    # two given items are kept together at rate q^2 (independence), within 6 SE
    both = sum("p000" in d and "p001" in d for d in draws) / len(draws)
    assert abs(both - 0.01) < 6 * (0.01 * 0.99 / len(draws)) ** 0.5
    # reproducible, and independent of the order the items come in
    assert poisson_sample(reversed(items), 0.1, 7, "sample") == poisson_sample(
        items, 0.1, 7, "sample"
    )


def test_poisson_rounds_invite_the_seeded_draw_and_the_ledger_records_it(tmp_path: Path) -> None:
    from lensemble_flwr.canonical import derive_seed
    from lensemble_flwr.coordinator.coordinator import poisson_draw

    coordinator, _, _ = sampled(tmp_path, sample_mode="poisson", sample_fraction=0.5)
    coordinator.run(4)
    records = verify(Store(tmp_path / "run"))
    everyone = {f"p{i:02d}" for i in range(10)}
    for record in records:
        seed = derive_seed(7, "sample", record.round, record.attempt)
        assert record.invited == tuple(poisson_draw(everyone, 0.5, seed, 2))
    assert len({len(r.invited) for r in records}) > 1


def test_a_poisson_draw_below_the_quorum_is_redrawn_before_anyone_trains(
    tmp_path: Path,
) -> None:
    """A short draw could only abort the attempt after its members trained and spent their
    budget: the attempt draws again (a seed per draw) until K are in; if no draw reaches
    K, nobody is invited and the attempt aborts at once."""
    from lensemble_flwr.canonical import derive_seed, poisson_sample
    from lensemble_flwr.coordinator.coordinator import poisson_draw

    quorum, rate = 4, 0.25
    everyone = {f"p{i:02d}" for i in range(10)}
    seed = derive_seed(7, "sample", 2, 1)
    first = poisson_sample(everyone, rate, derive_seed(seed, "draw", 0), "sample")
    assert len(first) < quorum  # the seeds at hand give round 2 a short first draw
    coordinator, _, _ = sampled(
        tmp_path, sample_mode="poisson", sample_fraction=rate, min_participants=quorum
    )
    coordinator.run(2)
    round_2 = [o for o in coordinator.outcomes if o.round == 2]
    assert [o.state.value for o in round_2] == ["closed"]  # no attempt was lost
    invited = verify(Store(tmp_path / "run"))[1].invited
    assert invited == tuple(poisson_draw(everyone, rate, seed, quorum))
    assert len(invited) >= quorum
    # no draw can reach K = 11 of 10: nobody is invited, and the attempt aborts at once
    hopeless, _, nodes = sampled(
        tmp_path, name="hopeless", sample_mode="poisson", sample_fraction=rate,
        min_participants=10, max_round_attempts=1,
    )  # fmt: skip
    assert poisson_draw(everyone, rate, derive_seed(7, "sample", 1, 1), 10) != sorted(everyone)
    with pytest.raises(FaultToleranceExceeded, match="the attempt's sample has"):
        hopeless.run(1)
    assert hopeless.outcomes[-1].elapsed < hopeless.config.federation.open_timeout
    assert all(node._last_open is None for node in nodes)  # no RoundOpen went out


def test_the_sample_is_a_pure_function_of_the_reachable_the_round_and_the_attempt() -> None:
    """``draw_sample`` reads nothing but its arguments: the same values draw the same
    sample, another attempt another one, and fewer than min-available reachable draws
    none (the attempt waits)."""
    from lensemble_flwr.coordinator.sampling import draw_sample

    fed = FederationConfig(sample_fraction=0.3, min_participants=2, min_available=5)
    everyone = frozenset(f"p{i:02d}" for i in range(20))
    first = draw_sample(everyone, 3, 1, fed)
    assert first is not None and len(first) == fed.sample_size(20) and first <= everyone
    assert draw_sample(everyone, 3, 1, fed) == first
    assert draw_sample(frozenset(sorted(everyone, reverse=True)), 3, 1, fed) == first
    assert {draw_sample(everyone, 3, n, fed) for n in range(1, 6)} != {first}
    assert draw_sample(frozenset(sorted(everyone)[:4]), 3, 1, fed) is None  # 4 < 5
    poisson = fed.model_copy(update={"sample_mode": "poisson"})
    drawn = draw_sample(everyone, 3, 1, poisson)
    assert drawn is not None and len(drawn) >= poisson.quorum


def test_oversampling_is_flagged_only_for_a_noised_fixed_sample() -> None:
    from lensemble_flwr.config import PrivacyConfig
    from lensemble_flwr.coordinator.sampling import oversampled

    fixed = FederationConfig(sample_fraction=0.1, min_participants=2)
    noised = PrivacyConfig(clip_norm=1.0, noise_multiplier=1.0, dp_epsilon=8.0)
    assert oversampled(5, 20, fixed, noised)  # 5 > 0.1 * 20 + 1
    assert not oversampled(3, 20, fixed, noised)
    assert not oversampled(5, 20, fixed, PrivacyConfig())  # no noise: no plan to break
    poisson = fixed.model_copy(update={"sample_mode": "poisson"})
    assert not oversampled(5, 20, poisson, noised)
