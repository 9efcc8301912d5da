"""A batch of collected updates is validated and hashed on threads (coordinator/batch.py)
and admitted in order: the round it makes is the one the sequential path makes, and a
malformed payload in it is rejected as it would be one at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator import batch as batch_module
from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.protocol.messages import Update, canonical_fields, to_wire
from lensemble_flwr.protocol.round import RoundState
from tests.coordinator.test_hash_once import unbound_coordinator

PEERS = [f"p{i:02d}" for i in range(4)]
SIZE = 1 << 20  # float32 values per update: 4 MB each, 16 MB a batch (on threads)


def _coordinator(run_dir: Path) -> Coordinator:
    return unbound_coordinator(Store(run_dir), size=SIZE)  # a quorum of 3


def _payloads(coordinator: Coordinator, *, malformed: int | None = None) -> list[dict]:
    rng = np.random.default_rng(1)
    state = coordinator.global_state()
    round, params = state.next_round, state.params
    out = []
    for i, pid in enumerate(PEERS):
        delta = {
            n: (rng.standard_normal(a.shape) * 1e-3).astype(np.float32) for n, a in params.items()
        }
        update = Update(
            run_id=coordinator.run_id,
            round=round,
            sender=pid,
            participant_id=pid,
            dataset_root=None,
            delta=delta,
            num_examples=1,
        )
        wire = to_wire(update)
        if i == malformed:
            wire["delta"] = dict(wire["delta"], w=np.full(SIZE, np.nan, np.float32))  # refused
        out.append(wire)
    return out


def _round(run_dir: Path, *, malformed: int | None = None) -> tuple[RoundOutcome, Coordinator]:
    coordinator = _coordinator(run_dir)
    coordinator.begin_attempt()
    coordinator.invite(PEERS)
    payloads = _payloads(coordinator, malformed=malformed)
    return coordinator.conclude_collected(payloads, PEERS), coordinator


def test_a_large_batch_is_prepared_on_threads_with_the_fields_admission_would_compute(
    tmp_path: Path,
) -> None:
    coordinator = _coordinator(tmp_path / "run")
    coordinator.begin_attempt()
    payloads = _payloads(coordinator)
    prepared = batch_module.prepare_batch(payloads)
    assert all(p is not None for p in prepared)
    for payload, ready in zip(payloads, prepared, strict=True):
        assert ready is not None
        message, fields = ready.result()
        assert fields == canonical_fields(message) and message.participant_id == payload["sender"]
    small = [dict(p, delta={n: a[:10] for n, a in p["delta"].items()}) for p in payloads]
    assert batch_module.prepare_batch(small) == [None] * len(small)  # in line: not worth it


def test_a_round_from_a_prepared_batch_is_the_round_the_sequential_path_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threaded, _ = _round(tmp_path / "threads")
    monkeypatch.setattr(batch_module, "PREPARE_ON_THREADS_MIN_BYTES", float("inf"))
    sequential, _ = _round(tmp_path / "sequential")
    assert threaded.state is sequential.state is RoundState.CLOSED
    assert threaded.count == sequential.count == len(PEERS)
    assert threaded.global_hash == sequential.global_hash
    assert Store(tmp_path / "threads").bound("ledger") == Store(tmp_path / "sequential").bound(
        "ledger"
    )


@pytest.mark.parametrize("on_threads", [True, False], ids=["threads", "sequential"])
def test_a_malformed_payload_in_a_batch_is_rejected_and_the_round_closes_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_threads: bool
) -> None:
    if not on_threads:
        monkeypatch.setattr(batch_module, "PREPARE_ON_THREADS_MIN_BYTES", float("inf"))
    outcome, _ = _round(tmp_path / "run", malformed=2)
    assert outcome.state is RoundState.CLOSED
    assert outcome.count == len(PEERS) - 1 and outcome.rejected == 1
    assert PEERS[2] not in outcome.contributors
