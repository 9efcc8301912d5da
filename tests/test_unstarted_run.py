"""RunDirBefore: a start that fails before its first round puts its run directory back."""

from __future__ import annotations

from pathlib import Path

from lensemble_flwr.strategies.unstarted_run import RunDirBefore


def _write_a_run(folder: Path) -> None:
    (folder / "names" / "manifest").mkdir(parents=True, exist_ok=True)
    (folder / "names" / "manifest" / "header").write_text("0" * 64)
    (folder / "blobs").mkdir(exist_ok=True)


def test_a_folder_the_start_made_is_removed(tmp_path: Path) -> None:
    before = RunDirBefore.of(tmp_path / "run")
    assert before.unused and not before.existed
    _write_a_run(tmp_path / "run")
    assert before.restore(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_empty_folder_is_emptied_and_kept(tmp_path: Path) -> None:
    before = RunDirBefore.of(tmp_path)
    assert before.unused and before.existed
    _write_a_run(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path.parent)  # removed as a link, not followed
    assert before.restore(tmp_path)
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []
    assert tmp_path.parent.is_dir()


def test_a_folder_that_held_anything_is_not_touched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    before = RunDirBefore.of(tmp_path)
    assert not before.unused
    _write_a_run(tmp_path)
    assert not before.restore(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "blobs").is_dir()


def test_only_the_folder_noted_is_restored(tmp_path: Path) -> None:
    """A run directory given as ``tmp_path / "a"`` never restores another folder."""
    other = tmp_path / "b"
    _write_a_run(other)
    assert not RunDirBefore.of(tmp_path / "a").restore(other)
    assert (other / "names" / "manifest" / "header").is_file()


def test_the_temporary_folder_of_a_strategy_given_none_is_removed(tmp_path: Path) -> None:
    before = RunDirBefore.of(None)
    made = tmp_path / "lensemble-run-x"
    _write_a_run(made)
    assert before.restore(made) and not made.exists()


def test_a_folder_that_cannot_be_listed_counts_as_used(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a folder")
    assert not RunDirBefore.of(path).unused
