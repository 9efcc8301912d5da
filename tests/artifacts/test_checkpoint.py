"""Tests for lensemble_flwr/artifacts/checkpoint.py."""

from __future__ import annotations

import numpy as np

from lensemble_flwr.artifacts.checkpoint import (
    checkpoint_parts,
    decode_checkpoint,
    encode_checkpoint,
)


def test_a_scalar_parameter_round_trips_with_its_shape() -> None:
    # a 0-d array (torch's nn.Parameter(torch.tensor(1.0))) once came back as shape (1,),
    # and every reader refused the checkpoint ("params hash differs")
    params = {"scale": np.array(1.5, np.float32), "w": np.ones((2, 3), np.float32)}
    momentum = {"scale": np.array(0.25, np.float32), "w": np.zeros((2, 3), np.float32)}
    decoded = decode_checkpoint(encode_checkpoint(4, params, momentum))
    assert decoded.params["scale"].shape == () and decoded.momentum["scale"].shape == ()
    assert float(decoded.params["scale"]) == 1.5
    assert b"".join(checkpoint_parts(4, params, momentum, params_hash=None)) == encode_checkpoint(
        4, params, momentum
    )
