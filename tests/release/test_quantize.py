"""int8 quantization of releases: error, bias, reproducibility, wire size, ingress."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import RoundError
from lensemble_flwr.protocol.messages import Update, from_wire, to_wire
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.release import Release, ReleaseContext
from lensemble_flwr.release.quantize import LEVELS, dequantize, int8_quantize, quantize_int8
from lensemble_flwr.strategies.records import arrays_to_record

STATE = GlobalState.create(0, {"w": np.zeros(4, np.float32)}, sketch_seed=1, h_steps=1)


def ctx(pid: str = "p", seed: int = 5) -> ReleaseContext:
    return ReleaseContext(
        participant_id=pid, global_state=STATE, round_seed=seed, dataset_root=None, num_examples=1
    )


@settings(max_examples=200, deadline=None)
@given(
    arrays(
        np.float32, st.integers(1, 300), elements=st.floats(-1e4, 1e4, width=32, allow_nan=False)
    ),
    st.integers(0, 2**32),
)
def test_every_coordinate_is_within_one_step(x: np.ndarray, seed: int) -> None:
    q, scale = quantize_int8(x, np.random.default_rng(seed))
    assert q.dtype == np.int8 and np.abs(q.astype(int)).max() <= LEVELS
    error = np.abs(q.astype(np.float64) * scale - x.astype(np.float64))
    assert (error < scale * (1 + 1e-12)).all()


def test_stochastic_rounding_is_unbiased() -> None:
    """4000 independent roundings: each coordinate's rounding error has std at most s/2,
    so the mean's standard error is at most s / (2·sqrt(4000)) ≈ s/126; tolerance 5 SE."""
    x = np.linspace(-1.0, 1.0, 257)
    rng = np.random.default_rng(0)
    total = np.zeros_like(x)
    scale = None
    for _ in range(4000):
        q, scale = quantize_int8(x, rng)
        total += q * scale
    assert scale is not None
    assert np.abs(total / 4000 - x).max() < 5 * scale / (2 * np.sqrt(4000))


def test_quantization_is_reproducible_per_round_and_participant() -> None:
    delta = {"w": np.random.default_rng(1).standard_normal(1000).astype(np.float32)}
    stage = int8_quantize()
    a, _ = stage.update(Release(delta=delta), None, ctx("p", 5))
    b, _ = stage.update(Release(delta=delta), None, ctx("p", 5))
    c, _ = stage.update(Release(delta=delta), None, ctx("q", 5))
    np.testing.assert_array_equal(a.delta["w"], b.delta["w"])
    assert not np.array_equal(a.delta["w"], c.delta["w"])
    assert a.metadata["scales"]["w"] == pytest.approx(np.abs(delta["w"]).max() / LEVELS)


def test_bytes_on_the_wire_drop_about_four_times() -> None:
    delta = {"w": np.random.default_rng(2).standard_normal(100_000).astype(np.float32)}
    quantized, _ = int8_quantize().update(Release(delta=delta), None, ctx())
    plain = arrays_to_record(delta).count_bytes()
    small = arrays_to_record(quantized.delta).count_bytes()
    assert 3.9 < plain / small <= 4.0


def quantized_update(**changes) -> dict:
    payload = to_wire(
        Update(
            run_id="r",
            round=1,
            sender="p",
            participant_id="p",
            dataset_root=None,
            delta={"w": np.array([3, -127], np.int8)},
            l2_norm=1.0,
            num_examples=1,
            scales={"w": 0.5},
        )
    )
    payload.update(changes)
    return payload


def test_a_quantized_update_validates_and_knows_its_largest_value() -> None:
    update = from_wire(quantized_update())
    assert update.max_abs == 63.5 and update.scale_of("w") == 0.5


@pytest.mark.parametrize(
    "changes",
    [
        {"scales": None},
        {"scales": {"v": 0.5}},
        {"scales": {"w": 0.0}},
        {"scales": {"w": float("inf")}},
        {"delta": {"w": np.array([0.5], np.float32)}},
    ],
    ids=[
        "int8 without scales",
        "scales for other names",
        "zero scale",
        "infinite scale",
        "float with scales",
    ],
)
def test_malformed_quantized_updates_are_rejected(changes: dict) -> None:
    with pytest.raises(RoundError):
        from_wire(quantized_update(**changes))


def test_global_params_cannot_be_int8() -> None:
    from lensemble_flwr.protocol.messages import MessageKind, RoundOpen

    with pytest.raises(RoundError):
        from_wire(
            to_wire(
                RoundOpen.model_construct(
                    run_id="r",
                    round=1,
                    sender="c",
                    attempt=1,
                    global_hash="ab" * 32,
                    params={"w": np.zeros(2, np.int8)},
                    sketch_seed=1,
                    h_steps=1,
                    probe_hash="",
                    landmark_hashes=(),
                    needs_commitment=True,
                    kind=MessageKind.ROUND_OPEN,
                )
            )
        )


def test_a_federation_of_int8_releases_closes_near_the_float_one(tmp_path: Path) -> None:
    base = small_config()
    int8 = LensembleConfig(**{**base.model_dump(), "release": {"quantize": "int8"}})
    results = {}
    for name, config in (("float", base), ("int8", int8)):
        coordinator, _, _ = federation(tmp_path, config=config, name=name)
        coordinator.run(2)
        records = verify(Store(tmp_path / name))
        assert [r.count for r in records] == [4, 4]
        results[name] = coordinator.global_state().params
    for name, value in results["float"].items():
        step = np.abs(value).max() / LEVELS
        assert np.abs(results["int8"][name] - value).max() < 2 * step + 1e-3


def test_dequantize_gives_the_released_values() -> None:
    q = {"w": np.array([1, -2, 127], np.int8)}
    np.testing.assert_array_equal(dequantize(q, {"w": 0.25})["w"], [0.25, -0.5, 31.75])


def test_a_quantized_update_crosses_a_flower_reply_unchanged() -> None:
    from lensemble_flwr.strategies.records import decode_reply, encode_reply

    payload = quantized_update()
    (back,) = decode_reply(encode_reply([payload], {"num-examples": 1}))
    update = from_wire(back)
    assert update.scales == {"w": 0.5} and update.delta["w"].dtype == np.int8
    np.testing.assert_array_equal(update.delta["w"], payload["delta"]["w"])
