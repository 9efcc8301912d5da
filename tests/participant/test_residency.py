"""Action heads and other local groups never leave a participant (INV-RESIDENCY,
INV-ACTIONHEAD-LOCAL), and the gauge settings refuse what cannot work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import ConfigError, ResidencyViolation
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.state import PseudoGradient
from lensemble_flwr.simulations.toy import GROUPS, ToyTrainer, initial_params
from lensemble_flwr.transports.inprocess import InProcessNetwork


def toy_config() -> LensembleConfig:
    """small_config with the toy model's groups named (local: action_head)."""
    return small_config().model_copy(update={"groups": GROUPS})


def pseudo_gradient(delta: dict) -> PseudoGradient:
    return PseudoGradient(
        participant_id="p",
        round=1,
        delta=delta,
        l2_norm=1.0,
        dataset_root=None,
        num_examples=1,
        groups=GROUPS,
    )


def test_a_pseudo_gradient_refuses_an_action_head_at_construction() -> None:
    w = np.ones(3, np.float32)
    assert pseudo_gradient({"encoder.w": w, "predictor.b": w}).delta
    with pytest.raises(ResidencyViolation, match=r"action_head\.w"):
        pseudo_gradient({"encoder.w": w, "action_head.w": w})
    with pytest.raises(ResidencyViolation, match="observations"):
        pseudo_gradient({"encoder.w": w, "observations": w})  # not a registered parameter


def test_a_coordinator_never_broadcasts_local_parameters(tmp_path: Path) -> None:
    network = InProcessNetwork()
    params = {**initial_params(), "action_head.weight": np.zeros((2, 2), np.float32)}
    with pytest.raises(ResidencyViolation, match=r"action_head\.weight.*local groups"):
        Coordinator(
            toy_config(),
            transport=network.coordinator,
            initial_params=params,
            store=Store(tmp_path / "run"),
        )
    assert not (tmp_path / "run" / "names").exists() or not any(
        (tmp_path / "run" / "names").iterdir()
    )


@pytest.mark.parametrize(
    ("config", "complaint"),
    [
        # whatever the groups say, only what was broadcast may go back
        (small_config, r"only the broadcast arrays, not \['action_head\.w'\]"),
        (toy_config, r"action_head\.w"),  # the toy's groups name the head local
    ],
    ids=["default-groups", "toy-groups"],
)
def test_participant_egress_refuses_a_release_with_a_local_name(
    tmp_path: Path, config, complaint: str
) -> None:
    from lensemble_flwr.release import ReleaseTransform, Stage, bind, chain, difference

    def leak(release, state, ctx):  # a buggy stage that lets an action head slip through
        return release.replace(delta={**release.delta, "action_head.w": np.ones(2)}), state

    pipeline = chain(
        difference(), ReleaseTransform("leak", Stage.QUANTIZE, lambda _: None, leak), bind()
    )
    coordinator, network, _ = federation(tmp_path)
    node = Participant(
        config(),
        participant_id="leaky",
        transport=network.transport_for("leaky"),
        trainer=ToyTrainer(9),
        pipeline=pipeline,
    )
    state = coordinator.global_state()
    with pytest.raises(ResidencyViolation, match=complaint):
        node.local_round(state, state.sketch_seed)


def test_gauge_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gauge-coordinator-harness"):
        LensembleConfig(gauge={"coordinator_harness": True}, privacy={"clip_norm": 1.0})
    with pytest.raises(ConfigError, match="gauge-coordinator-harness"):
        LensembleConfig(gauge={"coordinator_harness": True}, federation={"secagg_threshold": 2})
    with pytest.raises(ConfigError, match="gauge-coordinator-harness"):
        LensembleConfig(gauge={"coordinator_harness": True}, release={"quantize": "int8"})
    with pytest.raises(ConfigError, match="already align"):
        LensembleConfig(gauge={"coordinator_harness": True, "align": True})
    aligned = small_config().model_copy(
        update={"gauge": LensembleConfig(gauge={"align": True}).gauge}
    )
    network = InProcessNetwork()
    with pytest.raises(ConfigError, match="gauge-align"):
        Participant(
            aligned, participant_id="p", transport=network.transport_for("p"), trainer=ToyTrainer(0)
        )
    with pytest.raises(ConfigError, match="gauge-align"):
        Coordinator(
            aligned,
            transport=network.coordinator,
            initial_params=initial_params(),
            store=Store(tmp_path / "run"),
        )
