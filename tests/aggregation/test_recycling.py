"""A round's accumulator reuses the previous round's buffers only when nobody else holds
them, and its sum never depends on what the reused buffer held."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kernel_paths import kernels

from lensemble_flwr.aggregation import recycling
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import AggregationConfig
from lensemble_flwr.errors import StoreError
from tests.aggregation.test_fixed_point import _aggregate, _update
from tests.coordinator.test_hash_once import feed_round, unbound_coordinator

SIZE = recycling.RECYCLE_MIN_BYTES // 4  # float32 values: an int64 sum of 2 MiB


@pytest.fixture(autouse=True)
def _empty_bin() -> Iterator[None]:
    recycling.clear()
    yield
    recycling.clear()


def _sum_of(values: list[float]) -> dict[str, np.ndarray]:
    template = {"w": np.zeros(SIZE, np.float32), "b": np.zeros(3, np.float32)}
    updates = [
        (_update(f"p{i}", {n: np.full(a.shape, v, np.float32) for n, a in template.items()}), 1)
        for i, v in enumerate(values)
    ]
    aggregator, result = _aggregate(updates, AggregationConfig(), template, seed=1)
    aggregator.verify(result)
    assert result.digest  # as a commit does: the background hash is done ...
    for thread in threading.enumerate():
        if thread.name == "lensemble-sums-digest":
            thread.join()  # ... and its thread, which held the sum, gone
    return result.sums


def test_a_dropped_sum_gives_its_buffer_to_the_next_and_it_starts_from_zero() -> None:
    expected = _sum_of([0.5, 0.25])["w"].copy()
    first = _sum_of([0.5, 0.25])
    address = first["w"].ctypes.data
    del first
    second = _sum_of([0.5, 0.25])
    assert second["w"].ctypes.data == address  # the same memory, written over by the fold
    np.testing.assert_array_equal(second["w"], expected)
    assert not second["w"].flags.writeable  # a revealed sum stays read-only


def test_a_sum_somebody_still_holds_is_never_overwritten() -> None:
    first = _sum_of([0.5])
    kept = first["w"].copy()
    view = first["w"][:10]  # a view keeps its base alive: the base is held
    del first
    second = _sum_of([-0.25])
    assert second["w"].ctypes.data != view.base.ctypes.data  # type: ignore[union-attr]
    np.testing.assert_array_equal(view.base, kept)  # type: ignore[arg-type]


def _latest_sum() -> int:
    """The address of the accumulator the pool handed out last (the latest round's sum)."""
    with recycling._lock:
        return recycling._kept[("sum:w", (SIZE,), np.dtype(np.int64).str)][-1].ctypes.data


def test_small_arrays_are_not_kept() -> None:
    small = recycling.output("b", (3,), np.int64)
    recycling.output("w", (SIZE,), np.int64)
    assert list(recycling._kept) == [("w", (SIZE,), np.dtype(np.int64).str)]
    assert recycling.output("b", (3,), np.int64) is not small


def test_recycling_is_calibrated_to_how_this_interpreter_counts_references() -> None:
    """One more holder must count as exactly one more (CPython 3.14 may not count the
    argument of getrefcount; a free-threaded build gives no reliable counts): otherwise
    recycling is off and every buffer is fresh."""
    assert recycling._calibrate() == recycling._UNHELD
    if recycling._UNHELD is None:
        pytest.skip("recycling is off on this interpreter")
    held = np.zeros(8, np.int64)
    assert recycling._count([held], 0) == recycling._UNHELD + 1  # `held` is one more holder


def test_recycling_off_never_reuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recycling, "_UNHELD", None)
    recycling.output("w", (SIZE,), np.int64)
    assert not recycling._kept  # nothing is offered ...
    planted = np.ones(SIZE, np.int64)  # ... and nothing kept is handed out, held or not
    alive = weakref.ref(planted)
    with recycling._lock:
        recycling._kept[("w", (SIZE,), planted.dtype.str)] = [planted]
    del planted
    fresh = recycling.output("w", (SIZE,), np.int64)
    assert fresh is not alive()


def test_a_coordinator_folds_round_after_round_into_the_same_buffer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The previous attempt (its aggregator and sums) is let go as the next begins: the
    reach memos used to keep it alive, so the buffer was never free when it was wanted."""
    caplog.set_level(logging.ERROR)
    coordinator = unbound_coordinator(Store(tmp_path), size=SIZE)
    rng = np.random.default_rng(0)
    addresses = []
    for _ in range(3):
        feed_round(coordinator, rng)
        addresses.append(_latest_sum())
    assert [o.state.value for o in coordinator.outcomes] == ["closed"] * 3
    assert len(set(addresses)) == 1, addresses


def test_an_attempt_aborted_after_its_sum_gives_the_retry_its_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An aborted outcome keeps its error, not the error's traceback: the traceback's
    frames held the attempt and its sum, so the retry could never reuse the buffer (and
    up to 16 kept outcomes pinned whole attempts)."""
    caplog.set_level(logging.ERROR)
    coordinator = unbound_coordinator(Store(tmp_path), size=SIZE)
    put_parts = Store.put_parts

    def failing_once(self: Store, parts: list[bytes]) -> str:
        monkeypatch.setattr(Store, "put_parts", put_parts)  # the next write succeeds
        raise StoreError("disk full")

    monkeypatch.setattr(Store, "put_parts", failing_once)
    rng = np.random.default_rng(0)
    aborted = feed_round(coordinator, rng, attempt=1, closes=False)
    aborted_sum = _latest_sum()
    retried = feed_round(coordinator, rng, attempt=2)
    retried_sum = _latest_sum()
    assert aborted.state.value == "aborted" and isinstance(aborted.error, StoreError)
    assert aborted.error.__traceback__ is None
    assert retried.state.value == "closed"
    assert retried_sum == aborted_sum


# ------------------------------------------------------------- the round's outputs
def _step(theta: dict[str, np.ndarray], m: dict[str, np.ndarray], g: dict[str, np.ndarray]):
    from lensemble_flwr.config import OuterOptimizerConfig
    from lensemble_flwr.coordinator.outer_optimizer import outer_step

    return outer_step(theta, m, g, OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True))


def _model(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(seed).uniform(-1, 1, SIZE).astype(np.float32)}


def test_an_output_nobody_holds_is_reused_and_fully_rewritten() -> None:
    theta, m, g = _model(1), _model(2), _model(3)
    expected_p, expected_m = (x["w"].copy() for x in _step(theta, m, g))
    first_p, _ = _step(theta, m, _model(4))  # other values in the buffers
    address = first_p["w"].ctypes.data
    del first_p
    again_p, again_m = _step(theta, m, g)
    assert again_p["w"].ctypes.data == address
    assert again_p["w"].tobytes() == expected_p.tobytes()
    assert again_m["w"].tobytes() == expected_m.tobytes()


def test_an_output_somebody_holds_is_never_handed_out() -> None:
    theta, m, g = _model(1), _model(2), _model(3)
    held = [_step(theta, m, g)[0]["w"] for _ in range(recycling.GENERATIONS)]
    snapshots = [h.copy() for h in held]
    view = held[0][:5]
    held[0] = view  # the base is held through its view
    fresh, _ = _step(theta, m, _model(9))
    addresses = {h.ctypes.data for h in held[1:]} | {view.base.ctypes.data}  # type: ignore[union-attr]
    assert fresh["w"].ctypes.data not in addresses
    np.testing.assert_array_equal(view.base, snapshots[0])  # type: ignore[arg-type]
    for h, snap in zip(held[1:], snapshots[1:], strict=True):
        np.testing.assert_array_equal(h, snap)


def test_the_pool_keeps_a_few_generations_and_small_outputs_none() -> None:
    for _ in range(recycling.GENERATIONS + 3):
        recycling.output("x", (SIZE,), np.float32)  # each dropped at once: one buffer
    assert len(recycling._kept[("x", (SIZE,), np.dtype(np.float32).str)]) == 1
    held = [recycling.output("y", (SIZE,), np.float32) for _ in range(6)]
    assert len(recycling._kept[("y", (SIZE,), np.dtype(np.float32).str)]) == 4
    assert len({h.ctypes.data for h in held}) == 6
    recycling.output("small", (3,), np.float32)
    assert not any(key[0] == "small" for key in recycling._kept)


def test_a_read_only_output_comes_back_writable() -> None:
    out = recycling.output("z", (SIZE,), np.float32)
    out.setflags(write=False)  # as a pinned global state
    address = out.ctypes.data
    del out
    again = recycling.output("z", (SIZE,), np.float32)
    assert again.ctypes.data == address and again.flags.writeable


def _global_hashes(tmp_path: Path, rounds: int) -> list[str]:
    coordinator = unbound_coordinator(Store(tmp_path), size=SIZE)
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        feed_round(coordinator, rng)
    assert [o.state.value for o in coordinator.outcomes] == ["closed"] * rounds
    return [o.global_hash for o in coordinator.outcomes]


def test_a_coordinator_steps_into_freed_buffers_and_gets_the_same_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Over six rounds the mean, θ' and m' come from kept buffers once they are free, and
    every round's global hash is the one of a run that allocates them afresh."""
    caplog.set_level(logging.ERROR)
    before = recycling.reused()
    recycled = _global_hashes(tmp_path / "recycled", 6)
    assert recycling.reused() - before >= 6
    recycling.clear()
    monkeypatch.setattr(recycling, "_UNHELD", None)  # every output fresh
    assert _global_hashes(tmp_path / "fresh", 6) == recycled


def _plant_garbage(name: str) -> None:
    """Leave a kept, unheld accumulator for ``name`` full of garbage: the next aggregator
    of that layout is handed it, unzeroed."""
    garbage = np.full(SIZE, 12345, np.int64)
    with recycling._lock:
        recycling._kept[(f"sum:{name}", (SIZE,), garbage.dtype.str)] = [garbage]


@pytest.mark.parametrize("compiled_kernels", [True, False])
@pytest.mark.parametrize("fold_batch", [1, 2, 8])
def test_a_reused_accumulator_holding_garbage_gives_the_exact_sum(
    fold_batch: int, compiled_kernels: bool
) -> None:
    """The first batch writes the accumulator (it is never zeroed), later ones add: with
    the compiled fold and with numpy's."""
    if compiled_kernels:
        pytest.importorskip("numba", reason="the compiled fold needs the 'fast' extra")
    template = {"w": np.zeros(SIZE, np.float32)}
    rng = np.random.default_rng(3)
    updates = [
        (_update(f"p{i}", {"w": rng.uniform(-1, 1, SIZE).astype(np.float32)}), 1)
        for i in range(5)
    ]
    config = AggregationConfig(fold_batch=fold_batch)
    _, clean = _aggregate(updates, config, template, seed=1)
    expected = clean.sums["w"].copy()
    del clean
    _plant_garbage("w")
    before = recycling.reused()
    with kernels(compiled_kernels):
        aggregator, result = _aggregate(updates, config, template, seed=1)
    assert recycling.reused() > before  # the planted buffer was the one folded into
    np.testing.assert_array_equal(result.sums["w"], expected)
    aggregator.verify(result)


def test_a_reused_accumulator_with_nothing_folded_reveals_zeros() -> None:
    _plant_garbage("w")
    before = recycling.reused()
    aggregator, result = _aggregate([], AggregationConfig(), {"w": np.zeros(SIZE, np.float32)})
    assert recycling.reused() > before  # the planted buffer is the one revealed
    assert not result.sums["w"].any()
    aggregator.verify(result)
