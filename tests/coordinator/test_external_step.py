"""A model changed after its commit (a wrapper's central noise) is adopted as the next
round's external step: recorded, verifiable, durable, and refused when it does not fit.

In process, no Ray: the federation of tests/helpers/federation_helpers.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation
from hypothesis import given, settings
from hypothesis import strategies as st

from lensemble_flwr.artifacts.checkpoint import checkpoint_parts, decode_checkpoint
from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.cli import main
from lensemble_flwr.config import OuterOptimizerConfig
from lensemble_flwr.coordinator import durable
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.outer_optimizer import (
    influence_scale,
    momentum_after_external_step,
    outer_step,
)
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    IllegalTransition,
    LedgerError,
    ParameterMismatch,
)
from lensemble_flwr.provenance.audit import audit_run
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import record_breaks, verify
from tests.coordinator.test_recovery import restart


def noised(coordinator: Coordinator, scale: float = 0.01, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: (a + rng.normal(0, scale, a.shape)).astype(a.dtype)
        for n, a in coordinator.global_state().params.items()
    }


def test_an_adopted_model_is_trained_from_and_the_chain_runs_through_it(tmp_path: Path) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    committed = coordinator.global_state().params_hash
    step = coordinator.adopt(noised(coordinator))
    assert step is not None and step.committed_hash == committed and step.change_norm > 0
    assert coordinator.global_state().params_hash == step.adopted_hash
    coordinator.run(2)
    network.flush()
    records = verify(coordinator.store)  # the chain, and the adopted model's checkpoint
    assert records[1].external_step == step
    assert records[1].previous_global_hash == step.adopted_hash
    assert records[0].external_step is None and records[2].external_step is None
    assert [e.external_step for e in coordinator.manifest.rounds if e.round == 2] == [step]
    assert audit_run(coordinator.store.root).ok
    # a record without a step stores no field for it (older run directories keep hashes)
    stored = json.loads(coordinator.store.get(coordinator.store.resolve("ledger/00000001")))
    assert "external_step" not in stored


def test_the_momentum_after_adoption_does_not_depend_on_the_un_noised_mean(
    tmp_path: Path,
) -> None:
    """Two runs whose first rounds differ (other updates, so another un-noised mean) but
    adopt the same model keep the same momentum: the optimizer state holds released
    models only."""
    a, net_a, _ = federation(tmp_path, name="a")
    b, net_b, _ = federation(tmp_path, name="b", participants=3)
    a.run(1)
    b.run(1)
    assert a.global_state().params_hash != b.global_state().params_hash
    target = noised(a, scale=0.05)
    a.adopt(target)
    b.adopt(target)
    assert all(np.array_equal(a.momentum()[n], b.momentum()[n]) for n in target)
    net_a.flush()
    net_b.flush()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    lr=st.floats(0.1, 1.5),
    momentum=st.floats(0.0, 0.95),
    nesterov=st.booleans(),
)
def test_the_re_derived_momentum_is_the_steps_own_when_nothing_changed(
    seed: int, lr: float, momentum: float, nesterov: bool
) -> None:
    rng = np.random.default_rng(seed)
    theta = {
        "w": rng.normal(size=64).astype(np.float32),
        "v": rng.normal(size=8).astype(np.float32),
    }
    m = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in theta.items()}
    delta = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in theta.items()}
    config = OuterOptimizerConfig(lr=lr, momentum=momentum, nesterov=nesterov)
    stepped, m_step = outer_step(theta, m, delta, config, averaged={"v"})
    m_derived = momentum_after_external_step(theta, m, stepped, config, averaged={"v"})
    np.testing.assert_allclose(m_derived["w"], m_step["w"], rtol=1e-3, atol=1e-3)
    assert not m_derived["v"].any()  # averaged names keep a zero momentum
    # an adopted model n away from the step's moves the momentum by n / influence
    noise = rng.normal(size=64).astype(np.float32)
    moved = momentum_after_external_step(
        theta, m, {**stepped, "w": stepped["w"] + noise}, config, averaged={"v"}
    )
    np.testing.assert_allclose(
        moved["w"] - m_derived["w"], noise / influence_scale(config), rtol=1e-3, atol=1e-3
    )


def test_influence_scale_is_one_for_fedavgs_step_only() -> None:
    assert influence_scale(OuterOptimizerConfig(lr=1.0, momentum=0.0)) == 1.0
    assert influence_scale(OuterOptimizerConfig(lr=0.7, momentum=0.9)) == pytest.approx(1.33)
    assert influence_scale(OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=False)) == 0.7


def _bad_shape(p: dict) -> dict:
    name = sorted(p)[0]
    return {**p, name: np.zeros((*p[name].shape, 2), p[name].dtype)}


def _nan(p: dict) -> dict:
    name = sorted(p)[0]
    return {**p, name: np.full_like(p[name], np.nan)}


def _float64(p: dict) -> dict:
    return {n: a.astype(np.float64) for n, a in p.items()}


def _missing(p: dict) -> dict:
    return dict(sorted(p.items())[1:])


@pytest.mark.parametrize(
    ("mangle", "complaint"),
    [
        (_bad_shape, "shape"),
        (_nan, "non-finite"),
        (_float64, "dtypes"),
        (_missing, "adopted params"),
    ],
    ids=["shape", "nan", "dtype", "missing"],
)
def test_a_model_that_does_not_fit_is_refused_and_nothing_changes(
    tmp_path: Path, mangle, complaint: str
) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    before = coordinator.global_state().params_hash
    momentum = coordinator.momentum()
    with pytest.raises(ParameterMismatch, match=complaint):
        coordinator.adopt(mangle(noised(coordinator)))
    assert coordinator.global_state().params_hash == before
    assert all(np.array_equal(momentum[n], a) for n, a in coordinator.momentum().items())
    assert not coordinator.store.bound(durable.EXTERNAL_STEP)
    network.flush()


def test_adoption_is_refused_out_of_turn_and_idempotent_in_turn(tmp_path: Path) -> None:
    coordinator, network, _ = federation(tmp_path)
    with pytest.raises(IllegalTransition, match="committed no round"):
        coordinator.adopt(noised(coordinator))
    coordinator.run(1)
    assert coordinator.adopt(dict(coordinator.global_state().params)) is None  # unchanged
    target = noised(coordinator)
    step = coordinator.adopt(target)
    assert coordinator.adopt(target) == step  # the same model again: the same step
    with pytest.raises(IllegalTransition, match="release the aggregate twice"):
        coordinator.adopt(noised(coordinator, seed=1))
    coordinator.run(1)
    coordinator.begin_attempt()  # round 3 starts from its committed model
    with pytest.raises(IllegalTransition, match="already started"):
        coordinator.adopt(noised(coordinator))
    network.flush()


def test_a_restarted_coordinator_trains_from_the_adopted_model(tmp_path: Path) -> None:
    """The un-noised model must never be sent after a crash between adoption and round."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    step = coordinator.adopt(noised(coordinator))
    network.flush()
    resumed = restart(coordinator)
    assert resumed.global_state().params_hash == step.adopted_hash
    assert all(np.array_equal(coordinator.momentum()[n], a) for n, a in resumed.momentum().items())
    resumed.run(1)
    network.flush()
    assert verify(resumed.store)[1].external_step == step
    # once a round trained from it, a later restart resumes from that round's commit
    again = restart(resumed)
    assert again.global_state().params_hash == resumed.global_state().params_hash
    assert again.global_state().round == 2


def test_a_kept_step_that_does_not_parse_stops_the_resume(tmp_path: Path) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    coordinator.adopt(noised(coordinator))
    network.flush()
    store = coordinator.store
    store.bind(durable.EXTERNAL_STEP, store.put(b'{"committed_hash": 3}'))
    with pytest.raises(LedgerError, match="external step does not parse"):
        restart(coordinator)


def test_a_missing_adopted_checkpoint_breaks_verification(tmp_path: Path) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    step = coordinator.adopt(noised(coordinator))
    coordinator.run(1)
    network.flush()
    assert decode_checkpoint(coordinator.store.get(step.checkpoint)).params_hash == (
        step.adopted_hash
    )
    blob = next(coordinator.store.root.rglob(step.checkpoint))
    blob.unlink()
    with pytest.raises(LedgerError, match="round 1: checkpoint"):
        verify(coordinator.store)
    report = audit_run(coordinator.store.root)
    assert not report.ok


def test_a_record_whose_step_does_not_start_from_the_prior_commit_is_a_broken_link(
    tmp_path: Path,
) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    coordinator.adopt(noised(coordinator))
    coordinator.run(1)
    network.flush()
    records = Ledger(coordinator.store).records()
    forged_step = records[1].external_step.model_copy(update={"committed_hash": "e" * 64})
    for step, broken in [
        (forged_step, "ledger.external_step.committed_hash"),
        # a record that dropped its step no longer links to the prior commit
        (None, "ledger.previous_global_hash"),
    ]:
        record = records[1].model_copy(update={"external_step": step}).sealed()
        breaks = record_breaks(
            record,
            previous_record_hash=records[0].record_hash,
            previous_global_hash=records[0].new_global_hash,
        )
        assert [b.field for b in breaks] == [broken]


def test_show_and_verify_name_the_external_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    step = coordinator.adopt(noised(coordinator))
    coordinator.run(1)
    network.flush()
    run_dir = str(coordinator.store.root)
    assert main(["show", run_dir]) == 0
    out = capsys.readouterr().out
    assert "round 2: trained from a model changed after the previous commit" in out
    assert f"change norm {step.change_norm:.4g}" in out
    assert main(["show", run_dir, "--json"]) == 0
    attempts = json.loads(capsys.readouterr().out)["attempts"]
    assert [a["external_change"] for a in attempts] == [None, step.change_norm]
    assert main(["verify", run_dir]) == 0


def test_a_lying_change_norm_or_a_round_of_two_models_is_a_finding(tmp_path: Path) -> None:
    """The recorded norm is recomputed from the two checkpoints, by verify and the audit;
    and a round's attempts must all train from the same model."""
    from lensemble_flwr.provenance.ledger import ExternalStep

    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    committed = coordinator.global_state().params_hash
    zeros = {n: np.zeros_like(a) for n, a in coordinator.global_state().params.items()}
    step = coordinator.adopt(zeros)
    coordinator.run(1)
    network.flush()
    assert verify(coordinator.store)[1].external_step.change_norm == step.change_norm > 0
    # a coordinator that claims its swap moved the model by almost nothing
    from lensemble_flwr.norms import change_norm
    from lensemble_flwr.provenance.verify import record_checkpoint_breaks

    records = Ledger(coordinator.store).records()
    lying = records[1].model_copy(
        update={"external_step": step.model_copy(update={"change_norm": 1e-9})}
    )
    breaks = list(record_checkpoint_breaks(coordinator.store, lying, records[0].checkpoint))
    assert [b.field for b in breaks] == ["ledger.external_step.change_norm"]
    assert breaks[0].expected == pytest.approx(step.change_norm)
    assert change_norm(zeros, zeros) == 0.0
    assert isinstance(step, ExternalStep) and step.committed_hash == committed
    # a norm an earlier version recorded (BLAS: other last bits) still verifies; one off by
    # a millionth does not
    for near, finding in ((math.nextafter(step.change_norm, 0.0), False),
                          (step.change_norm * (1 + 1e-6), True)):  # fmt: skip
        claimed = records[1].model_copy(
            update={"external_step": step.model_copy(update={"change_norm": near})}
        )
        found = list(record_checkpoint_breaks(coordinator.store, claimed, records[0].checkpoint))
        assert bool(found) is finding
    # an adopted checkpoint whose arrays have the committed names but other sizes is a
    # finding, not an error out of verify
    other = {n: np.zeros(a.size + 1, a.dtype) for n, a in zeros.items()}
    resized = coordinator.store.put_parts(checkpoint_parts(1, other, other))
    claimed = records[1].model_copy(
        update={"external_step": step.model_copy(
            update={"checkpoint": resized, "adopted_hash": digest_arrays(other, "params")}
        )}
    )  # fmt: skip
    found = list(record_checkpoint_breaks(coordinator.store, claimed, records[0].checkpoint))
    assert [b.field for b in found] == ["ledger.external_step.change_norm"]


def test_the_stock_loop_does_not_resume_a_run(tmp_path: Path) -> None:
    """Flower's loop (and every wrapper) restarts at round 1 from the initial arrays; a
    resumed coordinator would send the last committed, un-noised model."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from lensemble_flwr.errors import ConfigError
    from lensemble_flwr.simulations.toy import initial_params
    from lensemble_flwr.strategies import LensembleStrategy

    strategy = LensembleStrategy(run_dir=tmp_path / "run", resume=True)
    arrays = ArrayRecord({n: Array(a) for n, a in initial_params().items()})
    with pytest.raises(ConfigError, match=r"resumed only by LensembleStrategy\.start"):
        strategy.configure_train(1, arrays, ConfigRecord(), grid=None)  # type: ignore[arg-type]
    assert strategy.coordinator is None and not (tmp_path / "run").exists()


def test_a_joining_participant_gets_the_adopted_model_not_the_one_it_replaced(
    tmp_path: Path,
) -> None:
    coordinator, network, nodes = federation(tmp_path)
    coordinator.run(1)
    committed = coordinator.global_state().params_hash
    assert nodes[0].join(str(coordinator.store.root)).params_hash == committed
    step = coordinator.adopt(noised(coordinator))
    joined = nodes[1].join(str(coordinator.store.root))
    assert joined.params_hash == step.adopted_hash
    coordinator.run(1)  # once the round trained from it, the new head is what one joins
    network.flush()
    assert nodes[2].join(str(coordinator.store.root)).params_hash == (
        coordinator.global_state().params_hash
    )


def test_an_adopted_checkpoint_that_does_not_read_back_adopts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adopted model's checkpoint is read back before the step is kept, as a commit's
    is: one that rots as it is written is CheckpointIntegrityError, removed, and nothing
    is adopted; the same adoption afterwards writes it afresh."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(1)
    before, store = coordinator.global_state().params_hash, coordinator.store
    write = store.put_parts

    def rotting(parts):  # type: ignore[no-untyped-def]
        digest = write(parts)
        blob = store.root / "blobs" / digest[:2] / digest
        blob.write_bytes(blob.read_bytes()[:-1] + b"\x00")
        return digest

    monkeypatch.setattr(store, "put_parts", rotting)
    target = noised(coordinator)
    with pytest.raises(CheckpointIntegrityError, match="reads back as"):
        coordinator.adopt(target)
    assert coordinator.global_state().params_hash == before
    assert not store.bound(durable.EXTERNAL_STEP)
    monkeypatch.setattr(store, "put_parts", write)
    step = coordinator.adopt(target)
    assert step is not None and decode_checkpoint(store.get(step.checkpoint))
    coordinator.run(1)
    network.flush()
    assert verify(store)[1].external_step == step
