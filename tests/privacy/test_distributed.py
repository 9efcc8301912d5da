"""Distributed DP over masked rounds: each member adds a discrete Gaussian share in the
masks' integer domain, and the revealed sum carries the calibrated noise.

In process, no Ray. The harness: a plaintext run with the same clip and no noise releases
the very same clipped updates (training is seeded and the distributed stage changes no
float), so the noise in a masked round's revealed sum is its sum minus the plaintext one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config
from opacus.accountants import RDPAccountant

from lensemble_flwr.aggregation.fixed_point import AggregateSum
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import ConfigError, RoundError
from lensemble_flwr.privacy.calibration import noise_multiplier_of
from lensemble_flwr.privacy.discrete_gaussian import ddg_sum_rho, secure_discrete_gaussian
from lensemble_flwr.privacy.distributed import distributed_noise_for
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.release import Release
from lensemble_flwr.release import masking as mask_stage
from lensemble_flwr.release import noise as noise_stage
from lensemble_flwr.simulations.digits_data import DigitsLinear, DigitsTrainer, load_partition
from lensemble_flwr.simulations.digits_data import initial_params as digits_params
from lensemble_flwr.testing import FaultPlan

CLIP = 0.5


def dp_config(tmp: Path, *, masked: bool = True, noise: bool = True, **privacy) -> LensembleConfig:
    base = small_config(secagg_threshold=3 if masked else 0, min_participants=3)
    settings = {"clip_norm": CLIP, "dp_state_dir": str(tmp / "budgets")}
    if noise:
        settings |= {"noise_multiplier": 2.0, "dp_epsilon": 50.0, "dp_mode": "distributed"}
    return LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        privacy={**settings, **privacy},
    )


def revealed_sums(coordinator: Coordinator) -> list[AggregateSum]:
    """Every sum the coordinator's round mode reveals, in order."""
    seen: list[AggregateSum] = []
    reveal = coordinator._mode.reveal

    def recording(attempt):  # type: ignore[no-untyped-def]
        result = reveal(attempt)
        seen.append(result)
        return result

    coordinator._mode.reveal = recording  # type: ignore[method-assign]
    return seen


@pytest.fixture
def shares(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every noise share a member adds, as (shape, sigma, values)."""
    drawn: list[dict] = []

    def recording(shape, sigma):  # type: ignore[no-untyped-def]
        values = secure_discrete_gaussian(shape, sigma)
        drawn.append({"shape": shape, "sigma": sigma, "values": values})
        return values

    monkeypatch.setattr(noise_stage, "secure_discrete_gaussian", recording)
    return drawn


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"secagg_threshold": 0}, "plaintext rounds would reveal each under-noised update"),
        # the refusal names the exact key that fixes it
        ({"weighting": "num-examples"}, 'num-examples.*set lensemble.weighting = "uniform"'),
    ],
    ids=["plaintext", "weighted"],
)
def test_distributed_noise_is_refused_where_it_would_not_protect(
    tmp_path: Path, change: dict, complaint: str
) -> None:
    base = small_config(secagg_threshold=3, min_participants=3)
    with pytest.raises(ConfigError, match=complaint):
        LensembleConfig(
            federation={**base.federation.model_dump(), **change},
            privacy={"clip_norm": 1.0, "noise_multiplier": 1.0, "dp_epsilon": 50.0,
                     "dp_mode": "distributed"},
        )  # fmt: skip
    with pytest.raises(ConfigError, match="distributed noise needs noise"):
        LensembleConfig(federation=base.federation.model_dump(), privacy={"dp_mode": "distributed"})
    with pytest.raises(ConfigError, match="quantize"):
        LensembleConfig(
            federation=base.federation.model_dump(),
            privacy={"clip_norm": 1.0, "noise_multiplier": 1.0, "dp_epsilon": 50.0,
                     "dp_mode": "distributed"},
            release={"quantize": "int8"},
        )  # fmt: skip


def test_the_revealed_sum_carries_exactly_the_members_shares(
    tmp_path: Path, shares: list[dict]
) -> None:
    plain, net_p, _ = federation(tmp_path, config=dp_config(tmp_path, noise=False), name="p")
    plain_sums = revealed_sums(plain)
    plain.run(1)
    masked, net_m, _ = federation(tmp_path, config=dp_config(tmp_path), name="m")
    masked_sums = revealed_sums(masked)
    masked.run(1)
    net_p.flush()
    net_m.flush()
    (p_sum,), (m_sum,) = plain_sums, masked_sums
    assert m_sum.contributors == p_sum.contributors and m_sum.count == 4
    names = sorted(p_sum.sums)  # each member draws one share per array, in sorted order
    assert len(shares) == 4 * len(names)
    by_member = [
        {n: d["values"] for n, d in zip(names, shares[i : i + len(names)], strict=True)}
        for i in range(0, len(shares), len(names))
    ]
    for name in p_sum.sums:
        noise = m_sum.sums[name] - p_sum.sums[name]  # exact integers, no rounding anywhere
        assert np.array_equal(noise, sum(member[name] for member in by_member))
    share = distributed_noise_for(2.0, CLIP, 32, 3, sum(a.size for a in p_sum.sums.values()))
    assert {s["sigma"] for s in shares} == {share.share_sigma}
    # the sum of the four shares, in value units: about sqrt(4) * sigma_i / 2**32 per entry
    total = np.concatenate([(m_sum.sums[n] - p_sum.sums[n]).ravel() for n in p_sum.sums])
    measured = float(np.std(total.astype(np.float64))) / 2.0**32
    assert measured == pytest.approx(2 * share.share_sigma / 2.0**32, rel=0.35)
    assert share.sum_std >= 2.0 * CLIP * 0.999  # t shares: the target noise, sigma * C
    verify(masked.store)


def test_a_dropped_member_takes_its_share_with_it_and_the_sum_is_still_protected(
    tmp_path: Path, shares: list[dict]
) -> None:
    faults = FaultPlan().drop("p02", round=1, at=RoundState.COLLECTING)
    masked, network, _ = federation(tmp_path, config=dp_config(tmp_path), faults=faults)
    masked.run(1)
    network.flush()
    assert [o.count for o in masked.outcomes] == [3]
    dim = sum(a.size for a in masked.global_state().params.values())
    share = distributed_noise_for(2.0, CLIP, 32, 3, dim)
    # three survivors' shares are the threshold the share was sized for; more only add
    target = 1 / (2 * (2.0 / 2) ** 2)
    for survivors in (3, 4, 6):
        assert ddg_sum_rho(share.sensitivity, share.share_sigma, survivors, dim) <= target
    assert verify(masked.store)[0].contributors == ("p00", "p01", "p03")


def test_the_epsilon_in_the_ledger_is_an_independent_recomputation(tmp_path: Path) -> None:
    config = dp_config(tmp_path)
    masked, network, _ = federation(tmp_path, config=config)
    masked.run(3)
    network.flush()
    dim = sum(a.size for a in masked.global_state().params.values())
    share = distributed_noise_for(noise_multiplier_of(config), CLIP, 32, 3, dim)
    for r, record in enumerate(Ledger(masked.store).records(), start=1):
        accountant = RDPAccountant()
        accountant.history = [(share.equivalent_noise_multiplier, 1.0, r)]
        expected = accountant.get_epsilon(delta=config.privacy.dp_delta)
        assert list(record.epsilon.values()) == [pytest.approx(expected, rel=1e-9)] * 4


def test_a_calibrated_distributed_run_spends_its_budget_over_its_plan(tmp_path: Path) -> None:
    config = dp_config(
        tmp_path, noise_multiplier=0.0, dp_epsilon=8.0, dp_rounds=3, dp_accountant="rdp"
    )
    masked, network, _ = federation(tmp_path, config=config)
    masked.run(3)
    network.flush()
    final = Ledger(masked.store).records()[-1].epsilon.values()
    assert all(7.9 < e <= 8.0 for e in final)


def test_a_member_whose_release_was_not_charged_adds_no_share_and_masks_nothing() -> None:
    config = dp_config(Path("unused"))
    values = {"w": np.zeros(4, np.int64)}
    uncharged = Release(delta={"w": np.zeros(4, np.float32)}, applied=("difference", "clip"))
    with pytest.raises(RoundError, match="without its charged release stage"):
        mask_stage.with_noise_share(values, uncharged, config, "p00")
    # a share, but no charging stage named: refused too
    unnamed = uncharged.replace(noise_share={"w": np.ones(4, np.int64)})
    with pytest.raises(RoundError, match="without its charged release stage"):
        mask_stage.with_noise_share(values, unnamed, config, "p00")
    charged = unnamed.replace(applied=("difference", "clip", "distributed_noise"))
    assert mask_stage.with_noise_share(values, charged, config, "p00")["w"].tolist() == [1] * 4


def test_a_local_dp_member_in_a_distributed_federation_is_refused(tmp_path: Path) -> None:
    """Its update went through gaussian_noise, not the distributed stage: the coordinator
    refuses it (the sum would carry its full local noise but not its share)."""
    from lensemble_flwr.coordinator.admission import check_privacy
    from lensemble_flwr.errors import UnprivatizedContribution
    from lensemble_flwr.protocol.messages import Update

    update = Update(
        run_id="r", round=1, sender="p00", participant_id="p00", attempt=1, dataset_root=None,
        delta={"w": np.zeros(2, np.float32)}, l2_norm=0.0, num_examples=1,
        transforms=("difference", "clip", "gaussian_noise"),
    )  # fmt: skip
    with pytest.raises(UnprivatizedContribution, match="distributed_noise"):
        check_privacy(dp_config(tmp_path), update)


def test_the_ledger_says_whom_the_epsilon_holds_against_and_show_prints_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lensemble_flwr.cli import main

    masked, network, _ = federation(tmp_path, config=dp_config(tmp_path))
    masked.run(2)
    network.flush()
    records = verify(masked.store)
    guarantee = records[0].privacy
    assert guarantee is not None and records[1].privacy == guarantee
    assert guarantee.mechanism == "distributed-discrete-gaussian" and guarantee.threshold == 3
    assert guarantee.against == ("coordinator", "other participants", "model recipients")
    assert "at least 3 honest members" in guarantee.assumption
    assert not guarantee.sampling_amplification
    assert main(["show", str(masked.store.root)]) == 0
    out = capsys.readouterr().out
    assert "privacy: distributed-discrete-gaussian (noise multiplier 2 over at least 3" in out
    assert "epsilon spent (against coordinator, model recipients, other participants): p00" in out
    # a run without DP records no guarantee (and stores no field for it)
    plain, net, _ = federation(tmp_path, config=dp_config(tmp_path, noise=False), name="p")
    plain.run(1)
    net.flush()
    assert Ledger(plain.store).records()[0].privacy is None


def test_the_sum_of_threshold_shares_of_a_zero_update_has_the_calibrated_spread(
    tmp_path: Path,
) -> None:
    """Many coordinates of a zero update, three members' shares summed: the spread is
    t·σᵢ² within six standard errors, it is at least the target σ·C in value units, and
    the values are integers centred on zero."""
    config = dp_config(tmp_path)
    dim = 40_000
    zero = {"w": np.zeros(dim, np.int64)}
    share = distributed_noise_for(2.0, CLIP, 32, 3, dim)
    charged = ("difference", "clip", "distributed_noise")
    total = zero["w"]
    for _ in range(3):  # three members, each drawing its share and adding it to its values
        drawn = noise_stage.draw_noise_share({"w": np.zeros(dim, np.float32)}, share)
        release = Release(
            delta={"w": np.zeros(dim, np.float32)}, noise_share=drawn, applied=charged
        )
        total = total + mask_stage.with_noise_share(zero, release, config, "p")["w"]
    variance = float(np.var(total.astype(np.float64)))
    expected = 3 * share.share_sigma**2
    standard_error = expected * np.sqrt(2.0 / dim)
    assert abs(variance - expected) < 6 * standard_error
    assert abs(float(np.mean(total))) < 6 * np.sqrt(expected / dim)
    assert np.sqrt(expected) / 2.0**32 >= 2.0 * CLIP  # the sum carries at least sigma * C


def test_over_many_rounds_the_noise_in_the_revealed_sum_is_fresh_and_calibrated_with_dropouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the pipeline, round after round: the noise in each revealed sum (the sum
    minus the exact integers of the contributors' clipped releases, recorded as each
    member adds its share) has the spread of the survivors' shares and is centred on
    zero; it is not correlated from one round to the next; and once a member has
    dropped, the three survivors' noise is still at least the target sigma * C (a share
    sized for four survivors would leave 3/4 of it, which the bound tells apart)."""
    rounds, dropped_from = 10, 6
    releases: list[tuple[str, dict[str, np.ndarray]]] = []
    add_share = mask_stage.with_noise_share

    def recording(values, release, config, me):  # type: ignore[no-untyped-def]
        releases.append((me, {n: a.copy() for n, a in values.items()}))
        return add_share(values, release, config, me)

    monkeypatch.setattr(mask_stage, "with_noise_share", recording)
    faults = FaultPlan().drop("p02", round=dropped_from, at=RoundState.COLLECTING)
    # DigitsLinear's 650 parameters: enough coordinates per round to tell a missing share
    masked, network, _ = federation(
        tmp_path,
        config=dp_config(tmp_path),
        faults=faults,
        trainer_of=lambda i: DigitsTrainer(load_partition(i, 4), model_class=DigitsLinear),
        params=digits_params(model_class=DigitsLinear),
    )
    sums = revealed_sums(masked)
    noise: list[np.ndarray] = []  # per round, on the grid
    for _ in range(rounds):
        releases.clear()
        masked.run(1)
        revealed, clean = sums[-1], dict(releases)
        assert set(revealed.contributors) <= set(clean)
        noise.append(
            np.concatenate(
                [
                    (revealed.sums[n] - sum(clean[p][n] for p in revealed.contributors)).ravel()
                    for n in sorted(revealed.sums)
                ]
            ).astype(np.float64)
        )
    network.flush()
    counts = [o.count for o in masked.outcomes]
    assert counts == [4] * (dropped_from - 1) + [3] * (rounds - dropped_from + 1)
    dim = noise[0].size
    share = distributed_noise_for(2.0, CLIP, 32, 3, dim)
    spread = [np.sqrt(c * share.share_sigma**2) for c in counts]  # of `count` shares
    z = np.stack([n / s for n, s in zip(noise, spread, strict=True)])
    # pooled over every round: the variance of `count` shares, within six standard errors
    assert abs(float(np.mean(z**2)) - 1.0) < 6 * np.sqrt(2.0 / z.size)
    assert abs(float(np.mean(z))) < 6 / np.sqrt(z.size)
    # fresh every round: consecutive rounds' noise is uncorrelated
    lagged = float(np.mean(z[1:] * z[:-1]))
    assert abs(lagged) < 6 / np.sqrt(dim * (rounds - 1))
    # three survivors, the threshold: at least the target noise sigma * C on the sum
    target = 2.0 * CLIP * 2.0**32
    survivors = np.concatenate(noise[dropped_from - 1 :])
    bound = 1 - 6 * np.sqrt(2.0 / survivors.size)
    assert bound > 0.75  # the check can tell shares sized for four survivors
    assert float(np.mean(survivors**2)) > target**2 * bound
    verify(masked.store)
