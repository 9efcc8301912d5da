"""RunDirBefore: a start that fails before its first round takes back the run it began."""

from __future__ import annotations

from pathlib import Path

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.strategies.run_dir import STORE_FOLDERS, RunDirBefore


def _write_a_run(folder: Path) -> None:
    store = Store(folder, sync=False)
    store.bind("manifest/header", store.put(b"a run's header"))


def test_a_run_directory_the_start_made_is_removed_with_the_parents_made_for_it(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "a" / "b" / "run"
    before = RunDirBefore.of(run_dir)
    _write_a_run(run_dir)
    removed = before.restore(run_dir)
    assert not (tmp_path / "a").exists() and tmp_path.is_dir()
    assert removed[-1] == tmp_path / "a"


def test_in_a_folder_that_was_there_only_the_store_folders_made_are_removed(
    tmp_path: Path,
) -> None:
    (tmp_path / ".gitkeep").write_text("")
    before = RunDirBefore.of(tmp_path)
    _write_a_run(tmp_path)
    (tmp_path / "written-meanwhile.txt").write_text("not the run's")
    (tmp_path / "link").symlink_to(tmp_path.parent)
    before.restore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".gitkeep",
        "link",
        "written-meanwhile.txt",
    ]


def test_store_folders_that_were_there_before_are_kept(tmp_path: Path) -> None:
    _write_a_run(tmp_path)
    before = RunDirBefore.of(tmp_path)
    assert before.present == frozenset(STORE_FOLDERS)
    assert before.restore(tmp_path) == []
    assert (tmp_path / "names" / "manifest" / "header").is_file()


def test_a_folder_made_by_the_start_but_written_into_meanwhile_is_kept(tmp_path: Path) -> None:
    before = RunDirBefore.of(tmp_path / "run")
    _write_a_run(tmp_path / "run")
    (tmp_path / "run" / "notes.txt").write_text("mine")
    before.restore(tmp_path / "run")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]


def test_only_the_folder_noted_is_restored(tmp_path: Path) -> None:
    other = tmp_path / "b"
    _write_a_run(other)
    assert RunDirBefore.of(tmp_path / "a").restore(other) == []
    assert (other / "names" / "manifest" / "header").is_file()


def test_the_temporary_folder_of_a_strategy_given_none_is_removed(tmp_path: Path) -> None:
    before = RunDirBefore.of(None)
    made = tmp_path / "lensemble-run-x"
    _write_a_run(made)
    assert before.restore(made)[-1] == made and not made.exists()


def test_a_dangling_link_as_run_directory_is_left_alone(tmp_path: Path) -> None:
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "nowhere")
    before = RunDirBefore.of(link)
    assert before.missing == () and before.restore(link) == []
    assert link.is_symlink()
