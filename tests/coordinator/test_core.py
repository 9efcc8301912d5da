"""The round core (lensemble_flwr.coordinator.core) works on values: no transport and no
clock. Who is reachable, what arrived, whether a deadline passed and the time are handed
in; a round runs to CLOSED (and to ABORTED) on those values alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator.core import Concluded, RoundCore
from lensemble_flwr.coordinator.create import Wiring, create_core, resume_core
from lensemble_flwr.errors import FaultToleranceExceeded, IllegalTransition
from lensemble_flwr.protocol.messages import Update, to_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.simulations.toy import initial_params
from tests.coordinator.test_admission import ROOT, commitment


def core_of(tmp: Path) -> RoundCore:
    return create_core(
        Wiring(small_config(min_participants=1), Store(tmp / "run")), "run", initial_params()
    )


def update(core: RoundCore) -> Update:
    params = core.run.head.state.params
    delta = {n: np.full_like(a, 0.5, dtype=np.float32) for n, a in params.items()}
    return Update(
        run_id="run", round=1, attempt=1, sender="p00", participant_id="p00",
        dataset_root=ROOT, delta=delta, l2_norm=0.0, num_examples=8,
    )  # fmt: skip


def test_the_core_holds_no_transport_and_reads_no_clock() -> None:
    assert not any("transport" in name or "clock" in name for name in vars(RoundCore))


def test_a_round_closes_on_values_alone(tmp_path: Path) -> None:
    core = core_of(tmp_path)
    before = core.run.head.state.params_hash
    attempt = core.begin(now=100.0)
    assert attempt.started == 100.0 and attempt.phase is RoundState.OPEN
    assert [peer for peer, _ in core.invite(("p00",))] == ["p00"]
    core.registry.bind(commitment())
    assert core.advance(("p00",), deadline_passed=False)  # K = 1 ready
    core.receive(to_wire(update(core)))
    assert core.advance(("p00",), deadline_passed=False)  # nobody left to deliver
    assert core.unmask() is None  # a plaintext round has no unmask exchange
    concluded = core.conclude()
    assert isinstance(concluded, Concluded) and concluded.failure is None
    assert attempt.phase is RoundState.CLOSED
    outcome = core.outcome(attempt, concluded.result, concluded.diagnostics, None, now=102.5)
    assert outcome.elapsed == 2.5 and outcome.contributors == ("p00",)
    (record,) = Ledger(Store(tmp_path / "run")).records()
    assert core.run.head.state.params_hash == record.new_global_hash != before
    assert core.run.head.record_hash == record.record_hash == concluded.close.record_hash


def test_a_deadline_handed_in_short_of_the_quorum_raises_and_abort_is_recorded(
    tmp_path: Path,
) -> None:
    core = core_of(tmp_path)
    attempt = core.begin(now=5.0)
    core.invite(())
    assert not core.advance((), deadline_passed=False)
    with pytest.raises(FaultToleranceExceeded, match="0 of quorum 1"):
        core.advance((), deadline_passed=True)
    outcome = core.abort(FaultToleranceExceeded("nobody came"), now=35.0)
    assert outcome.state is RoundState.ABORTED and outcome.elapsed == 30.0
    assert attempt.phase is RoundState.ABORTED
    assert [(e.round, e.attempt, e.state) for e in core.run.manifest.rounds] == [
        (1, 1, RoundState.ABORTED)
    ]
    assert core.next_attempt() == 2
    with pytest.raises(IllegalTransition, match="nothing to advance"):
        core.advance((), deadline_passed=True)


def test_resume_core_continues_the_stored_run(tmp_path: Path) -> None:
    core = core_of(tmp_path)
    core.begin(now=0.0)
    core.abort(FaultToleranceExceeded("nobody came"), now=1.0)
    again = resume_core(Wiring(small_config(min_participants=1), Store(tmp_path / "run")))
    assert again.run.head.state.params_hash == core.run.head.state.params_hash
    assert again.next_attempt() == 2 and again.inputs.run_id == "run"


@pytest.mark.parametrize("payload", [3, "update", b"bytes", ["kind", "update"]])
def test_a_payload_that_is_no_mapping_is_rejected_and_moves_nothing(
    tmp_path: Path, payload: object
) -> None:
    """Whatever a transport hands in, the core rejects what is not a message (counted)
    and its own rejection path raises nothing."""
    core = core_of(tmp_path)
    attempt = core.begin(now=0.0)
    assert core.receive(payload) is None  # type: ignore[arg-type]
    assert attempt.rejected == 1 and attempt.phase is RoundState.OPEN
    assert not attempt.admitted and not attempt.refused
