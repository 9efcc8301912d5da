"""The release chain, stage by stage: align → difference → clip → noise → quantize → mask →
bind, and the chain as the whole release.

Degenerate parameters recover plain averaging: a clip at infinity changes nothing, no
noise stage (σ = 0) adds nothing, and the mask stage's masks cancel in the sum, bit for
bit, so the revealed sum of masked releases is the plaintext sum of the same releases.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from lensemble_flwr.aggregation.fixed_point import to_fixed_point
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import PrivacyBudgetExceeded, RoundError
from lensemble_flwr.participant.release_chain import release_pipeline, with_mask
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.privacy.distributed import distributed_noise_for
from lensemble_flwr.protocol.messages import RoundOpen
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.release import (
    PrivacyState,
    Release,
    ReleaseContext,
    Stage,
    bind,
    chain,
    clip,
    difference,
    distributed_noise,
    gaussian_noise,
    int8_quantize,
    mask,
)
from lensemble_flwr.secagg import prg
from lensemble_flwr.secagg.participant_role import MaskingRole, MaskRound, encode_member
from lensemble_flwr.secagg.protocol import MaskedSum, Member, disclose

GLOBAL = {"a": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float32)}
STATE = GlobalState.create(0, GLOBAL, sketch_seed=1, h_steps=1)
FRACTION_BITS = 32


def local_weights(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {n: (a + rng.normal(0, 0.1, a.shape)).astype(np.float32) for n, a in GLOBAL.items()}


def ctx(pid: str = "p0", mask_round: MaskRound | None = None, **changes: object) -> ReleaseContext:
    fields: dict = dict(
        participant_id=pid,
        global_state=STATE,
        round_seed=5,
        dataset_root="ab" * 32,
        num_examples=10,
        mask_round=mask_round,
    )
    return ReleaseContext(**{**fields, **changes})


def release_of(transform, local, context=None):  # type: ignore[no-untyped-def]
    context = context or ctx()
    return transform.update(Release(local=local), transform.init(GLOBAL), context)


def masked_config(**privacy: object) -> LensembleConfig:
    return LensembleConfig(
        federation={"secagg_threshold": 2, "min_participants": 2}, privacy=dict(privacy)
    )


# -- the chain: order and what the config builds -------------------------------------------
def test_the_configured_chain_is_the_whole_release_in_order(tmp_path: Path) -> None:
    budgets = str(tmp_path / "budgets")
    local = LensembleConfig(
        privacy={"clip_norm": 1.0, "noise_multiplier": 1.0, "dp_epsilon": 50.0,
                 "dp_state_dir": budgets},
        release={"quantize": "int8"},
    )  # fmt: skip
    names = [p.name for p in release_pipeline(local, participant_id="p", dataset_root="r").parts]
    assert names == ["difference", "clip", "gaussian_noise", "int8_quantize", "bind"]
    masked = masked_config(
        clip_norm=1.0, noise_multiplier=1.0, dp_epsilon=50.0, dp_mode="distributed",
        dp_state_dir=budgets,
    )  # fmt: skip
    pipeline = release_pipeline(masked, participant_id="p", dataset_root="r")
    assert [(p.name, p.stage) for p in pipeline.parts] == [
        ("difference", Stage.DIFFERENCE),
        ("clip", Stage.CLIP),
        ("distributed_noise", Stage.NOISE),
        ("mask", Stage.MASK),
        ("bind", Stage.BIND),
    ]
    plain = release_pipeline(LensembleConfig(), participant_id="p", dataset_root=None)
    assert [p.name for p in plain.parts] == ["difference"]


def test_a_custom_pipeline_of_a_masked_federation_gets_the_mask_stage_before_bind() -> None:
    config = masked_config()
    custom = chain(difference(), bind())
    placed = with_mask(custom, config)
    assert [p.name for p in placed.parts] == ["difference", "mask", "bind"]
    assert with_mask(placed, config) is placed  # already has one
    assert with_mask(custom, LensembleConfig()) is custom  # a plaintext federation
    assert [p.name for p in with_mask(difference(), config).parts] == ["difference", "mask"]


def test_the_mask_stage_cannot_come_before_noise_or_after_bind() -> None:
    from lensemble_flwr.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot follow"):
        chain(difference(), mask(masked_config()), clip(1.0))
    with pytest.raises(ConfigError, match="cannot follow"):
        chain(difference(), bind(), mask(masked_config()))


# -- difference and clip -------------------------------------------------------------------
def test_difference_then_clip_at_infinity_is_the_plain_difference() -> None:
    local = local_weights(1)
    out, _ = release_of(chain(difference(), clip(math.inf)), local)
    for name in GLOBAL:
        np.testing.assert_array_equal(out.delta[name], local[name] - GLOBAL[name])
    assert out.metadata["clipped_norm"] == out.metadata["pre_clip_norm"]
    assert out.applied == ("difference", "clip")


def test_a_finite_clip_scales_to_the_bound_and_a_bad_one_is_refused() -> None:
    out, _ = release_of(chain(difference(), clip(0.01)), local_weights(2))
    assert out.metadata["clipped_norm"] <= 0.01 < out.metadata["pre_clip_norm"]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="clip_norm"):
            clip(bad)
    with pytest.raises(RoundError, match="no delta to clip"):
        clip(1.0).update(Release(), None, ctx())


def test_with_no_noise_stage_the_chain_recovers_plain_averaging() -> None:
    """clip = inf, σ = 0 (no noise stage): the mean of the releases is the mean update."""
    pipeline = chain(difference(), clip(math.inf), bind())
    locals_ = [local_weights(i) for i in range(4)]
    releases = [release_of(pipeline, w)[0] for w in locals_]
    for name in GLOBAL:
        averaged = np.mean([r.delta[name].astype(np.float64) for r in releases], axis=0)
        expected = np.mean([w[name].astype(np.float64) for w in locals_], axis=0) - GLOBAL[name]
        np.testing.assert_allclose(averaged, expected, atol=1e-6)
    assert all(r.bound_root == "ab" * 32 and r.applied[-1] == "bind" for r in releases)


# -- noise: the charge is the stage's state ------------------------------------------------
def budget_at(tmp_path: Path, epsilon: float = 50.0, **kwargs: object) -> PrivacyBudget:
    return PrivacyBudget(tmp_path / "budgets", "p", epsilon=epsilon, delta=1e-5, **kwargs)


def test_the_noise_stage_starts_from_the_budget_and_its_state_is_the_charge(
    tmp_path: Path,
) -> None:
    budget = budget_at(tmp_path)
    stage = gaussian_noise(1.0, 0.5, budget)
    assert stage.init(GLOBAL) == PrivacyState("rdp", "substitution", (), 0.0)
    pipeline = chain(difference(), clip(0.5), stage)
    state = pipeline.init(GLOBAL)
    for releases in (1, 2):
        out, state = pipeline.update(Release(local=local_weights(releases)), state, ctx())
        charged = state.states[2]
        assert charged.history == ((0.5, 1.0, releases),)  # sigma / 2 under substitution
        assert charged.epsilon == out.metadata["epsilon"] == budget.spent()
        durable = budget_at(tmp_path)  # what the budget file holds: the same charge
        assert PrivacyState.of(durable) == charged
    # a chain started later (another process) starts from what the budget holds
    assert gaussian_noise(1.0, 0.5, budget_at(tmp_path)).init(GLOBAL) == charged


def test_a_release_the_budget_cannot_cover_is_refused_and_charges_nothing(
    tmp_path: Path,
) -> None:
    budget = budget_at(tmp_path, epsilon=1.0)
    pipeline = chain(difference(), clip(0.5), gaussian_noise(1.0, 0.5, budget))
    state = pipeline.init(GLOBAL)
    with pytest.raises(PrivacyBudgetExceeded):
        pipeline.update(Release(local=local_weights(1)), state, ctx())
    assert budget_at(tmp_path, epsilon=1.0).history == []
    assert not (tmp_path / "budgets" / "p.json").exists()


def test_noise_needs_a_clipped_delta_and_a_finite_clip(tmp_path: Path) -> None:
    budget = budget_at(tmp_path)
    with pytest.raises(ValueError, match="noise_multiplier"):
        gaussian_noise(0.0, 0.5, budget)
    with pytest.raises(ValueError, match="finite clip_norm"):
        gaussian_noise(1.0, math.inf, budget)
    stage = gaussian_noise(1.0, 0.5, budget)
    with pytest.raises(RoundError, match="only a clipped delta"):
        stage.update(Release(delta=dict(GLOBAL)), stage.init(GLOBAL), ctx())
    assert budget.history == []


def test_the_distributed_noise_stage_charges_and_draws_the_share_and_leaves_the_floats(
    tmp_path: Path,
) -> None:
    budget = budget_at(tmp_path)
    stage = distributed_noise(2.0, 0.5, fraction_bits=FRACTION_BITS, threshold=3, budget=budget)
    clipped, _ = release_of(chain(difference(), clip(0.5)), local_weights(3))
    out, state = stage.update(clipped, stage.init(GLOBAL), ctx())
    for name in GLOBAL:
        np.testing.assert_array_equal(out.delta[name], clipped.delta[name])  # unchanged
    dim = sum(a.size for a in GLOBAL.values())
    share = distributed_noise_for(2.0, 0.5, FRACTION_BITS, 3, dim)
    assert out.noise_share is not None and sorted(out.noise_share) == sorted(GLOBAL)
    assert all(out.noise_share[n].dtype == np.int64 for n in GLOBAL)
    assert all(out.noise_share[n].shape == GLOBAL[n].shape for n in GLOBAL)
    assert out.metadata["noise_share_sigma"] == share.share_sigma
    assert state.history == ((share.equivalent_noise_multiplier, 1.0, 1),)
    assert state == PrivacyState.of(budget_at(tmp_path))


# -- quantize ------------------------------------------------------------------------------
def test_quantize_keeps_the_released_values_within_one_step() -> None:
    out, _ = release_of(chain(difference(), clip(math.inf), int8_quantize()), local_weights(4))
    for name in GLOBAL:
        step = out.metadata["scales"][name]
        released = out.delta[name].astype(np.float64) * step
        assert np.all(np.abs(released - (local_weights(4)[name] - GLOBAL[name])) <= step)


# -- mask: the masks cancel in the sum, bit for bit ----------------------------------------
def open_rounds(pids: list[str], config: LensembleConfig) -> dict[str, MaskRound]:
    """Each member's role opens round 1 of run "run" (the member list of their keys)."""
    roles = {pid: MaskingRole(pid) for pid in pids}
    members = []
    for pid, role in roles.items():
        keys = role.keys_for_commitment()
        members.append(Member(pid, bytes.fromhex(keys["mask_key"]), bytes.fromhex(keys["enc_key"])))
    opened = RoundOpen.model_construct(
        run_id="run", round=1, attempt=1, secagg_prg=prg.PRG_ID, secagg_neighbours=0,
        secagg_threshold=2, secagg_members=tuple(encode_member(m) for m in members),
    )  # fmt: skip
    rounds = {pid: role.open_round(opened, config) for pid, role in roles.items()}
    assert all(r is not None for r in rounds.values())
    return rounds  # type: ignore[return-value]


def test_the_revealed_sum_of_masked_releases_is_the_plaintext_sum_bit_for_bit() -> None:
    config = masked_config()
    pids = ["p0", "p1", "p2"]
    rounds = open_rounds(pids, config)
    plain = chain(difference(), clip(math.inf))
    masked = chain(difference(), clip(math.inf), mask(config), bind())
    clear = {pid: release_of(plain, local_weights(i))[0] for i, pid in enumerate(pids)}
    sent = {
        pid: release_of(masked, local_weights(i), ctx(pid, rounds[pid]))[0]
        for i, pid in enumerate(pids)
    }
    assert all(r.masked and r.applied == ("difference", "clip", "bind") for r in sent.values())
    assert all("scales" not in r.metadata for r in sent.values())
    first = rounds["p0"]
    total = MaskedSum(GLOBAL, first.members, threshold=2, context=first.context)
    for pid in pids:
        total.add(pid, sent[pid].delta)
    disclosures = {
        holder: disclose(
            me=holder, keys=rounds[holder].keys, members=first.members,
            context=first.context, survivors=total.survivors, dropped=total.dropped,
            self_mask_shares={
                s: bytes.fromhex(sent[s].metadata["sealed_shares"][holder]) for s in pids
            },
            threshold=2,
        )
        for holder in pids
    }  # fmt: skip
    revealed = total.reveal(disclosures)
    unit = float(config.federation.weight_of(10)) * 2.0**config.aggregation.fraction_bits
    for name in GLOBAL:
        expected = sum(
            to_fixed_point(clear[p].delta, {n: unit for n in GLOBAL})[name] for p in pids
        )
        np.testing.assert_array_equal(revealed[name], expected)  # bit for bit
        mean = revealed[name].astype(np.float64) / (unit * len(pids))
        plain_mean = np.mean([clear[p].delta[name].astype(np.float64) for p in pids], axis=0)
        np.testing.assert_allclose(mean, plain_mean, atol=2.0**-30)  # plain averaging


def test_the_mask_stage_masks_only_into_a_round_and_never_out_of_range() -> None:
    config = LensembleConfig(
        federation={"secagg_threshold": 2, "min_participants": 2},
        aggregation={"max_abs_update": 1.0},
    )
    stage = mask(config)
    release = Release(delta={"w": np.full(3, 0.5, np.float32)})
    with pytest.raises(RoundError, match="no masked round to mask for"):
        stage.update(release, None, ctx())
    rounds = open_rounds(["p0", "p1"], config)
    with pytest.raises(RoundError, match="no masked round to mask for"):  # another member's
        stage.update(release, None, ctx("p0", rounds["p1"]))
    huge = Release(delta={"w": np.full(3, 5.0, np.float32)})
    with pytest.raises(RoundError, match="max-abs-update"):
        stage.update(huge, None, ctx("p0", rounds["p0"]))
    with pytest.raises(RoundError, match="only a differenced delta"):
        stage.update(Release(local={"w": np.zeros(3, np.float32)}), None, ctx("p0", rounds["p0"]))
    out, _ = stage.update(release, None, ctx("p0", rounds["p0"]))
    assert out.masked and out.metadata["next_mask_key"] == rounds["p0"].next_mask_key


def test_a_distributed_federation_masks_only_a_release_that_carries_its_charged_share(
    tmp_path: Path,
) -> None:
    config = masked_config(
        clip_norm=0.5, noise_multiplier=2.0, dp_epsilon=50.0, dp_mode="distributed",
        dp_state_dir=str(tmp_path),
    )  # fmt: skip
    rounds = open_rounds(["p0", "p1"], config)
    clipped, _ = release_of(chain(difference(), clip(0.5)), local_weights(5))
    with pytest.raises(RoundError, match="without its charged release stage"):
        mask(config).update(clipped, None, ctx("p0", rounds["p0"]))
    budget = budget_at(tmp_path)
    noise = distributed_noise(2.0, 0.5, fraction_bits=FRACTION_BITS, threshold=2, budget=budget)
    noised, _ = release_of(chain(difference(), clip(0.5), noise), local_weights(5))
    out, _ = mask(config).update(noised, None, ctx("p0", rounds["p0"]))
    assert out.masked and out.noise_share is None  # added into the masked integers


# -- difference and bind: their guards -------------------------------------------------------
def test_difference_needs_local_weights_and_bind_a_differenced_unbound_delta() -> None:
    with pytest.raises(RoundError, match="no local weights"):
        difference().update(Release(), None, ctx())
    with pytest.raises(RoundError, match="only a differenced delta"):
        bind().update(Release(local=dict(GLOBAL)), None, ctx())
    delta = Release(delta=dict(GLOBAL))
    bound, _ = bind().update(delta, None, ctx())
    assert bound.bound_root == "ab" * 32
    with pytest.raises(RoundError, match="already bound"):
        bind().update(bound, None, ctx())
    with pytest.raises(RoundError, match="no dataset commitment"):
        bind().update(delta, None, ctx(dataset_root=None))
