"""``dp-adjacency``: what an epsilon protects, and what it costs in noise.

Substitution (the default): any change to a participant's whole dataset, sensitivity 2C.
Zero-out: the participant's update against none, sensitivity C. The same epsilon needs
half the noise under zero-out; a budget is kept under one adjacency; the ledger says which
one its epsilon figures are for, and records of the default keep the bytes (and so the
hashes) they had before the choice existed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config
from opacus.accountants import RDPAccountant

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError, PrivacyBudgetExceeded
from lensemble_flwr.privacy.budget import PrivacyBudget, sensitivity_factor
from lensemble_flwr.privacy.calibration import (
    calibrated_noise_multiplier,
    max_rounds,
    noise_multiplier_of,
    planned_epsilon,
)
from lensemble_flwr.privacy.discrete_gaussian import grid_l2_sensitivity
from lensemble_flwr.privacy.distributed import distributed_noise_for
from lensemble_flwr.privacy.guarantee import guarantee_of
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify

CLIP = 0.5


def dp_config(tmp: Path, *, masked: bool, **privacy: object) -> LensembleConfig:
    base = small_config(secagg_threshold=3 if masked else 0, min_participants=3)
    settings = {
        "clip_norm": CLIP,
        "dp_state_dir": str(tmp / "budgets"),
        "noise_multiplier": 2.0,
        "dp_epsilon": 50.0,
        "dp_mode": "distributed" if masked else "local",
    }
    return LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        privacy={**settings, **privacy},
    )


def test_the_same_epsilon_costs_half_the_noise_under_zero_out() -> None:
    substitution = calibrated_noise_multiplier(8.0, 1e-5, 20)
    zero_out = calibrated_noise_multiplier(8.0, 1e-5, 20, sensitivity=1.0)
    assert zero_out == pytest.approx(substitution / 2, rel=1e-12)
    for sigma, rounds in [(1.0, 1), (3.0, 20), (7.5, 400)]:
        assert planned_epsilon(sigma, rounds, 1e-5, sensitivity=1.0) == pytest.approx(
            planned_epsilon(2 * sigma, rounds, 1e-5), rel=1e-12
        )
    assert max_rounds(3.0, 8.0, 1e-5, sensitivity=1.0) == max_rounds(6.0, 8.0, 1e-5)
    # a config's plan goes through the same factor
    plan = {"clip_norm": 1.0, "dp_epsilon": 8.0, "dp_rounds": 20}
    sub = noise_multiplier_of(LensembleConfig(privacy=plan))
    zero = noise_multiplier_of(LensembleConfig(privacy={**plan, "dp_adjacency": "zero-out"}))
    assert zero == pytest.approx(sub / 2, rel=1e-12)


def test_an_unknown_adjacency_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"^dp-adjacency: "):
        LensembleConfig.from_flat({"dp-adjacency": "add-remove"})
    with pytest.raises(ConfigError, match=r"dp-adjacency.*unknown adjacency 'add-remove'"):
        sensitivity_factor("add-remove")
    with pytest.raises(ValueError, match="sensitivity_factor must be 1 or 2"):
        grid_l2_sensitivity(1.0, 2.0**10, 4, sensitivity_factor=3.0)


def test_a_refused_plan_names_the_adjacency_it_was_planned_under() -> None:
    config = LensembleConfig(
        privacy={"clip_norm": 1.0, "noise_multiplier": 0.5, "dp_epsilon": 8.0,
                 "dp_rounds": 20, "dp_adjacency": "zero-out"}
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"rdp, zero-out adjacency.*>= 2\.85"):
        noise_multiplier_of(config)


def test_the_zero_out_share_is_charged_as_a_mechanism_half_as_sensitive() -> None:
    """At the same σ the sum carries the same noise (σ·C); the zero-out mechanism's
    sensitivity is half, so its ρ is a quarter; at the same ρ its share is half."""
    dim, scale = 2410, 2.0**32
    sub = distributed_noise_for(4.0, 3.0, 32, 800, dim)
    zero = distributed_noise_for(4.0, 3.0, 32, 800, dim, "zero-out")
    assert zero.sensitivity == pytest.approx(sub.sensitivity / 2, rel=1e-15)
    assert zero.sum_std == pytest.approx(sub.sum_std, rel=1e-6)
    assert zero.sum_std == pytest.approx(4.0 * 3.0, rel=1e-6)  # σ·C, the rounding negligible
    assert zero.rho == pytest.approx(sub.rho / 4, rel=1e-6)
    half = distributed_noise_for(2.0, 3.0, 32, 800, dim, "zero-out")
    assert half.rho == pytest.approx(sub.rho, rel=1e-6)
    assert half.share_sigma == pytest.approx(sub.share_sigma / 2, rel=1e-6)
    assert grid_l2_sensitivity(3.0, scale, dim, sensitivity_factor=1.0) == 3.0 * scale + (
        np.sqrt(dim) / 2
    )


@pytest.mark.parametrize("masked", [False, True], ids=["local", "distributed"])
def test_a_zero_out_run_charges_and_records_the_zero_out_epsilon(
    tmp_path: Path, masked: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from lensemble_flwr.cli import main

    config = dp_config(tmp_path, masked=masked, dp_adjacency="zero-out")
    coordinator, network, _ = federation(tmp_path, config=config)
    coordinator.run(2)
    network.flush()
    dim = sum(a.size for a in coordinator.global_state().params.values())
    if masked:
        z = distributed_noise_for(2.0, CLIP, 32, 3, dim, "zero-out").equivalent_noise_multiplier
    else:
        z = 2.0  # std / C against a sensitivity of C
    records = verify(coordinator.store)
    for r, record in enumerate(records, start=1):
        accountant = RDPAccountant()
        accountant.history = [(z, 1.0, r)]
        expected = accountant.get_epsilon(delta=config.privacy.dp_delta)
        assert list(record.epsilon.values()) == [pytest.approx(expected, rel=1e-9)] * 4
        assert record.privacy is not None and record.privacy.adjacency == "zero-out"
    assert main(["show", str(coordinator.store.root)]) == 0
    assert "epsilon under zero-out adjacency holds against" in capsys.readouterr().out
    # the same run under substitution spends more, as a mechanism twice as sensitive
    sub_config = dp_config(tmp_path / "sub", masked=masked)
    sub, sub_network, _ = federation(tmp_path, config=sub_config, name="sub")
    sub.run(2)
    sub_network.flush()
    sub_last = Ledger(sub.store).records()[-1]
    assert min(sub_last.epsilon.values()) > max(records[-1].epsilon.values())
    assert sub_last.privacy is not None and sub_last.privacy.adjacency == "substitution"


def test_a_default_guarantee_keeps_the_bytes_it_had_before_the_choice() -> None:
    """Ledger records hash their JSON: a substitution guarantee must not grow a field."""
    default = guarantee_of("distributed", 2.0, 3).model_dump(mode="json")
    assert "adjacency" not in default
    zero = guarantee_of("distributed", 2.0, 3, adjacency="zero-out").model_dump(mode="json")
    assert zero["adjacency"] == "zero-out"
    assert {k: v for k, v in zero.items() if k != "adjacency"} == default


def test_a_budget_is_kept_under_one_adjacency(tmp_path: Path) -> None:
    zero = PrivacyBudget(tmp_path, "p", epsilon=50.0, delta=1e-5, adjacency="zero-out")
    spent = zero.charge(2.0)
    recorded = json.loads(zero.path.read_text())
    assert recorded["adjacency"] == "zero-out" and recorded["history"] == [[2.0, 1.0, 1]]
    assert PrivacyBudget(
        tmp_path, "p", epsilon=50.0, delta=1e-5, adjacency="zero-out"
    ).spent() == pytest.approx(spent)
    before = zero.path.read_bytes()
    with pytest.raises(ConfigError, match="accounted under 'zero-out' adjacency, not"):
        PrivacyBudget(tmp_path, "p", epsilon=50.0, delta=1e-5)
    assert zero.path.read_bytes() == before  # nothing changed
    # a substitution budget's file is what it was before the choice: no field, and a file
    # without one is a substitution budget
    sub = PrivacyBudget(tmp_path, "q", epsilon=50.0, delta=1e-5)
    sub.charge(2.0)
    assert "adjacency" not in json.loads(sub.path.read_text())
    assert sub.history == [(1.0, 1.0, 1)]  # σ/2 against a sensitivity of 2C
    with pytest.raises(ConfigError, match="accounted under 'substitution' adjacency"):
        PrivacyBudget(tmp_path, "q", epsilon=50.0, delta=1e-5, adjacency="zero-out")


def test_a_given_noise_that_fits_only_under_zero_out_is_accepted_under_it() -> None:
    plan = {"clip_norm": 1.0, "noise_multiplier": 3.0, "dp_epsilon": 8.0, "dp_rounds": 20}
    with pytest.raises(ConfigError, match=r"use noise-multiplier >= 5\.7"):
        noise_multiplier_of(LensembleConfig(privacy=plan))  # substitution needs 5.71
    zero = LensembleConfig(privacy={**plan, "dp_adjacency": "zero-out"})
    assert noise_multiplier_of(zero) == 3.0  # zero-out needs 2.85
    affords = max_rounds(2.0, 8.0, 1e-5, sensitivity=1.0)
    with pytest.raises(ConfigError, match=rf"or plan at most {affords} rounds"):
        noise_multiplier_of(LensembleConfig(privacy={**plan, "noise_multiplier": 2.0,
                                                     "dp_adjacency": "zero-out"}))  # fmt: skip


def test_the_manifest_records_the_adjacency_only_when_it_is_not_the_default() -> None:
    """So a run of the default keeps the header (and ledger hashes) it had before the key
    existed, and a run recorded then resumes; a zero-out run resumes only as zero-out."""
    default = LensembleConfig()
    zero = LensembleConfig(privacy={"dp_adjacency": "zero-out"})
    assert "dp-adjacency" not in default.to_recorded()
    assert zero.to_recorded()["dp-adjacency"] == "zero-out"
    default.check_recorded(default.to_recorded())  # recorded before the key: no key at all
    zero.check_recorded(zero.to_recorded())
    with pytest.raises(ConfigError, match=r"differs .* in \['dp-adjacency'\]"):
        default.check_recorded(zero.to_recorded())
    with pytest.raises(ConfigError, match=r"differs .* in \['dp-adjacency'\]"):
        zero.check_recorded(default.to_recorded())
    assert LensembleConfig.from_flat(zero.to_flat()) == zero


@pytest.mark.parametrize("mode", ["local", "distributed"])
def test_an_update_accounted_under_another_adjacency_is_refused(tmp_path: Path, mode: str) -> None:
    from lensemble_flwr.coordinator.admission import check_privacy
    from lensemble_flwr.errors import UnprivatizedContribution
    from lensemble_flwr.protocol.messages import Update

    base = "distributed_noise" if mode == "distributed" else "gaussian_noise"

    def update(noise: str) -> Update:
        return Update(
            run_id="r", round=1, sender="p00", participant_id="p00", attempt=1,
            dataset_root=None, delta={"w": np.zeros(2, np.float32)}, l2_norm=0.0,
            num_examples=1, transforms=("difference", "clip", noise),
        )  # fmt: skip

    masked = mode == "distributed"
    zero = dp_config(tmp_path, masked=masked, dp_adjacency="zero-out")
    sub = dp_config(tmp_path, masked=masked)
    check_privacy(zero, update(f"{base}@zero-out"))
    check_privacy(sub, update(base))
    with pytest.raises(UnprivatizedContribution, match=rf"noised as '{base}', accounted under"):
        check_privacy(zero, update(base))
    with pytest.raises(UnprivatizedContribution, match=rf"noised as '{base}@zero-out'"):
        check_privacy(sub, update(f"{base}@zero-out"))


def test_a_member_adds_no_share_for_a_stage_charged_under_another_adjacency() -> None:
    """A custom pipeline whose budget has another adjacency than the config: the share
    the masking role would add is sized from the config, so it refuses to add one."""
    from lensemble_flwr.errors import RoundError
    from lensemble_flwr.release import Release
    from lensemble_flwr.release.masking import with_noise_share

    zero = dp_config(Path("unused"), masked=True, dp_adjacency="zero-out")
    values = {"w": np.zeros(4, np.int64)}

    def charged_by(*transforms: str) -> Release:
        share = {"w": np.zeros(4, np.int64)}
        return Release(delta={"w": np.zeros(4, np.float32)}, noise_share=share, applied=transforms)

    with pytest.raises(RoundError, match="without its charged release stage"):
        with_noise_share(values, charged_by("difference", "clip", "distributed_noise"), zero, "p00")
    shared = with_noise_share(
        values, charged_by("difference", "clip", "distributed_noise@zero-out"), zero, "p00"
    )
    assert shared["w"].dtype == np.int64


def test_two_budget_objects_on_one_identity_lose_no_charge(tmp_path: Path) -> None:
    """Each charge re-reads the file under a lock: two objects (two processes of one node)
    charging in turn both count, instead of the second overwriting the first."""
    first = PrivacyBudget(tmp_path, "p", epsilon=50.0, delta=1e-5)
    second = PrivacyBudget(tmp_path, "p", epsilon=50.0, delta=1e-5)
    first.charge(2.0)
    second.charge(2.0)
    first.charge(2.0)
    assert PrivacyBudget(tmp_path, "p", epsilon=50.0, delta=1e-5).history == [(1.0, 1.0, 3)]
    # and the budget holds across them: a charge past it is refused whoever makes it
    small = PrivacyBudget(tmp_path, "q", epsilon=1.0, delta=1e-5)
    other = PrivacyBudget(tmp_path, "q", epsilon=1.0, delta=1e-5)
    spent = small.charge(40.0)
    while True:
        try:
            spent = other.charge(40.0)
        except PrivacyBudgetExceeded:
            break
    with pytest.raises(PrivacyBudgetExceeded):
        small.charge(40.0)  # its own stale history would have allowed it
    assert PrivacyBudget(tmp_path, "q", epsilon=1.0, delta=1e-5).spent() == pytest.approx(spent)
