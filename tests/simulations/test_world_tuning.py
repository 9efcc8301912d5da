"""Baselines tuned on held-out data: the validation split, the stopping rule, the
learning-rate search, and the tuned local-only and centralized runs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations import world_tuning
from lensemble_flwr.simulations.world_data import Transitions, participant_data
from lensemble_flwr.simulations.world_model import WorldTrainer
from lensemble_flwr.simulations.world_tuning import (
    Stopping,
    Trial,
    search_lr,
    split_validation,
    train_until_stale,
    tuned_centralized,
    tuned_local_only,
)

CONFIG = LensembleConfig(inner={"steps": 2, "lr": 0.004, "batch_size": 8})
DATA = {"trajectories": 1, "steps": 6, "validation_trajectories": 4, "actuation": "full"}
QUICK = Stopping(every=2, patience=2, max_steps=8)


def test_the_split_keeps_whole_trajectories_apart() -> None:
    data = participant_data(0, **{**DATA, "validation_trajectories": 5})
    tune, score = split_validation(data.validation, 5)
    assert (len(tune), len(score)) == (2 * 6, 3 * 6)  # 2 trajectories tune, 3 score
    for field in ("obs", "actions", "next_obs"):
        joined = np.concatenate([getattr(tune, field), getattr(score, field)])
        assert np.array_equal(joined, getattr(data.validation, field))
    # a trajectory's rows are consecutive: the tuning half ends where trajectory 2 starts
    assert not np.array_equal(tune.next_obs[5], tune.obs[6])
    assert np.array_equal(tune.next_obs[4], tune.obs[5])


@pytest.mark.parametrize(("trajectories", "rows"), [(1, 6), (4, 18)])
def test_the_split_refuses_what_cannot_be_halved(trajectories: int, rows: int) -> None:
    data = participant_data(0, **DATA)
    part = Transitions(
        *(getattr(data.validation, f)[:rows] for f in ("obs", "actions", "next_obs"))
    )
    with pytest.raises(ConfigError, match=r"^validation-trajectories"):
        split_validation(part, trajectories)


def scripted(tune: list[float]) -> tuple[list[int], object, object]:
    """A step counter and a measure that returns the next scripted tuning loss (and the
    step count as the scoring loss)."""
    done = [0]
    losses = iter(tune)

    def step() -> None:
        done[0] += 1

    def measure() -> tuple[float, tuple[float, ...]]:
        return next(losses), (float(done[0]),)

    return done, step, measure


def test_training_stops_after_patience_evaluations_without_improvement() -> None:
    done, step, measure = scripted([5.0, 4.0, 3.0, 3.5, 3.0, 2.9, 3.4, 3.3, 3.2, 9.0])
    trial = train_until_stale(step, measure, lr=0.1, stopping=Stopping(every=3, patience=3))
    assert trial.steps == (0, 3, 6, 9, 12, 15, 18, 21, 24)  # 3 evaluations above 2.9
    assert done == [24]
    assert (trial.best_step, trial.best_tune, trial.best_score) == (15, 2.9, (15.0,))
    assert not trial.capped
    # a plateau is no improvement: equal losses count towards the patience
    _, step, measure = scripted([5.0, 4.0, 4.0, 4.0, 4.0])
    trial = train_until_stale(step, measure, lr=0.1, stopping=Stopping(every=1, patience=3))
    assert trial.steps == (0, 1, 2, 3, 4) and trial.best_step == 1


def test_training_stops_at_the_cap_and_says_so() -> None:
    _, step, measure = scripted([5.0, 4.0, math.nan, 3.0, 2.0])
    trial = train_until_stale(step, measure, lr=0.1, stopping=Stopping(every=3, max_steps=10))
    assert trial.steps == (0, 3, 6, 9, 10)  # the last chunk is cut at the cap
    assert trial.best_step == 10 and trial.capped
    # a non-finite loss never counts as the best
    _, step, measure = scripted([5.0, math.nan, math.nan])
    trial = train_until_stale(step, measure, lr=0.1, stopping=Stopping(every=1, patience=2))
    assert trial.best_step == 0 and not trial.capped


@pytest.mark.parametrize(
    "kwargs", [{"every": 0}, {"patience": 0}, {"max_steps": 0}, {"every": 5, "max_steps": 4}]
)
def test_bad_stopping_rules_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=r"^stopping"):
        Stopping(**kwargs)


def bowl(best_lr: float, tried: list[float]):  # type: ignore[no-untyped-def]
    """A trial whose tuning loss is lowest at ``best_lr`` (in log scale)."""

    def trial(lr: float) -> Trial:
        tried.append(lr)
        loss = math.log(lr / best_lr) ** 2
        return Trial(lr, (0, 1), (1e9, loss), ((0.0,), (loss,)), capped=False)

    return trial


def test_the_lr_search_grows_past_an_edge_pick() -> None:
    tried: list[float] = []
    search = search_lr(bowl(0.001, tried), [0.01, 0.02, 0.04])
    assert tried == [0.01, 0.02, 0.04, 0.005, 0.0025, 0.00125, 0.000625]
    assert search.chosen.lr == 0.00125 and not search.at_edge
    assert [t.lr for t in search.trials] == sorted(tried)
    tried.clear()
    search = search_lr(bowl(1.0, tried), [0.01, 0.02, 0.04], max_extensions=2)
    assert tried == [0.01, 0.02, 0.04, 0.08, 0.16]
    assert search.chosen.lr == 0.16 and search.at_edge  # said, not hidden
    tried.clear()
    search = search_lr(bowl(0.02, tried), [0.01, 0.02, 0.04])
    assert tried == [0.01, 0.02, 0.04] and search.chosen.lr == 0.02


@pytest.mark.parametrize(
    ("grid", "kwargs"),
    [
        ([], {}),
        ([0.0, 0.1], {}),
        ([math.nan], {}),
        ([0.1, 0.1], {}),
        ([0.1], {"factor": 1.0}),
        ([0.1], {"max_extensions": -1}),
    ],
)
def test_bad_lr_grids_are_refused(grid: list[float], kwargs: dict[str, float]) -> None:
    tried: list[float] = []
    with pytest.raises(ConfigError, match=r"^lr grid"):
        search_lr(bowl(0.1, tried), grid, **kwargs)  # type: ignore[arg-type]
    assert tried == []  # refused before any training


def test_tuned_local_only_never_looks_at_the_scoring_half(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = participant_data(1, **DATA)
    honest = tuned_local_only(data, 4, CONFIG, grid=[0.002, 0.01], stopping=QUICK)
    tune, score = split_validation(data.validation, 4)
    fresh = WorldTrainer(data)
    assert fresh.loss_on(data.validation) == fresh.validation_loss()  # the same loss
    first = honest.trials[0]
    assert first.tune[0] == fresh.loss_on(tune) and first.score[0] == (fresh.loss_on(score),)
    assert honest.chosen.best_tune == min(t.best_tune for t in honest.trials)
    # scramble the scoring half: every choice stays the same, only the scores change
    noise = np.random.default_rng(0).standard_normal(score.obs.shape).astype(np.float32)
    scrambled = dataclasses.replace(score, obs=score.obs + 3 * noise)
    monkeypatch.setattr(world_tuning, "split_validation", lambda *_: (tune, scrambled))
    blind = tuned_local_only(data, 4, CONFIG, grid=[0.002, 0.01], stopping=QUICK)
    assert [(t.lr, t.steps, t.tune) for t in blind.trials] == [
        (t.lr, t.steps, t.tune) for t in honest.trials
    ]
    assert (blind.chosen.lr, blind.chosen.best_step) == (honest.chosen.lr, honest.chosen.best_step)
    assert blind.chosen.best_score != honest.chosen.best_score


def test_tuned_centralized_stops_on_the_nodes_mean_tuning_loss() -> None:
    datas = [participant_data(i, **DATA) for i in range(2)]
    search = tuned_centralized(datas, 4, CONFIG, grid=[0.004], stopping=QUICK, init_seed=3)
    (trial,) = search.trials  # one rate: no edge to grow past
    fresh = [WorldTrainer(d, init_seed=3) for d in datas]
    halves = [split_validation(d.validation, 4) for d in datas]
    assert trial.tune[0] == pytest.approx(
        np.mean([t.loss_on(h[0]) for t, h in zip(fresh, halves, strict=True)])
    )
    assert trial.score[0] == tuple(t.loss_on(h[1]) for t, h in zip(fresh, halves, strict=True))
    assert len(trial.best_score) == 2 and trial.steps[-1] <= QUICK.max_steps
    with pytest.raises(ConfigError, match=r"^num-partitions"):
        tuned_centralized([], 4, CONFIG)
