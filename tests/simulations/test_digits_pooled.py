"""The pooled reference: the federation's model trained in one place on the union of the
participants' examples, tuned and early-stopped on a held-out share of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations.digits_data import D_IN, NUM_CLASSES, DigitsLinear, DigitsPartition
from lensemble_flwr.simulations.digits_pooled import pooled_examples, pooled_reference

FAST = {"max_epochs": 40, "patience": 5, "batch_size": 16}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _blobs(n: int, seed: int, *, spread: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points around one of 10 fixed centres each: linearly separable at this spread."""
    centres = np.random.default_rng(1234).uniform(0, 1, (NUM_CLASSES, D_IN))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES, n)
    x = centres[y] + rng.normal(0, spread / np.sqrt(D_IN), (n, D_IN))
    return x.astype(np.float32), y.astype(np.int64)


def _split(x: np.ndarray, y: np.ndarray, participants: int, seed: int) -> list[DigitsPartition]:
    owners = np.random.default_rng(seed).integers(0, participants, len(y))
    empty_x, empty_y = np.zeros((0, D_IN), np.float32), np.zeros(0, np.int64)
    return [
        DigitsPartition(x[owners == i], y[owners == i], empty_x, empty_y, partition_id=i)
        for i in range(participants)
    ]


def test_it_learns_a_separable_problem_and_not_random_labels():
    x, y = _blobs(300, seed=0)
    x_test, y_test = _blobs(200, seed=1)
    parts = _split(x, y, participants=40, seed=0)
    result = pooled_reference(
        parts, x_test, y_test, model_class=DigitsLinear, lrs=(0.01, 0.03, 0.1), **FAST
    )
    assert result.test_accuracy >= 0.95
    # the same features with labels that carry nothing: near chance, so the figure above
    # is learnt from the examples, not an artefact of the scoring
    shuffled = np.random.default_rng(5).permutation(y)
    noise = pooled_reference(
        _split(x, shuffled, 40, seed=0), x_test, y_test, model_class=DigitsLinear,
        lrs=(0.01, 0.03, 0.1), min_lr=0.01, max_lr=0.1, **FAST,
    )  # fmt: skip
    assert noise.test_accuracy <= 0.35


def test_it_pools_exactly_the_participants_examples_whatever_the_split():
    x, y = _blobs(120, seed=2)
    one, other = _split(x, y, 30, seed=0), _split(x, y, 7, seed=9)
    pooled_x, pooled_y = pooled_examples(one)
    assert len(pooled_y) == len(y)
    as_rows = {tuple(row) for row in np.column_stack([x, y])}
    assert {tuple(row) for row in np.column_stack([pooled_x, pooled_y])} == as_rows
    other_x, other_y = pooled_examples(other)
    np.testing.assert_array_equal(pooled_x, other_x)
    np.testing.assert_array_equal(pooled_y, other_y)
    x_test, y_test = _blobs(50, seed=3)
    kwargs = {"model_class": DigitsLinear, "lrs": (0.03, 0.1), **FAST}
    first = pooled_reference(one, x_test, y_test, **kwargs)
    assert first == pooled_reference(other, x_test, y_test, **kwargs)
    assert first.fit_examples + first.validation_examples == len(y)
    assert first.validation_examples == int(np.ceil(0.15 * len(y)))
    # one participant's examples fewer is another union, and trains another model
    fewer = pooled_reference(one[1:], x_test, y_test, **kwargs)
    assert fewer.fit_examples + fewer.validation_examples == len(y) - len(one[0].y_train)


def test_the_grid_is_extended_past_an_end_pick():
    x, y = _blobs(200, seed=4)
    x_test, y_test = _blobs(50, seed=5)
    parts = _split(x, y, 10, seed=0)
    # 1e-4 for a few epochs barely moves the model: the pick must climb past it
    result = pooled_reference(
        parts, x_test, y_test, model_class=DigitsLinear, lrs=(1e-4,),
        max_epochs=8, patience=3, batch_size=16,
    )  # fmt: skip
    tried = [t.lr for t in result.tried]
    assert tried[0] <= 1e-4 * (1 + 1e-9) and len(tried) >= 3
    assert result.grid_interior
    assert min(tried) < result.lr < max(tried)
    assert result.lr == max(result.tried, key=lambda t: t.score()).lr
    # no room to extend: the pick is the only lr and says so
    stuck = pooled_reference(
        parts, x_test, y_test, model_class=DigitsLinear, lrs=(1e-4,), min_lr=1e-4,
        max_lr=1e-4, max_epochs=2, patience=1, batch_size=16,
    )  # fmt: skip
    assert [t.lr for t in stuck.tried] == [1e-4] and not stuck.grid_interior


def test_it_stops_patience_epochs_after_the_best():
    x, y = _blobs(200, seed=6)
    x_test, y_test = _blobs(50, seed=7)
    result = pooled_reference(
        _split(x, y, 10, seed=0), x_test, y_test, model_class=DigitsLinear, lrs=(0.1,),
        min_lr=0.1, max_lr=0.1, max_epochs=200, patience=3, batch_size=16,
    )  # fmt: skip
    (run,) = result.tried
    assert 1 <= run.epochs < 200 - 3  # stopped well before the cap
    assert result.epochs == run.epochs


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("lrs", {"lrs": ()}),
        ("lrs", {"lrs": (0.01, -0.1)}),
        ("lrs", {"lrs": (float("nan"),)}),
        ("validation_fraction", {"validation_fraction": 0.0}),
        ("validation_fraction", {"validation_fraction": 1.0}),
        ("batch_size", {"batch_size": 0}),
        ("max_epochs", {"max_epochs": 0}),
        ("patience", {"patience": 0}),
        ("extend_factor", {"extend_factor": 1.0}),
        ("min_lr", {"min_lr": 0.0}),  # a pick at the bottom would extend forever
        ("min_lr", {"min_lr": 1.0, "max_lr": 0.1}),
        ("min_lr", {"max_lr": float("inf")}),
    ],
)
def test_bad_settings_are_refused(field, kwargs):
    x, y = _blobs(40, seed=0)
    with pytest.raises(ConfigError) as err:
        pooled_reference(_split(x, y, 4, seed=0), x, y, model_class=DigitsLinear, **kwargs)
    assert err.value.field == field


def test_nothing_to_pool_or_to_score_is_refused():
    x, y = _blobs(40, seed=0)
    with pytest.raises(ConfigError) as err:
        pooled_reference([], x, y, model_class=DigitsLinear)
    assert err.value.field == "parts"
    with pytest.raises(ConfigError) as err:
        pooled_reference(_split(x, y, 4, seed=0), x[:0], y[:0], model_class=DigitsLinear)
    assert err.value.field == "y_test"
    one = _split(x[:1], y[:1], 1, seed=0)  # one example: no fit split beside validation
    with pytest.raises(ConfigError) as err:
        pooled_reference(one, x, y, model_class=DigitsLinear)
    assert err.value.field == "parts"
