"""The gauge checks where they sit in a round: probe pinning on RoundOpen, the warm start
of θ_0 (coordinator, round 1's RoundOpen and rejoin), the round's sketch on every update, frame
drift in the manifest and the ledger, and alignment before every other release stage."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import DegenerateProcrustes, GaugeError, SketchMismatch
from lensemble_flwr.gauge import (
    Probe,
    coordinator_harness,
    encoder_hash,
    sketch_fingerprint,
    sketch_matrix,
)
from lensemble_flwr.gauge import stage as gauge_stage
from lensemble_flwr.gauge.runtime import (
    check_sketch,
    drift_diagnostics,
    expected_fingerprint,
    harness_transform,
)
from lensemble_flwr.protocol.messages import MessageKind, Update
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.release.quantize import quantize_int8
from lensemble_flwr.simulations.world_federation import build_world, world_gauge
from lensemble_flwr.simulations.world_model import (
    WorldModelAdapter,
    initial_params,
    random_orthogonal,
)
from lensemble_flwr.transports.faults import FaultPlan


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


COORDINATOR_LOG = "lensemble_flwr.coordinator.coordinator"


def config(**gauge: object) -> LensembleConfig:
    return LensembleConfig(
        federation={"min_participants": 2, "open_timeout": 10, "collect_timeout": 10},
        inner={"steps": 3, "lr": 3e-3, "weight_decay": 0.0, "batch_size": 16},
        gauge={"align": True, **gauge},
    )


def world(tmp: Path, cfg: LensembleConfig | None = None, **kwargs: object):
    return build_world(cfg or config(), tmp / "run", participants=3, trajectories=2, **kwargs)


def plaintext_update(delta: dict, **fields: object) -> Update:
    return Update(
        run_id="r",
        round=1,
        sender="p01",
        participant_id="p01",
        dataset_root="a" * 64,
        delta=delta,
        l2_norm=0.0,
        num_examples=1,
        **fields,
    )


def test_a_participant_with_another_probe_rejects_the_round(tmp_path: Path) -> None:
    fed = world(tmp_path)
    other = Probe(inputs=fed.gauge.probe.inputs + 1.0, landmarks=fed.gauge.probe.landmarks)
    fed.participants[2].gauge = dataclasses.replace(fed.gauge, probe=other)
    fed.coordinator.run(1)
    entry = fed.coordinator.manifest.rounds[-1]
    assert entry.contributors == ("p00", "p01")
    assert entry.refused["p02"].startswith("ProbeError")


def test_check_sketch_passes_the_rounds_fingerprint_and_refuses_any_other() -> None:
    gauge, cfg = world_gauge(0), config(sketch_rows=8)
    expected = expected_fingerprint(gauge, cfg, round_seed=3)
    assert expected == sketch_fingerprint(sketch_matrix(3, 8, gauge.probe.size))

    def update(fingerprint: str | None) -> Update:
        return plaintext_update({"w": np.zeros(2, np.float32)}, sketch_fingerprint=fingerprint)

    check_sketch(update(expected), expected)
    other = expected_fingerprint(gauge, cfg, round_seed=4)
    with pytest.raises(SketchMismatch, match=r"p01: aligned on sketch .*contribution rejected"):
        check_sketch(update(other), expected)
    with pytest.raises(SketchMismatch, match="aligned on sketch None"):
        check_sketch(update(None), expected)


def test_the_harness_computes_the_rounds_target_once(monkeypatch) -> None:
    gauge, cfg, params = world_gauge(0), config(sketch_rows=16), initial_params(0)
    calls = []
    real_target = gauge_stage.alignment_target

    def counted(*args, **kwargs):
        calls.append(args)
        return real_target(*args, **kwargs)

    monkeypatch.setattr(gauge_stage, "alignment_target", counted)
    transform = harness_transform(gauge, cfg, params, round_seed=7)
    assert calls == []  # computed at the first update, where a failure rejects that update
    rng = np.random.default_rng(0)
    for k in range(3):
        moved = {
            n: a + 1e-3 * rng.standard_normal(a.shape).astype(np.float32) for n, a in params.items()
        }
        local = WorldModelAdapter().rotate(moved, random_orthogonal(8, seed=k))
        raw = {n: local[n] - params[n] for n in params}
        aligned = transform(plaintext_update(raw)).delta
        expected = coordinator_harness(gauge.adapter, gauge.probe, cfg.gauge, params, raw, 7)
        for name in params:
            np.testing.assert_array_equal(aligned[name], expected[name])
    assert len(calls) == 1 + 3  # once for the round, once per direct coordinator_harness


def rejections(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == COORDINATOR_LOG and "message rejected" in r.getMessage()
    ]


def test_an_update_aligned_on_another_sketch_is_rejected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def other_sketch(payload: dict) -> dict:
        payload["sketch_fingerprint"] = "0" * 64
        return payload

    faults = FaultPlan().corrupt("p01", round=1, kind=MessageKind.UPDATE, mutate=other_sketch)
    fed = world(tmp_path, faults=faults)
    with caplog.at_level(logging.WARNING, logger=COORDINATOR_LOG):
        fed.coordinator.run(1)
    entry = fed.coordinator.manifest.rounds[-1]
    assert entry.state is RoundState.CLOSED and entry.contributors == ("p00", "p02")
    assert entry.rejected == 1
    (rejected,) = rejections(caplog)
    assert re.search(
        r"p01: aligned on sketch 000000000000…, the round's is [0-9a-f]{12}…", rejected
    )


def test_an_unaligned_update_is_rejected_when_alignment_is_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def strip(payload: dict) -> dict:
        payload["sketch_fingerprint"] = None
        return payload

    faults = FaultPlan().corrupt("p00", round=1, kind=MessageKind.UPDATE, mutate=strip)
    fed = world(tmp_path, faults=faults)
    with caplog.at_level(logging.WARNING, logger=COORDINATOR_LOG):
        fed.coordinator.run(1)
    entry = fed.coordinator.manifest.rounds[-1]
    assert entry.contributors == ("p01", "p02") and entry.rejected == 1
    (rejected,) = rejections(caplog)
    assert "p00: aligned on sketch None…" in rejected


def test_the_warm_start_is_checked_at_every_join_point(tmp_path: Path) -> None:
    params = initial_params(0)
    good = encoder_hash(params, ["encoder"])
    # the coordinator refuses to start from another encoder
    with pytest.raises(GaugeError, match="is not the warm start abababababab"):
        world(tmp_path / "a", config(warm_start_hash="ab" * 32))
    # participants check θ_0's encoder on round 1's RoundOpen: a participant pinned to
    # another warm start refuses round 1 (and only round 1)
    fed = world(tmp_path / "b", config(warm_start_hash=good))
    fed.participants[1].config = config(warm_start_hash="cd" * 32)
    fed.coordinator.run(2)
    first, second = (e for e in fed.coordinator.manifest.rounds)
    assert first.refused["p01"].startswith("GaugeError") and "p01" not in first.contributors
    assert "p01" in second.contributors
    # a rejoiner at θ_0 revalidates it from the run directory
    fresh = world(tmp_path / "c", config(warm_start_hash=good))
    fresh.participants[0].config = config(warm_start_hash="cd" * 32)
    with pytest.raises(GaugeError, match="is not the warm start"):
        fresh.participants[0].join(str(tmp_path / "c" / "run"))


def test_frame_drift_is_recorded_in_the_manifest_and_the_ledger(tmp_path: Path) -> None:
    fed = world(tmp_path, config(drift_threshold=1e-9))
    fed.coordinator.run(2)
    records = verify(fed.coordinator.store)
    for entry, record in zip(fed.coordinator.manifest.rounds, records, strict=True):
        assert 0.0 <= entry.diagnostics["frame_drift"] <= 1.0
        assert record.frame_drift == entry.diagnostics["frame_drift"]
        assert entry.diagnostics["frame_drift_exceeded"] == 1.0  # any drift crosses 1e-9
    assert Ledger(fed.coordinator.store).head().frame_drift is not None


def test_a_drift_that_cannot_be_computed_does_not_stop_the_run(monkeypatch) -> None:
    fed_config = config()

    def degenerate(*_args, **_kwargs):
        raise DegenerateProcrustes("all-zero probe embeddings")

    monkeypatch.setattr("lensemble_flwr.gauge.runtime.frame_drift", degenerate)
    params = initial_params(0)
    out = drift_diagnostics(world_gauge(0), fed_config, params, params, round=4)
    assert "frame_drift" not in out and out["frame_drift_failed"] == 1.0


def test_alignment_happens_before_every_other_release_stage(tmp_path: Path) -> None:
    cfg = config()
    cfg = cfg.model_copy(
        update={
            "privacy": LensembleConfig(privacy={"clip_norm": 0.5}).privacy,
            "release": LensembleConfig(release={"quantize": "int8"}).release,
        }
    )
    fed = world(tmp_path, cfg)
    fed.coordinator.run(1)
    node = fed.participants[0]
    state = fed.coordinator.global_state()
    released = node.local_round(state, state.sketch_seed)
    assert released.transforms[:3] == ("align", "difference", "clip")
    assert released.transforms[-2:] == ("int8_quantize", "bind")
    assert released.sketch_fingerprint is not None
    assert np.isfinite(released.l2_norm) and released.l2_norm <= 0.5 + 1e-6
    assert fed.coordinator.round_state() is RoundState.CLOSED


def _int8_release(payload: dict) -> dict:
    """p02 as a participant configured with ``quantize = "int8"`` sends it: int8 codes and
    their scales, the stage named."""
    rng = np.random.default_rng(0)
    codes, scales = {}, {}
    for name, values in payload["delta"].items():
        codes[name], scales[name] = quantize_int8(np.asarray(values), rng)
    payload.update(delta=codes, scales=scales, transforms=("difference", "int8_quantize", "bind"))
    return payload


def test_the_harness_refuses_an_int8_update_instead_of_aligning_its_codes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator harness aligns raw plaintext deltas only: an int8 release of a
    participant configured otherwise is rejected at ingress by its metadata, never
    aligned, and the round sums exactly what it would have summed without it (aligned
    as if they were deltas, its codes came out far from the released values: the sum
    they would have entered is shown wrong here too)."""
    cfg = config(align=False, coordinator_harness=True)
    faults = FaultPlan().corrupt("p02", round=1, kind=MessageKind.UPDATE, mutate=_int8_release)
    fed = world(tmp_path / "int8", cfg, faults=faults)
    with caplog.at_level(logging.WARNING, logger=COORDINATOR_LOG):
        fed.coordinator.run(1)
    entry = fed.coordinator.manifest.rounds[-1]
    assert entry.state is RoundState.CLOSED and entry.contributors == ("p00", "p01")
    assert entry.rejected == 1
    (rejected,) = rejections(caplog)
    assert "UnalignableUpdate" in rejected and "int8 scales" in rejected
    # the sum is untouched: the same global as a round in which p02 sent nothing
    silent = FaultPlan().drop("p02", round=1, at=RoundState.OPEN)
    twin = world(tmp_path / "without", cfg, faults=silent)
    twin.coordinator.run(1)
    assert twin.coordinator.manifest.rounds[-1].contributors == ("p00", "p01")
    assert fed.coordinator.global_state().params_hash == twin.coordinator.global_state().params_hash


def test_aligning_int8_codes_as_deltas_is_far_from_aligning_what_was_released() -> None:
    """Why the harness refuses an int8 release: its transform, given the codes, sums
    (aligned codes) x scale, which is nowhere near the alignment of the released values."""
    gauge, cfg, params = world_gauge(0), config(sketch_rows=16), initial_params(0)
    rng = np.random.default_rng(1)
    moved = {
        n: a + 1e-3 * rng.standard_normal(a.shape).astype(np.float32) for n, a in params.items()
    }
    local = WorldModelAdapter().rotate(moved, random_orthogonal(8, seed=3))
    raw = {n: local[n] - params[n] for n in params}
    codes, scales = {}, {}
    for name in raw:
        codes[name], scales[name] = quantize_int8(raw[name], rng)
    released = {n: (codes[n] * scales[n]).astype(np.float32) for n in raw}
    transform = harness_transform(gauge, cfg, params, round_seed=7)
    right = transform(plaintext_update(released)).delta
    wrong = transform(plaintext_update(codes, scales=scales)).delta  # what it used to sum
    error = np.sqrt(sum(np.sum((wrong[n] * scales[n] - right[n]) ** 2) for n in raw))
    assert error / np.sqrt(sum(np.sum(right[n] ** 2) for n in raw)) > 0.5


def test_local_round_checks_the_warm_start_at_t0_without_a_round_open(tmp_path: Path) -> None:
    """A caller that trains through ``Participant.local_round`` (no RoundOpen) meets the
    same INV-WARMSTART-T0 check: round 1 from a θ_0 whose encoder is not the warm start is
    refused before any training; from the warm start it trains, and a later round is not
    checked."""
    params = initial_params(0)
    good = encoder_hash(params, ["encoder"])
    fed = world(tmp_path, config(warm_start_hash=good))
    node, seed, probe = fed.participants[0], 11, fed.gauge.probe

    def state(round: int, params: dict) -> GlobalState:
        return GlobalState.create(
            round, params, sketch_seed=seed, h_steps=1, probe_hash=probe.probe_hash,
            landmark_hashes=probe.landmark_hashes,
        )  # fmt: skip

    other = {n: a + 1.0 if n.startswith("encoder") else a for n, a in params.items()}
    t0_other = state(0, other)
    with pytest.raises(GaugeError, match="is not the warm start"):
        node.local_round(t0_other, seed)
    assert node.last_loss is None  # refused before it trained
    released = node.local_round(state(0, params), seed)
    assert released.round == 1 and node.last_loss is not None
    later = node.local_round(state(1, other), seed)
    assert later.round == 2  # θ_1 is no warm start to check
    # a participant pinned to another warm start refuses the agreed θ_0 as well
    node.config = config(warm_start_hash="cd" * 32)
    with pytest.raises(GaugeError, match="is not the warm start cdcdcdcdcdcd"):
        node.local_round(state(0, params), seed)
