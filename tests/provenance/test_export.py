"""``committed_model`` and ``encode_model``: the global model a round left, checked
against the ledger, written by the app's names bit for bit; what is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config
from flwr.app import ArrayRecord
from run_dir_helpers import blob_path, flip_byte, read_json, synthetic_run
from safetensors.numpy import load
from safetensors.torch import load as safetensors_load

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import CheckpointIntegrityError, ConfigError, LedgerError
from lensemble_flwr.provenance.audit import open_run
from lensemble_flwr.provenance.export import (
    FORMAT,
    CommittedModel,
    committed_model,
    encode_model,
)
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.simulations.toy import ToyWorldModel
from lensemble_flwr.strategies import LensembleStrategy
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    NODES,
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    clientapp_node,
)


def checkpoint_of(run: Path, round: int) -> dict[str, np.ndarray]:
    digest = read_json(run, f"ledger/{round:08d}")["checkpoint"]
    return decode_checkpoint(blob_path(run, digest).read_bytes()).params


def same_bits(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> bool:
    return list(left) == list(right) and all(
        left[n].dtype == right[n].dtype
        and left[n].shape == right[n].shape
        and left[n].tobytes() == right[n].tobytes()
        for n in left
    )


def test_the_newest_model_is_the_last_records_checkpoint_bit_for_bit(run: Path) -> None:
    model = committed_model(open_run(run))
    head = read_json(run, "ledger/00000003")
    assert model.round == 3 and not model.external_step
    assert model.params_hash == head["new_global_hash"] == digest_arrays(model.params, "params")
    assert model.checkpoint == head["checkpoint"] and model.record_hash == head["record_hash"]
    assert same_bits(model.params, checkpoint_of(run, 3))
    first = committed_model(open_run(run), 1)
    assert first.round == 1 and same_bits(first.params, checkpoint_of(run, 1))
    assert not same_bits(first.params, model.params)
    back = load(encode_model(model))
    assert same_bits(dict(sorted(back.items())), checkpoint_of(run, 3))


def test_the_file_records_where_the_model_comes_from(run: Path) -> None:
    from safetensors import safe_open

    model = committed_model(open_run(run))
    path = run.parent / "model.safetensors"
    path.write_bytes(encode_model(model))
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {
            "format": FORMAT,
            "run_id": model.run_id,
            "round": "3",
            "params_hash": model.params_hash,
            "checkpoint": model.checkpoint,
            "record_hash": model.record_hash,
            "model": "round",
        }


ODD = {  # names as apps give them: a state_dict's dots, a path, spaces, non-ASCII; dtypes
    "encoder.0.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
    "encoder.0.bias": np.array([np.pi, -0.0], np.float64),
    "bn.running_var": np.array([1e-40, np.inf], np.float32),  # a subnormal, an infinity
    "head/out layer": np.array(1.5, np.float16),  # 0-d
    "übersetzer.β": np.zeros((0, 4), np.float32),  # empty
}


def test_names_dtypes_and_bits_round_trip() -> None:
    params = {n: ODD[n] for n in sorted(ODD)}
    model = CommittedModel(
        run_id="odd",
        round=1,
        params=params,
        params_hash=digest_arrays(params, "params"),
        checkpoint="00" * 32,
        record_hash="11" * 32,
        external_step=False,
    )
    data = encode_model(model)
    back = load(data)
    assert same_bits(dict(sorted(back.items())), params)
    assert digest_arrays(back, "params") == model.params_hash
    assert {encode_model(model) for _ in range(8)} == {data}  # one model, one file's bytes


def test_an_unknown_format_is_refused() -> None:
    model = CommittedModel("r", 1, {"w": np.zeros(1, np.float32)}, "", "", "", False)
    with pytest.raises(ConfigError, match="format"):
        encode_model(model, "torch")  # type: ignore[arg-type]  # a pickle: refused


def test_flowers_arrayrecord_names_come_back_as_the_apps_state_dict(tmp_path: Path) -> None:
    """A Flower run started from ``ArrayRecord(model.state_dict())``: the export holds
    the names and bits of the arrays ``start`` returned, and loads into the same torch
    model by name (only the local action head, which never leaves a node, is missing)."""
    from flwr.app import Context, RecordDict

    config = small_config(min_participants=3)
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    grid = FakeGrid(
        FakeClock(), {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)}
    )
    state = ToyWorldModel(seed=0).state_dict()
    shared = {n: t for n, t in state.items() if not n.startswith("action_head")}
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(shared), num_rounds=2)
    model = committed_model(Store(tmp_path / "run"), None)
    returned = {n: result.arrays[n].numpy() for n in result.arrays}
    assert list(returned) == list(shared)  # Flower keeps the state_dict's order
    assert same_bits(model.params, {n: returned[n] for n in sorted(returned)})
    back = safetensors_load(encode_model(model))
    net = ToyWorldModel(seed=5)
    missing, unexpected = net.load_state_dict(back, strict=False)
    assert unexpected == [] and missing and all(n.startswith("action_head") for n in missing)
    for name, tensor in net.state_dict().items():
        if name in returned:
            assert tensor.numpy().tobytes() == returned[name].tobytes()


def test_the_model_an_external_step_adopted_is_exported_not_the_rounds_own(
    tmp_path: Path,
) -> None:
    """Under central DP (Flower's wrappers) the round's own checkpoint is the un-noised
    sum; the run released the adopted model, and that is what is exported (pending, for
    the newest round; from the next record, for an older one)."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    network.flush()
    adopted = {n: (a + 1.0).astype(a.dtype) for n, a in coordinator.global_state().params.items()}
    coordinator.adopt(adopted)
    newest = committed_model(coordinator.store)
    assert newest.round == 2 and newest.external_step
    assert same_bits(newest.params, {n: adopted[n] for n in sorted(adopted)})
    assert committed_model(coordinator.store).metadata()["model"] == "external-step"
    coordinator.run(1)
    network.flush()
    again = committed_model(coordinator.store, 2)
    assert again.external_step and same_bits(again.params, newest.params)


def test_a_run_without_records_and_rounds_not_committed_are_refused(
    run: Path, tmp_path: Path
) -> None:
    empty = synthetic_run(tmp_path / "empty", [])
    with pytest.raises(LedgerError, match="no closed round"):
        committed_model(open_run(empty))
    for round in (0, -1):
        with pytest.raises(ConfigError, match="round"):
            committed_model(open_run(run), round)
    with pytest.raises(LedgerError, match=r"round 4 was not committed \(.* rounds 1-3\)"):
        committed_model(open_run(run), 4)


def test_a_checkpoint_that_does_not_verify_is_refused(run: Path) -> None:
    digest = read_json(run, "ledger/00000003")["checkpoint"]
    flip_byte(blob_path(run, digest))
    with pytest.raises(LedgerError, match=r"round 3: checkpoint: blob .* hashes to"):
        committed_model(open_run(run))


def test_a_pruned_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    base = small_config()
    config = LensembleConfig(
        federation=base.federation.model_dump(),
        inner=base.inner.model_dump(),
        retention={"keep_last_checkpoints": 1},
    )
    coordinator, network, _ = federation(tmp_path, config=config)
    coordinator.run(3)
    network.flush()
    assert committed_model(coordinator.store).round == 3
    with pytest.raises(LedgerError, match=r"round 2's checkpoint .* was pruned"):
        committed_model(coordinator.store, 2)


def test_what_is_read_is_checked_again_whatever_verify_said(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export re-checks the blob it reads itself: with ``verify`` out of the way, a
    store that hands back another round's well-formed checkpoint is refused, and so is a
    blob whose bytes no longer hash to their address."""
    import lensemble_flwr.provenance.export as export

    monkeypatch.setattr(export, "verify", lambda store: Ledger(store).records())
    store = open_run(run)
    first = read_json(run, "ledger/00000001")["checkpoint"]
    real_get = Store.get
    newest = read_json(run, "ledger/00000003")["checkpoint"]
    monkeypatch.setattr(
        Store, "get", lambda self, digest: real_get(self, first if digest == newest else digest)
    )
    with pytest.raises(LedgerError, match=r"not the model .* the ledger names"):
        committed_model(store)
    monkeypatch.setattr(Store, "get", real_get)
    flip_byte(blob_path(run, newest))
    with pytest.raises(CheckpointIntegrityError):
        committed_model(store)
