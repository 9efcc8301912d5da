"""The compiled aggregation kernels give the numpy passes' bytes, whatever path they take.

Each test runs the same aggregation twice: once with the compiled kernels for every array
(:data:`compiled.COMPILED_MIN_SIZE` lowered to 1, so that small arrays take them), once
with numpy's passes (no kernels), and compares sums, checksums, means and outer steps
byte for byte. numba compiles (once, then caches on disk) one fold per ``fold_batch``
and dtype: a shorter batch is padded to ``fold_batch``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_paths import kernels

import lensemble_flwr.aggregation.chunked as chunked
from lensemble_flwr.aggregation import compiled
from lensemble_flwr.aggregation.fixed_point import AggregateSum, FixedPointAggregator
from lensemble_flwr.config import AggregationConfig, OuterOptimizerConfig
from lensemble_flwr.coordinator.outer_optimizer import outer_step
from lensemble_flwr.errors import NonDeterministicAggregation
from lensemble_flwr.protocol.messages import Update
from tests.aggregation.test_fixed_point import _update

pytest.importorskip("numba", reason="the compiled kernels need the 'fast' extra")


@pytest.fixture(autouse=True)
def _compiled_kernels_in_use() -> None:
    """Every comparison below would compare numpy with numpy if the kernels were off."""
    assert compiled.available(), "LENSEMBLE_FLWR_COMPILED_KERNELS switches the kernels off"


Summed = tuple[AggregateSum, dict[str, np.ndarray]]


def _admitted(
    updates: Sequence[tuple[Update, int]],
    template: dict[str, np.ndarray],
    config: AggregationConfig,
) -> FixedPointAggregator:
    agg = FixedPointAggregator(template, config, check_seed=5)
    for update, weight in updates:
        agg.admit(update, weight=weight)
    return agg


def _sum(
    updates: Sequence[tuple[Update, int]],
    template: dict[str, np.ndarray],
    config: AggregationConfig,
) -> Summed:
    """Admit, reveal, verify and take the mean, all under the kernels in force."""
    agg = _admitted(updates, template, config)
    result = agg.reveal()
    agg.verify(result)
    return result, result.mean()


def _both_paths_agree(
    updates: Sequence[tuple[Update, int]],
    template: dict[str, np.ndarray],
    config: AggregationConfig,
    magic_bound: int | None = None,
) -> None:
    """Sums, checksums and means are the same bytes with numpy's passes and the kernels."""
    with kernels(False):
        reference = _sum(updates, template, config)
    with kernels(True, magic_bound=magic_bound):
        fused = _sum(updates, template, config)
    _same(reference, fused)


def _same(a: Summed, b: Summed) -> None:
    (sum_a, mean_a), (sum_b, mean_b) = a, b
    assert sum_a.checksum == sum_b.checksum
    assert sum_a.sums.keys() == sum_b.sums.keys() == mean_a.keys() == mean_b.keys()
    for name in sum_a.sums:
        assert sum_a.sums[name].tobytes() == sum_b.sums[name].tobytes(), name
        assert mean_a[name].tobytes() == mean_b[name].tobytes(), name


# values that round to ties on the grid, the smallest subnormals, the ingress limit
_HARD = st.one_of(
    st.floats(-64.0, 64.0, width=32, allow_nan=False, allow_subnormal=True),
    st.sampled_from(
        [0.0, -0.0, 1e-45, -1e-45, 2**-9, -(2**-9), 3 * 2**-9, 2**-33, -(2**-33), 64.0, -64.0]
    ),
)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(st.lists(_HARD, min_size=5, max_size=5), min_size=1, max_size=4),
    weights=st.lists(st.sampled_from([1, 2, 3, 7, 1024, 40_000]), min_size=4, max_size=4),
    fraction_bits=st.sampled_from([8, 24, 32]),
    dtype=st.sampled_from(["float32", "float64", "int8"]),
    magic=st.booleans(),
)
def test_the_compiled_fold_gives_numpys_integers(
    rows: list[list[float]], weights: list[int], fraction_bits: int, dtype: str, magic: bool
) -> None:
    """float32, float64 or int8 (quantized) updates, power-of-two weights or not, at grids
    where values fall on ties; both the magic-constant rounding and the rint path."""
    updates = []
    for i, (row, weight) in enumerate(zip(rows, weights, strict=False)):
        values = np.asarray(row, np.float32)
        if dtype == "int8":
            delta = {"w": np.clip(np.rint(values * 2), -127, 127).astype(np.int8)}
            scales = {"w": 0.37}
        else:
            delta, scales = {"w": values.astype(dtype)}, None
        updates.append((_update(f"p{i}", delta, scales=scales), weight))
    config = AggregationConfig(fraction_bits=fraction_bits, fold_batch=3)
    template = {"w": np.zeros(5, np.float32)}
    _both_paths_agree(updates, template, config, magic_bound=compiled.MAGIC_BOUND if magic else 0)


def test_the_threaded_compiled_fold_takes_each_path_and_matches_numpy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Large arrays split over the kernel threads, a batch of 8 and a batch of 1, weights
    whose bound is above 2**51 (the rint path) and below (the magic constant), float64."""
    monkeypatch.setattr(chunked, "_WORKERS", 2)
    size = compiled.COMPILED_MIN_SIZE + 4_321
    assert len(chunked.split(size)) == 2
    rng = np.random.default_rng(3)
    for dtype, weight in ((np.float32, 1), (np.float32, 40_000), (np.float64, 3)):
        updates = [
            (_update(f"p{i}", {"big": rng.uniform(-30, 30, size).astype(dtype)}), weight)
            for i in range(9)
        ]
        bound = weight * (30 * 2**32 + 1)
        assert (bound < compiled.MAGIC_BOUND) == (weight != 40_000)
        template = {"big": np.zeros(size, np.float32)}
        with kernels(False):
            reference = _sum(updates, template, AggregationConfig())
        fused = _sum(updates, template, AggregationConfig())  # the real size threshold
        _same(reference, fused)


def test_a_batch_of_mixed_dtypes_is_folded_by_numpy() -> None:
    a = np.linspace(-1, 1, 7, dtype=np.float32)
    arrays = [a, a.astype(np.float64)]
    big = np.zeros(2 * compiled.COMPILED_MIN_SIZE, np.float32)
    r, at = np.ones(chunked.CHUNK, np.int64), compiled.COMPILED_MIN_SIZE
    assert compiled.fold_kernel([big[:at], big[:at].astype(np.float64)], [1, 1], r, 1) is None
    assert compiled.fold_kernel([big[:at], big[at:]], [1, 1], r, 1) is not None
    assert compiled.fold_kernel([big[: at - 1]], [1], r, 1) is None
    assert compiled.fold_kernel([big[::2]], [1], r, 1) is None
    updates = [(_update(f"p{i}", {"w": x}), 1) for i, x in enumerate(arrays)]
    template = {"w": np.zeros(7, np.float32)}
    _both_paths_agree(updates, template, AggregationConfig())


def test_batches_shorter_than_fold_batch_run_the_same_compiled_fold() -> None:
    """A round whose C_t is not a multiple of fold_batch ends on a shorter batch: it is
    padded (the padding never read), so it compiles no fold of its own, and every batch
    length gives the numpy sum."""
    template = {"w": np.zeros(7, np.float32)}
    rng = np.random.default_rng(11)
    updates = [
        (_update(f"p{i}", {"w": rng.uniform(-1, 1, 7).astype(np.float32)}), 1)
        for i in range(7)
    ]
    config = AggregationConfig(fold_batch=4)
    fold = compiled.kernels().fold  # type: ignore[union-attr]
    _both_paths_agree(updates[:4], template, config)  # compiles the fold of 4 slots
    signatures = len(fold.signatures)
    for count in (1, 3, 6, 7):  # last batches of 1, 3, 2 and 3
        _both_paths_agree(updates[:count], template, config)
    assert len(fold.signatures) == signatures


def test_the_compiled_verify_detects_a_changed_sum() -> None:
    rng = np.random.default_rng(1)
    updates = [
        (_update(f"p{i}", {"w": rng.uniform(-1, 1, 50).astype(np.float32)}), 1) for i in range(3)
    ]
    with kernels(True):
        agg = _admitted(updates, {"w": np.zeros(50, np.float32)}, AggregationConfig())
        result = agg.reveal()
        agg.verify(result)
        tampered = result.sums["w"].copy()
        tampered[17] += 1
        forged = AggregateSum(
            {"w": tampered},
            result.total_weight,
            result.contributors,
            result.fraction_bits,
            result.checksum,
        )
        with pytest.raises(NonDeterministicAggregation, match="does not reproduce"):
            agg.verify(forged)


def test_a_batch_of_read_only_and_writable_arrays_is_folded() -> None:
    """numba types the two differently; the kernel takes read-only views of all of them."""
    rng = np.random.default_rng(2)
    arrays = [rng.uniform(-1, 1, 3000).astype(np.float32) for _ in range(3)]
    arrays[1].setflags(write=False)
    updates = [(_update(f"p{i}", {"w": x}), 1) for i, x in enumerate(arrays)]
    template = {"w": np.zeros(3000, np.float32)}
    _both_paths_agree(updates, template, AggregationConfig())
    assert arrays[0].flags.writeable  # the caller's arrays keep their flags


@pytest.mark.parametrize("use", [False, True], ids=["numpy", "compiled"])
def test_verify_refuses_a_sum_of_another_layout(use: bool) -> None:
    """A forged sum larger than every tensor of the template is refused before the
    checksum reads it (the compiled checksum does not check its bounds)."""
    updates = [(_update("p0", {"w": np.ones(50, np.float32)}), 1)]
    with kernels(use):
        agg = _admitted(updates, {"w": np.zeros(50, np.float32)}, AggregationConfig())
        result = agg.reveal()
        for sums in ({"w": np.zeros(5000, np.int64)}, {"v": result.sums["w"]}):
            forged = AggregateSum(
                sums, result.total_weight, result.contributors, result.fraction_bits, 0
            )
            with pytest.raises(NonDeterministicAggregation, match="revealed sum"):
                agg.verify(forged)
        agg.verify(result)


_INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(
        st.one_of(_INT64, st.integers(-(2**53) - 5, 2**53 + 5), st.integers(-4, 4)),
        min_size=1,
        max_size=40,
    ),
    weight=st.integers(1, 2**20),
    fraction_bits=st.integers(8, 40),
)
def test_the_compiled_mean_is_numpys(values: list[int], weight: int, fraction_bits: int) -> None:
    """Any int64, including those float64 cannot hold exactly (the conversion rounds)."""
    sums = np.asarray(values, np.int64)
    result = AggregateSum({"w": sums}, weight, ("p",), fraction_bits, 0)
    with kernels(False):
        reference = result.mean()["w"]
    with kernels(True):
        fused = result.mean()["w"]
    assert fused.tobytes() == reference.tobytes()


def test_the_compiled_mean_is_numpys_over_many_blocks() -> None:
    rng = np.random.default_rng(4)
    sums = rng.integers(-(2**62), 2**62, 10_003, dtype=np.int64)
    sums[:6] = [-(2**63), 2**63 - 1, 0, -1, 2**53 + 1, -(2**53) - 1]
    sums[5000:5100] = rng.integers(-1000, 1000, 100)
    sums.setflags(write=False)  # as revealed
    result = AggregateSum({"w": sums}, 7, ("p",), 32, 0)
    with kernels(False):
        reference = result.mean()["w"]
    with kernels(True):
        fused = result.mean()["w"]
    assert fused.tobytes() == reference.tobytes()


_F32 = st.floats(-1e3, 1e3, width=32, allow_nan=False, allow_subnormal=True)


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(_F32, _F32, _F32), min_size=1, max_size=30),
    lr=st.sampled_from([1.0, 0.7, 0.1, 1e-3]),
    mu=st.sampled_from([0.0, 0.9, 0.5, 0.99]),
    nesterov=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
    consume=st.booleans(),
)
def test_the_compiled_outer_step_is_numpys(
    data: list[tuple[float, float, float]],
    lr: float,
    mu: float,
    nesterov: bool,
    dtype: type,
    consume: bool,
) -> None:
    theta, m, g = (np.asarray(column, dtype) for column in zip(*data, strict=True))
    config = OuterOptimizerConfig(lr=lr, momentum=mu, nesterov=nesterov)
    with kernels(False):
        ref_p, ref_m = outer_step({"w": theta}, {"w": m}, {"w": g.copy()}, config)
    with kernels(True):
        mean = {"w": g.copy()}
        new_p, new_m = outer_step({"w": theta}, {"w": m}, mean, config, consume_mean=consume)
    assert new_p["w"].tobytes() == ref_p["w"].tobytes()
    assert new_m["w"].tobytes() == ref_m["w"].tobytes()
    # m' is written over the mean when asked
    assert np.shares_memory(new_m["w"], mean["w"]) == consume


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LENSEMBLE_FLWR_COMPILED_KERNELS", "0")
    compiled.kernels.cache_clear()
    try:
        assert not compiled.available()
        assert compiled.for_size(10**9) is None
    finally:
        monkeypatch.delenv("LENSEMBLE_FLWR_COMPILED_KERNELS")
        compiled.kernels.cache_clear()
    assert compiled.available()


def test_without_numba_it_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """And folds with numpy (every other test of the aggregator runs that path too)."""
    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, "numba", None)  # import numba -> ImportError
        compiled.kernels.cache_clear()
        try:
            with caplog.at_level(logging.WARNING, logger=compiled.__name__):
                assert compiled.for_size(10**9) is None
        finally:
            compiled.kernels.cache_clear()
    assert "pip install 'lensemble-flwr[fast]'" in caplog.text
    assert compiled.available()


def test_no_writable_cache_folder_compiles_in_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """numba refuses ``cache=True`` with a RuntimeError when no cache folder is writable."""
    define, asked = compiled._define, []

    def without_cache_folder(numba: object, *, cache: bool) -> compiled.Kernels:
        asked.append(cache)
        if cache:
            raise RuntimeError("cannot cache function: no locator available")
        return define(numba, cache=cache)

    monkeypatch.setattr(compiled, "_define", without_cache_folder)
    compiled.kernels.cache_clear()
    try:
        assert compiled.available() and asked == [True, False]
    finally:
        compiled.kernels.cache_clear()


@pytest.mark.parametrize(
    "error",
    [OSError("libllvmlite.so: cannot open shared object file"), RuntimeError("no locator")],
    ids=["llvmlite", "not-even-without-a-cache"],
)
def test_kernels_that_cannot_be_built_leave_the_numpy_passes(
    error: Exception, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(numba: object, *, cache: bool) -> compiled.Kernels:
        raise error

    monkeypatch.setattr(compiled, "_define", broken)
    compiled.kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=compiled.__name__):
            assert compiled.for_size(10**9) is None
    finally:
        compiled.kernels.cache_clear()
    assert "numba kernels unavailable" in caplog.text and "numpy passes" in caplog.text
