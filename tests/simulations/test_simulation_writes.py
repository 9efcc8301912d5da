"""The files the shared-folder demo and the crash drill write go through the atomic-write
primitive: a private key is owner-only from its first byte, and a drill's report is whole
or absent, with no temp file left behind."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

import pytest

import lensemble_flwr.atomic_write as atomic_write
from lensemble_flwr.atomic_write import user_file_mode
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.simulations import crash_drill
from lensemble_flwr.simulations.shared_folder_demo import keys_of, make_keys


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _no_plain_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a plain ``Path.write_text`` / ``write_bytes`` fail the test."""

    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{self} written in place, not through the atomic primitive")

    monkeypatch.setattr(Path, "write_text", refuse)
    monkeypatch.setattr(Path, "write_bytes", refuse)


def test_a_private_key_is_never_readable_by_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "p00.key").write_bytes(b"an old key")
    (keys / "p00.key").chmod(0o644)  # a wider file already there is replaced, not reused
    seen: list[tuple[str, int]] = []
    fill = atomic_write.fill

    def watch(fd: int, data: Any, *, sync: bool) -> None:
        head = bytes(data)[:40].decode(errors="replace")
        seen.append((head, stat.S_IMODE(os.fstat(fd).st_mode)))
        fill(fd, data, sync=sync)

    monkeypatch.setattr(atomic_write, "fill", watch)
    _no_plain_writes(monkeypatch)
    make_keys(keys, ["p00", "p01"])
    monkeypatch.undo()

    private = [mode for head, mode in seen if "PRIVATE" in head]
    assert private == [0o600, 0o600]  # owner-only before the first byte was written
    assert sorted(p.name for p in keys.iterdir()) == ["p00.key", "p00.pub", "p01.key", "p01.pub"]
    for pid in ("p00", "p01"):
        assert _mode(keys / f"{pid}.key") == 0o600
        assert _mode(keys / f"{pid}.pub") == user_file_mode()
    loaded = keys_of(keys, "p00", ["p00", "p01"])
    assert isinstance(loaded["identity"], IdentityKey)
    assert loaded["identity"].public_openssh.strip() == loaded["identities"]["p00"]


def test_the_report_of_a_killed_drill_is_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "kill.json"
    report.write_text("an earlier report")
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(crash_drill.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    _no_plain_writes(monkeypatch)
    crash_drill._die(report, 2, 1, "checkpoint-write", detail="x")
    monkeypatch.undo()

    assert kills == [(os.getpid(), signal.SIGKILL)]
    assert json.loads(report.read_text()) == {
        "outcome": "killed",
        "round": 2,
        "attempt": 1,
        "point": "checkpoint-write",
        "detail": "x",
    }
    assert _mode(report) == user_file_mode()  # as a plain file would be
    assert [p.name for p in tmp_path.iterdir()] == ["kill.json"]  # no temp file left


def test_a_failed_report_write_leaves_the_old_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "r.json"
    report.write_text('{"old": true}')

    def broken(fd: int, data: Any, *, sync: bool) -> None:
        os.close(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_write, "fill", broken)
    with pytest.raises(OSError, match="No space"):
        crash_drill.write_report(report, '{"new": true}')
    assert json.loads(report.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_the_drill_writes_its_summary_through_the_primitive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "report.json"
    _no_plain_writes(monkeypatch)
    argv = ["--run-dir", str(tmp_path / "run"), "--rounds", "1"]
    assert crash_drill.main([*argv, "--report", str(report)]) == 0
    monkeypatch.undo()
    summary = json.loads(report.read_text())
    assert (summary["outcome"], summary["closed_rounds"]) == ("completed", 1)
    assert _mode(report) == user_file_mode()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.json")]
