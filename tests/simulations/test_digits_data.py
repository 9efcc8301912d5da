"""The digits demo task: a deterministic non-IID partition and a Trainer over it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lensemble_flwr.simulations.digits_data import (
    DigitsLinear,
    DigitsNet,
    DigitsTrainer,
    _load_digits,
    centralized_evaluate,
    initial_params,
    load_partition,
)

N = 10
TOTAL = 1797


def _partitions(**kwargs):
    return [load_partition(i, N, **kwargs) for i in range(N)]


def _label_tv(parts) -> float:
    """Mean total-variation distance of the partitions' label histograms to the global one."""
    labels = [np.concatenate([p.y_train, p.y_test]) for p in parts]
    glob = np.bincount(np.concatenate(labels), minlength=10) / TOTAL
    return float(
        np.mean([0.5 * np.abs(np.bincount(y, minlength=10) / len(y) - glob).sum() for y in labels])
    )


def test_partitions_are_deterministic():
    for a, b in zip(_partitions(), _partitions(), strict=True):
        for field in ("x_train", "y_train", "x_test", "y_test"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    other = load_partition(0, N, seed=1)
    assert not np.array_equal(other.y_train, load_partition(0, N).y_train)


def test_partitions_are_disjoint_and_cover_the_dataset():
    parts = _partitions()
    assert sum(len(p.y_train) + len(p.y_test) for p in parts) == TOTAL
    # Digits has duplicate images, so compare multisets of (x, y) rows, not sets.
    x, y = _load_digits()
    everything = sorted(xi.tobytes() + yi.tobytes() for xi, yi in zip(x, y, strict=True))
    ours = sorted(
        xi.tobytes() + yi.tobytes()
        for p in parts
        for xs, ys in ((p.x_train, p.y_train), (p.x_test, p.y_test))
        for xi, yi in zip(xs, ys, strict=True)
    )
    assert ours == everything
    for p in parts:
        assert p.x_train.dtype == np.float32 and p.y_train.dtype == np.int64
        assert p.x_train.shape[1] == 64
        assert p.x_train.min() >= 0.0 and p.x_train.max() <= 1.0
        assert len(p.y_train) >= 10
        assert len(p.y_test) == int(0.2 * (len(p.y_train) + len(p.y_test)))


def test_partitions_are_non_iid():
    parts = _partitions()
    shares = [np.bincount(p.y_train, minlength=10).max() / len(p.y_train) for p in parts]
    assert max(shares) > 0.3
    # A near-IID split (large alpha) stays close to the global label mix; ours does not.
    assert _label_tv(parts) > 0.3
    assert _label_tv(_partitions(alpha=100.0)) < 0.1


def test_many_partitions_still_get_enough_training_examples():
    n = 120
    parts = [load_partition(i, n, alpha=0.1) for i in range(n)]
    assert min(len(p.y_train) for p in parts) >= 10
    assert sum(len(p.y_train) + len(p.y_test) for p in parts) == TOTAL
    with pytest.raises(ValueError):
        load_partition(0, 200)


def test_dataset_records():
    part = load_partition(3, N)
    trainer = DigitsTrainer(part)
    records = list(trainer.dataset_records())
    assert len(records) == trainer.num_examples() == len(part.y_train)
    assert records[0] == part.x_train[0].tobytes() + part.y_train[0].tobytes()
    x = part.x_train.copy()
    x[5, 10] += 0.5
    changed = list(DigitsTrainer(dataclasses.replace(part, x_train=x)).dataset_records())
    assert [i for i, (a, b) in enumerate(zip(records, changed, strict=True)) if a != b] == [5]


def test_sample_batch_is_reproducible():
    trainer = DigitsTrainer(load_partition(0, N))
    a = trainer.sample_batch(torch.Generator().manual_seed(7), 16)
    b = trainer.sample_batch(torch.Generator().manual_seed(7), 16)
    c = trainer.sample_batch(torch.Generator().manual_seed(8), 16)
    assert a[0].shape == (16, 64) and a[1].dtype == torch.int64
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def _train(trainer: DigitsTrainer, steps: int = 100) -> tuple[float, float]:
    """The training loss before and after ``steps`` AdamW steps on batches of 32."""
    x, y = torch.from_numpy(trainer.partition.x_train), torch.from_numpy(trainer.partition.y_train)
    with torch.no_grad():
        before = float(trainer.loss(trainer.model, (x, y)))
    opt = torch.optim.AdamW(trainer.model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        trainer.loss(trainer.model, trainer.sample_batch(gen, 32)).backward()
        opt.step()
    with torch.no_grad():
        return before, float(trainer.loss(trainer.model, (x, y)))


def test_training_lowers_the_loss():
    trainer = DigitsTrainer(load_partition(2, N))
    before, after = _train(trainer)
    assert after < 0.3 * before
    loss, acc, n = trainer.evaluate()
    assert n == len(trainer.partition.y_test) and acc > 0.5 and np.isfinite(loss)


def test_evaluate_with_params_leaves_the_model_alone():
    trainer = DigitsTrainer(load_partition(1, N))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    other = {k: v + 0.1 for k, v in initial_params(seed=5).items()}
    with_other = trainer.evaluate(other)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k])
    assert with_other != trainer.evaluate()
    assert trainer.evaluate(initial_params()) == trainer.evaluate()


def test_initial_params():
    params = initial_params()
    assert list(params) == sorted(DigitsNet().state_dict())
    assert list(params) == [
        "encoder.0.bias",
        "encoder.0.weight",
        "predictor.bias",
        "predictor.weight",
    ]
    assert all(v.dtype == np.float32 for v in params.values())
    again, other = initial_params(), initial_params(seed=1)
    assert all(np.array_equal(params[k], again[k]) for k in params)
    assert not np.array_equal(params["predictor.weight"], other["predictor.weight"])
    # Every participant starts from the same model (init seed 0).
    a, b = DigitsTrainer(load_partition(0, N)), DigitsTrainer(load_partition(9, N))
    assert all(torch.equal(a.model.state_dict()[k], b.model.state_dict()[k]) for k in params)


def test_the_linear_model_is_seeded_trains_and_is_what_its_trainer_holds():
    params = initial_params(model_class=DigitsLinear)
    assert list(params) == ["predictor.bias", "predictor.weight"]
    assert sum(v.size for v in params.values()) == 650  # the model for DP at this size
    again, other = (
        initial_params(model_class=DigitsLinear),
        initial_params(seed=1, model_class=DigitsLinear),
    )
    assert all(np.array_equal(params[k], again[k]) for k in params)
    assert not np.array_equal(params["predictor.weight"], other["predictor.weight"])
    trainer = DigitsTrainer(load_partition(2, N), model_class=DigitsLinear)
    assert isinstance(trainer.model, DigitsLinear)
    assert all(np.array_equal(trainer.model.state_dict()[k].numpy(), params[k]) for k in params)
    before, after = _train(trainer)
    assert after < 0.5 * before
    assert trainer.evaluate()[1] > 0.5


def test_centralized_evaluate():
    loss, acc = centralized_evaluate(initial_params())
    assert np.isfinite(loss) and 0.0 <= acc <= 0.3


def test_the_apps_model_key_names_a_digits_model_and_refuses_another() -> None:
    from lensemble_flwr.errors import ConfigError
    from lensemble_flwr.simulations.digits_data import (
        DigitsLinear,
        DigitsNet,
        centralized_evaluate,
        model_class_of,
    )

    assert model_class_of("net") is DigitsNet
    assert model_class_of("linear") is DigitsLinear
    for bad in ("mlp", "", None, 3):
        with pytest.raises(ConfigError, match=r"model: .* is not a digits model"):
            model_class_of(bad)
    # the server's evaluation loads the model the key names
    params = initial_params(model_class=DigitsLinear)
    loss, accuracy = centralized_evaluate(params, model_class=DigitsLinear)
    assert loss > 0 and 0.0 <= accuracy <= 1.0
