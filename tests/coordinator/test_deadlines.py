"""Deadlines that follow the federation (``deadline-mode = "adaptive"``) and fixed ones:
the computation, what an attempt records, and a slow but steady federation on the
simulated clock."""

from __future__ import annotations

from pathlib import Path

import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.config import FederationConfig, LensembleConfig
from lensemble_flwr.coordinator.deadlines import (
    ADAPTIVE_WINDOW,
    DeadlineTracker,
    adaptive_deadline,
)
from lensemble_flwr.errors import ConfigError, FaultToleranceExceeded
from lensemble_flwr.protocol.round import RoundState


def test_adaptive_deadline_is_the_margin_times_the_longest_time_within_floor_and_cap() -> None:
    bounds = {"floor": 10.0, "cap": 100.0, "margin": 3.0}
    assert adaptive_deadline([], **bounds) == 100.0  # nothing observed: the cap
    assert adaptive_deadline([5.0, 12.0, 7.0], **bounds) == 36.0  # 3 x the longest
    assert adaptive_deadline([1.0, 2.0], **bounds) == 10.0  # the floor
    assert adaptive_deadline([50.0], **bounds) == 100.0  # the cap


@pytest.mark.parametrize(
    ("args", "times"),
    [
        ({"floor": 20.0, "cap": 10.0, "margin": 2.0}, [1.0]),
        ({"floor": 1.0, "cap": 10.0, "margin": 0.5}, [1.0]),
        ({"floor": 1.0, "cap": 10.0, "margin": 2.0}, [-1.0]),
    ],
)
def test_adaptive_deadline_refuses_bad_bounds_and_negative_times(
    args: dict[str, float], times: list[float]
) -> None:
    with pytest.raises(ValueError):
        adaptive_deadline(times, **args)


def test_the_tracker_follows_only_the_last_rounds_and_says_what_it_computed_from() -> None:
    fed = FederationConfig(
        deadline_mode="adaptive", deadline_floor=5.0, deadline_cap=200.0, deadline_margin=2.0
    )
    tracker = DeadlineTracker(fed)
    first = tracker.next()
    assert (first.open, first.collect, first.mode) == (200.0, 200.0, "adaptive")
    assert "no round observed yet" in first.basis
    tracker.observe(40.0)  # a slow round, then ADAPTIVE_WINDOW quick ones push it out
    assert tracker.next().collect == 80.0
    for _ in range(ADAPTIVE_WINDOW):
        tracker.observe(4.0)
    assert tracker.observed == (4.0,) * ADAPTIVE_WINDOW
    later = tracker.next()
    assert later.collect == 8.0 and later.open == 8.0
    assert later.describe("collect") == (
        "8 s, lensemble.deadline-mode = adaptive: 2 x 4 s, the longest of the last 5 round "
        "times, within [5, 200] s"
    )
    tracker.aborted()  # a retry waits the cap, until the next round closes
    retry = tracker.next()
    assert retry.collect == 200.0 and "a retry after an aborted attempt" in retry.basis
    tracker.observe(5.0)
    assert tracker.next().collect == 10.0
    with pytest.raises(ValueError):
        tracker.observe(-0.5)


def test_fixed_deadlines_are_the_timeouts_and_name_their_keys() -> None:
    tracker = DeadlineTracker(FederationConfig(open_timeout=7.0, collect_timeout=45.5))
    tracker.observe(1.0)  # observed times change nothing in fixed mode
    fixed = tracker.next()
    assert (fixed.open, fixed.collect, fixed.mode) == (7.0, 45.5, "fixed")
    assert fixed.describe("open") == "7 s, lensemble.open-timeout"
    assert fixed.describe("collect", grace=12.25) == (
        "45.5 s, lensemble.collect-timeout; + 12.2 s warm-up grace"
    )


@pytest.mark.parametrize(
    ("flat", "key"),
    [
        ({"deadline-mode": "auto"}, "deadline-mode"),
        ({"deadline-floor": 0.0}, "deadline-floor"),
        ({"deadline-floor": 30.0, "deadline-cap": 20.0}, "deadline-cap"),
        ({"deadline-margin": 0.5}, "deadline-margin"),
    ],
)
def test_a_bad_deadline_setting_is_a_config_error_naming_its_key(
    flat: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        LensembleConfig.from_flat(flat)
    assert raised.value.field == key


def test_the_deadline_keys_are_recorded_only_when_set() -> None:
    """A run of the default (fixed) mode keeps the manifest header it had before the keys
    existed; an adaptive run records its mode and bounds."""
    assert not any(k.startswith("deadline-") for k in LensembleConfig().to_recorded())
    adaptive = LensembleConfig.from_flat({"deadline-mode": "adaptive", "deadline-cap": 90.0})
    recorded = adaptive.to_recorded()
    assert recorded["deadline-mode"] == "adaptive" and recorded["deadline-cap"] == 90.0
    with pytest.raises(ConfigError, match="deadline-mode"):
        LensembleConfig().check_recorded(recorded)


SLOW = 15.0
"""Simulated seconds each participant trains: longer than the 10 s collect timeout."""


def test_a_slow_steady_federation_aborts_at_a_too_short_fixed_deadline(tmp_path: Path) -> None:
    coordinator, network, _ = federation(tmp_path, config=small_config(max_round_attempts=2))
    network.compute_s = SLOW
    with pytest.raises(FaultToleranceExceeded) as raised:
        coordinator.run(1)
    message = str(raised.value)
    assert message.startswith(
        "0 updates by the collect deadline (10 s, lensemble.collect-timeout; no answer from "
    )
    assert message.endswith("quorum 3")
    outcome = coordinator.outcomes[-1]
    assert outcome.state is RoundState.ABORTED
    assert outcome.deadlines is not None
    assert (outcome.deadlines.mode, outcome.deadlines.collect) == ("fixed", 10.0)
    assert outcome.round_time is None  # nothing was admitted


def test_the_same_federation_completes_with_adaptive_deadlines_that_follow_it(
    tmp_path: Path,
) -> None:
    config = small_config(
        deadline_mode="adaptive", deadline_floor=5.0, deadline_cap=60.0, deadline_margin=2.0
    )
    coordinator, network, _ = federation(tmp_path, config=config)
    network.compute_s = SLOW
    coordinator.run(3)
    outcomes = coordinator.outcomes
    assert [o.state for o in outcomes] == [RoundState.CLOSED] * 3
    assert all(o.count == 4 for o in outcomes)
    times = [o.round_time for o in outcomes]
    assert all(t is not None and SLOW <= t < SLOW + 1 for t in times)
    collects = [o.deadlines.collect for o in outcomes if o.deadlines is not None]
    assert collects[0] == 60.0  # round 1: the cap
    assert collects[1] == pytest.approx(2 * times[0])  # then 2 x the round's time
    assert collects[2] == pytest.approx(2 * max(times[:2]))
    # the simulated clock makes it the same run every time
    again, network2, _ = federation(tmp_path, config=config, name="again")
    network2.compute_s = SLOW
    again.run(3)
    assert [o.deadlines for o in again.outcomes] == [o.deadlines for o in outcomes]
    assert again.global_state().params_hash == coordinator.global_state().params_hash


def test_an_adaptive_deadline_aborts_naming_what_it_was_computed_from(tmp_path: Path) -> None:
    """A participant that becomes slower than the margin allows is not waited for past
    the adaptive deadline, and the reason says how that deadline was computed."""
    config = small_config(
        deadline_mode="adaptive",
        deadline_floor=5.0,
        deadline_cap=60.0,
        deadline_margin=2.0,
        max_round_attempts=1,
        min_participants=4,
    )
    coordinator, network, _ = federation(tmp_path, config=config)
    network.compute_s = SLOW
    coordinator.run(1)
    network.set_compute_time("p03", 100.0)  # now far slower than 2 x its round time
    with pytest.raises(FaultToleranceExceeded) as raised:
        coordinator.run(1)
    message = str(raised.value)
    assert "by the collect deadline (30" in message
    assert "lensemble.deadline-mode = adaptive: 2 x 15" in message
    assert "no answer from p03" in message and message.endswith("quorum 4")


def test_after_an_abort_at_an_adaptive_deadline_the_retry_waits_the_cap(tmp_path: Path) -> None:
    """A federation that slowed down past the margin: the attempt aborts at the adaptive
    deadline, its retry waits deadline-cap and closes, and the next round follows the
    slower times."""
    config = small_config(
        deadline_mode="adaptive",
        deadline_floor=5.0,
        deadline_cap=100.0,
        deadline_margin=2.0,
        max_round_attempts=2,
        min_participants=4,
    )
    coordinator, network, _ = federation(tmp_path, config=config)
    network.compute_s = SLOW
    coordinator.run(1)
    network.compute_s = 40.0  # the machine got busier: every node now takes 40 s
    coordinator.run(2)
    states = [(o.round, o.attempt, o.state) for o in coordinator.outcomes]
    assert states == [
        (1, 1, RoundState.CLOSED),
        (2, 1, RoundState.ABORTED),
        (2, 2, RoundState.CLOSED),
        (3, 1, RoundState.CLOSED),
    ]
    outcomes = coordinator.outcomes
    collects = [o.deadlines.collect for o in outcomes if o.deadlines]
    assert len(collects) == 4 and collects[0] == 100.0  # round 1: the cap
    assert collects[1] == pytest.approx(2 * outcomes[0].round_time)  # 2 x 15 s: too short
    assert collects[2] == 100.0  # the retry: the cap
    assert outcomes[2].round_time is not None and outcomes[2].round_time >= 40.0
    assert collects[3] == pytest.approx(2 * outcomes[2].round_time)  # 2 x 40 s


def test_the_apps_evaluation_waits_for_the_cap_under_adaptive_deadlines() -> None:
    from lensemble_flwr.simulations.flower_app import evaluation_timeout

    assert evaluation_timeout(LensembleConfig.from_flat({"collect-timeout": 45.0})) == 45.0
    adaptive = LensembleConfig.from_flat({"deadline-mode": "adaptive", "deadline-cap": 300.0})
    assert evaluation_timeout(adaptive) == 300.0
