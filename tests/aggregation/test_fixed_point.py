"""Tests of the exact, order-independent fixed-point aggregator."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lensemble_flwr.aggregation.chunked as chunked
import lensemble_flwr.aggregation.fixed_point as fixed_point_module
from lensemble_flwr.aggregation.fixed_point import AggregateSum, FixedPointAggregator
from lensemble_flwr.config import AggregationConfig
from lensemble_flwr.errors import NonDeterministicAggregation, ParameterMismatch, RoundError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.protocol.messages import Update

SHAPES: dict[str, tuple[int, ...]] = {"enc.w": (3, 4), "enc.b": (5,)}


def _update(
    pid: str, delta: NamedArrays, n: int = 1, scales: dict[str, float] | None = None
) -> Update:
    return Update(
        run_id="r",
        round=1,
        sender=pid,
        participant_id=pid,
        dataset_root="a" * 64,
        delta=delta,
        scales=scales,
        l2_norm=0.0,
        num_examples=n,
    )


def _template(shapes: dict[str, tuple[int, ...]] = SHAPES) -> NamedArrays:
    return {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}


def _random_delta(
    rng: np.random.Generator, scale: float = 1.0, shapes: dict[str, tuple[int, ...]] = SHAPES
) -> NamedArrays:
    return {
        name: (rng.uniform(-1.0, 1.0, size=shape) * scale).astype(np.float32)
        for name, shape in shapes.items()
    }


def _aggregate(
    updates: Sequence[tuple[Update, int]],
    config: AggregationConfig,
    template: NamedArrays | None = None,
    seed: int = 0,
) -> tuple[FixedPointAggregator, AggregateSum]:
    agg = FixedPointAggregator(template or _template(), config, check_seed=seed)
    for update, weight in updates:
        agg.admit(update, weight=weight)
    return agg, agg.reveal()


def _python_int_sums(
    updates: Sequence[tuple[Update, int]], fraction_bits: int
) -> dict[str, list[int]]:
    """Pure-Python reference: sum of round(float64(x) * w * 2**F), half to even, as ints."""
    unit = 2.0**fraction_bits
    out: dict[str, list[int]] = {}
    for name in sorted(updates[0][0].delta):
        totals = [0] * updates[0][0].delta[name].size
        for update, weight in updates:
            for i, x in enumerate(update.delta[name].reshape(-1).tolist()):
                totals[i] += round(float(np.float64(x)) * weight * unit)
        out[name] = totals
    return out


def _assert_same_sum(a: AggregateSum, b: AggregateSum) -> None:
    assert list(a.sums) == list(b.sums)
    for name in a.sums:
        assert a.sums[name].dtype == np.int64
        assert a.sums[name].tobytes() == b.sums[name].tobytes(), name
    assert (a.total_weight, a.contributors, a.fraction_bits, a.checksum) == (
        b.total_weight,
        b.contributors,
        b.fraction_bits,
        b.checksum,
    )
    assert a.digest == b.digest


# ---------------------------------------------------------------------------- the mean


@pytest.mark.parametrize("fraction_bits", [12, 16, 20])
def test_mean_matches_float64_reference_within_the_grid(fraction_bits: int) -> None:
    rng = np.random.default_rng(fraction_bits)
    deltas = [_random_delta(rng, scale=4.0) for _ in range(5)]
    cfg = AggregationConfig(fraction_bits=fraction_bits)
    _, result = _aggregate([(_update(f"p{i}", d), 1) for i, d in enumerate(deltas)], cfg)
    assert result.count == 5 and result.total_weight == 5
    mean = result.mean()
    assert list(mean) == sorted(SHAPES)
    for name in SHAPES:
        ref = np.mean([d[name].astype(np.float64) for d in deltas], axis=0)
        assert mean[name].dtype == np.float32 and mean[name].shape == SHAPES[name]
        err = np.abs(mean[name].astype(np.float64) - ref)
        # the grid error (<= 2**-F) plus the final rounding to float32 (<= half an ulp)
        assert np.all(err <= 2.0**-fraction_bits + np.abs(ref) * 2.0**-24), name
        # the grid is real: a coarse grid is measurably off the float64 mean
        if fraction_bits == 12:
            assert err.max() > 2.0**-20


def test_weighted_mean_ten_times_the_data_pulls_ten_times() -> None:
    ones = {name: np.ones(shape, np.float32) for name, shape in SHAPES.items()}
    zeros = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    big, small = _update("big", ones, n=10), _update("small", zeros, n=1)
    cfg = AggregationConfig()
    _, weighted = _aggregate([(big, big.num_examples), (small, small.num_examples)], cfg)
    _, uniform = _aggregate([(big, 1), (small, 1)], cfg)
    assert weighted.total_weight == 11
    for name in SHAPES:
        np.testing.assert_allclose(weighted.mean()[name], 10.0 / 11.0, rtol=1e-7)
        np.testing.assert_array_equal(uniform.mean()[name], 0.5)


def test_weighted_mean_matches_np_average() -> None:
    rng = np.random.default_rng(11)
    deltas = [_random_delta(rng) for _ in range(4)]
    weights = [1, 7, 30, 250]
    cfg = AggregationConfig(fraction_bits=32)
    _, result = _aggregate(
        [
            (_update(f"p{i}", d, n=w), w)
            for i, (d, w) in enumerate(zip(deltas, weights, strict=True))
        ],
        cfg,
    )
    assert result.total_weight == sum(weights)
    for name in SHAPES:
        ref = np.average([d[name].astype(np.float64) for d in deltas], axis=0, weights=weights)
        np.testing.assert_allclose(result.mean()[name], ref, rtol=2**-23, atol=2.0**-32)


# ----------------------------------------------------------------- order independence


@functools.lru_cache(maxsize=1)
def _permutation_updates() -> tuple[tuple[Update, int], ...]:
    rng = np.random.default_rng(2024)
    return tuple(
        (_update(f"p{i}", _random_delta(rng, scale=50.0)), int(w))
        for i, w in enumerate(rng.integers(1, 2**16, size=6))
    )


@functools.lru_cache(maxsize=1)
def _baseline_sum() -> AggregateSum:
    return _aggregate(_permutation_updates(), AggregationConfig(fold_batch=8))[1]


@settings(max_examples=60, deadline=None)
@given(
    order=st.permutations(range(6)),
    fold_batch=st.sampled_from([1, 2, 3, 8]),
)
def test_permuted_arrival_gives_a_bitwise_identical_sum(order: list[int], fold_batch: int) -> None:
    updates = _permutation_updates()
    agg, result = _aggregate([updates[i] for i in order], AggregationConfig(fold_batch=fold_batch))
    _assert_same_sum(result, _baseline_sum())
    agg.verify(result)


def test_fold_batch_one_and_eight_give_the_same_result() -> None:
    updates = _permutation_updates()
    _, one = _aggregate(updates, AggregationConfig(fold_batch=1))
    _, eight = _aggregate(updates, AggregationConfig(fold_batch=8))
    _assert_same_sum(one, eight)
    # and the fixed-point path reproduces the exact integer reference
    ref = _python_int_sums(updates, 32)
    for name in one.sums:
        assert one.sums[name].reshape(-1).tolist() == ref[name]


def test_digest_depends_on_sum_weight_and_contributors() -> None:
    base = _baseline_sum()
    sums = {k: v.copy() for k, v in base.sums.items()}
    sums["enc.b"][0] += 1
    assert dataclasses.replace(base, sums=sums).digest != base.digest
    assert dataclasses.replace(base, total_weight=base.total_weight + 1).digest != base.digest
    assert dataclasses.replace(base, contributors=base.contributors[:-1]).digest != base.digest
    assert dataclasses.replace(base, fraction_bits=31).digest != base.digest


# ------------------------------------------------------------ exactness, both paths


def test_float_exact_path_equals_python_int_reference() -> None:
    rng = np.random.default_rng(5)
    cfg = AggregationConfig(fraction_bits=32)
    updates = [
        (_update(f"p{i}", _random_delta(rng, scale=2.0)), w) for i, w in enumerate([1, 3, 17])
    ]
    # 3 * 17 * 2 * 2**32 < 2**53: this batch is summed in float64
    assert sum(w * (math.ceil(2.0 * 2**32) + 1) for _, w in updates) < 2**53
    _, result = _aggregate(updates, cfg)
    ref = _python_int_sums(updates, 32)
    for name in result.sums:
        assert result.sums[name].reshape(-1).tolist() == ref[name], name


def test_rounding_is_half_to_even_per_update() -> None:
    cfg = AggregationConfig(fraction_bits=8)
    unit = 2.0**-8
    halves = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.25, 3.75], np.float64) * unit
    update = _update("p", {"x": halves})
    _, result = _aggregate([(update, 1)], cfg, template={"x": np.zeros(8, np.float32)})
    assert result.sums["x"].tolist() == [0, 2, 2, 0, -2, -2, 3, 4]
    # per update: two halves do not add up to a whole before rounding
    _, two = _aggregate(
        [(update, 1), (_update("q", {"x": halves}), 1)], cfg, template={"x": np.zeros(8)}
    )
    assert two.sums["x"].tolist() == [0, 4, 4, 0, -4, -4, 6, 8]


def test_int64_path_equals_python_int_reference() -> None:
    """Values near 60 with weights near 2**15 at F=32: one update's bound is just under
    2**53, a batch of several is above it, so the batch is summed in int64. Summing such
    a batch in float64 would lose low bits, which the exact comparison would catch."""
    rng = np.random.default_rng(6)
    cfg = AggregationConfig(fraction_bits=32, max_abs_update=64.0, fold_batch=8)
    shapes = {"x": (64,), "y": (2, 3)}
    updates = []
    for i, weight in enumerate([2**15 + 1, 2**15 - 3, 2**15 + 7]):
        delta = {n: rng.uniform(-60.0, 60.0, size=s) for n, s in shapes.items()}  # float64
        delta["x"][:32] = rng.uniform(-1e-6, 1e-6, size=32)  # sub-grid digits get rounded
        delta["x"][32] = 60.0 if i % 2 else -60.0
        updates.append((_update(f"p{i}", delta), weight))
    bounds = [w * (math.ceil(60.0 * 2**32) + 1) for _, w in updates]
    assert max(bounds) < 2**53 <= sum(bounds)
    ref = _python_int_sums(updates, 32)
    assert any(abs(v) >= 2**53 and v % 2 for v in ref["x"] + ref["y"])  # float64 would fail
    template = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    agg, result = _aggregate(updates, cfg, template=template)
    for name in shapes:
        assert result.sums[name].reshape(-1).tolist() == ref[name], name
    agg.verify(result)
    # one at a time (each fold in float64) gives the same integers
    _, serial = _aggregate(updates, AggregationConfig(fold_batch=1), template=template)
    _assert_same_sum(serial, result)


# ------------------------------------------------------------ large / threaded arrays


def test_large_arrays_threaded_path_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked, "_WORKERS", 4)
    shapes = {"big": (4 * chunked.CHUNK + 4_321,), "small": (7,)}
    assert len(chunked.split(shapes["big"][0])) > 1  # the threaded path really runs
    rng = np.random.default_rng(8)
    weights = [1, 2**10 + 1, 40_000]
    updates = [
        (_update(f"p{i}", _random_delta(rng, 60.0, shapes)), w) for i, w in enumerate(weights)
    ]
    template = _template(shapes)
    cfg = AggregationConfig(fraction_bits=32, fold_batch=8)  # batch bound > 2**53: int64
    agg, result = _aggregate(updates, cfg, template=template)
    agg.verify(result)
    for name in shapes:
        ref = np.zeros(shapes[name], np.int64)
        for update, w in updates:
            ref += np.rint(update.delta[name].astype(np.float64) * w * 2.0**32).astype(np.int64)
        assert result.sums[name].tobytes() == ref.tobytes(), name
    _, folded_singly = _aggregate(updates, AggregationConfig(fold_batch=1), template=template)
    _assert_same_sum(folded_singly, result)
    monkeypatch.setattr(chunked, "_WORKERS", 1)
    _, serial = _aggregate(updates, cfg, template=template)
    _assert_same_sum(serial, result)
    np.testing.assert_array_equal(serial.mean()["big"], result.mean()["big"])


# --------------------------------------------------------------------------- guards


def _good(pid: str, seed: int) -> Update:
    return _update(pid, _random_delta(np.random.default_rng(seed), scale=3.0))


def _bad_duplicate(agg: FixedPointAggregator) -> None:
    agg.admit(_good("a", 99), weight=2)


def _bad_weight_zero(agg: FixedPointAggregator) -> None:
    agg.admit(_good("c", 3), weight=0)


def _bad_weight_too_large(agg: FixedPointAggregator) -> None:
    agg.admit(_good("c", 3), weight=2**16 + 1)


def _bad_value(agg: FixedPointAggregator) -> None:
    delta = _random_delta(np.random.default_rng(4))
    delta["enc.b"][2] = np.float32(64.5)
    agg.admit(_update("c", delta), weight=1)


def _bad_layout(agg: FixedPointAggregator) -> None:
    delta = _random_delta(np.random.default_rng(4))
    delta["enc.w"] = np.zeros((4, 3), np.float32)
    agg.admit(_update("c", delta), weight=1)


def _bad_missing_name(agg: FixedPointAggregator) -> None:
    agg.admit(_update("c", {"enc.w": np.zeros((3, 4), np.float32)}), weight=1)


GUARDS = [
    (_bad_duplicate, RoundError, "a: already contributed"),
    (_bad_weight_zero, RoundError, r"c: weight 0 outside \[1, 65536\]"),
    (_bad_weight_too_large, RoundError, r"c: weight 65537 outside \[1, 65536\]"),
    (_bad_value, RoundError, r"c: \|value\| 64.5 exceeds max_abs_update 64 \(max-abs-update; set"),
    (_bad_layout, ParameterMismatch, r"enc.w expected shape \(3, 4\), got \(4, 3\)"),
    (_bad_missing_name, ParameterMismatch, r"missing \['enc.b'\]"),
]


@pytest.mark.parametrize("fold_batch", [1, 8])
@pytest.mark.parametrize(
    ("bad", "error", "match"),
    GUARDS,
    ids=["duplicate", "weight-0", "weight-max", "max-abs", "layout", "missing"],
)
def test_refused_update_leaves_the_aggregator_unchanged(
    bad: Callable[[FixedPointAggregator], None],
    error: type[Exception],
    match: str,
    fold_batch: int,
) -> None:
    cfg = AggregationConfig(fold_batch=fold_batch, max_abs_update=64.0)
    a, b = _good("a", 1), _good("b", 2)
    agg = FixedPointAggregator(_template(), cfg, check_seed=0)
    agg.admit(a, weight=2)
    with pytest.raises(error, match=match):
        bad(agg)
    assert agg.contributors == ("a",)
    agg.admit(b, weight=5)
    result = agg.reveal()
    _, clean = _aggregate([(a, 2), (b, 5)], cfg)
    _assert_same_sum(result, clean)
    agg.verify(result)


def test_capacity_overflow_is_refused_and_changes_nothing() -> None:
    # One update fits (2**20 * 3 * 2**40 < 2**62); three such updates do not fit int64.
    cfg = AggregationConfig(fraction_bits=40, max_abs_update=2.0**20, max_weight=3)
    template = {"x": np.zeros(4, np.float32)}

    def huge(pid: str, sign: float) -> Update:
        return _update(pid, {"x": np.full(4, sign * 2.0**20, np.float32)})

    small = _update("d", {"x": np.array([1.0, -0.5, 0.25, 3.0], np.float32)})
    agg = FixedPointAggregator(template, cfg, check_seed=1)
    agg.admit(huge("a", 1.0), weight=3)
    agg.admit(huge("b", 1.0), weight=3)
    with pytest.raises(RoundError, match="c: admitting this update would overflow"):
        agg.admit(huge("c", -1.0), weight=3)  # even a negative one: the bound is |.|
    agg.admit(small, weight=1)
    result = agg.reveal()
    agg.verify(result)
    assert result.contributors == ("a", "b", "d")
    assert result.total_weight == 7
    expected = [2 * 3 * 2**60 + round(v * 2**40) for v in (1.0, -0.5, 0.25, 3.0)]
    assert result.sums["x"].tolist() == expected
    _, clean = _aggregate(
        [(huge("a", 1.0), 3), (huge("b", 1.0), 3), (small, 1)], cfg, template=template, seed=1
    )
    _assert_same_sum(result, clean)


def test_admit_after_reveal_is_refused() -> None:
    agg = FixedPointAggregator(_template(), AggregationConfig(), check_seed=0)
    agg.admit(_good("a", 1), weight=1)
    result = agg.reveal()
    before = {k: v.tobytes() for k, v in result.sums.items()}
    with pytest.raises(RoundError, match="b: the contributing set is frozen"):
        agg.admit(_good("b", 2), weight=1)
    again = agg.reveal()
    assert again is result
    assert {k: v.tobytes() for k, v in again.sums.items()} == before
    assert again.contributors == ("a",) and again.total_weight == 1
    agg.verify(again)


def test_revealed_sums_are_read_only() -> None:
    _, result = _aggregate([(_good("a", 1), 1)], AggregationConfig())
    for array in result.sums.values():
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0


# ------------------------------------------------------------------------ self-check


def _honest() -> tuple[FixedPointAggregator, AggregateSum]:
    updates = [(_good(f"p{i}", i), i + 1) for i in range(4)]
    return _aggregate(updates, AggregationConfig(fold_batch=3), seed=17)


def test_verify_passes_on_an_honest_result() -> None:
    agg, result = _honest()
    agg.verify(result)
    # an independent aggregator with the same seed and updates agrees
    other, _ = _honest()
    other.verify(result)


def _corrupt_in_place(result: AggregateSum, name: str = "enc.w", index: int = 3) -> None:
    """A fault of the accumulator itself (the revealed sums are its arrays)."""
    array = result.sums[name]
    array.setflags(write=True)
    array.reshape(-1)[index] += 5
    array.setflags(write=False)


def test_the_resum_is_computed_from_the_inputs_not_read_from_the_sum() -> None:
    """A corruption of the first accumulator fails the check; the re-sum, folded apart
    from the same inputs, passes it and holds the honest sums."""
    agg, result = _honest()
    _corrupt_in_place(result)
    with pytest.raises(NonDeterministicAggregation, match="does not reproduce"):
        agg.verify(result)
    again = agg.resum()
    agg.verify(again)
    assert agg.reveal() is again  # the re-sum is now the revealed sum
    _, honest = _honest()
    for name, sums in honest.sums.items():
        assert np.array_equal(again.sums[name], sums)
        assert not np.shares_memory(again.sums[name], result.sums[name])
    assert (again.checksum, again.total_weight, again.contributors) == (
        honest.checksum,
        honest.total_weight,
        honest.contributors,
    )


def test_a_resum_corrupted_too_fails_its_check() -> None:
    agg, result = _honest()
    _corrupt_in_place(result)
    again = agg.resum()
    _corrupt_in_place(again, "enc.b", 0)
    with pytest.raises(NonDeterministicAggregation, match="does not reproduce"):
        agg.verify(again)


class _Disagreeing(FixedPointAggregator):
    """Its second computation adds another value than its first (each consistent with its
    own checksums, as a fold that does not reproduce would be)."""

    def _fold_into(self, accs, again, batch, assign):  # type: ignore[no-untyped-def]
        first, second = super()._fold_into(accs, again, batch, assign)
        again["enc.b"].reshape(-1)[0] += 1  # element 0 weighs 1 + r[0] in the checksum
        return first, (second + 1 + int(self._r[0])) % 2**64


def test_two_computations_that_disagree_pass_neither_check() -> None:
    agg = _Disagreeing(_template(), AggregationConfig(fold_batch=3), check_seed=17)
    for i in range(4):
        agg.admit(_good(f"p{i}", i), weight=i + 1)
    with pytest.raises(NonDeterministicAggregation, match="re-sum's"):
        agg.verify(agg.reveal())
    with pytest.raises(NonDeterministicAggregation, match="re-sum's"):
        agg.verify(agg.resum())


def test_an_empty_round_resums_to_zero() -> None:
    agg = FixedPointAggregator(_template(), AggregationConfig(), check_seed=1)
    agg.verify(agg.reveal())
    again = agg.resum()
    agg.verify(again)
    assert all(not a.any() for a in again.sums.values())


@pytest.mark.parametrize(
    ("name", "index", "delta"),
    [("enc.b", 0, 1), ("enc.w", 11, -1), ("enc.b", 4, 2**40)],
)
def test_verify_detects_one_changed_element(name: str, index: int, delta: int) -> None:
    agg, result = _honest()
    sums = {k: v.copy() for k, v in result.sums.items()}
    sums[name].reshape(-1)[index] += delta
    tampered = dataclasses.replace(result, sums=sums)
    with pytest.raises(NonDeterministicAggregation, match="does not reproduce"):
        agg.verify(tampered)


def test_verify_detects_swapped_elements() -> None:
    agg, result = _honest()
    sums = {k: v.copy() for k, v in result.sums.items()}
    flat = sums["enc.w"].reshape(-1)
    assert flat[0] != flat[1]
    flat[0], flat[1] = flat[1], flat[0]  # the plain sum is unchanged, the weighted one not
    with pytest.raises(NonDeterministicAggregation):
        agg.verify(dataclasses.replace(result, sums=sums))


def test_verify_detects_altered_weight_contributors_or_checksum() -> None:
    agg, result = _honest()
    with pytest.raises(NonDeterministicAggregation, match="weight 11 vs 10"):
        agg.verify(dataclasses.replace(result, total_weight=result.total_weight + 1))
    with pytest.raises(NonDeterministicAggregation, match="3 vs 4 contributors"):
        agg.verify(dataclasses.replace(result, contributors=result.contributors[:-1]))
    renamed = ("p0", "p1", "p2", "zz")
    with pytest.raises(NonDeterministicAggregation):
        agg.verify(dataclasses.replace(result, contributors=renamed))
    with pytest.raises(NonDeterministicAggregation):
        agg.verify(dataclasses.replace(result, checksum=(result.checksum + 1) % 2**64))


def test_verify_detects_a_change_that_keeps_the_plain_sum() -> None:
    # +1 on one element and -1 on another keeps the plain sum; the seeded sum catches it.
    agg, result = _honest()
    sums = {k: v.copy() for k, v in result.sums.items()}
    sums["enc.w"].reshape(-1)[0] += 1
    sums["enc.w"].reshape(-1)[1] -= 1
    with pytest.raises(NonDeterministicAggregation):
        agg.verify(dataclasses.replace(result, sums=sums))


def test_verify_hands_the_checked_mean_to_the_next_mean_call_only() -> None:
    """verify computes the mean in its pass over the sums; mean() returns it once, and
    computes the same bytes afresh afterwards (the caller may overwrite what it got)."""
    agg, result = _honest()
    reference = {n: a.copy() for n, a in AggregateSum(**_fields(result)).mean().items()}
    agg.verify(result)
    assert "_verified_mean" in result.__dict__  # the check's own mean is the one handed on
    first = result.mean()
    assert "_verified_mean" not in result.__dict__
    for name, values in first.items():
        assert values.tobytes() == reference[name].tobytes(), name
        values[...] = 7.0  # a caller that consumes the mean (the outer step does)
    second = result.mean()
    for name, values in second.items():
        assert values.tobytes() == reference[name].tobytes(), name
        assert not np.shares_memory(values, first[name])


def test_a_failed_verify_hands_no_mean_on() -> None:
    agg, result = _honest()
    tampered = dataclasses.replace(result, checksum=(result.checksum + 1) % 2**64)
    with pytest.raises(NonDeterministicAggregation):
        agg.verify(tampered)
    assert "_verified_mean" not in tampered.__dict__


def test_a_sum_of_no_weight_has_no_mean_but_verifies() -> None:
    agg = FixedPointAggregator(_template(), AggregationConfig(), check_seed=0)
    result = agg.reveal()
    agg.verify(result)
    with pytest.raises(RoundError, match="no mean"):
        result.mean()


def test_a_fold_that_fails_half_way_leaves_an_aggregator_that_refuses_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first tensor was folded, the second was not: revealing that sum would drop an
    update from one tensor (and, from a reused buffer, keep old contents in the other)."""
    real = fixed_point_module._float32_exact
    calls = []

    def fails_on_the_second_tensor(values: np.ndarray, scale: np.float64) -> bool:
        calls.append(1)
        if len(calls) > 3:  # fold_batch=3: the second tensor's inputs
            raise MemoryError("no room for the second tensor's temporaries")
        return real(values, scale)

    monkeypatch.setattr(fixed_point_module, "_float32_exact", fails_on_the_second_tensor)
    monkeypatch.setattr(fixed_point_module.compiled, "fold_kernel", lambda *a, **k: None)
    agg = FixedPointAggregator(_template(), AggregationConfig(fold_batch=3), check_seed=0)
    agg.admit(_good("p0", 0), weight=1)
    agg.admit(_good("p1", 1), weight=1)
    with pytest.raises(MemoryError):
        agg.admit(_good("p2", 2), weight=1)  # the batch's fold starts and fails
    monkeypatch.setattr(fixed_point_module, "_float32_exact", real)
    with pytest.raises(RoundError, match=r"a fold failed .*MemoryError"):
        agg.reveal()
    with pytest.raises(RoundError, match="a fold failed"):
        agg.admit(_good("p3", 3), weight=1)


def _fields(result: AggregateSum) -> dict[str, object]:
    return {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("fold_batch", [1, 3, 8])
def test_never_holds_more_than_fold_batch_pending_updates(fold_batch: int) -> None:
    agg = FixedPointAggregator(_template(), AggregationConfig(fold_batch=fold_batch), check_seed=0)
    for i in range(20):
        agg.admit(_good(f"p{i:02d}", i), weight=1)
        assert agg.pending_count <= fold_batch
        assert agg.pending_count == (i + 1) % fold_batch
    result = agg.reveal()
    assert agg.pending_count == 0
    assert result.count == 20
    agg.verify(result)


_HARD_FLOAT32 = st.one_of(
    st.floats(-64, 64, width=32),
    # values whose scaled form sits on or next to a rounding tie at 2**-32 resolution
    st.integers(-(2**37), 2**37).map(lambda n: np.float32((n + 0.5) / 2**32)),
    st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 2**-33, -(2**-33), 63.999996, -64.0]),
)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.lists(_HARD_FLOAT32, min_size=3, max_size=3), min_size=1, max_size=5),
    weights=st.lists(st.sampled_from([1, 2, 3, 4, 7, 8, 1024]), min_size=5, max_size=5),
)
def test_the_fold_gives_the_float64_fixed_point_integers_whatever_path_it_takes(
    values: list[list[float]], weights: list[int]
) -> None:
    """Power-of-two scales take a float32 path in the fold; the integers must be exactly
    rint(float64(x) * w * 2**F), the ones a masked participant computes (to_fixed_point)."""
    from lensemble_flwr.aggregation.fixed_point import to_fixed_point

    template = {"w": np.zeros(3, np.float32)}
    agg = FixedPointAggregator(template, AggregationConfig(), check_seed=1)
    expected = np.zeros(3, np.int64)
    for i, (row, weight) in enumerate(zip(values, weights, strict=False)):
        delta = {"w": np.asarray(row, np.float32)}
        agg.admit(
            Update(
                run_id="r",
                round=1,
                sender=f"p{i}",
                participant_id=f"p{i}",
                dataset_root=None,
                delta=delta,
                l2_norm=1.0,
                num_examples=1,
            ),
            weight=weight,
        )
        expected += to_fixed_point(delta, {"w": float(weight) * 2.0**32})["w"]
    result = agg.reveal()
    agg.verify(result)
    np.testing.assert_array_equal(result.sums["w"], expected)


def test_the_plaintext_aggregator_refuses_a_masked_update() -> None:
    """A masked release is a share of a secure sum, not values: summed in plain it would
    also bypass max-abs-update (its values are not checked). Refused, nothing admitted."""
    template = _template()
    agg = FixedPointAggregator(template, AggregationConfig(), check_seed=0)
    huge = {n: np.full(a.shape, 7 * 10**8, np.int64) for n, a in template.items()}
    masked = Update(
        run_id="r",
        round=1,
        sender="p",
        participant_id="p",
        dataset_root=None,
        delta=huge,
        num_examples=1,
        masked=True,
        sealed_shares={"p": "00"},
    )
    with pytest.raises(RoundError, match="masked update has no place"):
        agg.admit(masked, weight=1)
    assert agg.pending_count == 0
    agg.admit(_update("q", {n: np.zeros_like(a) for n, a in template.items()}), weight=1)
    assert agg.reveal().contributors == ("q",)


@pytest.mark.parametrize("size", [1, 7, 100, 4099, chunked.CHUNK - 1])
def test_a_small_models_checksum_weights_are_the_first_of_a_chunks(size: int) -> None:
    """A model smaller than a chunk draws only as many self-check weights as its largest
    array has elements, and they are the weights a full chunk starts with."""
    aggregator = FixedPointAggregator(
        {"a": np.zeros(size, np.float32), "b": np.zeros(3, np.float32)},
        AggregationConfig(),
        check_seed=11,
    )
    full = fixed_point_module._checksum_vector(11)
    assert full.size == chunked.CHUNK
    np.testing.assert_array_equal(aggregator._r, full[: max(size, 3)])


def test_an_unset_value_bound_is_the_exact_sums_room_for_unprotected_updates() -> None:
    """A stock ClientApp's update (a BatchNorm running_var on raw pixels reaches hundreds)
    is taken as FedAvg takes it, up to what the exact sum holds for one update at the
    largest weight; clipped, noised or masked releases keep the guard's 64 (or the clip
    norm, if larger)."""
    from lensemble_flwr.config import LensembleConfig
    from lensemble_flwr.privacy.calibration import ingress_bound

    assert AggregationConfig().max_abs_update == 0.0  # unset
    assert AggregationConfig().plaintext_bound() == 8192.0  # at max-weight 2**16
    assert AggregationConfig().plaintext_bound(largest_weight=1) == 2.0**20  # capped
    assert AggregationConfig(max_abs_update=3.0).plaintext_bound() == 3.0
    assert ingress_bound(LensembleConfig()) == 2.0**20  # uniform weighting: weight 1
    examples = {"federation": {"weighting": "num-examples"}}
    assert ingress_bound(LensembleConfig(**examples)) == 8192.0
    assert ingress_bound(LensembleConfig(release={"quantize": "int8"})) == 2.0**20
    for protected, bound in (
        ({"privacy": {"clip_norm": 1.0}}, 64.0),
        ({"privacy": {"clip_norm": 100.0}}, 100.0),  # a clipped coordinate reaches it
        ({"federation": {"min_participants": 3, "secagg_threshold": 2}}, 64.0),
        ({"aggregation": {"max_abs_update": 5.0}}, 5.0),  # set: as given
    ):
        assert ingress_bound(LensembleConfig(**protected)) == bound, protected
    agg = FixedPointAggregator(_template(), AggregationConfig(), check_seed=0)
    delta = _random_delta(np.random.default_rng(4))
    delta["enc.b"][2] = np.float32(300.0)
    agg.admit(_update("c", delta), weight=1)
    delta["enc.b"][2] = np.float32(8193.0)
    with pytest.raises(RoundError, match=r"exceeds max_abs_update 8\.19e\+03"):
        agg.admit(_update("d", delta), weight=1)
