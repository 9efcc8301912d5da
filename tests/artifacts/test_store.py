"""Tests of the content-addressed artifact store."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lensemble_flwr.artifacts.store as store_module
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import CheckpointIntegrityError, StoreError

# Folder that must be on sys.path for ``import lensemble_flwr`` in a child process.
_IMPORT_ROOT = str(Path(store_module.__file__).resolve().parents[2])


def _blob_files(store: Store) -> list[Path]:
    return [p for p in (store.root / "blobs").rglob("*") if p.is_file()]


def test_put_get_round_trip_and_sha256_address(tmp_path: Path) -> None:
    store = Store(tmp_path)
    digest = store.put(b"weights")
    assert digest == hashlib.sha256(b"weights").hexdigest()
    assert store.get(digest) == b"weights"
    assert store.has(digest)
    blob = tmp_path / "blobs" / digest[:2] / digest
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest  # sha256sum-checkable


def test_put_is_idempotent_and_does_not_rewrite(tmp_path: Path) -> None:
    store = Store(tmp_path)
    first = store.put(b"same")
    inode = (tmp_path / "blobs" / first[:2] / first).stat().st_ino
    second = store.put(b"same")
    assert first == second
    assert len(_blob_files(store)) == 1
    assert (tmp_path / "blobs" / first[:2] / first).stat().st_ino == inode
    assert list((tmp_path / "tmp").iterdir()) == []


def test_get_of_tampered_blob_raises_integrity_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    digest = store.put(b"original")
    (tmp_path / "blobs" / digest[:2] / digest).write_bytes(b"tampered")
    with pytest.raises(CheckpointIntegrityError, match=digest):
        store.get(digest)


def test_get_of_unknown_or_malformed_digest_raises_store_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(StoreError):
        store.get(hashlib.sha256(b"never stored").hexdigest())
    for bad in ["", "abc", "A" * 64, "g" * 64, "0" * 63, "0" * 65, "../" + "0" * 61]:
        with pytest.raises(StoreError):
            store.get(bad)


def test_bind_resolve_and_replace(tmp_path: Path) -> None:
    store = Store(tmp_path)
    a, b = store.put(b"a"), store.put(b"b")
    store.bind("checkpoints/latest", a)
    assert store.resolve("checkpoints/latest") == a
    store.bind("checkpoints/latest", b)
    assert store.resolve("checkpoints/latest") == b
    assert list((tmp_path / "tmp").iterdir()) == []


def test_resolve_unbound_and_bind_missing_digest_raise(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(StoreError):
        store.resolve("round/1/averaging")
    with pytest.raises(StoreError):
        store.bind("round/1/averaging", hashlib.sha256(b"absent").hexdigest())
    with pytest.raises(StoreError):
        store.resolve("round/1/averaging")


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "", "a/./b", "sp ace", "a/", "a/.."])
def test_bad_names_raise(tmp_path: Path, name: str) -> None:
    store = Store(tmp_path)
    digest = store.put(b"x")
    with pytest.raises(StoreError):
        store.bind(name, digest)
    with pytest.raises(StoreError):
        store.claim(name, digest)
    with pytest.raises(StoreError):
        store.resolve(name)
    assert not (tmp_path / "x").exists()
    assert store.bound() == []


def test_name_that_clashes_with_a_prefix_raises(tmp_path: Path) -> None:
    store = Store(tmp_path)
    digest = store.put(b"x")
    store.bind("a/b", digest)
    with pytest.raises(StoreError):
        store.bind("a", digest)
    with pytest.raises(StoreError):
        store.claim("a/b/c", digest)
    with pytest.raises(StoreError):
        store.resolve("a")


def test_claim_takes_a_free_name_once(tmp_path: Path) -> None:
    store = Store(tmp_path)
    first, second = store.put(b"first"), store.put(b"second")
    assert store.claim("round/3/averaging", first) is True
    assert store.resolve("round/3/averaging") == first
    assert store.claim("round/3/averaging", second) is False
    assert store.claim("round/3/averaging", first) is False
    assert store.resolve("round/3/averaging") == first
    assert list((tmp_path / "tmp").iterdir()) == []


def test_claim_refuses_what_bind_would_replace(tmp_path: Path) -> None:
    store = Store(tmp_path)
    old, new = store.put(b"old"), store.put(b"new")
    store.bind("checkpoints/latest", old)
    assert store.claim("checkpoints/latest", new) is False
    assert store.resolve("checkpoints/latest") == old
    with pytest.raises(StoreError):
        store.claim("checkpoints/other", hashlib.sha256(b"absent").hexdigest())


def test_failed_write_leaves_no_temp_file_and_no_binding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path)
    digest = store.put(b"x")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(store_module.os, "replace", broken_replace)
    with pytest.raises(StoreError, match=r"names/n: cannot write: disk gone"):  # typed
        store.bind("n", digest)
    assert list((tmp_path / "tmp").iterdir()) == []
    monkeypatch.undo()
    with pytest.raises(StoreError):
        store.resolve("n")


def test_bound_lists_sorted_names_under_prefix(tmp_path: Path) -> None:
    store = Store(tmp_path)
    digest = store.put(b"x")
    for name in ["round/3/b", "round/30/a", "round/3/a", "checkpoints/latest", "round/1/a"]:
        store.bind(name, digest)
    assert store.bound() == [
        "checkpoints/latest",
        "round/1/a",
        "round/3/a",
        "round/3/b",
        "round/30/a",
    ]
    assert store.bound("round/3") == ["round/3/a", "round/3/b"]
    assert store.bound("round") == ["round/1/a", "round/3/a", "round/3/b", "round/30/a"]
    assert store.bound("nothing") == []


_RACER = """
import json, os, sys, time
from lensemble_flwr.artifacts.store import Store

root, start, i = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = Store(root)
digest = store.put(f"racer-{i}".encode())
print("ready", flush=True)
deadline = time.monotonic() + 30
while not os.path.exists(start):
    if time.monotonic() > deadline:
        sys.exit("start signal never came")
    time.sleep(0.0005)
print(json.dumps({"i": i, "digest": digest, "won": store.claim("race/winner", digest)}))
"""


def test_eight_processes_race_to_claim_one_name(tmp_path: Path) -> None:
    root, start = tmp_path / "store", tmp_path / "start"
    Store(root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_IMPORT_ROOT, *sys.path])}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(root), str(start), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(8)
    ]
    try:
        for racer in racers:  # everyone has put its blob and is spinning on the start file
            assert racer.stdout is not None
            assert racer.stdout.readline() == "ready\n", racer.communicate(timeout=30)[1]
        start.touch()
        results = []
        for racer in racers:
            out, err = racer.communicate(timeout=30)
            assert racer.returncode == 0, err
            results.append(json.loads(out))
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.wait()

    assert sorted(r["i"] for r in results) == list(range(8))
    winners = [r for r in results if r["won"]]
    # A resolve-then-bind claim tells several racers they won; an atomic one tells one.
    assert len(winners) == 1, winners
    assert Store(root).resolve("race/winner") == winners[0]["digest"]
    assert winners[0]["digest"] == hashlib.sha256(f"racer-{winners[0]['i']}".encode()).hexdigest()
    assert list((root / "tmp").iterdir()) == []


# -- the store stays inside its directory, and says what went wrong (issue 12, part 6) --
@pytest.mark.parametrize("where", ["blobs", "names", "tmp", "names/coordinator"])
def test_a_planted_symlink_inside_the_run_directory_is_refused(tmp_path: Path, where: str) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    digest = Store(run).put(b"x")
    target = run / where
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreError, match="symbolic link inside the run directory"):
        store = Store(run)  # the three folders are checked as the store opens
        store.bind("coordinator/x", digest)
        store.put(b"another blob")
    assert list(outside.iterdir()) == []  # nothing was written outside


@pytest.mark.parametrize("root", ["run", "./run", "run/../run"])
def test_a_planted_symlink_is_refused_however_the_root_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: str
) -> None:
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    store = Store(root)
    digest = store.put(b"x")
    (tmp_path / "run" / "names" / "round").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreError, match="run/names/round: a symbolic link inside"):
        store.bind("round/1/entry", digest)
    assert list(outside.iterdir()) == []


def test_a_symlinked_name_is_not_followed_when_read(tmp_path: Path) -> None:
    store = Store(tmp_path / "run")
    secret = tmp_path / "secret"
    secret.write_text("a" * 64 + "\n")
    (tmp_path / "run" / "names" / "stolen").symlink_to(secret)
    with pytest.raises(StoreError, match="symbolic link"):
        store.resolve("stolen")
    with pytest.raises(StoreError, match="symbolic link"):
        store.bound()


def test_a_run_dir_that_is_a_file_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a folder")
    with pytest.raises(StoreError, match=r"run/blobs: cannot open the store"):
        Store(tmp_path / "run")


def test_a_full_disk_is_a_store_error_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path)

    def no_space(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module.os, "fsync", no_space)
    with pytest.raises(StoreError, match="cannot write: No space left on device"):
        store.put(b"y" * 100)
    monkeypatch.undo()
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing half-written
    assert not store.has(hashlib.sha256(b"y" * 100).hexdigest())


@pytest.mark.parametrize("sync", [True, False])
def test_sync_false_publishes_as_atomically_without_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    fsyncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    store = Store(tmp_path / "run", sync=sync)
    digest = store.put(b"a checkpoint")  # a new blob prefix folder, the blob
    store.bind("round/1/ledger", digest)  # new name folders, the name
    assert store.claim("round/1/claimed", digest) is True
    assert (len(fsyncs) > 0) is sync
    assert store.get(digest) == b"a checkpoint"
    assert store.resolve("round/1/ledger") == digest
    assert list((tmp_path / "run" / "tmp").iterdir()) == []  # no temp file left either way

    # and a write cut short before it is published leaves nothing, as with fsync
    def cut(kind: str, key: str, data: bytes) -> None:
        raise OSError("killed")

    store.on_write = cut
    with pytest.raises(OSError, match="killed"):
        store.put(b"never published")
    assert not store.has(hashlib.sha256(b"never published").hexdigest())


# -- writes prepared ahead (the files a coordinator makes while it waits for replies) ----
def _made_temp_files(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every temp file the store makes from now on (prepared or not), by path."""
    made: list[str] = []
    real = store_module.tempfile.mkstemp

    def counting(*args: object, **kwargs: object) -> tuple[int, str]:
        fd, path = real(*args, **kwargs)  # type: ignore[call-overload]
        made.append(path)
        return fd, path

    monkeypatch.setattr(store_module.tempfile, "mkstemp", counting)
    return made


def test_prepared_temp_files_are_what_later_writes_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "s")
    made = _made_temp_files(monkeypatch)
    store.prepare_writes(3)
    assert len(made) == 3 and sorted(os.listdir(tmp_path / "s" / "tmp")) == sorted(
        Path(p).name for p in made
    )
    assert all(Path(p).stat().st_size == 0 for p in made)
    store.prepare_writes(3)  # three are ready: none more is made
    assert len(made) == 3
    digest = store.put(b"first")
    assert store.claim("a/b", digest)  # a name is a write too
    store.put_parts([b"par", memoryview(b"ts")])
    assert len(made) == 3, "a write made its own temp file though prepared ones were left"
    assert store.get(digest) == b"first" and store.get(store.put(b"parts")) == b"parts"
    assert store.resolve("a/b") == digest
    assert len(made) == 3  # b"parts" was stored already: nothing was written
    store.put(b"fourth")  # none left: the write makes its own
    assert len(made) == 4
    assert os.listdir(tmp_path / "s" / "tmp") == []  # every taken temp file was published


def test_prepare_writes_makes_blob_folders_a_few_at_a_time(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    blobs = tmp_path / "s" / "blobs"
    digest = store.put(b"x")  # its folder is made by the write
    store.prepare_writes(5)
    assert len(os.listdir(blobs)) == 1 + 5
    for _ in range(60):
        store.prepare_writes(5)
    assert sorted(os.listdir(blobs)) == [f"{i:02x}" for i in range(256)]
    assert [p.name for p in blobs.rglob("*") if p.is_file()] == [digest]  # folders only
    assert store.bound() == []
    assert store.get(digest) == b"x"


def test_close_removes_the_prepared_files_and_the_store_stays_usable(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    store.prepare_writes(4)
    store.put(b"one")  # takes one
    store.close()
    assert os.listdir(tmp_path / "s" / "tmp") == []
    assert store.get(store.put(b"two")) == b"two"
    assert os.listdir(tmp_path / "s" / "tmp") == []


def test_a_store_dropped_without_close_removes_its_prepared_files(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    store.prepare_writes(4)
    del store
    assert os.listdir(tmp_path / "s" / "tmp") == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_neither_writes_into_nor_removes_its_parents_prepared_files(
    tmp_path: Path,
) -> None:
    """The spares' descriptors share their file offsets with the parent's after a fork:
    a child writing into them would mix both processes' bytes into one blob."""
    store = Store(tmp_path / "s")
    store.prepare_writes(2)
    spares = list(store._spares)
    pid = os.fork()
    if pid == 0:  # a child that closes the store at once
        store.close()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store._spares == spares and all(Path(p).exists() for _, p in spares)
    pid = os.fork()
    if pid == 0:  # the child: write, close, leave without running the parent's cleanup
        code = 0
        try:
            digest = store.put(b"child-bytes")
            store.prepare_writes(1)
            store.close()
            code = 0 if store.get(digest) == b"child-bytes" else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store._spares == spares and all(Path(p).exists() for _, p in spares)
    digest = store.put(b"parent-bytes")
    assert store.get(digest) == b"parent-bytes"
    assert store.get(hashlib.sha256(b"child-bytes").hexdigest()) == b"child-bytes"
    store.close()
    assert os.listdir(tmp_path / "s" / "tmp") == []


def test_a_prepared_file_replaced_in_tmp_is_not_written_into(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    store.prepare_writes(3)
    (_, gone), (_, replaced), (_, shared) = store._spares
    os.unlink(gone)  # someone cleaned tmp/
    outside, elsewhere = tmp_path / "outside", tmp_path / "elsewhere"
    outside.write_bytes(b"")
    os.unlink(replaced)
    os.link(outside, replaced)  # put another file under the name
    os.link(shared, elsewhere)  # and gave ours a second name
    digests = [store.put(b"payload"), store.put(b"other payload"), store.put(b"third")]
    assert [store.get(d) for d in digests] == [b"payload", b"other payload", b"third"]
    assert outside.read_bytes() == b"" and elsewhere.read_bytes() == b""
    # the replaced name is not the store's to remove; the linked one is gone from tmp/
    assert sorted(os.listdir(tmp_path / "s" / "tmp")) == [Path(replaced).name]


@pytest.mark.parametrize("count", [-1, True, 2.0, "3"])
def test_prepare_writes_refuses_a_bad_count(tmp_path: Path, count: object) -> None:
    store = Store(tmp_path / "s")
    with pytest.raises(StoreError, match="count must be an int >= 0"):
        store.prepare_writes(count)  # type: ignore[arg-type]
    assert os.listdir(tmp_path / "s" / "tmp") == [] and os.listdir(tmp_path / "s" / "blobs") == []


def test_prepare_writes_on_a_store_opened_to_read_writes_nothing(tmp_path: Path) -> None:
    Store(tmp_path / "s").put(b"x")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(StoreError, match="create=False"):
        Store(tmp_path / "s", create=False).prepare_writes(3)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_prepare_writes_that_cannot_make_a_file_is_a_store_error(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    shutil.rmtree(tmp_path / "s" / "tmp")
    (tmp_path / "s" / "tmp").write_bytes(b"")  # tmp/ is a file: nothing can be made in it
    with pytest.raises(StoreError, match="cannot prepare writes"):
        store.prepare_writes(2)


# -- read_back: what a commit checks before its record names a blob ----------------------
@pytest.mark.parametrize("size", [0, 1000, 3 * 1024 * 1024 + 17])
def test_read_back_passes_a_blob_that_hashes_to_its_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """Small blobs are hashed as they are read; from a megabyte on, one slice is read
    while the other is hashed (slices of 1 MiB here: four turns)."""
    monkeypatch.setattr(store_module, "_SLICE", 1 << 20)
    store = Store(tmp_path)
    data = os.urandom(size)
    digest = store.put_parts([data[:100], memoryview(data)[100:]])
    store.read_back(digest)  # nothing raised, nothing removed
    assert store.get(digest) == data
    blob = tmp_path / "blobs" / digest[:2] / digest
    rotted = bytearray(data or b"\x00")  # one byte flipped (or one byte more)
    rotted[size // 2] ^= 0xFF
    blob.write_bytes(bytes(rotted))
    with pytest.raises(CheckpointIntegrityError, match="reads back as"):
        store.read_back(digest)
    assert not store.has(digest)


def test_a_corrupt_blob_found_at_the_digest_is_refused_removed_and_rewritten(
    tmp_path: Path,
) -> None:
    """put_parts finds a blob under the digest and does not rewrite it; read_back does
    not trust it: it is refused, removed, and the next write of the same bytes publishes
    them afresh."""
    store = Store(tmp_path)
    data = b"checkpoint bytes " * 1000
    digest = hashlib.sha256(data).hexdigest()
    planted = tmp_path / "blobs" / digest[:2] / digest
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"not those bytes")
    assert store.put_parts([data]) == digest  # found there: not rewritten
    with pytest.raises(CheckpointIntegrityError, match=r"reads back as .*; removed"):
        store.read_back(digest)
    assert not store.has(digest)
    assert store.put_parts([data]) == digest  # written afresh this time
    store.read_back(digest)
    assert store.get(digest) == data


def test_read_back_of_a_missing_or_malformed_blob(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(CheckpointIntegrityError, match="not there"):
        store.read_back("0" * 64)
    with pytest.raises(StoreError, match="malformed digest"):
        store.read_back("xyz")


def test_a_blob_that_does_not_read_back_and_cannot_be_removed_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Still refused (the typed error), and its message says it is still there: the next
    write of the same bytes finds it and the next read-back refuses it again."""
    store = Store(tmp_path)
    digest = store.put(b"original")
    (tmp_path / "blobs" / digest[:2] / digest).write_bytes(b"tampered")

    def refuse(digest: str) -> bool:
        raise StoreError("read-only")

    monkeypatch.setattr(store, "delete", refuse)
    for _ in range(2):
        with pytest.raises(CheckpointIntegrityError, match=r"not removed \(read-only\)"):
            store.read_back(digest)
        assert store.put(b"original") == digest
