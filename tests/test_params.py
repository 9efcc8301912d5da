"""Tests of moving a model's shared parameter groups in and out of torch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from lensemble_flwr.config import ParamGroupsConfig
from lensemble_flwr.errors import ParameterMismatch
from lensemble_flwr.params import (
    NamedArrays,
    check_same_layout,
    export_shared,
    frozen,
    in_group,
    load_shared,
    shared_names,
    subtract,
)

GROUPS = ParamGroupsConfig(shared=("encoder", "predictor"), local=("action_head",))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.predictor = nn.Linear(3, 2)
        self.encoder = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        self.action_head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.action_head(self.predictor(self.encoder(x)))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _state_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_state_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
        # bitwise, not just ==: compare the raw bytes too (catches -0.0 vs 0.0)
        assert a[name].numpy().tobytes() == b[name].numpy().tobytes(), name


def _train_one_step(model: nn.Module) -> None:
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(8, 4)).pow(2).sum()
    loss.backward()
    opt.step()


EXPECTED_SHARED = [
    "encoder.0.bias",
    "encoder.0.weight",
    "encoder.1.bias",
    "encoder.1.running_mean",
    "encoder.1.running_var",
    "encoder.1.weight",
    "predictor.bias",
    "predictor.weight",
]


def test_export_is_sorted_float_only_and_shared_only() -> None:
    model = _net()
    exported = export_shared(model, GROUPS)
    assert list(exported) == EXPECTED_SHARED == sorted(exported)
    assert shared_names(model, GROUPS) == EXPECTED_SHARED
    assert "encoder.1.num_batches_tracked" in model.state_dict()
    assert "encoder.1.num_batches_tracked" not in exported
    assert not any(name.startswith("action_head") for name in exported)
    for name, array in exported.items():
        assert isinstance(array, np.ndarray)
        assert array.dtype == np.float32, name
        np.testing.assert_array_equal(array, model.state_dict()[name].numpy())


def test_star_shares_everything_not_local() -> None:
    model = _net()
    everything = ParamGroupsConfig(shared=("*",), local=("action_head",))
    exported = export_shared(model, everything)
    float_names = sorted(n for n, t in model.state_dict().items() if torch.is_floating_point(t))
    assert list(exported) == [n for n in float_names if not n.startswith("action_head")]
    assert "encoder.1.num_batches_tracked" not in exported


def test_group_prefix_matches_whole_components_only() -> None:
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(1, 1)
            self.encoder = nn.Linear(1, 1)

    exported = export_shared(Named(), ParamGroupsConfig(shared=("enc",), local=()))
    assert list(exported) == ["enc.bias", "enc.weight"]


def test_in_group_is_the_group_itself_or_a_dotted_child() -> None:
    assert in_group("enc", "enc") and in_group("enc.weight", "enc")
    assert in_group("enc.0.weight", "enc.0") and not in_group("enc.10.weight", "enc.1")
    assert not in_group("encoder.weight", "enc") and not in_group("enc", "enc.weight")


def test_export_is_a_snapshot() -> None:
    model = _net()
    exported = export_shared(model, GROUPS)
    before = {k: v.copy() for k, v in exported.items()}
    _train_one_step(model)
    with torch.no_grad():
        model.encoder[0].weight.add_(1.0)
    moved = model.encoder[0].weight.detach().numpy()
    assert not np.array_equal(moved, exported["encoder.0.weight"])
    for name in before:
        np.testing.assert_array_equal(exported[name], before[name])
    # and the exported arrays do not alias the model's memory
    exported["predictor.bias"][...] = 42.0
    assert not torch.any(model.predictor.bias == 42.0)


def test_load_shared_round_trips() -> None:
    source, target = _net(1), _net(2)
    arrays = export_shared(source, GROUPS)
    local_before = _state_copy(target.action_head)
    counter_before = target.encoder[1].num_batches_tracked.clone()
    load_shared(target, arrays, GROUPS)
    after = export_shared(target, GROUPS)
    assert list(after) == list(arrays)
    for name in arrays:
        assert after[name].tobytes() == arrays[name].tobytes(), name
    _assert_state_bitwise_equal(_state_copy(target.action_head), local_before)
    assert torch.equal(target.encoder[1].num_batches_tracked, counter_before)
    # the model does not alias the loaded arrays
    arrays["predictor.bias"][...] = 7.0
    assert not torch.any(target.predictor.bias == 7.0)


def test_load_never_touches_num_batches_tracked() -> None:
    model = _net()
    _train_one_step(model)  # BatchNorm in train mode bumps the counter
    counter = model.encoder[1].num_batches_tracked.clone()
    assert int(counter) == 1
    arrays = {k: v + 1.0 for k, v in export_shared(model, GROUPS).items()}
    load_shared(model, arrays, GROUPS)
    assert torch.equal(model.encoder[1].num_batches_tracked, counter)
    np.testing.assert_array_equal(
        model.encoder[1].running_var.numpy(), arrays["encoder.1.running_var"]
    )


def _changed(model: nn.Module) -> NamedArrays:
    """Every shared array of ``model`` changed, so a partial load would be visible."""
    return {k: v + 0.5 for k, v in export_shared(model, GROUPS).items()}


def _unknown_name(a: NamedArrays) -> None:
    a["encoder.9.weight"] = np.zeros((2, 2), np.float32)


def _wrong_shape(a: NamedArrays) -> None:
    a["predictor.weight"] = np.zeros((3, 2), np.float32)  # model has (2, 3)


def _missing_name(a: NamedArrays) -> None:
    del a["predictor.bias"]


def _local_name(a: NamedArrays) -> None:
    a["action_head.weight"] = np.zeros((1, 2), np.float32)


def _integer_buffer(a: NamedArrays) -> None:
    a["encoder.1.num_batches_tracked"] = np.array(5, np.int64)


def _integer_array(a: NamedArrays) -> None:
    a["predictor.bias"] = np.array([1, 2], np.int64)


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (_unknown_name, r"no tensor named \['encoder\.9\.weight'\]"),
        (_wrong_shape, r"predictor\.weight: model shape \(2, 3\), got \(3, 2\)"),
        (_missing_name, r"missing shared tensors \['predictor\.bias'\]"),
        (_local_name, r"not shared.*\['action_head\.weight'\]"),
        (_integer_buffer, r"not shared.*\['encoder\.1\.num_batches_tracked'\]"),
        (_integer_array, r"predictor\.bias: expected a floating-point array, got int64"),
    ],
    ids=["unknown", "wrong-shape", "missing", "local", "int-buffer", "int-array"],
)
def test_load_refuses_and_writes_nothing(
    corrupt: Callable[[NamedArrays], None], match: str
) -> None:
    model = _net()
    _train_one_step(model)
    arrays = _changed(model)
    corrupt(arrays)
    before = _state_copy(model)
    with pytest.raises(ParameterMismatch, match=match):
        load_shared(model, arrays, GROUPS)
    _assert_state_bitwise_equal(_state_copy(model), before)


def test_wrong_shape_message_contains_both_shapes() -> None:
    model = _net()
    arrays = _changed(model)
    arrays["encoder.0.weight"] = np.zeros((4, 3), np.float32)
    with pytest.raises(ParameterMismatch) as info:
        load_shared(model, arrays, GROUPS)
    assert "(3, 4)" in str(info.value) and "(4, 3)" in str(info.value)


def test_check_same_layout_guards() -> None:
    a = {"x": np.zeros(3, np.float32), "y": np.zeros((2, 2), np.float32)}
    check_same_layout(a, {"y": np.ones((2, 2)), "x": np.ones(3)}, "ok")  # order-insensitive
    with pytest.raises(ParameterMismatch, match=r"what: missing \['y'\], unexpected \['z'\]"):
        check_same_layout(a, {"x": a["x"], "z": a["y"]}, "what")
    with pytest.raises(ParameterMismatch, match=r"what: missing \['y'\], unexpected \[\]"):
        check_same_layout(a, {"x": a["x"]}, "what")
    with pytest.raises(ParameterMismatch, match=r"what: y expected shape \(2, 2\), got \(4,\)"):
        check_same_layout(a, {"x": a["x"], "y": np.zeros(4, np.float32)}, "what")


def test_subtract_is_float32_sorted_and_guarded() -> None:
    left = {"b": np.array([3.0, 4.0]), "a": np.array([[1.5]], np.float32)}
    right = {"a": np.array([[0.25]], np.float32), "b": np.array([1.0, 1.0], np.float32)}
    out = subtract(left, right)
    assert list(out) == ["a", "b"]
    assert all(v.dtype == np.float32 for v in out.values())
    np.testing.assert_array_equal(out["a"], [[1.25]])
    np.testing.assert_array_equal(out["b"], [2.0, 3.0])
    with pytest.raises(ParameterMismatch, match="subtract: missing"):
        subtract(left, {"a": right["a"]})
    with pytest.raises(ParameterMismatch, match=r"subtract: a expected shape \(1, 1\)"):
        subtract(left, {"a": np.zeros(1, np.float32), "b": right["b"]})


def test_frozen_copies_sorted_read_only() -> None:
    source = {"b": np.arange(3.0), "a": np.ones(2)}
    snap = frozen(source)
    assert list(snap) == ["a", "b"]
    source["b"][0] = 99.0
    assert snap["b"][0] == 0.0
    with pytest.raises(ValueError, match="read-only"):
        snap["a"][0] = 5.0
