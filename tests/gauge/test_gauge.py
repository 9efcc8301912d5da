"""Gauge alignment: Procrustes, its conditioning rule, probe pinning, the sketch, the warm
start, frame drift, the world model's gauge adapter and alignment as a release stage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.linalg import orthogonal_procrustes

from lensemble_flwr.config import GaugeConfig, LensembleConfig
from lensemble_flwr.errors import (
    ConfigError,
    DegenerateProcrustes,
    GaugeError,
    ParameterMismatch,
    ProbeError,
    RoundError,
)
from lensemble_flwr.gauge import (
    GaugeAdapter,
    Probe,
    align,
    align_to_global,
    alignment_target,
    check_pinned,
    check_warm_start,
    coordinator_harness,
    encoder_hash,
    frame_drift,
    harness_delta,
    procrustes_align,
    sketch_fingerprint,
    sketch_matrix,
)
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.params import subtract
from lensemble_flwr.participant.release_chain import release_pipeline
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.release import Release, ReleaseContext, Stage, bind, chain, clip, difference
from lensemble_flwr.simulations.world_data import participant_data, public_probe
from lensemble_flwr.simulations.world_model import (
    WorldModelAdapter,
    WorldTrainer,
    initial_params,
    random_orthogonal,
)

ALIGN = {"max_condition": 1e6}
D = 8


def rotation_2d(angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, s], [-s, c]])


# -- procrustes_align -------------------------------------------------------------------
def test_procrustes_hand_checked_quarter_turn() -> None:
    # Two points, (1, 0) and (0, 1), turned a quarter to (0, 1) and (-1, 0): the cross-
    # covariance is the quarter turn itself, and so is its polar factor.
    local = np.eye(2)
    target = np.array([[0.0, 1.0], [-1.0, 0.0]])
    alignment = procrustes_align(local, target, **ALIGN)
    np.testing.assert_allclose(alignment.q, target, atol=1e-12)
    assert alignment.condition == pytest.approx(1.0)
    assert alignment.residual_before == pytest.approx(math.sqrt(4 / 2))  # ||I - T|| / ||T||
    assert alignment.residual_after == pytest.approx(0.0, abs=1e-12)
    assert not alignment.conditioned


def test_procrustes_recovers_a_known_rotation_exactly() -> None:
    rng = np.random.default_rng(0)
    local = rng.standard_normal((50, D))
    q = random_orthogonal(D, seed=3)
    alignment = procrustes_align(local, local @ q, **ALIGN)
    np.testing.assert_allclose(alignment.q, q, atol=1e-10)
    assert alignment.residual_after < 1e-12 < alignment.residual_before


def test_procrustes_allows_reflections() -> None:
    # The loss is invariant under all of O(d), so a reflected frame is aligned too.
    rng = np.random.default_rng(1)
    local = rng.standard_normal((40, D))
    reflection = np.diag([1.0] * (D - 1) + [-1.0]) @ random_orthogonal(D, seed=5)
    alignment = procrustes_align(local, local @ reflection, **ALIGN)
    assert np.linalg.det(alignment.q) == pytest.approx(-1.0)
    np.testing.assert_allclose(alignment.q, reflection, atol=1e-10)


def test_procrustes_matches_scipy_on_noisy_data() -> None:
    rng = np.random.default_rng(2)
    local = rng.standard_normal((30, D))
    target = local @ random_orthogonal(D, seed=7) + 0.3 * rng.standard_normal((30, D))
    alignment = procrustes_align(local, target, **ALIGN)
    expected, _ = orthogonal_procrustes(local, target)
    np.testing.assert_allclose(alignment.q, expected, atol=1e-10)
    np.testing.assert_allclose(alignment.q @ alignment.q.T, np.eye(D), atol=1e-12)
    assert alignment.residual_after < alignment.residual_before


@pytest.mark.parametrize(
    ("local", "target", "match"),
    [
        (np.full((5, 2), np.nan), np.ones((5, 2)), "non-finite"),
        (np.ones((5, 2)), np.full((5, 2), np.inf), "non-finite"),
        (np.ones((5, 2)), np.ones((5, 3)), "same shape"),
        (np.ones(5), np.ones(5), "same shape"),
        (np.ones((0, 2)), np.ones((0, 2)), "same shape"),
        (np.eye(2), np.zeros((2, 2)), "all zero"),
    ],
)
def test_procrustes_refuses_bad_inputs(local: np.ndarray, target: np.ndarray, match: str) -> None:
    with pytest.raises(DegenerateProcrustes, match=match):
        procrustes_align(local, target, **ALIGN)


def rank_deficient() -> tuple[np.ndarray, np.ndarray]:
    """Embeddings whose last latent dimension carries no signal."""
    local = np.random.default_rng(3).standard_normal((20, 3))
    local[:, 2] = 0.0
    return local, local.copy()


def test_procrustes_refuse_rule_raises_on_a_rank_deficient_cross_covariance() -> None:
    local, target = rank_deficient()
    with pytest.raises(DegenerateProcrustes, match="condition inf exceeds"):
        procrustes_align(local, target, max_condition=1e6, conditioning="refuse")


def test_procrustes_ridge_rule_leaves_an_undetermined_direction_unrotated() -> None:
    local, target = rank_deficient()
    alignment = procrustes_align(local, target, max_condition=1e6, conditioning="ridge")
    assert alignment.conditioned and math.isinf(alignment.condition)
    np.testing.assert_allclose(alignment.q, np.eye(3), atol=1e-12)


def test_procrustes_ridge_rule_keeps_well_determined_directions() -> None:
    # A rotation in the plane the probe determines survives the ridge; the third,
    # unconstrained direction stays put.
    local, _ = rank_deficient()
    q = np.eye(3)
    q[:2, :2] = rotation_2d(0.4)
    alignment = procrustes_align(local, local @ q, max_condition=1e6, conditioning="ridge")
    np.testing.assert_allclose(alignment.q, q, atol=2e-3)


def test_procrustes_ridge_rule_refuses_when_still_ill_conditioned() -> None:
    # M = diag(1, -1e-3): the ridge 1e-3 * sigma_max * I cancels the second singular value.
    target = np.diag([1.0, -1e-3])
    with pytest.raises(DegenerateProcrustes, match="still inf with a ridge"):
        procrustes_align(np.eye(2), target, max_condition=100.0, ridge=1e-3)
    with pytest.raises(DegenerateProcrustes, match="still"):  # no signal at all
        procrustes_align(np.zeros((4, 2)), np.ones((4, 2)), max_condition=100.0)


def test_procrustes_threshold_is_max_condition() -> None:
    local = np.diag([1.0, 0.1])  # cross-covariance diag(1, 0.01): condition 100
    assert procrustes_align(local, local, max_condition=100.0, conditioning="refuse")
    with pytest.raises(DegenerateProcrustes, match="exceeds 99"):
        procrustes_align(local, local, max_condition=99.0, conditioning="refuse")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"conditioning": "clamp"}, "gauge.conditioning"),
        ({"ridge": 0.0}, "gauge.ridge"),
        ({"max_condition": 1.0}, "gauge.max_condition"),
    ],
)
def test_procrustes_refuses_bad_settings(kwargs: dict, field: str) -> None:
    arguments = {"max_condition": 1e6, **kwargs}
    with pytest.raises(ConfigError) as info:
        procrustes_align(np.eye(2), np.eye(2), **arguments)
    assert info.value.field == field


# -- the probe ----------------------------------------------------------------------------
def small_probe() -> Probe:
    return Probe(np.arange(24, dtype=np.float32).reshape(6, 4), landmarks=(1, 4))


def test_probe_hashes_are_canonical_and_cover_what_they_say() -> None:
    probe = small_probe()
    assert probe.probe_hash == small_probe().probe_hash
    assert len(probe.landmark_hashes) == 2 and len(set(probe.landmark_hashes)) == 2
    # a float64 copy of the same values is the same probe
    same = Probe(probe.inputs.astype(np.float64), landmarks=(1, 4))
    assert same.probe_hash == probe.probe_hash
    # the landmark subset is part of the probe hash
    assert Probe(probe.inputs, landmarks=(1, 3)).probe_hash != probe.probe_hash
    # changing a non-landmark row changes only the probe hash
    inputs = probe.inputs.copy()
    inputs[0, 0] += 1
    other = Probe(inputs, landmarks=(1, 4))
    assert other.probe_hash != probe.probe_hash
    assert other.landmark_hashes == probe.landmark_hashes


def test_probe_keeps_a_read_only_copy() -> None:
    inputs = np.ones((3, 2), np.float32)
    probe = Probe(inputs, landmarks=(0,))
    before = probe.probe_hash
    inputs[0, 0] = 5.0
    assert probe.inputs[0, 0] == 1.0 and not probe.inputs.flags.writeable
    assert Probe(probe.inputs, landmarks=(0,)).probe_hash == before


@pytest.mark.parametrize(
    ("inputs", "landmarks", "match"),
    [
        (np.ones(4), (), "n x obs_dim"),
        (np.ones((0, 3)), (), "n x obs_dim"),
        (np.array([[1.0, np.nan]]), (), "finite"),
        (np.array([["a", "b"]]), (), "finite"),
        (np.ones((3, 2)), (3,), r"landmarks \[3\] are not rows"),
        (np.ones((3, 2)), (-1,), "are not rows"),
        (np.ones((3, 2)), (1, 1), "repeat"),
    ],
)
def test_probe_refuses_bad_input(inputs: np.ndarray, landmarks: tuple, match: str) -> None:
    with pytest.raises(ProbeError, match=match):
        Probe(inputs, landmarks=landmarks)


def test_check_pinned_accepts_the_pinned_probe() -> None:
    probe = small_probe()
    check_pinned(probe, probe.probe_hash, probe.landmark_hashes)


def test_check_pinned_names_what_differs() -> None:
    probe = small_probe()
    with pytest.raises(ProbeError, match="announces no probe"):
        check_pinned(probe, "", ())
    with pytest.raises(ProbeError, match="announces 1 landmarks, the pinned probe has 2"):
        check_pinned(probe, probe.probe_hash, probe.landmark_hashes[:1])
    inputs = probe.inputs.copy()
    inputs[4, 2] = -1.0  # landmark #1 is row 4
    moved = Probe(inputs, landmarks=(1, 4))
    with pytest.raises(ProbeError, match=r"landmarks differ from the pinned probe: #1 \(row 4\)"):
        check_pinned(probe, moved.probe_hash, moved.landmark_hashes)
    inputs = probe.inputs.copy()
    inputs[0, 0] = -1.0  # not a landmark
    other = Probe(inputs, landmarks=(1, 4))
    with pytest.raises(ProbeError, match="other probe rows differ"):
        check_pinned(probe, other.probe_hash, other.landmark_hashes)


# -- the sketch ---------------------------------------------------------------------------
def test_sketch_is_a_deterministic_function_of_the_round_seed() -> None:
    a = sketch_matrix(11, 32, 256)
    assert a.shape == (32, 256) and a.dtype == np.float64
    np.testing.assert_array_equal(a, sketch_matrix(11, 32, 256))
    assert not np.allclose(a, sketch_matrix(12, 32, 256))
    assert not np.allclose(a[:16], sketch_matrix(11, 16, 256))  # rows change the scale
    # entries are N(0, 1/m): the sample variance of 8192 draws is within 5% of 1/32
    assert np.var(a) == pytest.approx(1 / 32, rel=0.05)


def test_sketch_fingerprint_identifies_the_matrix() -> None:
    a = sketch_matrix(3, 8, 20)
    assert sketch_fingerprint(a) == sketch_fingerprint(a.copy())
    assert sketch_fingerprint(a) == sketch_fingerprint(a.astype(">f8"))  # byte order
    assert sketch_fingerprint(a) != sketch_fingerprint(sketch_matrix(4, 8, 20))
    assert sketch_fingerprint(a) != sketch_fingerprint(a.T)
    assert sketch_fingerprint(a) == sketch_fingerprint(sketch_matrix(3, 8, 20))
    assert sketch_fingerprint(a) != sketch_fingerprint(sketch_matrix(3, 9, 20))  # rows
    assert sketch_fingerprint(a) != sketch_fingerprint(sketch_matrix(3, 8, 21))  # probe size


@pytest.mark.parametrize(
    ("args", "field"),
    [((-1, 4, 4), "round_seed"), ((0, 0, 4), "gauge.sketch_rows"), ((0, 4, 0), "probe size")],
)
def test_sketch_refuses_bad_arguments(args: tuple, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        sketch_matrix(*args)
    assert info.value.field == field


def test_sketch_fingerprint_refuses_what_is_not_a_sketch() -> None:
    with pytest.raises(GaugeError):
        sketch_fingerprint(np.ones(3))
    with pytest.raises(GaugeError):
        sketch_fingerprint(np.array([[np.nan]]))


# -- the warm start -----------------------------------------------------------------------
def test_warm_start_hash_covers_the_encoder_only() -> None:
    params = initial_params(0)
    expected = encoder_hash(params, ["encoder"])
    check_warm_start(params, ["encoder"], expected)
    predictor_changed = {**params, "predictor.out.bias": params["predictor.out.bias"] + 1}
    check_warm_start(predictor_changed, ["encoder"], expected)
    assert encoder_hash(initial_params(1), ["encoder"]) != expected


def test_warm_start_mismatch_raises_gauge_error() -> None:
    params = initial_params(0)
    expected = encoder_hash(params, ["encoder"])
    nudged = {**params, "encoder.out.bias": params["encoder.out.bias"] + 1e-6}
    with pytest.raises(GaugeError, match="is not the warm start"):
        check_warm_start(nudged, ["encoder"], expected)
    with pytest.raises(GaugeError, match="no parameter belongs"):
        check_warm_start(params, ["encoders"], expected)
    check_warm_start(nudged, ["encoder"], "")  # no published warm start: nothing to check


# -- the world model's gauge adapter -----------------------------------------------------
@pytest.fixture(scope="module")
def trainer() -> WorldTrainer:
    return WorldTrainer(participant_data(1, trajectories=4, steps=16))


@pytest.fixture(scope="module")
def probe() -> Probe:
    return public_probe(0)


def test_world_adapter_is_a_gauge_adapter() -> None:
    adapter = WorldModelAdapter()
    assert isinstance(adapter, GaugeAdapter)
    assert set(adapter.frame_names) <= set(initial_params())


def test_rotate_changes_the_frame_and_nothing_else(probe: Probe, trainer: WorldTrainer) -> None:
    adapter = WorldModelAdapter()
    params = initial_params(0)
    q = random_orthogonal(D, seed=9)
    rotated = adapter.rotate(params, q)
    z = adapter.embed(params, probe.inputs)
    np.testing.assert_allclose(adapter.embed(rotated, probe.inputs), z @ q, atol=1e-5)
    assert all(rotated[n].dtype == np.float32 for n in rotated)
    for name in set(params) - set(adapter.frame_names):
        np.testing.assert_array_equal(rotated[name], params[name])
    for name in adapter.frame_names:
        assert not np.allclose(rotated[name], params[name])
    # the action-embedding columns of the predictor's first layer are not in the frame
    np.testing.assert_array_equal(
        rotated["predictor.inp.weight"][:, D:], params["predictor.inp.weight"][:, D:]
    )
    # round trip
    back = adapter.rotate(rotated, q.T)
    for name in params:
        np.testing.assert_allclose(back[name], params[name], atol=1e-6)


def test_rotated_network_predicts_the_same_up_to_q_and_has_the_same_loss(
    trainer: WorldTrainer,
) -> None:
    adapter = WorldModelAdapter()
    params = initial_params(0)
    q = random_orthogonal(D, seed=10)
    rotated = adapter.rotate(params, q)
    obs, actions, next_obs = trainer.sample_batch(torch.Generator().manual_seed(0), 64)

    def outputs(shared: dict) -> tuple[np.ndarray, np.ndarray, float]:
        model = trainer.model
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if name in shared:
                    tensor.copy_(torch.from_numpy(shared[name]))
            z = model.encoder(obs)
            predicted = model.predictor(z, model.action_head(actions))
            return z.numpy(), predicted.numpy(), float(model.loss(obs, actions, next_obs))

    z, predicted, loss = outputs(params)
    z_r, predicted_r, loss_r = outputs(rotated)
    np.testing.assert_allclose(z_r, z @ q, atol=1e-5)
    np.testing.assert_allclose(predicted_r, predicted @ q, atol=1e-5)
    assert loss_r == pytest.approx(loss, rel=1e-5)
    assert trainer.validation_loss(rotated) == pytest.approx(
        trainer.validation_loss(params), rel=1e-5
    )


def test_rotate_refuses_a_bad_q_or_missing_frame_tensors() -> None:
    adapter = WorldModelAdapter()
    params = initial_params(0)
    with pytest.raises(ParameterMismatch, match="8 x 8"):
        adapter.rotate(params, np.eye(3))
    with pytest.raises(ParameterMismatch, match="finite"):
        adapter.rotate(params, np.full((D, D), np.nan))
    without = {n: a for n, a in params.items() if n != "predictor.out.bias"}
    with pytest.raises(ParameterMismatch, match=r"predictor\.out\.bias"):
        adapter.rotate(without, np.eye(D))
    with pytest.raises(ParameterMismatch, match="encoder"):
        adapter.embed({}, np.ones((2, 24), np.float32))


# -- frame drift --------------------------------------------------------------------------
def test_frame_drift_measures_the_rotation_between_global_models(probe: Probe) -> None:
    adapter = WorldModelAdapter()
    params = initial_params(0)
    assert frame_drift(adapter, probe, params, params) == pytest.approx(0.0, abs=1e-6)
    q = random_orthogonal(D, seed=4)
    expected = np.linalg.norm(q - np.eye(D)) / (2 * math.sqrt(D))
    drift = frame_drift(adapter, probe, params, adapter.rotate(params, q))
    assert drift == pytest.approx(expected, abs=1e-5)
    flipped = frame_drift(adapter, probe, params, adapter.rotate(params, -np.eye(D)))
    assert flipped == pytest.approx(1.0, abs=1e-6)


def test_frame_drift_of_a_collapsed_latent_is_still_a_number(probe: Probe) -> None:
    adapter = WorldModelAdapter()
    params = initial_params(0)
    collapsed = {**params, "encoder.out.weight": params["encoder.out.weight"].copy()}
    collapsed["encoder.out.weight"][3:] = 0.0
    collapsed["encoder.out.bias"] = np.zeros_like(params["encoder.out.bias"])
    assert 0.0 <= frame_drift(adapter, probe, params, collapsed) <= 1.0
    dead = {**collapsed, "encoder.out.weight": np.zeros_like(params["encoder.out.weight"])}
    with pytest.raises(DegenerateProcrustes, match="all zero"):
        frame_drift(adapter, probe, dead, params)


# -- alignment as a release stage --------------------------------------------------------
GAUGE = GaugeConfig(align=True, sketch_rows=32)


def context(probe: Probe, params: dict, *, round_seed: int = 5) -> ReleaseContext:
    state = GlobalState.create(
        0,
        params,
        sketch_seed=round_seed,
        h_steps=1,
        probe_hash=probe.probe_hash,
        landmark_hashes=probe.landmark_hashes,
    )
    return ReleaseContext(
        participant_id="p",
        global_state=state,
        round_seed=round_seed,
        dataset_root="root",
        num_examples=1,
    )


def drifted_local(params: dict, *, seed: int = 0, scale: float = 1e-3) -> tuple[dict, dict]:
    """A small update of ``params``, and the same network in a random frame."""
    rng = np.random.default_rng(seed)
    trained = {
        n: a + scale * rng.standard_normal(a.shape).astype(np.float32) for n, a in params.items()
    }
    q = random_orthogonal(D, seed=100 + seed)
    return trained, WorldModelAdapter().rotate(trained, q)


def test_align_stage_rotates_before_differencing(probe: Probe) -> None:
    adapter = WorldModelAdapter()
    params = initial_params(0)
    trained, local = drifted_local(params)
    pipeline = chain(align(adapter, probe, GAUGE), difference(), clip(10.0), bind())
    ctx = context(probe, params)
    release, _ = pipeline.update(Release(local=local), pipeline.init(params), ctx)
    assert release.applied == ("align", "difference", "clip", "bind")
    # Up to the small rotation that Procrustes also reads into the update, the released
    # delta is the update made in the global frame, not the change of frame.
    true_norm = l2_norm(subtract(trained, params))
    assert l2_norm(release.delta) < 2 * true_norm
    assert l2_norm(subtract(local, params)) > 50 * true_norm
    meta = release.metadata
    assert meta["sketch_fingerprint"] == sketch_fingerprint(sketch_matrix(5, 32, probe.size))
    assert meta["procrustes_residual_after"] < 0.05 < 0.5 < meta["procrustes_residual_before"]
    assert 1.0 <= meta["procrustes_condition"] < GAUGE.max_condition
    assert meta["procrustes_conditioned"] is False


def test_align_of_an_exact_rotation_gives_a_zero_delta(probe: Probe) -> None:
    params = initial_params(0)
    local = WorldModelAdapter().rotate(params, random_orthogonal(D, seed=1))
    pipeline = chain(align(WorldModelAdapter(), probe, GAUGE), difference())
    release, _ = pipeline.update(
        Release(local=local), pipeline.init(params), context(probe, params)
    )
    assert max(float(np.abs(d).max()) for d in release.delta.values()) < 1e-5


def test_alignment_must_come_first_in_the_release_order(probe: Probe) -> None:
    stage = align(WorldModelAdapter(), probe, GAUGE)
    assert stage.stage is Stage.ALIGN
    with pytest.raises(ConfigError, match="'align' \\(ALIGN\\) cannot follow 'clip'"):
        chain(difference(), clip(1.0), stage)
    with pytest.raises(ConfigError, match="cannot follow 'difference'"):
        chain(difference(), stage)
    with pytest.raises(ConfigError, match="cannot follow 'align'"):
        chain(stage, stage)


def test_align_stage_refuses_another_probe(probe: Probe) -> None:
    params = initial_params(0)
    stage = align(WorldModelAdapter(), probe, GAUGE)
    other = Probe(probe.inputs[:-1], landmarks=probe.landmarks)
    with pytest.raises(ProbeError):
        stage.update(Release(local=params), None, context(other, params))


def test_align_stage_needs_local_weights(probe: Probe) -> None:
    params = initial_params(0)
    stage = align(WorldModelAdapter(), probe, GAUGE)
    with pytest.raises(RoundError, match="before difference"):
        stage.update(Release(delta=params), None, context(probe, params))


def test_align_stage_lets_a_degenerate_alignment_refuse_the_release(probe: Probe) -> None:
    params = initial_params(0)
    collapsed = {**params, "encoder.out.weight": params["encoder.out.weight"].copy()}
    collapsed["encoder.out.weight"][2:] = 0.0
    collapsed["encoder.out.bias"] = np.zeros_like(params["encoder.out.bias"])
    refuse = GaugeConfig(align=True, conditioning="refuse")
    with pytest.raises(DegenerateProcrustes):
        align(WorldModelAdapter(), probe, refuse).update(
            Release(local=collapsed), None, context(probe, params)
        )
    # the ridge rule aligns the determined directions and leaves the others alone
    release, _ = align(WorldModelAdapter(), probe, GAUGE).update(
        Release(local=collapsed), None, context(probe, params)
    )
    assert release.metadata["procrustes_conditioned"] is True


def test_coordinator_harness_aligns_a_plaintext_delta(probe: Probe) -> None:
    params = initial_params(0)
    trained, local = drifted_local(params, seed=2)
    raw = subtract(local, params)
    aligned = coordinator_harness(WorldModelAdapter(), probe, GAUGE, params, raw, 5)
    assert l2_norm(aligned) < 2 * l2_norm(subtract(trained, params))
    assert l2_norm(raw) > 50 * l2_norm(subtract(trained, params))
    # the same computation as the participant's stage
    stage = chain(align(WorldModelAdapter(), probe, GAUGE), difference())
    release, _ = stage.update(Release(local=local), stage.init(params), context(probe, params))
    for name in params:
        np.testing.assert_allclose(aligned[name], release.delta[name], atol=1e-6)
    with pytest.raises(ParameterMismatch):
        coordinator_harness(WorldModelAdapter(), probe, GAUGE, params, {"encoder.x": 1}, 5)


def test_a_round_target_computed_once_gives_the_same_alignments(probe: Probe) -> None:
    adapter, params = WorldModelAdapter(), initial_params(0)
    target = alignment_target(adapter, probe, GAUGE, params, 5)
    assert target.fingerprint == sketch_fingerprint(sketch_matrix(5, 32, probe.size))
    for seed in (2, 3):
        _, local = drifted_local(params, seed=seed)
        raw = subtract(local, params)
        once = harness_delta(adapter, probe, GAUGE, target, raw)
        each = coordinator_harness(adapter, probe, GAUGE, params, raw, 5)
        for name in params:
            np.testing.assert_array_equal(once[name], each[name])
        _, _, fingerprint = align_to_global(
            adapter, probe, GAUGE, local=local, global_params=params, round_seed=5
        )
        assert fingerprint == target.fingerprint
    with pytest.raises(ParameterMismatch):
        harness_delta(adapter, probe, GAUGE, target, {"encoder.x": np.ones(1)})


def test_coordinator_harness_refuses_a_non_finite_delta(probe: Probe) -> None:
    params = initial_params(0)
    raw = {n: np.zeros_like(a) for n, a in params.items()}
    raw["predictor.out.bias"][0] = np.inf
    with pytest.raises(ParameterMismatch, match="coordinator harness: non-finite delta"):
        coordinator_harness(WorldModelAdapter(), probe, GAUGE, params, raw, 5)
    raw["predictor.out.bias"][0] = 0.0
    raw["encoder.out.weight"][1, 2] = np.nan
    with pytest.raises(ParameterMismatch, match="coordinator harness: non-finite delta"):
        coordinator_harness(WorldModelAdapter(), probe, GAUGE, params, raw, 5)


class LossyAdapter(WorldModelAdapter):
    """A broken adapter whose rotation loses a tensor."""

    def rotate(self, params, q):  # type: ignore[override]
        rotated = super().rotate(params, q)
        del rotated["predictor.inp.bias"]
        return rotated


def test_alignment_refuses_an_adapter_whose_rotation_changes_the_layout(probe: Probe) -> None:
    params = initial_params(0)
    _, local = drifted_local(params)
    with pytest.raises(ParameterMismatch, match=r"rotate: missing \['predictor\.inp\.bias'\]"):
        align_to_global(
            LossyAdapter(), probe, GAUGE, local=local, global_params=params, round_seed=5
        )


def test_a_pipeline_that_aligns_needs_a_gauge_setup() -> None:
    with pytest.raises(ConfigError) as info:
        release_pipeline(
            LensembleConfig(gauge={"align": True}), participant_id="p", dataset_root=None
        )
    assert info.value.field == "gauge-align" and "GaugeSetup" in info.value.reason
