"""The float64 norms: the same bits whatever BLAS does and whatever the CPU, close to the
exact value."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lensemble_flwr.norms import CHUNK, change_norm, l2_norm, sum_of_squares

_PROBE = """
import json
import numpy as np
from lensemble_flwr.norms import change_norm, l2_norm
a = {"w": np.random.default_rng(0).standard_normal(1_000_003).astype(np.float32),
     "b": np.random.default_rng(1).standard_normal(70_001)}
b = {"w": np.random.default_rng(2).standard_normal(1_000_003).astype(np.float32),
     "b": np.random.default_rng(3).standard_normal(70_001)}
print(json.dumps([l2_norm(a).hex(), change_norm(a, b).hex()]))
"""


def _norms_with_blas_threads(threads: int) -> list[str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_the_norms_do_not_depend_on_the_blas_thread_count() -> None:
    # np.dot's float64 sum, which l2_norm and change_norm used, differed in its last
    # bits between 1 and 2 OpenBLAS threads on a million floats, and a run's records with
    # it (verify then compared an external step's change_norm exactly: a run checked on
    # another machine broke).
    assert _norms_with_blas_threads(1) == _norms_with_blas_threads(4)


_CPUS = [  # kernels and feature levels this machine may pick, forced down one at a time
    {},
    {"OPENBLAS_CORETYPE": "Haswell"},
    {
        "OPENBLAS_CORETYPE": "Prescott",
        "NPY_DISABLE_CPU_FEATURES": "X86_V3,X86_V4,AVX512_ICL,AVX512_SPR",
    },
]


def test_the_norms_do_not_depend_on_the_cpu_kernels() -> None:
    # with np.dot, OpenBLAS's SkylakeX (AVX-512) and Haswell (AVX2) kernels gave other
    # last bits: a run's records (clip factors, mean_delta_l2) and its pinned digests
    # differed between two machines; numpy's own sum differs between feature levels too
    outputs = []
    for cpu in _CPUS:
        env = {**os.environ, **cpu}
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(json.loads(done.stdout))
    assert outputs[1:] == outputs[:1] * (len(outputs) - 1)


def _tree(values: list[float]) -> float:
    """The pairwise tree of norms.py in Python floats (IEEE doubles on every machine)."""
    width = 1 << max(len(values) - 1, 0).bit_length()
    level = values + [0.0] * (width - len(values))
    while len(level) > 1:
        half = len(level) // 2
        level = [level[i] + level[half + i] for i in range(half)]
    return level[0]


@settings(max_examples=40, deadline=None)
@given(st.lists(arrays(np.float32, st.integers(0, 40), elements=st.floats(-1e3, 1e3, width=32)),
                max_size=3))  # fmt: skip
def test_the_sum_is_the_fixed_tree_over_every_array_in_order(values: list[np.ndarray]) -> None:
    squares = [float(x) * float(x) for v in values for x in v.ravel()]
    assert sum_of_squares(values) == (_tree(squares) if squares else 0.0)


def test_buffers_of_chunk_squares_are_summed_in_order() -> None:
    values = np.random.default_rng(9).standard_normal(CHUNK + 5)
    first, rest = values[:CHUNK], values[CHUNK:]
    expected = _tree([float(x) ** 2 for x in first]) + _tree([float(x) ** 2 for x in rest])
    assert sum_of_squares([values[:7], values[7:]]) == expected


def _exact_sum_of_squares(values: list[np.ndarray]) -> Fraction:
    return sum((Fraction(float(x)) ** 2 for v in values for x in v.ravel()), Fraction(0))


finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(arrays(np.float32, st.integers(0, 300), elements=finite), max_size=4))
def test_the_norm_is_within_rounding_of_the_exact_value(values: list[np.ndarray]) -> None:
    named = {f"a{i}": v for i, v in enumerate(values)}
    exact = _exact_sum_of_squares(values)
    got = sum_of_squares(named[n] for n in sorted(named))
    assert abs(Fraction(got) - exact) <= Fraction(1e-12) * exact
    assert l2_norm(named) == math.sqrt(got)


def test_chunks_cross_array_and_chunk_boundaries_in_order() -> None:
    rng = np.random.default_rng(5)
    big = rng.standard_normal(3 * CHUNK + 17).astype(np.float32)
    other = rng.standard_normal(3 * CHUNK + 17).astype(np.float32)
    exact = _exact_sum_of_squares([big.astype(np.float64)])
    assert abs(Fraction(sum_of_squares([big])) - exact) <= Fraction(1e-12) * exact
    # a strided view and a contiguous copy hold the same values: the same bits
    view = np.stack([big, other], axis=1)[:, 0]
    assert not view.flags.c_contiguous
    assert sum_of_squares([view]) == sum_of_squares([big])
    # change_norm is the norm of the float64 difference, name by name in sorted order
    diff = other.astype(np.float64) - big.astype(np.float64)
    assert change_norm({"x": big}, {"x": other}) == math.sqrt(sum_of_squares([diff]))
    assert l2_norm({}) == 0.0 and change_norm({}, {}) == 0.0


def test_every_value_is_converted_to_float64_before_it_is_subtracted() -> None:
    # a longdouble ``before`` subtracted in longdouble rounded otherwise (1 in 10 of these
    # draws), and longdouble itself differs between x86, aarch64 and Windows
    rng = np.random.default_rng(3)
    for _ in range(50):
        after = rng.standard_normal(50)
        tiny = np.longdouble(2.0) ** -60 * rng.standard_normal(50).astype(np.longdouble)
        before = rng.standard_normal(50).astype(np.longdouble) + tiny
        as_float64 = {"x": before.astype(np.float64)}
        assert change_norm({"x": before}, {"x": after}) == change_norm(as_float64, {"x": after})


def test_a_difference_of_arrays_of_other_sizes_is_refused() -> None:
    with pytest.raises(ValueError, match="sizes differ"):
        change_norm({"x": np.zeros(3)}, {"x": np.zeros(4)})
