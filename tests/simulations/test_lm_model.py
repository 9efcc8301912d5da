"""lm_model: the byte transformer is causal, seeded, 1-5M parameters at the app's sizes,
and runs where lm_device says (CUDA when there is one, the same code)."""

from __future__ import annotations

import math

import pytest
import torch

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations import lm_model
from lensemble_flwr.simulations.lm_model import (
    ByteLM,
    ModelShape,
    bits_per_byte,
    evaluate_bits_per_byte,
    lm_device,
    next_byte_loss,
)

TINY = ModelShape(d_model=16, layers=2, heads=2, seq_len=12)


def test_the_default_model_has_between_one_and_five_million_parameters() -> None:
    count = sum(p.numel() for p in ByteLM().parameters())
    assert 1_000_000 <= count <= 5_000_000
    assert count == 1_727_488  # the number docs/lm.md and the module give


def test_a_later_byte_changes_no_earlier_prediction() -> None:
    model = ByteLM(TINY, seed=1).eval()
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :7], after[:, :7])  # positions 0..6 never see byte 7
    assert not torch.allclose(before[:, 7:], after[:, 7:])  # position 7 on does


def test_the_initial_weights_are_the_seeds_and_leave_torchs_generator_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first, again, other = ByteLM(TINY, seed=4), ByteLM(TINY, seed=4), ByteLM(TINY, seed=5)
    assert torch.equal(torch.rand(3), expected_next)
    state, same, different = first.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[n], same[n]) for n in state)
    assert any(not torch.equal(state[n], different[n]) for n in state)
    norms = [n for n in state if "norm" in n and n.endswith("weight")]
    assert norms and all(torch.equal(state[n], torch.ones_like(state[n])) for n in norms)


def test_more_bytes_than_the_context_are_refused() -> None:
    with pytest.raises(ConfigError) as raised:
        ByteLM(TINY)(torch.zeros((1, 13), dtype=torch.int64))
    assert raised.value.field == "seq-len"


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"d_model": 0}, "d-model"),
        ({"layers": 0}, "layers"),
        ({"heads": 0}, "heads"),
        ({"seq_len": 0}, "seq-len"),
        ({"d_model": 10, "heads": 4}, "heads"),
    ],
)
def test_a_shape_out_of_range_is_refused(kwargs: dict[str, int], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        ModelShape(**kwargs)
    assert raised.value.field == key


def test_bits_per_byte_of_a_uniform_guess_is_eight() -> None:
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)

    class Uniform(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.zeros((*tokens.shape, 256)) + self.w

    windows = torch.randint(0, 256, (5, 9))
    assert evaluate_bits_per_byte(Uniform(), windows, batch_size=2) == pytest.approx(8.0)


def test_evaluation_weights_every_predicted_byte_alike_whatever_the_batching() -> None:
    model = ByteLM(TINY, seed=2)
    windows = torch.randint(0, 256, (7, 13), generator=torch.Generator().manual_seed(1))
    whole = evaluate_bits_per_byte(model, windows, batch_size=64)
    assert evaluate_bits_per_byte(model, windows, batch_size=3) == pytest.approx(whole, rel=1e-6)
    with torch.no_grad():
        direct = bits_per_byte(float(next_byte_loss(model, windows[:, :-1], windows[:, 1:])))
    assert whole == pytest.approx(direct, rel=1e-6)


def test_the_device_is_cuda_when_torch_sees_one_and_the_cpu_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one code path: only the device differs. (This test runs on a CPU.)"""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lm_device() == torch.device("cpu")
    assert "CUBLAS_WORKSPACE_CONFIG" not in __import__("os").environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert lm_device() == torch.device("cuda")
    # deterministic cuBLAS, as inner-deterministic asks; a value already set is kept
    assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == lm_model.CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    lm_device()
    assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
