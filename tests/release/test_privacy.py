"""Differential privacy on the release path: clip, CSPRNG noise, the persistent budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from opacus.accountants import PRVAccountant, RDPAccountant

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import (
    ConfigError,
    DPBoundViolation,
    PrivacyBudgetExceeded,
    PrivacyBudgetUnreadable,
    RoundError,
)
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.privacy.gaussian import secure_normal, secure_uniform
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import Ledger, RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.release import Release, ReleaseContext, chain, clip, gaussian_noise
from lensemble_flwr.release.clipping import check_clip_bound
from lensemble_flwr.simulations.toy import initial_params

STATE = GlobalState.create(0, {"w": np.zeros(4, np.float32)}, sketch_seed=1, h_steps=1)
CTX = ReleaseContext(
    participant_id="p", global_state=STATE, round_seed=1, dataset_root="ab" * 32, num_examples=10
)


def dp_config(tmp: Path, *, epsilon: float = 50.0, noise: float = 1.0, **fed) -> LensembleConfig:
    return LensembleConfig(
        federation={
            "min_participants": 3,
            "open_timeout": 10.0,
            "collect_timeout": 10.0,
            "root_seed": 7,
            **fed,
        },
        inner={"steps": 2, "lr": 0.05, "batch_size": 8},
        privacy={
            "clip_norm": 0.5,
            "noise_multiplier": noise,
            "dp_epsilon": epsilon,
            "dp_state_dir": str(tmp / "budgets"),
        },
    )


# -- clip --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    values=arrays(
        np.float32, st.integers(1, 64), elements=st.floats(-1e6, 1e6, width=32, allow_nan=False)
    ),
    clip_norm=st.floats(1e-3, 1e3),
)
def test_clip_bounds_the_norm_of_any_update(values: np.ndarray, clip_norm: float) -> None:
    release = Release(delta={"a": values, "b": values[::-1].copy()})
    out, _ = clip(clip_norm).update(release, None, CTX)
    assert l2_norm(out.delta) <= clip_norm
    if l2_norm(release.delta) <= clip_norm:  # small updates pass unchanged
        np.testing.assert_array_equal(out.delta["a"], values)


def test_the_clip_bound_check_trips_on_an_unclipped_update() -> None:
    with pytest.raises(DPBoundViolation, match="exceeds the clip norm"):
        check_clip_bound({"w": np.full(4, 1.0, np.float32)}, 1.0)


def test_noise_must_follow_clip(tmp_path: Path) -> None:
    budget = PrivacyBudget(tmp_path, "p", epsilon=8.0, delta=1e-5)
    with pytest.raises(ConfigError, match="cannot follow"):
        chain(gaussian_noise(1.0, 1.0, budget), clip(1.0))
    with pytest.raises(RoundError, match="only a clipped delta"):
        gaussian_noise(1.0, 1.0, budget).update(
            Release(delta={"w": np.zeros(4, np.float32)}), None, CTX
        )


@pytest.mark.parametrize(
    "privacy",
    [{"noise_multiplier": 1.0, "dp_epsilon": 1.0}, {"noise_multiplier": 1.0, "clip_norm": 1.0}],
)
def test_noise_without_a_clip_norm_or_a_budget_is_refused(privacy: dict) -> None:
    with pytest.raises(ConfigError):
        LensembleConfig(privacy=privacy)


# -- noise -------------------------------------------------------------------------------
def test_secure_noise_has_the_requested_spread() -> None:
    """n = 400k: the sample std's relative standard error is 1/sqrt(2n) ≈ 0.11%, so a 1%
    tolerance is ~9 standard errors; the mean's is std/sqrt(n) ≈ 0.16% of std."""
    z = secure_normal((400_000,), 2.0)
    assert abs(z.std() / 2.0 - 1.0) < 0.01
    assert abs(z.mean()) < 0.01 * 2.0
    u = secure_uniform(100_000)
    assert u.min() > 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.005


def test_noise_is_never_the_same_twice() -> None:
    assert not np.array_equal(secure_normal((16,), 1.0), secure_normal((16,), 1.0))


def test_noise_stage_adds_noise_of_std_sigma_c(tmp_path: Path) -> None:
    budget = PrivacyBudget(tmp_path, "k", epsilon=1e9, delta=1e-5)
    delta = {"w": np.zeros(200_000, np.float32)}
    clipped, _ = clip(0.5).update(Release(delta=delta), None, CTX)
    noised, _ = gaussian_noise(1.5, 0.5, budget).update(clipped, None, CTX)
    assert abs(noised.delta["w"].std() / 0.75 - 1.0) < 0.02
    assert noised.metadata["epsilon"] == budget.spent() > 0


# -- the budget --------------------------------------------------------------------------
@pytest.mark.parametrize(("mechanism", "opacus"), [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_spent_epsilon_equals_opacus_for_the_same_history(
    tmp_path: Path, mechanism: str, opacus: type
) -> None:
    budget = PrivacyBudget(tmp_path, "k", epsilon=1e9, delta=1e-5, accountant=mechanism)
    for _ in range(5):
        budget.charge(2.0)
    reference = opacus()
    for _ in range(5):  # sensitivity 2C: Opacus sees noise multiplier sigma / 2, rate 1
        reference.step(noise_multiplier=1.0, sample_rate=1.0)
    assert budget.spent() == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)


def test_a_release_that_would_exceed_the_budget_is_refused_and_not_recorded(
    tmp_path: Path,
) -> None:
    budget = PrivacyBudget(tmp_path, "k", epsilon=20.0, delta=1e-5)
    spent = [budget.charge(1.0) for _ in range(2)]
    assert spent[0] < spent[1] <= 20.0
    history = list(budget.history)
    with pytest.raises(PrivacyBudgetExceeded):
        while True:
            budget.charge(1.0)
    assert budget.spent() <= 20.0
    reloaded = PrivacyBudget(tmp_path, "k", epsilon=20.0, delta=1e-5)
    assert reloaded.history == budget.history and len(budget.history[-1]) == 3
    assert budget.history[-1][2] >= history[-1][2]


@pytest.mark.parametrize(
    "text", ["{not json", "[1, 2]", '"a string"', "{}", '{"accountant": "rdp", "history": [[1]]}']
)
def test_a_corrupt_budget_file_is_a_typed_error_that_releases_nothing(
    tmp_path: Path, text: str
) -> None:
    budget = PrivacyBudget(tmp_path, "k", epsilon=20.0, delta=1e-5)
    budget.charge(1.0)
    budget.path.write_text(text)
    with pytest.raises(PrivacyBudgetUnreadable, match="restore the file"):
        budget.charge(1.0)  # what was spent is unknown: nothing is charged or released
    assert budget.path.read_text() == text
    with pytest.raises(PrivacyBudgetUnreadable):
        PrivacyBudget(tmp_path, "k", epsilon=20.0, delta=1e-5)


def test_the_budget_survives_a_restart_and_a_new_run(tmp_path: Path) -> None:
    first = PrivacyBudget(tmp_path, "root", epsilon=100.0, delta=1e-5)
    first.charge(1.0)
    first.charge(1.0)
    again = PrivacyBudget(tmp_path, "root", epsilon=100.0, delta=1e-5)  # a new process/run
    assert again.spent() == first.spent() > 0
    with pytest.raises(ConfigError, match="accounted with"):
        PrivacyBudget(tmp_path, "root", epsilon=100.0, delta=1e-5, accountant="prv")


def test_every_charge_is_on_disk_file_and_folder_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import stat

    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    budget = PrivacyBudget(tmp_path, "k", epsilon=1e9, delta=1e-5)
    monkeypatch.setattr(os, "fsync", recording)
    budget.charge(1.0)
    assert synced == ["file", "folder"]  # the budget always writes durably
    monkeypatch.undo()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [budget.path.name, budget.path.name + ".lock"]  # no temp file left
    assert stat.S_IMODE(budget.path.stat().st_mode) == 0o600  # the owner's only


# -- in a federation ---------------------------------------------------------------------
def test_identical_seeds_release_different_noise_but_the_rest_reproduces(tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        coordinator, _, _ = federation(tmp_path, config=dp_config(tmp_path / name), name=name)
        coordinator.run(2)
        store = Store(tmp_path / name)
        runs.append((RunManifest.load(store), verify(store)))
    (m1, r1), (m2, r2) = runs
    assert m1.initial_params_hash == m2.initial_params_hash
    assert m1.rounds[0].round_seed == m2.rounds[0].round_seed
    assert r1[0].contributors == r2[0].contributors
    assert r1[0].aggregate_digest != r2[0].aggregate_digest  # real noise was released
    # the ledger says what each contributor spent, and that the update was noised
    assert all(e is not None and e > 0 for e in r1[0].epsilon.values())
    assert r1[1].epsilon["p00"] > r1[0].epsilon["p00"]


def test_a_budget_that_runs_out_aborts_the_round_before_the_release(tmp_path: Path) -> None:
    """The participant's own refusal, for budgets an earlier run spent: each run's plan
    fits the budget, the two together do not."""
    # sigma 1 (0.5 after the factor 2 of sensitivity 2C), RDP, delta 1e-5: epsilon 10.7
    # after one release, 16.5 after two, 21.4 after three. A budget of 20 allows two.
    config = dp_config(tmp_path, epsilon=20.0)
    first, _, _ = federation(tmp_path, config=config, name="first")
    first.run(1)
    coordinator, _, _ = federation(tmp_path, config=config)
    before_abort = None
    with pytest.raises(PrivacyBudgetExceeded):
        try:
            coordinator.run(2)  # the plan (two rounds) fits; the budgets hold one already
        finally:
            before_abort = coordinator.global_state()
    outcomes = coordinator.outcomes
    assert [o.state for o in outcomes] == [RoundState.CLOSED, RoundState.ABORTED]
    assert "PrivacyBudgetExceeded" in (outcomes[-1].reason or "")
    assert before_abort.round == 1  # the aborted round changed nothing
    records = Ledger(Store(tmp_path / "run")).records()
    assert len(records) == 1
    assert all(e <= 20.0 for r in records for e in r.epsilon.values() if e is not None)
    # no budget was charged for the refused release: two releases each, no more
    for budget_file in (tmp_path / "budgets").glob("*.json"):
        budget = PrivacyBudget(tmp_path / "budgets", budget_file.stem, epsilon=20.0, delta=1e-5)
        assert sum(n for _, _, n in budget.history) == 2


def test_a_plan_the_budget_cannot_cover_is_refused_before_round_one(tmp_path: Path) -> None:
    config = dp_config(tmp_path, epsilon=20.0)
    coordinator, _, _ = federation(tmp_path, config=config)
    with pytest.raises(ConfigError, match=r"5 rounds at noise-multiplier 1 would spend epsilon "
                       r"30\.1\d* > dp-epsilon 20 .*noise-multiplier >= 1\.3\d*, or plan at "
                       r"most 2 rounds"):  # fmt: skip
        coordinator.run(5)
    assert coordinator.outcomes == [] and not Ledger(Store(tmp_path / "run")).records()
    assert not list((tmp_path / "budgets").glob("*.json"))  # nobody was charged


def test_an_update_without_the_required_noise_is_refused(tmp_path: Path) -> None:
    """A participant configured without DP cannot slip into a DP federation."""
    from lensemble_flwr.coordinator.coordinator import Coordinator
    from lensemble_flwr.participant.participant import Participant
    from lensemble_flwr.simulations.toy import ToyTrainer
    from lensemble_flwr.transports.inprocess import InProcessNetwork

    strict = dp_config(tmp_path)
    lax = LensembleConfig(
        federation=strict.federation.model_dump(), inner=strict.inner.model_dump()
    )
    network = InProcessNetwork()
    for i in range(4):
        pid = f"p{i:02d}"
        network.attach(
            Participant(
                strict if i else lax,
                participant_id=pid,
                transport=network.transport_for(pid),
                trainer=ToyTrainer(i),
            )
        )
    coordinator = Coordinator(
        strict,
        transport=network.coordinator,
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
    )
    coordinator.run(1)
    outcome = coordinator.outcomes[0]
    assert outcome.rejected == 1 and "p00" not in outcome.contributors and outcome.count == 3


@pytest.mark.parametrize(
    "protection",
    [
        {"privacy": {"clip_norm": 1.0}},
        {"release": {"quantize": "int8"}},
        {"federation": {"secagg_threshold": 2}},
    ],
    ids=["clip", "int8", "masking"],
)
def test_a_coordinator_side_update_transform_is_refused_with_protected_releases(
    tmp_path: Path, protection: dict
) -> None:
    from lensemble_flwr.coordinator.coordinator import Coordinator
    from lensemble_flwr.transports.inprocess import InProcessNetwork

    config = LensembleConfig(**protection)
    with pytest.raises(ConfigError, match=r"^update_transform"):
        Coordinator(
            config,
            transport=InProcessNetwork().coordinator,
            initial_params=initial_params(),
            store=Store(tmp_path / "run"),
            update_transform=lambda update: update,
        )


def test_an_update_transform_applies_to_plaintext_updates(tmp_path: Path) -> None:
    from federation_helpers import small_config

    from lensemble_flwr.coordinator.coordinator import Coordinator
    from lensemble_flwr.participant.participant import Participant
    from lensemble_flwr.simulations.toy import ToyTrainer
    from lensemble_flwr.transports.inprocess import InProcessNetwork

    config = small_config()
    network = InProcessNetwork()
    for i in range(3):
        pid = f"p{i}"
        network.attach(
            Participant(
                config,
                participant_id=pid,
                transport=network.transport_for(pid),
                trainer=ToyTrainer(i),
            )
        )
    seen: list[str] = []

    def zero(update):  # a harness that discards every update's content
        seen.append(update.participant_id)
        return update.model_copy(
            update={"delta": {n: np.zeros_like(a) for n, a in update.delta.items()}}
        )

    coordinator = Coordinator(
        config,
        transport=network.coordinator,
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
        update_transform=zero,
    )
    before = coordinator.global_state().params
    coordinator.run(1)
    assert sorted(seen) == ["p0", "p1", "p2"]
    for name, value in coordinator.global_state().params.items():
        np.testing.assert_array_equal(value, before[name])  # zero mean update: unchanged


@pytest.mark.parametrize(
    "first_use",
    [
        "from lensemble_flwr.privacy.calibration import calibrated_noise_multiplier\n"
        "calibrated_noise_multiplier(8.0, 1e-5, 10)\n",
        "from lensemble_flwr.config import LensembleConfig\n"
        "from lensemble_flwr.privacy.calibration import noise_multiplier_of\n"
        "noise_multiplier_of(LensembleConfig(privacy={'dp_epsilon': 8, 'dp_rounds': 10,"
        " 'clip_norm': 1}))\n",
    ],
    ids=["calibration", "a-calibrated-config"],
)
def test_a_calibrated_plan_leaves_the_users_logging_alone(first_use: str) -> None:
    """Calibration was the first, unguarded opacus import of a process with a calibrated
    plan (noise-multiplier 0 and dp-rounds): it left the root logger with a handler."""
    import subprocess
    import sys

    probe = (
        "import logging\n"
        + first_use
        + "root = logging.getLogger()\n"
        "assert root.handlers == [] and root.level == logging.WARNING, root.handlers\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


def test_importing_the_package_leaves_the_users_logging_alone() -> None:
    """opacus calls logging.basicConfig when it is imported: that gave the root logger a
    handler, and every Flower log line printed twice (issue 13, item 9, in part)."""
    import subprocess
    import sys

    probe = (
        "import logging\n"
        "import lensemble_flwr.strategies, lensemble_flwr.clients, lensemble_flwr.privacy.budget\n"
        "from lensemble_flwr.strategies import LensembleStrategy\n"
        "from lensemble_flwr.privacy.budget import accountant_class\n"
        "accountant_class('rdp')().get_epsilon(delta=1e-5)\n"  # opacus imported, and used
        "from opacus.accountants import RDPAccountant\n"  # already imported: no new handler
        "root = logging.getLogger()\n"
        "assert root.handlers == [] and root.level == logging.WARNING, root.handlers\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


def test_a_noise_draw_never_runs_out_of_chacha20_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    # os.urandom's bytes also filled the block counter: one that started at 2**32 - 1
    # left a single 64-byte block, and a larger draw raised ValueError mid-release
    import lensemble_flwr.privacy.gaussian as gaussian

    monkeypatch.setattr(gaussian.os, "urandom", lambda n: b"\xff" * n)
    u = gaussian.secure_uniform(10_000)
    assert u.shape == (10_000,) and np.all((u > 0) & (u < 1))
