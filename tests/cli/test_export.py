"""``lensemble-flwr export RUN_DIR OUT``: the committed model as safetensors or a torch
state_dict, bit for bit the checkpoint the ledger names; each bad input refused with
nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_dir_helpers import blob_path, flip_byte, read_json, synthetic_run
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch_file

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.cli import main
from lensemble_flwr.cli.output import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def checkpoint_params(run: Path, round: int) -> dict:
    digest = read_json(run, f"ledger/{round:08d}")["checkpoint"]
    return decode_checkpoint(blob_path(run, digest).read_bytes()).params


def test_export_writes_the_newest_model_bit_for_bit(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.safetensors"
    code, stdout, _ = cli(capsys, "export", run, out)
    head = read_json(run, "ledger/00000003")
    assert code == EXIT_OK
    assert "round 3's global model" in stdout and head["new_global_hash"] in stdout
    exported, expected = load_file(str(out)), checkpoint_params(run, 3)
    assert sorted(exported) == sorted(expected)
    for name, array in expected.items():
        assert exported[name].dtype == array.dtype and exported[name].shape == array.shape
        assert exported[name].tobytes() == array.tobytes()
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temp file


def test_export_of_a_round_loads_as_a_torch_state_dict(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "round1.safetensors"
    assert cli(capsys, "export", run, out, "--round", 1)[0] == EXIT_OK
    state = load_torch_file(out)  # safetensors: never a pickle
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    expected = checkpoint_params(run, 1)
    assert sorted(state) == sorted(expected)
    assert all(state[n].numpy().tobytes() == a.tobytes() for n, a in expected.items())


def test_an_existing_out_is_refused_unless_forced(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.safetensors"
    out.write_bytes(b"mine")
    code, _, err = cli(capsys, "export", run, out)
    assert code == EXIT_USAGE and "exists (--force replaces it)" in err
    assert out.read_bytes() == b"mine"
    assert cli(capsys, "export", run, out, "--force")[0] == EXIT_OK
    assert sorted(load_file(str(out))) == sorted(checkpoint_params(run, 3))
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]


def test_bad_input_is_refused_and_nothing_is_written(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "model.safetensors"
    empty = synthetic_run(tmp_path / "empty", [])
    refusals = [
        ((empty, out), EXIT_FAILED, "LedgerError: the run has no closed round"),
        ((run, out, "--round", 4), EXIT_FAILED, "round 4 was not committed"),
        ((run, out, "--round", 0), EXIT_USAGE, "--round: rounds are numbered from 1"),
        ((run, folder), EXIT_USAGE, "is a directory"),
        ((run, folder, "--force"), EXIT_USAGE, "is a directory"),
        ((run, tmp_path / "nowhere" / "m.safetensors"), EXIT_USAGE, "is not a directory"),
        ((tmp_path, out), EXIT_USAGE, "is not a run directory"),
    ]
    for argv, expected_code, message in refusals:
        code, _, err = cli(capsys, "export", *argv)
        assert (code, message in err) == (expected_code, True), (argv, err)
        assert list(folder.iterdir()) == []
    flip_byte(blob_path(run, read_json(run, "ledger/00000003")["checkpoint"]))
    code, _, err = cli(capsys, "export", run, out)
    assert code == EXIT_FAILED and "round 3: checkpoint" in err
    assert list(folder.iterdir()) == [] and not (tmp_path / "nowhere").exists()
