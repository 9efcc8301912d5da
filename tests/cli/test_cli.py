"""The ``lensemble-flwr`` console script: verify, show, report, prove and check-proof on real
run directories, and their exit codes (0 ok, 1 a check failed, 2 bad usage)."""

from __future__ import annotations

import base64
import importlib.metadata
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from run_dir_helpers import (
    blob_path,
    flip_byte,
    read_json,
    rewrite_json,
    synthetic_run,
)

from lensemble_flwr.cli import main
from lensemble_flwr.cli.output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, write_output
from lensemble_flwr.simulations.toy import ToyTrainer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_console_script_is_registered() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    (entry,) = [e for e in scripts if e.name == "lensemble-flwr"]
    assert entry.value == "lensemble_flwr.cli:main" and entry.load() is main


# -- verify ----------------------------------------------------------------------------------
def test_verify_passes_an_untouched_run(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "verify", run)
    assert code == EXIT_OK
    assert "rounds closed      3" in out and "attempts aborted   1" in out
    assert "verified: hash chain, checkpoints, manifest and endorsements agree" in out
    # the fixture's participants hold no identity keys: nothing can be endorsed, and says so
    assert "rounds 1-3 cannot be endorsed: no contributor holds an identity key" in out


def test_verify_names_the_first_broken_link(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    digest = read_json(run, "ledger/00000002")["checkpoint"]
    flip_byte(blob_path(run, digest))
    code, out, _ = cli(capsys, "verify", run)
    assert code == EXIT_FAILED
    (line,) = [x for x in out.splitlines() if x.startswith("BROKEN")]
    assert line.startswith(f"BROKEN round 2: checkpoint sha256: expected {digest}, found ")


def test_verify_json_and_all(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "names" / "ledger" / "00000002").unlink()
    rewrite_json(run, "manifest/rounds/00000003-0001", count=2, total_weight=2)
    code, out, _ = cli(capsys, "verify", run, "--json")
    doc = json.loads(out)
    assert code == EXIT_FAILED and doc["ok"] is False
    assert doc["findings"][0] == {
        "where": "round 2",
        "field": "ledger record",
        "expected": "a record for closed attempt 2",
        "found": "none",
        "round": 2,
    }
    assert [f["field"] for f in doc["findings"][1:]] == [
        "manifest.count",
        "manifest.total_weight",
        "ledger.entries_digest",
    ]
    _, out, _ = cli(capsys, "verify", run)
    assert "more finding" in out and "also:" not in out
    _, out, _ = cli(capsys, "verify", run, "--all")
    assert out.count("also:") == len(doc["findings"]) - 1 > 0


def test_verify_expect_head(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = read_json(run, "ledger/00000003")["record_hash"]
    assert cli(capsys, "verify", run, "--expect-head", head)[0] == EXIT_OK
    code, out, _ = cli(capsys, "verify", run, "--expect-head", "0" * 64)
    assert code == EXIT_FAILED and f"BROKEN ledger head: record_hash: expected {'0' * 64}" in out
    with pytest.raises(SystemExit) as usage:
        main(["verify", str(run), "--expect-head", head[:12]])
    assert usage.value.code == EXIT_USAGE


def test_a_folder_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("verify", "show", "report"):
        code, _, err = cli(capsys, command, tmp_path / "nothing")
        assert code == EXIT_USAGE and "is not a run directory" in err
    assert list(tmp_path.iterdir()) == []  # nothing created


# -- show ------------------------------------------------------------------------------------
def test_show_json_lists_every_attempt(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "show", run, "--json")
    doc = json.loads(out)
    assert code == EXIT_OK
    assert doc["run_id"] == read_json(run, "manifest/header")["run_id"]
    rows = [(a["round"], a["attempt"], a["state"], a["count"]) for a in doc["attempts"]]
    assert rows == [
        (1, 1, "closed", 4),  # Flower's numbering: the first round is round 1
        (2, 1, "aborted", 0),
        (2, 2, "closed", 4),
        (3, 1, "closed", 4),
    ]
    aborted = doc["attempts"][1]
    assert aborted["reason"].startswith("FaultToleranceExceeded") and aborted["epsilon"] == {}
    for attempt, name in [(0, "00000001"), (2, "00000002"), (3, "00000003")]:
        record = read_json(run, f"ledger/{name}")
        row = doc["attempts"][attempt]
        assert row["epsilon"] == record["epsilon"] and row["contributors"] == record["contributors"]
        assert row["epsilon_max"] == max(record["epsilon"].values())
        assert row["frame_drift"] is None  # this run has no gauge adapter
    assert doc["epsilon_spent"] == read_json(run, "ledger/00000003")["epsilon"]
    assert (doc["rounds_closed"], doc["attempts_aborted"]) == (3, 1)
    assert doc["final_global_hash"] == read_json(run, "ledger/00000003")["new_global_hash"]


def test_show_table(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "show", run)
    assert code == EXIT_OK
    assert "aborted" in out and "closed" in out and "p00, p01, p02, p03" in out
    assert "frame drift" in out and "–" in out
    assert "round 2 attempt 1 aborted: FaultToleranceExceeded: 1 updates" in out
    assert "closed rounds: 3, aborted attempts: 1;" in out
    # the epsilon figures say whom they hold against, and the mechanism is named
    assert "epsilon spent (against coordinator, model recipients, other participants): p00" in out
    assert "privacy: local-gaussian (noise multiplier" in out


def test_show_reads_the_frame_drift_diagnostic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = synthetic_run(tmp_path / "syn", [{"a": "aa" * 32}, {"a": "aa" * 32}])
    _, out, _ = cli(capsys, "show", run, "--json")
    assert [a["frame_drift"] for a in json.loads(out)["attempts"]] == [0.01, 0.02]
    _, out, _ = cli(capsys, "show", run)
    assert "0.02" in out


def test_show_refuses_a_manifest_it_cannot_read(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = blob_path(run, (run / "names/manifest/rounds/00000001-0001").read_text().strip())
    flip_byte(path, offset=3)
    code, _, err = cli(capsys, "show", run)
    assert code == EXIT_FAILED and "CheckpointIntegrityError" in err


# -- report ----------------------------------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_report_writes_a_png_and_markdown(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "report"
    code, out, _ = cli(capsys, "report", run, "--out", out_dir)
    assert code == EXIT_OK and "rounds.png" in out
    width, height = png_size(out_dir / "rounds.png")
    assert width > 500 and height > 500 and (out_dir / "rounds.png").stat().st_size > 10_000
    md = (out_dir / "report.md").read_text()
    head = read_json(run, "ledger/00000003")
    assert "![per-round curves](rounds.png)" in md
    assert "| rounds closed | 3 |" in md and "| attempts aborted | 1 |" in md
    assert f"| final global hash | `{head['new_global_hash']}` |" in md
    assert "- round 2, attempt 1: FaultToleranceExceeded" in md
    assert f"| p00 | {head['epsilon']['p00']:.4g} |" in md
    assert "| audit (`lensemble-flwr verify`) | passed (3 records, 4 checkpoints) |" in md
    assert sorted(p.name for p in out_dir.iterdir()) == ["report.md", "rounds.png"]


def test_report_defaults_to_the_run_dir_and_plots_every_diagnostic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_drift = synthetic_run(tmp_path / "drift", [{"a": "aa" * 32}] * 3)
    without = synthetic_run(tmp_path / "plain", [{"a": "aa" * 32}] * 3, frame_drift=False)
    for run in (with_drift, without):
        assert cli(capsys, "report", run)[0] == EXIT_OK
    # one more panel (frame_drift) makes a taller figure
    assert (
        png_size(with_drift / "report/rounds.png")[1] > png_size(without / "report/rounds.png")[1]
    )
    md = (with_drift / "report/report.md").read_text()
    assert "| round | attempt | C_t | mean_delta_l2 | frame_drift | epsilon max |" in md
    assert "No differentially private release was recorded." in md


def test_report_of_a_broken_run_says_so(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rewrite_json(run, "manifest/rounds/00000002-0002", aggregate_digest="ab" * 32)
    code, _, err = cli(capsys, "report", run, "--out", tmp_path / "r")
    assert code == EXIT_OK and "does not verify" in err
    md = (tmp_path / "r" / "report.md").read_text()
    assert "**FAILED**: round 2: manifest.aggregate_digest" in md


def test_atomic_writes_leave_nothing_behind_on_failure(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # os.replace cannot put a file over a folder
    with pytest.raises(OSError):
        write_output(tmp_path / "taken", b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    write_output(tmp_path / "file", b"one")
    write_output(tmp_path / "file", b"two")
    assert (tmp_path / "file").read_bytes() == b"two" and len(list(tmp_path.iterdir())) == 2


def test_an_output_file_gets_the_users_mode_and_its_folder(tmp_path: Path) -> None:
    import os
    import stat

    umask = os.umask(0o022)
    try:
        write_output(tmp_path / "new" / "folder" / "report.md", b"text")
    finally:
        os.umask(umask)
    path = tmp_path / "new" / "folder" / "report.md"
    assert path.read_bytes() == b"text" and stat.S_IMODE(path.stat().st_mode) == 0o644


# -- prove / check-proof --------------------------------------------------------------------
@pytest.fixture
def node_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A participant's module exposing its records, the way --records-from expects."""
    (tmp_path / "my_node.py").write_text(
        "from lensemble_flwr.simulations.toy import ToyTrainer\n"
        "def records():\n    return ToyTrainer(1).dataset_records()\n"
        "trainer = ToyTrainer(1)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --records-from adds the cwd
    return "my_node"


def test_prove_then_check_proof(
    run: Path,
    pristine: Path,
    tmp_path: Path,
    node_module: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proof = tmp_path / "proof.json"
    code, out, _ = cli(
        capsys, "prove", "--records-from", f"{node_module}:records", "--index", 5,
        "--participant", "p01", "--out", proof, "--state-dir", pristine.parent / "budgets",
    )  # fmt: skip
    assert code == EXIT_OK and "record 5 of 64" in out
    bundle = json.loads(proof.read_text())
    assert bundle["participant_id"] == "p01"
    assert bundle["root"] == read_json(run, "ledger/00000001")["dataset_roots"]["p01"]
    code, out, _ = cli(capsys, "check-proof", run, proof, "--participant", "p01")
    assert code == EXIT_OK and out.startswith("accepted: record 5 of 64")
    # the same bundle from an object with dataset_records(), printed to stdout
    code, out, _ = cli(
        capsys, "prove", "--records-from", f"{node_module}:trainer", "--index", 5,
        "--stable-id", "p01", "--state-dir", pristine.parent / "budgets",
    )  # fmt: skip
    assert code == EXIT_OK and json.loads(out) == bundle | {"participant_id": None}
    # the salt stays with the participant: without it, no bundle leads to the root
    code, _, err = cli(
        capsys, "prove", "--records-from", f"{node_module}:records", "--index", 5,
        "--stable-id", "p01", "--state-dir", tmp_path / "elsewhere",
    )  # fmt: skip
    assert code != EXIT_OK and "no commitment secret for 'p01'" in err
    unsalted = tmp_path / "unsalted.json"
    cli(
        capsys, "prove", "--records-from", f"{node_module}:records", "--index", 5,
        "--unsalted", "--out", unsalted,
    )  # fmt: skip
    code, _, err = cli(capsys, "check-proof", run, unsalted, "--participant", "p01")
    assert code == EXIT_FAILED and "not the dataset root" in err


def test_check_proof_refusals(
    run: Path, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = list(ToyTrainer(1).dataset_records())
    records_file = tmp_path / "records.b64"
    records_file.write_text("\n".join(base64.b64encode(r).decode() for r in records) + "\n")
    proof = tmp_path / "proof.json"
    args = ("prove", "--records-file", records_file, "--index", 0, "--out", proof)
    args = (*args, "--stable-id", "p01", "--state-dir", pristine.parent / "budgets")
    assert cli(capsys, *args)[0] == EXIT_OK

    code, _, err = cli(capsys, "check-proof", run, proof, "--participant", "p02")
    assert code == EXIT_FAILED and "CommitmentMismatch" in err and "not the dataset root" in err
    code, _, err = cli(capsys, "check-proof", run, proof, "--participant", "p99")
    assert code == EXIT_FAILED and "contributed to no round" in err

    forged = json.loads(proof.read_text()) | {"record": base64.b64encode(b"forged").decode()}
    proof.write_text(json.dumps(forged))
    code, _, err = cli(capsys, "check-proof", run, proof, "--participant", "p01")
    assert code == EXIT_FAILED and "hashes to leaf" in err
    proof.write_text("{not json")
    code, _, err = cli(capsys, "check-proof", run, proof, "--participant", "p01")
    assert code == EXIT_FAILED and "not an inclusion proof bundle" in err
    code, _, err = cli(capsys, "check-proof", run, tmp_path / "absent.json", "--participant", "p01")
    assert code == EXIT_USAGE and "absent.json" in err


def test_prove_usage_errors(
    tmp_path: Path, node_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = [
        (("--records-from", "my_node"), "expected MODULE:NAME"),
        (("--records-from", "no_such_module:records"), "cannot import"),
        (("--records-from", f"{node_module}:absent"), "has no absent"),
        (("--records-from", "json:dumps"), "dumps() missing"),
        (("--records-from", "os:sep"), "iterable of records"),
        (("--records-file", tmp_path / "absent"), "absent"),
        (("--records-from", f"{node_module}:records", "--index", "64"), "has 64 records"),
    ]
    (tmp_path / "bad.b64").write_text("!!!\n")
    bad.append((("--records-file", tmp_path / "bad.b64"), "line 1: not base64"))
    out = tmp_path / "proof.json"
    for args, message in bad:
        if "--index" not in args:
            args = (*args, "--index", "0")
        code, _, err = cli(capsys, "prove", *args, "--out", out)
        assert code == EXIT_USAGE and message in err, (args, err)
    assert not out.exists()  # a refused prove writes nothing


def test_python_dash_m_runs_the_same_cli(run: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lensemble_flwr.cli", "verify", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert "verified" in done.stdout


def test_prove_needs_the_identity_of_the_secret(
    tmp_path: Path, node_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "prove", "--records-from", f"{node_module}:records", "--index", 1)
    assert code != EXIT_OK and "--stable-id or --participant" in err
