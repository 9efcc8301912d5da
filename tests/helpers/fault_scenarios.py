"""The fault-injection catalogue: each scenario scripts one fault into an in-process
federation of four participants (p00..p03, quorum 3) and states the end it must reach.

``tests/end_to_end/test_fault_injection.py`` runs every scenario; ``docs/update_generated.py``
renders the catalogue as the table in docs/fault-injection.md, so the documented
outcomes are the tested ones.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from federation_helpers import federation, signed_federation, small_config

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.participant.release_chain import budget_name
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.protocol.messages import MessageKind, from_wire
from lensemble_flwr.protocol.round import RoundMachine, RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.testing import FaultPlan
from lensemble_flwr.transports.base import COORDINATOR
from lensemble_flwr.transports.inprocess import InProcessNetwork

FAULT_ROUND = 2  # round 1 closes cleanly first, so there is something committed to lose


class CoordinatorCrash(BaseException):
    """Stands for the coordinator process dying: no handler catches it."""


@dataclasses.dataclass(frozen=True)
class Expected:
    """How the faulted round must end."""

    attempts: tuple[str, ...]  # the state each attempt of the faulted round ended in
    error: str | None = None  # the error that stops the federation, if any
    contributors: tuple[str, ...] | None = None  # C of the attempt that closed
    rejected: int | None = None  # messages rejected at ingress in that attempt
    rejected_as: str | None = None  # the error type those rejections were logged with
    late: tuple[str, ...] = ()  # dropped as late when they arrive, in the next round


@dataclasses.dataclass
class Setup:
    """A federation with its fault scripted (and what a scenario may still poke at)."""

    coordinator: Coordinator
    network: InProcessNetwork
    nodes: list[Participant]
    crash_at: RoundState | None = None  # the coordinator dies on entering this state
    between_rounds: Callable[[Setup], None] | None = None  # runs after round 1
    offline_at: tuple[str, RoundState] | None = None  # a participant vanishes here


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # what is injected, in words (for the docs)
    outcome: str  # what must happen, in words (for the docs)
    build: Callable[[Path], Setup]
    expected: Expected


def _plain(tmp: Path, faults: FaultPlan | None = None, **cfg: Any) -> Setup:
    config = small_config(**cfg)
    coordinator, network, nodes = federation(tmp, config=config, faults=faults)
    return Setup(coordinator, network, nodes)


def _masked(tmp: Path, faults: FaultPlan | None = None, threshold: int = 3) -> Setup:
    return _plain(tmp, faults, secagg_threshold=threshold, min_participants=3)


def _signed(tmp: Path, faults: FaultPlan | None = None) -> Setup:
    keys = {f"p{i:02d}": IdentityKey.generate() for i in range(4)}
    return Setup(*signed_federation(tmp, keys, faults=faults))


def _dp(tmp: Path) -> Setup:
    # sigma 1, clip 0.5, RDP, delta 1e-5: two releases cost ~16.5 epsilon, three ~21.4.
    # An earlier run spent one release of every budget, so this run's plan (two rounds)
    # fits and the coordinator lets it start; the participants refuse the third release.
    for i in range(4):
        PrivacyBudget(tmp / "budgets", budget_name(f"p{i:02d}"), epsilon=20.0, delta=1e-5).charge(
            1.0
        )
    config = LensembleConfig(
        federation={"min_participants": 3, "open_timeout": 10.0, "collect_timeout": 10.0},
        inner={"steps": 2, "lr": 0.05, "batch_size": 8},
        privacy={
            "clip_norm": 0.5,
            "noise_multiplier": 1.0,
            "dp_epsilon": 20.0,
            "dp_state_dir": str(tmp / "budgets"),
        },
    )
    coordinator, network, nodes = federation(tmp, config=config)
    return Setup(coordinator, network, nodes)


def _vanish(state: RoundState, pid: str = "p03", masked: bool = False) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        setup = _masked(tmp) if masked else _plain(tmp)
        setup.offline_at = (pid, state)
        return setup

    return build


def _crash(state: RoundState) -> Callable[[Path], Setup]:
    def build(tmp: Path) -> Setup:
        setup = _plain(tmp)
        setup.crash_at = state
        return setup

    return build


def _nan_delta(payload: dict) -> dict:
    payload["delta"] = {k: np.full_like(v, np.nan) for k, v in payload["delta"].items()}
    return payload


def _forge_root(payload: dict) -> dict:
    payload["dataset_root"] = "f" * 64
    return payload


def _garble_shares(payload: dict) -> dict:
    payload["b_shares"] = {"p00": "not-a-share"}
    return payload


def _resign(payload: dict) -> dict:
    msg = from_wire(payload)
    return dict(IdentityKey.generate().sign(msg, 0))


def _tampered_rejoin(tmp: Path) -> Setup:
    faults = FaultPlan().drop("p03", round=1, at=RoundState.COLLECTING).rejoin("p03", round=2)
    setup = _plain(tmp, faults)

    def tamper_in_transit(s: Setup) -> None:
        # the rejoiner recovers from a copy of the run directory whose newest
        # checkpoint was altered on the way; the coordinator's own store is intact
        mirror = tmp / "mirror"
        shutil.copytree(s.coordinator.store.root, mirror)
        head = Ledger(s.coordinator.store).head()
        assert head is not None
        blob = mirror / "blobs" / head.checkpoint[:2] / head.checkpoint
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0x01
        blob.write_bytes(bytes(data))
        s.network.join_endpoint = str(mirror)

    setup.between_rounds = tamper_in_transit
    return setup


def _replay(tmp: Path) -> Setup:
    seen: list[dict] = []

    def keep(payload: dict) -> dict:
        seen.append(dict(payload))
        return payload

    setup = _signed(tmp, FaultPlan().corrupt("p01", round=1, kind=MessageKind.UPDATE, mutate=keep))

    def replay(s: Setup) -> None:  # round 1's admitted update, delivered again in round 2
        s.network.inject("p01", COORDINATOR, seen[0])

    setup.between_rounds = replay
    return setup


def _duplicate(tmp: Path) -> Setup:
    setup = _signed(tmp, FaultPlan().duplicate("p03", round=2, kind=MessageKind.UPDATE))
    setup.network.set_compute_time("p03", 0.1)  # both copies arrive before the others
    return setup


ALL = ("p00", "p01", "p02", "p03")
THREE = ("p00", "p01", "p02")
CLOSED = ("closed",)

SCENARIOS: list[Scenario] = [
    Scenario(
        "dropout in OPEN",
        "p03 goes offline before the RoundOpen reaches it",
        "round closes elastically without it",
        lambda tmp: _plain(tmp, FaultPlan().drop("p03", round=2, at=RoundState.OPEN)),
        Expected(CLOSED, contributors=THREE),
    ),
    Scenario(
        "dropout in COLLECTING",
        "p03 goes offline before its update leaves",
        "round closes elastically without it",
        lambda tmp: _plain(tmp, FaultPlan().drop("p03", round=2, at=RoundState.COLLECTING)),
        Expected(CLOSED, contributors=THREE),
    ),
    Scenario(
        "dropout in AGGREGATING (masked)",
        "p03 sent its masked update, then vanishes before the unmasking",
        "the survivors' shares unmask the sum; p03's update counts",
        _vanish(RoundState.AGGREGATING, masked=True),
        Expected(CLOSED, contributors=ALL),
    ),
    Scenario(
        "dropout in ALIGNING",
        "p03 vanishes after the contributing set froze",
        "round closes with its update; it misses the RoundClose",
        _vanish(RoundState.ALIGNING),
        Expected(CLOSED, contributors=ALL),
    ),
    Scenario(
        "dropout in COMMITTING",
        "p03 vanishes while the coordinator commits",
        "round closes with its update; it misses the RoundClose",
        _vanish(RoundState.COMMITTING),
        Expected(CLOSED, contributors=ALL),
    ),
    Scenario(
        "slower than the collect timeout",
        "p03's update arrives 0.5 s after the collect deadline (10 s)",
        "round closes without it; its update, arriving during the next round, is dropped as late",
        lambda tmp: _plain(tmp, FaultPlan().delay("p03", round=2, seconds=9.5)),
        Expected(CLOSED, contributors=THREE, late=("p03",)),
    ),
    Scenario(
        "malformed update",
        "p03's delta is all NaN",
        "rejected at ingress (RoundError); round closes without it",
        lambda tmp: _plain(
            tmp, FaultPlan().corrupt("p03", round=2, kind=MessageKind.UPDATE, mutate=_nan_delta)
        ),
        Expected(CLOSED, contributors=THREE, rejected=1, rejected_as="RoundError"),
    ),
    Scenario(
        "forged update",
        "p03's update re-signed with a key that is not its registered one",
        "rejected at ingress (ForgedMessage); round closes without it",
        lambda tmp: _signed(
            tmp, FaultPlan().corrupt("p03", round=2, kind=MessageKind.UPDATE, mutate=_resign)
        ),
        Expected(CLOSED, contributors=THREE, rejected=1, rejected_as="ForgedMessage"),
    ),
    Scenario(
        "replayed update",
        "p01's admitted round-1 update is delivered again in round 2",
        "rejected at ingress (ReplayedMessage); p01's real update counts",
        _replay,
        Expected(CLOSED, contributors=ALL, rejected=1, rejected_as="ReplayedMessage"),
    ),
    Scenario(
        "duplicated update",
        "p03 sends its round-2 update twice",
        "the copy is rejected (DuplicateMessage); p03 counts once",
        _duplicate,
        Expected(CLOSED, contributors=ALL, rejected=1, rejected_as="DuplicateMessage"),
    ),
    Scenario(
        "commitment mismatch",
        "p02's update is bound to another dataset root than it committed",
        "round aborts fail-closed; the federation stops (CommitmentMismatch)",
        lambda tmp: _plain(
            tmp, FaultPlan().corrupt("p02", round=2, kind=MessageKind.UPDATE, mutate=_forge_root)
        ),
        Expected(("aborted",), error="CommitmentMismatch"),
    ),
    Scenario(
        "tampered checkpoint on rejoin",
        "p03 rejoins in round 2; the checkpoint it recovers was altered on disk",
        "p03 refuses it (CheckpointIntegrityError) and stays out; round closes",
        _tampered_rejoin,
        Expected(CLOSED, contributors=THREE),
    ),
    Scenario(
        "privacy budget exhausted",
        "epsilon budget 20 allows two releases (sigma 1), one spent by an earlier run; "
        "round 2 would exceed it",
        "participants refuse to release; round aborts; the federation stops",
        _dp,
        Expected(("aborted",), error="PrivacyBudgetExceeded"),
    ),
    Scenario(
        "secure-aggregation survivors below threshold",
        "threshold 4 of 4; p00's disclosure is garbled",
        "attempt aborts (SecureAggregationError); the retry closes",
        lambda tmp: _masked(
            tmp,
            FaultPlan().corrupt(
                "p00", round=2, kind=MessageKind.UNMASK_RESPONSE, mutate=_garble_shares
            ),
            threshold=4,
        ),
        Expected(("aborted", "closed"), contributors=ALL),
    ),
    *(
        Scenario(
            f"coordinator crash in {state.name}",
            f"the coordinator process dies on entering {state.name}"
            + (" (after the RoundOpens went out)" if state is RoundState.OPEN else ""),
            "restarted on its run directory, it resumes from the last CLOSED round"
            + (
                " (the commit was already made)"
                if state is RoundState.CLOSED
                else "; the cut attempt is recorded aborted and retried"
            ),
            _crash(state),
            Expected(
                CLOSED if state is RoundState.CLOSED else ("aborted", "closed"), contributors=ALL
            ),
        )
        for state in (
            RoundState.OPEN,
            RoundState.COLLECTING,
            RoundState.AGGREGATING,
            RoundState.ALIGNING,
            RoundState.COMMITTING,
            RoundState.CLOSED,
        )
    ),
]

# The budget scenario's fault is in round 2 (an earlier run and round 1 spend the budget).
FAULTED_ROUND = {"privacy budget exhausted": 2}


@dataclasses.dataclass
class Observed:
    coordinator: Coordinator
    error: LensembleError | None
    committed_before: list[str]  # record hashes committed before the fault


def play(scenario: Scenario, tmp: Path) -> Observed:
    """Run a scenario to the end of its faulted round (or until the federation stops)."""
    setup = scenario.build(tmp)
    fault_round = FAULTED_ROUND.get(scenario.name, FAULT_ROUND)
    coordinator = setup.coordinator
    coordinator.run(fault_round - 1)  # the rounds before it close cleanly
    committed = [r.record_hash for r in Ledger(coordinator.store).records()]
    if setup.between_rounds is not None:
        setup.between_rounds(setup)

    def hook(machine: RoundMachine) -> None:
        if machine.round != fault_round:
            return
        if setup.offline_at and machine.state is setup.offline_at[1]:
            setup.network.take_offline(setup.offline_at[0])
        if setup.crash_at is not None and machine.state is setup.crash_at:
            setup.crash_at = None  # the restarted coordinator runs without the fault
            raise CoordinatorCrash

    # the coordinator calls the hook once an attempt's invitations are out (OPEN) and
    # after every transition
    coordinator.on_transition = hook
    error: LensembleError | None = None
    try:
        coordinator.run(1)
    except CoordinatorCrash:
        coordinator = Coordinator.resume(
            coordinator.config, transport=setup.network.coordinator, store=coordinator.store
        )
        coordinator.run(fault_round - coordinator.global_state().round)
    except LensembleError as exc:
        error = exc
    return Observed(coordinator, error, committed)


def scenario_table() -> str:
    """The catalogue as a markdown table (rendered into docs/fault-injection.md)."""
    rows = [
        "| scenario | fault injected | required outcome | attempts of the faulted round |",
        "| --- | --- | --- | --- |",
    ]
    for s in SCENARIOS:
        ends = " → ".join(s.expected.attempts)
        if s.expected.error:
            ends += f", stops with `{s.expected.error}`"
        if s.expected.contributors is not None:
            ends += f", C_t = {len(s.expected.contributors)}"
        rows.append(f"| {s.name} | {s.fault} | {s.outcome} | {ends} |")
    return "\n".join(rows)
