"""The latent world-model simulation: sovereign data from a seed, the model and its loss,
the rotated-start trainer, and a small federation with and without alignment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import RoundOutcome
from lensemble_flwr.errors import ConfigError, ParameterMismatch
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.world_data import (
    ACTION_DIMS,
    LATENT_DIM,
    OBS_DIM,
    make_embodiment,
    participant_data,
    public_probe,
)
from lensemble_flwr.simulations.world_federation import (
    WorldFederation,
    build_world,
    validation_loss,
)
from lensemble_flwr.simulations.world_model import (
    WorldModelAdapter,
    WorldTrainer,
    WorldTraining,
    initial_params,
    random_orthogonal,
)


def test_world_data_is_a_pure_function_of_its_seeds() -> None:
    first, again = participant_data(2, seed=4), participant_data(2, seed=4)
    for split in ("train", "validation"):
        for field in ("obs", "actions", "next_obs"):
            a, b = getattr(getattr(first, split), field), getattr(getattr(again, split), field)
            np.testing.assert_array_equal(a, b)
            assert a.dtype == np.float32
    assert not np.array_equal(first.train.obs, participant_data(2, seed=5).train.obs)
    assert not np.array_equal(first.train.obs, first.validation.obs)
    np.testing.assert_array_equal(public_probe(4).inputs, public_probe(4).inputs)
    assert public_probe(4).probe_hash != public_probe(5).probe_hash


def test_each_participant_is_its_own_embodiment() -> None:
    dims = [make_embodiment(i).action_dim for i in range(len(ACTION_DIMS))]
    assert dims == list(ACTION_DIMS)
    data = participant_data(1, trajectories=3, steps=5)
    assert data.train.obs.shape == (15, OBS_DIM)
    assert data.train.actions.shape == (15, ACTION_DIMS[1])
    # transitions chain within a trajectory: o_{t+1} of one row is o_t of the next
    np.testing.assert_array_equal(data.train.next_obs[0], data.train.obs[1])
    assert len(list(data.train.records())) == 15
    with pytest.raises(ConfigError, match="index"):
        make_embodiment(-1)


def test_initial_params_are_the_shared_groups_only() -> None:
    params = initial_params(0)
    assert all(n.startswith(("encoder.", "predictor.")) for n in params)
    assert params["predictor.inp.weight"].shape[1] > LATENT_DIM  # latent + action embedding
    trainer = WorldTrainer(participant_data(3, trajectories=2, steps=4))
    own = {n: t.detach().numpy() for n, t in trainer.model.state_dict().items()}
    for name, array in params.items():
        np.testing.assert_array_equal(own[name], array)  # everyone starts from the same θ_0
    assert own["action_head.weight"].shape[1] == ACTION_DIMS[3]


def test_the_loss_is_invariant_under_the_adapters_change_of_frame() -> None:
    trainer = WorldTrainer(participant_data(0, trajectories=4, steps=16))
    batch = trainer.sample_batch(torch.Generator().manual_seed(1), 32)
    adapter = WorldModelAdapter()
    params = initial_params(0)
    losses = []
    for q in (np.eye(LATENT_DIM), random_orthogonal(LATENT_DIM, 1), -np.eye(LATENT_DIM)):
        model = trainer.model
        rotated = adapter.rotate(params, q)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if name in rotated:
                    tensor.copy_(torch.from_numpy(rotated[name]))
            losses.append(float(trainer.loss(model, batch)))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)


def test_validation_loss_leaves_the_model_alone_and_checks_names() -> None:
    trainer = WorldTrainer(participant_data(0, trajectories=2, steps=8))
    before = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    zeros = {n: np.zeros_like(a) for n, a in initial_params(0).items()}
    assert trainer.validation_loss(zeros) != trainer.validation_loss()
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, before[name])
    with pytest.raises(ParameterMismatch):
        trainer.validation_loss({**zeros, "action_head.weight": np.zeros((8, 2), np.float32)})


def test_rotated_start_trains_in_its_own_fixed_frame() -> None:
    config = LensembleConfig(inner={"steps": 1, "batch_size": 4})
    params = initial_params(0)
    adapter = WorldModelAdapter()

    def start(index: int, rotate: bool) -> dict[str, np.ndarray]:
        trainer = WorldTrainer(participant_data(index, trajectories=2, steps=4))
        training = WorldTraining(trainer, config, rotate_start=rotate, rotation_seed=0)
        # zero steps: what the inner loop starts from
        return training.fit(params, steps=0, seed=0)

    plain, rotated, again, other = start(0, False), start(0, True), start(0, True), start(1, True)
    for name in params:
        np.testing.assert_array_equal(plain[name], params[name])
        np.testing.assert_array_equal(rotated[name], again[name])
    probe = public_probe(0).inputs
    z = adapter.embed(params, probe)
    for frame in (rotated, other):
        q, *_ = np.linalg.lstsq(z, adapter.embed(frame, probe), rcond=None)
        np.testing.assert_allclose(q @ q.T, np.eye(LATENT_DIM), atol=1e-4)  # a change of frame
        assert np.linalg.norm(q - np.eye(LATENT_DIM)) > 1.0
    assert not np.allclose(adapter.embed(rotated, probe), adapter.embed(other, probe))


ROUNDS = 3


def world_config(**gauge: bool) -> LensembleConfig:
    return LensembleConfig(
        federation={"min_participants": 3, "open_timeout": 30, "collect_timeout": 30},
        inner={"steps": 20, "lr": 3e-3, "weight_decay": 0.0, "batch_size": 32},
        outer={"lr": 1.0, "momentum": 0.0},  # plain averaging: the least noisy few rounds
        gauge=gauge,
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models train faster on one thread (and do not fight over a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_world(
    tmp_path: Path, *, align: bool, rotate: bool, rounds: int
) -> tuple[float, WorldFederation, list[RoundOutcome]]:
    outcomes: list[RoundOutcome] = []
    fed = build_world(
        world_config(align=align),
        tmp_path / f"run-{align}-{rotate}",
        participants=3,
        rotate_start=rotate,
        trajectories=4,
        on_round=outcomes.append,
    )
    fed.coordinator.run(rounds)
    assert [o.state for o in outcomes] == [RoundState.CLOSED] * rounds
    return validation_loss(fed.coordinator.global_state().params, fed.trainers), fed, outcomes


@pytest.mark.usefixtures("one_thread")
def test_an_aligned_world_federation_recovers_from_drifted_frames(tmp_path: Path) -> None:
    aligned, fed, outcomes = run_world(tmp_path, align=True, rotate=True, rounds=ROUNDS)
    unaligned, *_ = run_world(tmp_path, align=False, rotate=True, rounds=ROUNDS)
    control, *_ = run_world(tmp_path, align=False, rotate=False, rounds=ROUNDS)
    # measured: 0.433, 0.748, 0.429
    assert aligned < 0.75 * unaligned
    assert aligned == pytest.approx(control, rel=0.1)
    # every round announced the pinned probe and recorded the frame drift
    assert fed.coordinator.global_state().probe_hash == fed.gauge.probe.probe_hash
    assert all(0.0 <= o.diagnostics["frame_drift"] <= 1.0 for o in outcomes)
    assert len(verify(fed.coordinator.store)) == ROUNDS
    assert all(p.last_loss is not None for p in fed.participants)


@pytest.mark.usefixtures("one_thread")
def test_the_coordinator_harness_aligns_as_the_participants_would(tmp_path: Path) -> None:
    """The plaintext research harness (alignment of each raw update at the coordinator)
    computes what the participants' align stage computes, up to float32 rounding."""
    finals = {}
    for name, gauge in (
        ("participants", {"align": True}),
        ("harness", {"coordinator_harness": True}),
    ):
        config = world_config(**gauge)
        fed = build_world(
            config, tmp_path / name, participants=3, rotate_start=True, trajectories=4
        )
        fed.coordinator.run(2)
        finals[name] = fed.coordinator.global_state().params
    for array_name, array in finals["participants"].items():
        np.testing.assert_allclose(finals["harness"][array_name], array, atol=1e-4)
