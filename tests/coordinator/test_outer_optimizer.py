"""Tests of the DiLoCo outer step against torch's SGD and plain averaging."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lensemble_flwr.aggregation.chunked as chunked
from lensemble_flwr.config import OuterOptimizerConfig
from lensemble_flwr.coordinator.outer_optimizer import outer_step, zero_momentum
from lensemble_flwr.errors import ParameterMismatch
from lensemble_flwr.params import NamedArrays

EPS32 = float(np.finfo(np.float32).eps)


def _random(rng: np.random.Generator, scale: float = 1.0) -> NamedArrays:
    return {
        "enc.w": (rng.standard_normal((17, 9)) * scale).astype(np.float32),
        "enc.b": (rng.standard_normal(9) * scale).astype(np.float32),
        "pred.w": (rng.standard_normal((3, 4, 5)) * scale).astype(np.float32),
    }


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "heavy-ball"])
def test_matches_torch_sgd_on_negated_mean_delta(nesterov: bool) -> None:
    """Oracle: torch.optim.SGD(lr, momentum, nesterov, dampening=0) stepping on -mean_delta.

    Tolerance. The momentum is compared bitwise (both compute fl(mu*m) + g). The
    parameters are not bitwise equal: torch's CPU kernels fuse ``a + alpha*b`` into an
    FMA, numpy rounds the product first. Before every step torch's parameters are reset
    to ours, so the difference is that of one step: each element must be within
    4 * eps32 * (|theta| + lr * (|mean_delta| + mu * |m'|)), a few float32 roundings of
    the operands. (A plain rtol=1e-6/atol=1e-7 is not meaningful here: a result that
    cancels to near zero carries the absolute rounding error of its O(1) operands.)
    """
    lr, mu = 0.7, 0.9
    cfg = OuterOptimizerConfig(lr=lr, momentum=mu, nesterov=nesterov)
    rng = np.random.default_rng(1234)
    params = _random(rng)
    momentum = zero_momentum(params)
    tparams = {n: torch.nn.Parameter(torch.from_numpy(a.copy())) for n, a in params.items()}
    opt = torch.optim.SGD(
        list(tparams.values()), lr=lr, momentum=mu, nesterov=nesterov, dampening=0.0
    )
    for _ in range(6):
        delta = _random(rng, scale=0.1)
        new_params, new_momentum = outer_step(params, momentum, delta, cfg)
        for name, t in tparams.items():
            with torch.no_grad():
                t.copy_(torch.from_numpy(params[name]))
            t.grad = torch.from_numpy(-delta[name])
        opt.step()
        for name, t in tparams.items():
            buf = -opt.state[t]["momentum_buffer"].numpy()
            assert new_momentum[name].dtype == np.float32
            np.testing.assert_array_equal(new_momentum[name], buf, err_msg=name)
            got, want = new_params[name], t.detach().numpy()
            assert got.dtype == np.float32 and got.shape == want.shape
            step_scale = np.abs(params[name]) + lr * (
                np.abs(delta[name]) + mu * np.abs(new_momentum[name])
            )
            excess = np.abs(got.astype(np.float64) - want) - 4 * EPS32 * step_scale
            assert float(excess.max()) <= 0.0, name
        params, momentum = new_params, new_momentum


def test_free_running_trajectory_stays_close_to_torch() -> None:
    """Eight steps without resynchronising: rtol=1e-5, atol=1e-6 on O(1) parameters."""
    cfg = OuterOptimizerConfig()  # lr 0.7, momentum 0.9, Nesterov
    rng = np.random.default_rng(7)
    params = _random(rng)
    momentum = zero_momentum(params)
    tparams = {n: torch.nn.Parameter(torch.from_numpy(a.copy())) for n, a in params.items()}
    opt = torch.optim.SGD(list(tparams.values()), lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(8):
        delta = _random(rng, scale=0.1)
        params, momentum = outer_step(params, momentum, delta, cfg)
        for name, t in tparams.items():
            t.grad = torch.from_numpy(-delta[name])
        opt.step()
    for name, t in tparams.items():
        np.testing.assert_allclose(params[name], t.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_lr_one_momentum_zero_is_plain_averaging() -> None:
    rng = np.random.default_rng(3)

    def dyadic(shape: tuple[int, ...]) -> np.ndarray:
        return (rng.integers(-512, 512, size=shape) / 64.0).astype(np.float32)

    shapes = {"a": (4, 3), "b": (5,)}
    theta = {n: dyadic(s) for n, s in shapes.items()}
    locals_ = [{n: dyadic(s) for n, s in shapes.items()} for _ in range(4)]
    mean_delta = {
        n: (sum(local[n] - theta[n] for local in locals_) / np.float32(4)).astype(np.float32)
        for n in shapes
    }
    mean_local = {n: (sum(local[n] for local in locals_) / np.float32(4)) for n in shapes}
    momentum = {n: dyadic(s) for n, s in shapes.items()}  # ignored when mu == 0
    for nesterov in (True, False):
        cfg = OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=nesterov)
        new_params, new_momentum = outer_step(theta, momentum, mean_delta, cfg)
        for n in shapes:
            np.testing.assert_array_equal(new_params[n], mean_local[n])
            np.testing.assert_array_equal(new_momentum[n], mean_delta[n])
            assert not np.array_equal(new_params[n], theta[n])


def test_inputs_are_not_modified() -> None:
    rng = np.random.default_rng(5)
    params, momentum, delta = _random(rng), _random(rng), _random(rng)
    copies = [{n: a.copy() for n, a in x.items()} for x in (params, momentum, delta)]
    new_params, new_momentum = outer_step(params, momentum, delta, OuterOptimizerConfig())
    for original, copy in zip((params, momentum, delta), copies, strict=True):
        for n in copy:
            assert original[n].tobytes() == copy[n].tobytes(), n
    for n in params:
        assert not np.shares_memory(new_params[n], params[n])
        assert not np.shares_memory(new_momentum[n], momentum[n])
        assert not np.array_equal(new_params[n], params[n])


def test_output_is_sorted_and_keeps_shapes() -> None:
    rng = np.random.default_rng(6)
    params = _random(rng)
    unsorted = {n: params[n] for n in reversed(list(params))}
    new_params, new_momentum = outer_step(
        unsorted, zero_momentum(params), _random(rng), OuterOptimizerConfig()
    )
    assert list(new_params) == sorted(params) == list(new_momentum)
    assert all(new_params[n].shape == params[n].shape for n in params)


def test_layout_mismatch_is_refused() -> None:
    rng = np.random.default_rng(8)
    params = _random(rng)
    cfg = OuterOptimizerConfig()
    momentum = zero_momentum(params)
    delta = _random(rng)
    with pytest.raises(ParameterMismatch, match=r"momentum: missing \['enc.b'\]"):
        outer_step(params, {n: a for n, a in momentum.items() if n != "enc.b"}, delta, cfg)
    bad_delta = dict(delta, **{"enc.w": np.zeros((9, 17), np.float32)})
    with pytest.raises(ParameterMismatch, match=r"mean delta: enc.w expected shape \(17, 9\)"):
        outer_step(params, momentum, bad_delta, cfg)
    extra = dict(delta, extra=np.zeros(1, np.float32))
    with pytest.raises(ParameterMismatch, match=r"unexpected \['extra'\]"):
        outer_step(params, momentum, extra, cfg)


def test_integer_params_are_refused() -> None:
    params = {"count": np.array([3], np.int64), "w": np.ones(2, np.float32)}
    momentum = {"count": np.zeros(1, np.int64), "w": np.zeros(2, np.float32)}
    delta = {"count": np.ones(1, np.int64), "w": np.ones(2, np.float32)}
    with pytest.raises(ParameterMismatch, match="count: integer tensors are never stepped"):
        outer_step(params, momentum, delta, OuterOptimizerConfig())


def _numpy_reference(
    p: np.ndarray, m: np.ndarray, g: np.ndarray, lr: float, mu: float, nesterov: bool
) -> tuple[np.ndarray, np.ndarray]:
    lr32, mu32 = np.float32(lr), np.float32(mu)
    m_new = m * mu32 + g
    step = g + m_new * mu32 if nesterov else m_new
    return p + step * lr32, m_new


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "heavy-ball"])
def test_large_array_threaded_path_matches_numpy_reference(
    nesterov: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunked, "_WORKERS", 4)
    shape = (54_321, 5)  # 271_605 elements > 4 * CHUNK, not chunk-aligned
    n = shape[0] * shape[1]
    assert n > 4 * chunked.CHUNK and n % chunked.CHUNK
    assert len(chunked.split(n)) > 1  # the threaded, chunked path really runs
    rng = np.random.default_rng(9)
    params = {
        "big": rng.standard_normal(shape).astype(np.float32),
        "small": rng.standard_normal(3).astype(np.float32),
    }
    momentum = {
        k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in params.items()
    }
    delta = {k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in params.items()}
    cfg = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    new_params, new_momentum = outer_step(params, momentum, delta, cfg)
    for name in params:
        want_p, want_m = _numpy_reference(
            params[name], momentum[name], delta[name], 0.7, 0.9, nesterov
        )
        assert new_params[name].tobytes() == want_p.tobytes(), name
        assert new_momentum[name].tobytes() == want_m.tobytes(), name
    monkeypatch.setattr(chunked, "_WORKERS", 1)
    assert len(chunked.split(n)) == 1
    serial_params, _ = outer_step(params, momentum, delta, cfg)
    assert serial_params["big"].tobytes() == new_params["big"].tobytes()
