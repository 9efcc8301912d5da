"""The DiLoCo outer step: Nesterov momentum on the mean pseudo-gradient, as a pure function.

With Δ = local − global (what participants release) and mean Δ̄::

    m' = μ·m + Δ̄
    θ' = θ + η·(Δ̄ + μ·m')      (Nesterov)      or      θ' = θ + η·m'   (heavy ball)

This is exactly ``torch.optim.SGD(lr=η, momentum=μ, nesterov=True)`` stepping on the
gradient −Δ̄ (its momentum buffer is −m). With η = 1 and μ = 0 it is plain averaging:
θ' = θ + Δ̄ = mean of the local models. Arithmetic is in the parameters' dtype (float32),
element-wise, so the result is bitwise reproducible and independent of how the arrays
are split between threads.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from lensemble_flwr.aggregation import compiled, recycling
from lensemble_flwr.aggregation.chunked import CHUNK, run_ranges
from lensemble_flwr.config import OuterOptimizerConfig
from lensemble_flwr.errors import ParameterMismatch
from lensemble_flwr.params import NamedArrays, check_same_layout


def zero_momentum(params: Mapping[str, np.ndarray]) -> NamedArrays:
    """The initial momentum: zeros shaped like ``params``."""
    return {name: np.zeros_like(params[name]) for name in sorted(params)}


def outer_step(
    params: Mapping[str, np.ndarray],
    momentum: Mapping[str, np.ndarray],
    mean_delta: Mapping[str, np.ndarray],
    config: OuterOptimizerConfig,
    averaged: Collection[str] = (),
    *,
    consume_mean: bool = False,
) -> tuple[NamedArrays, NamedArrays]:
    """Return ``(new_params, new_momentum)``; the inputs are not modified, except that
    with ``consume_mean`` the new momentum is written into ``mean_delta``'s own arrays
    where it can be (a writeable, C-contiguous array of the parameter's dtype): for a
    caller that does not use the mean again, one model-sized allocation fewer. The
    results are bitwise the same either way.

    The ``averaged`` names (statistics such as BatchNorm's running mean and variance,
    which are not trained by gradients) take plain averaging, θ' = θ + Δ̄ (FedAvg's
    mean of the local values), and keep a zero momentum: a momentum step could push a
    variance below zero.

    Raises:
        ParameterMismatch: the three mappings differ in names or shapes, or a parameter
            is not floating-point (integer buffers are never stepped).
    """
    check_same_layout(params, momentum, "momentum")
    check_same_layout(params, mean_delta, "mean delta")
    new_params: NamedArrays = {}
    new_momentum: NamedArrays = {}
    for name in sorted(params):
        p = params[name]
        if not np.issubdtype(p.dtype, np.floating):
            raise ParameterMismatch(f"{name}: integer tensors are never stepped ({p.dtype})")
        if name in averaged:
            delta = mean_delta[name].astype(p.dtype, copy=False)
            new_params[name] = np.add(p, delta)
            new_momentum[name] = np.zeros_like(p)
            continue
        new_params[name], new_momentum[name] = _momentum_step(
            name, p, momentum[name], mean_delta[name], config, consume_mean
        )
    return new_params, new_momentum


def _momentum_step(
    name: str,
    p: np.ndarray,
    momentum: np.ndarray,
    g: np.ndarray,
    config: OuterOptimizerConfig,
    consume_mean: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """One trained array's step: ``(θ', m')`` from θ = ``p``, m and the mean ``g``."""
    dtype = p.dtype.type
    lr, mu = dtype(config.lr), dtype(config.momentum)
    p_in, m_in = p.reshape(-1), momentum.astype(p.dtype, copy=False).reshape(-1)
    g_in = g.astype(p.dtype, copy=False).reshape(-1)
    in_place = (
        consume_mean
        and isinstance(g, np.ndarray)
        and g.dtype == p.dtype
        and g.flags.c_contiguous
        and g.flags.writeable
    )
    p_out = recycling.output(f"params:{name}", p_in.shape, p_in.dtype)
    # m' over Δ̄, chunk by chunk, when the caller lets it
    m_out = g_in if in_place else recycling.output(f"momentum:{name}", p_in.shape, p_in.dtype)
    # m_in and g_in have p's dtype; the kernel takes any strides
    fast = compiled.for_size(p_in.size) if p.dtype in _COMPILED_DTYPES else None
    nesterov = config.nesterov

    def kernel(lo: int, hi: int) -> None:
        if fast is not None:  # the same float32 operations, one pass
            fast.outer(p_in, m_in, g_in, p_out, m_out, lr, mu, nesterov, lo, hi)
            return
        _numpy_step(p_in, m_in, g_in, p_out, m_out, lr, mu, nesterov, lo, hi)

    run_ranges(p_in.size, kernel)
    return p_out.reshape(p.shape), m_out.reshape(p.shape)


def _numpy_step(
    p_in: np.ndarray,
    m_in: np.ndarray,
    g_in: np.ndarray,
    p_out: np.ndarray,
    m_out: np.ndarray,
    lr: np.floating,
    mu: np.floating,
    nesterov: bool,
    lo: int,
    hi: int,
) -> None:
    """The step over ``[lo, hi)`` with numpy, chunk by chunk (``m_out`` may be ``g_in``)."""
    tmp = np.empty(min(CHUNK, hi - lo), p_in.dtype)
    for s in range(lo, hi, CHUNK):
        e = min(s + CHUNK, hi)
        g, m, t = g_in[s:e], tmp[: e - s], p_out[s:e]  # t: θ' is built in place
        np.multiply(m_in[s:e], mu, out=m)
        np.add(m, g, out=m)  # m' = mu*m + g
        if nesterov:
            np.multiply(m, mu, out=t)
            np.add(g, t, out=t)  # g + mu*m'
        else:
            t[...] = m
        np.multiply(t, lr, out=t)
        np.add(p_in[s:e], t, out=t)
        m_out[s:e] = m  # last: m_out may be g's own buffer


_COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""The dtypes the compiled outer step takes (float16 and longdouble stay with numpy)."""


def momentum_after_external_step(
    base: Mapping[str, np.ndarray],
    base_momentum: Mapping[str, np.ndarray],
    adopted: Mapping[str, np.ndarray],
    config: OuterOptimizerConfig,
    averaged: Collection[str] = (),
) -> NamedArrays:
    """The momentum of an outer step from ``(base, base_momentum)`` whose result was
    ``adopted``: a model changed after the step (a wrapping strategy's central noise).

    It solves the step for the mean delta that would have produced ``adopted``
    (Nesterov: θ̃ = θ + η·((1 + μ)·Δ̃ + μ²·m), so Δ̃ = ((θ̃ − θ)/η − μ²·m)/(1 + μ);
    heavy ball: θ̃ = θ + η·(μ·m + Δ̃)) and returns m̃ = μ·m + Δ̃. It reads nothing but the
    previous released state and the adopted model, so the momentum, and every later step,
    is a function of released models only: the un-noised mean the step consumed does not
    survive in the optimizer's state. Applying :func:`outer_step` with Δ̃ to the base gives
    ``adopted`` (up to float rounding). The ``averaged`` names keep a zero momentum.

    Raises:
        ParameterMismatch: the mappings differ in names or shapes.
    """
    check_same_layout(base, base_momentum, "momentum")
    check_same_layout(base, adopted, "adopted params")
    momentum: NamedArrays = {}
    for name in sorted(base):
        theta = base[name]
        dtype = theta.dtype.type
        if name in averaged:
            momentum[name] = np.zeros_like(theta)
            continue
        lr, mu = dtype(config.lr), dtype(config.momentum)
        m = base_momentum[name].astype(theta.dtype, copy=False)
        moved = (adopted[name].astype(theta.dtype, copy=False) - theta) / lr
        if config.nesterov:  # the Δ̃ that solves the step, then m̃ = μ·m + Δ̃
            momentum[name] = mu * m + (moved - mu * mu * m) / (dtype(1) + mu)
        else:  # heavy ball: θ̃ = θ + η·m̃
            momentum[name] = moved
    return momentum


def influence_scale(config: OuterOptimizerConfig) -> float:
    """How much one step scales the mean delta's effect on the model: η·(1 + μ) with
    Nesterov momentum, η without (1 for FedAvg's step, η = 1 and μ = 0). A wrapper that
    adds noise calibrated to FedAvg's averaging to the result of this step gets a noise
    multiplier divided by this factor."""
    return config.lr * (1 + config.momentum) if config.nesterov else config.lr
