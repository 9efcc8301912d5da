"""A content-addressed artifact store on a plain folder.

Layout under ``root``:

* ``blobs/<first 2 hex>/<digest>``: the bytes whose ``hashlib.sha256`` hex digest is
  ``<digest>``, so any blob can be checked with ``sha256sum``.
* ``names/<name>``: a file holding the 64-hex digest a name is bound to. Names are
  relative slash-separated paths such as ``round/3/averaging``.
* ``tmp/``: scratch space. Every write goes to a temp file here, is flushed and
  fsynced, then published with ``os.replace`` (or ``os.link`` for :meth:`Store.claim`),
  after which the destination directory is fsynced: the steps of
  :mod:`lensemble_flwr.atomic_write`, with the store's own temp files. Nothing
  half-written is ever visible under ``blobs/`` or ``names/``, and a write removes its
  temp file on every path (empty temp files made ahead of writes are another matter: see
  below).

A large blob (a checkpoint) is written by :meth:`Store.put_parts` from its parts (views of
the arrays it holds) and hashed as it is written, on a second thread: the blob is never
assembled in memory, and its digest costs no pass of its own. A blob read back later
(:meth:`Store.get`: recovery, a joining participant, ``verify``) is always re-hashed; a
commit re-reads the checkpoint it relies on (:meth:`Store.read_back`) before recording it.

``Store(root, sync=False)`` skips the fsyncs and keeps everything else: a write is still
published whole or not at all, so a killed *process* leaves the store as it was after its
last completed write (the kernel keeps what was written); only a power loss or a kernel
crash may lose the latest writes, or leave one of them empty (which :meth:`Store.get`
then refuses as an integrity error). It is for runs that cannot outlive their machine
anyway, such as a Flower simulation, whose participants' state lives in the engine's memory.

Making a file is the dear part of a small write on some filesystems (a new inode: on the
ext4 machines this project is measured on, 20-300 us of kernel time per file, against a
few us for the link that publishes it), and so is making a ``blobs/<xx>/`` folder. A
caller that knows when it is idle can pay for both ahead of time:
:meth:`Store.prepare_writes` makes empty temp files that later writes take instead of
making their own, and some of the blob folders not made yet. A coordinator does it once
a round's instructions are out, so that the commit between the round's last reply and
the next round's instructions makes no file. The spare temp files are empty and are
removed when the store is closed (:meth:`Store.close`), garbage-collected or the process
exits. A killed process leaves its spares (at most the count it prepared) in ``tmp/``,
where nothing reads or removes them: they add up over repeated crashes, and may be
deleted while no process writes to the store. A forked child never writes into the
spares it inherited.

A write can be watched, or cut short, from outside: ``Store(root, on_write=hook)`` calls
``hook(kind, key, data)`` before each write is published (:data:`WriteHook`); the crash
drill kills its process there, half-way through a checkpoint.

Flower-free; standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from lensemble_flwr.artifacts.direct_write import DIRECT_WRITE_MIN_BYTES, write_direct
from lensemble_flwr.atomic_write import discard, fill, fsync_folder, publish
from lensemble_flwr.canonical import HASH_ON_A_THREAD_MIN_BYTES
from lensemble_flwr.errors import CheckpointIntegrityError, StoreError

_DIGEST = re.compile(r"[0-9a-f]{64}")
_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")
# A name path that collides with another name used as a prefix (or vice versa).
_CONFLICT = (FileExistsError, IsADirectoryError, NotADirectoryError)

WriteHook = Callable[[Literal["blob", "name", "delete"], str, bytes], None]
"""Called as ``hook(kind, key, data)`` before a write is published: a new blob (``kind``
``"blob"``, ``key`` its digest, ``data`` its bytes), a binding (``"name"``, ``key`` the
name, ``data`` the digest line) or the removal of a blob (``"delete"``, ``key`` its
digest, ``data`` empty), by :meth:`Store.put`, :meth:`Store.bind`, :meth:`Store.claim`
and :meth:`Store.delete` once their arguments are checked (a claim is reported before it is
tried: it may find the name taken). Nothing of the write is visible yet: a hook that
raises, or ends the process, leaves the store as it was. A put of a blob already stored
writes nothing, so calls no hook. For :meth:`Store.put_parts` the hook is called once the
temp file is written and hashed, with the blob's bytes read back from it (only when a
hook is set)."""

_SLICE = 1 << 24
"""Bytes per hash update of :meth:`Store.put_parts` (16 MiB)."""

_BLOB_FOLDERS = tuple(f"{i:02x}" for i in range(256))
"""The folders of ``blobs/``, one per first byte of a digest."""


def _cause(exc: BaseException) -> str:
    """An OS error's cause in words (e.g. 'No space left on device')."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _hash_file(blob: io.RawIOBase) -> str:
    """SHA-256 of an open file's bytes, read a slice at a time: a large file is read into
    one buffer while the other is hashed on a thread (hashlib releases the GIL), so the
    hash costs no time of its own beside the read."""
    size = os.fstat(blob.fileno()).st_size
    hasher = hashlib.sha256()
    if size < HASH_ON_A_THREAD_MIN_BYTES:
        view = memoryview(bytearray(max(size, 1)))
        while count := blob.readinto(view):
            hasher.update(view[:count])
        return hasher.hexdigest()
    with contextlib.suppress(AttributeError, OSError):  # a hint: read ahead further
        os.posix_fadvise(blob.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buffers = [memoryview(bytearray(min(size, _SLICE))) for _ in range(2)]
    with ThreadPoolExecutor(1, thread_name_prefix="lensemble-store-hash") as pool:
        hashing: Future[None] | None = None
        for turn in itertools.count():
            view = buffers[turn % 2]  # not the one being hashed
            count = blob.readinto(view)
            if hashing is not None:
                hashing.result()
            if not count:
                return hasher.hexdigest()
            hashing = pool.submit(hasher.update, view[:count])
    raise AssertionError("unreachable")  # pragma: no cover


def _check_digest(digest: str) -> None:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise StoreError(f"malformed digest {digest!r}: expected 64 lower-case hex characters")


def _check_name(name: str) -> None:
    if not isinstance(name, str):
        raise StoreError(f"invalid name {name!r}: not a string")
    for part in name.split("/"):
        if part in (".", "..") or not _COMPONENT.fullmatch(part):
            raise StoreError(f"invalid name {name!r}: components must match [A-Za-z0-9._-]+")


def _discard_spares(spares: list[tuple[int, str]], owner: int) -> None:
    """Close and remove prepared temp files (only in the process that made them: a forked
    child's copy of the list names its parent's files)."""
    if os.getpid() != owner:
        return
    while spares:
        fd, path = spares.pop()
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


class Store:
    """Content-addressed blobs plus a namespace of names bound to blob digests."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        on_write: WriteHook | None = None,
        create: bool = True,
        sync: bool = True,
    ) -> None:
        """Open (creating if needed) the store at ``root``.

        Args:
            root: Folder holding ``blobs/``, ``names/`` and ``tmp/``.
            on_write: called before every write is published (tests and drills).
            create: False opens an existing store to read it, creating nothing (an
                audit of a read-only copy); a write then fails with StoreError.
            sync: fsync every write and the folder it is published in (durable across a
                power loss); False publishes as atomically but without fsync (see the
                module's docstring).
        """
        self.root: Path = Path(root)
        self.sync = sync
        self.on_write = on_write
        self._blobs = self.root / "blobs"
        self._names = self.root / "names"
        self._tmp = self.root / "tmp"
        self._writable = create
        self._spares: list[tuple[int, str]] = []  # (fd, path) of empty temp files
        self._spares_owner = os.getpid()  # a forked child must not write into them
        self._unmade_folders: list[str] | None = None  # blob folders to make, once listed
        self._discard = weakref.finalize(self, _discard_spares, self._spares, os.getpid())
        for folder in (self._blobs, self._names, self._tmp):
            self._check_no_links(folder)
            if not create:
                continue
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"{folder}: cannot open the store: {_cause(exc)}") from None

    def prepare_writes(self, count: int) -> None:
        """Pay now for what the next ``count`` writes would make: keep ``count`` empty temp
        files ready (fewer are made if some are left), and make up to ``count`` of the
        ``blobs/`` folders that do not exist yet (see the module's docstring). Nothing is
        visible under ``blobs/`` or ``names/`` but empty folders; a write finds the same
        store whether or not this was called.

        Raises:
            StoreError: ``count`` is negative, the store was opened with
                ``create=False``, or a file or folder cannot be made.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise StoreError(f"prepare_writes: count must be an int >= 0, got {count!r}")
        if not self._writable:
            raise StoreError(f"{self.root}: opened with create=False: nothing is written")
        self._check_no_links(self._tmp)
        self._check_no_links(self._blobs)
        self._forget_inherited_spares()
        try:
            while len(self._spares) < count:
                self._spares.append(tempfile.mkstemp(dir=self._tmp))
            if self._unmade_folders is None:
                made = set(os.listdir(self._blobs))
                self._unmade_folders = [f for f in _BLOB_FOLDERS if f not in made]
            made_any = False
            for _ in range(count):
                try:
                    folder = self._unmade_folders.pop()
                except IndexError:  # all made (or another thread took the last)
                    break
                (self._blobs / folder).mkdir(exist_ok=True)
                made_any = True
            if made_any and self.sync:
                fsync_folder(self._blobs)
        except OSError as exc:
            raise StoreError(f"{self._tmp}: cannot prepare writes: {_cause(exc)}") from None

    def close(self) -> None:
        """Remove the temp files :meth:`prepare_writes` kept and no write took. The store
        stays usable (a later write makes its own temp file). A forked child removes
        none of its parent's."""
        self._forget_inherited_spares()
        _discard_spares(self._spares, os.getpid())

    def _forget_inherited_spares(self) -> None:
        """In a forked child, drop the spares it inherited: they are its parent's files
        (the descriptors share the parent's file offsets), so writing into them would mix
        both processes' bytes. The child closes its copies of the descriptors only."""
        if self._spares_owner == os.getpid():
            return
        inherited, self._spares = self._spares, []
        self._spares_owner = os.getpid()
        self._discard.detach()  # the parent's (a no-op here: it checks the pid)
        self._discard = weakref.finalize(self, _discard_spares, self._spares, os.getpid())
        for fd, _path in inherited:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _temp_file(self) -> tuple[int, str]:
        """A temp file in ``tmp/`` to write into: a prepared one if one is left and it is
        still the file at its path (nothing replaced or linked it meanwhile), else a new
        one."""
        self._forget_inherited_spares()
        while True:
            try:
                fd, path = self._spares.pop()
            except IndexError:  # none left (a check first could race another thread's pop)
                return tempfile.mkstemp(dir=self._tmp)
            try:
                held, named = os.fstat(fd), os.lstat(path)
                ours = (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
                if ours and held.st_nlink == 1 and held.st_size == 0:
                    return fd, path
                if ours:  # linked elsewhere or written into: not used, and not left behind
                    os.unlink(path)
            except OSError:
                pass  # removed from tmp/ (or replaced: then not ours to remove)
            with contextlib.suppress(OSError):
                os.close(fd)

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its SHA-256 hex digest; an existing blob is not rewritten."""
        digest = hashlib.sha256(data).hexdigest()
        path = self._blob_path(digest)
        self._check_no_links(path)
        if not path.exists():
            if self.on_write is not None:
                self.on_write("blob", digest, data)
            self._publish(data, path, exclusive=False)
        return digest

    def put_parts(self, parts: Iterable[bytes | memoryview]) -> str:
        """Store the concatenation of ``parts`` and return its SHA-256 hex digest, as
        :meth:`put` does, without assembling it: each part is written to the temp file
        and hashed at the same time (the hash on a second thread; hashlib releases the
        GIL), so the digest is that of the bytes written. An existing blob is not
        rewritten (its temp file is dropped).

        Raises:
            StoreError: the temp file or the blob cannot be written.
        """
        views = [memoryview(part).cast("B") for part in parts]
        self._check_no_links(self._tmp)
        try:
            return self._stream_then_publish(views)
        except OSError as exc:
            raise StoreError(f"{self._blobs}: cannot write a blob: {_cause(exc)}") from None

    def _stream_then_publish(self, views: list[memoryview]) -> str:
        hasher = hashlib.sha256()
        failed: list[BaseException] = []

        def hash_all() -> None:
            try:
                for view in views:
                    for lo in range(0, len(view), _SLICE):
                        hasher.update(view[lo : lo + _SLICE])
            except BaseException as exc:  # re-raised on the writing thread
                failed.append(exc)

        fd, tmp = self._temp_file()
        size = sum(len(view) for view in views)
        try:
            hashing: threading.Thread | None = None
            if size < HASH_ON_A_THREAD_MIN_BYTES:
                hash_all()  # small: hashed here, before the write (a thread costs more)
            else:
                hashing = threading.Thread(target=hash_all, name="lensemble-store-hash")
                hashing.start()
            try:
                self._fill(fd, tmp, views, size)
            finally:
                if hashing is not None:
                    hashing.join()
            if failed:
                raise failed[0]
            digest = hasher.hexdigest()
            path = self._blob_path(digest)
            self._check_no_links(path)
            if path.exists():
                return digest
            if self.on_write is not None:
                self.on_write("blob", digest, Path(tmp).read_bytes())
            self._ensure_dir(path.parent)
            publish(tmp, path, sync=self.sync)
            return digest
        finally:
            discard(tmp)

    def _fill(self, fd: int, tmp: str, views: list[memoryview], size: int) -> None:
        """Write ``views`` into the temp file ``fd`` (at ``tmp``) and close it: around the
        page cache (``O_DIRECT``, fsynced) when the store syncs, the blob is large and
        direct I/O is available there; through it otherwise (fsynced when the store syncs).
        """
        if self.sync and size >= DIRECT_WRITE_MIN_BYTES:
            try:
                direct = write_direct(tmp, views)
            except BaseException:
                os.close(fd)
                raise
            if direct:
                os.close(fd)
                return
        fill(fd, views, sync=self.sync)

    def get(self, digest: str) -> bytes:
        """Return the bytes stored under ``digest``, re-hashed on read.

        Raises:
            StoreError: ``digest`` is malformed or not in the store.
            CheckpointIntegrityError: The stored bytes do not hash to ``digest``.
        """
        _check_digest(digest)
        path = self._blob_path(digest)
        self._check_no_links(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"unknown digest {digest}") from None
        except OSError as exc:
            raise StoreError(f"{path}: cannot read: {_cause(exc)}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CheckpointIntegrityError(f"blob {digest} hashes to {actual}")
        return data

    def read_back(self, digest: str) -> None:
        """Re-read the blob ``digest`` from disk and re-hash it a slice at a time, as a
        commit does with a checkpoint it wrote (or found stored) before recording it. A
        blob that does not hash to its digest is useless to every reader (:meth:`get`
        refuses it): it is removed (:meth:`delete`) before the error is raised, so that
        the next write of the same bytes publishes them afresh instead of trusting it.

        Raises:
            StoreError: ``digest`` is malformed, or the blob cannot be read.
            CheckpointIntegrityError: the blob is missing or does not hash to ``digest``.
        """
        _check_digest(digest)
        path = self._blob_path(digest)
        self._check_no_links(path)
        try:
            with open(path, "rb", buffering=0) as blob:
                actual = _hash_file(blob)
        except FileNotFoundError:
            raise CheckpointIntegrityError(f"blob {digest} was written but is not there") from None
        except OSError as exc:
            raise StoreError(f"{path}: cannot read back: {_cause(exc)}") from None
        if actual == digest:
            return
        try:
            self.delete(digest)
            what = "removed"
        except StoreError as exc:
            what = f"not removed ({exc})"
        raise CheckpointIntegrityError(f"blob {digest} reads back as {actual}; {what}")

    def delete(self, digest: str) -> bool:
        """Remove the blob ``digest`` (a checkpoint a retention policy prunes) and fsync
        its folder (when the store syncs); names bound to it are left as they are (the
        caller records why it is gone first, so that a reader can tell a pruned blob from
        a lost one).

        Returns:
            Whether the blob was there.

        Raises:
            StoreError: ``digest`` is malformed, or the blob cannot be removed.
        """
        _check_digest(digest)
        path = self._blob_path(digest)
        self._check_no_links(path)
        if not path.is_file():
            return False
        if self.on_write is not None:
            self.on_write("delete", digest, b"")
        try:
            os.unlink(path)
            if self.sync:
                fsync_folder(path.parent)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"{path}: cannot delete: {_cause(exc)}") from None
        return True

    def has(self, digest: str) -> bool:
        """Return whether a blob is stored under ``digest`` (not re-hashed).

        Raises:
            StoreError: ``digest`` is malformed.
        """
        _check_digest(digest)
        path = self._blob_path(digest)
        self._check_no_links(path)
        return path.is_file()

    def bind(self, name: str, digest: str) -> None:
        """Bind ``name`` to ``digest``, atomically replacing any existing binding.

        Raises:
            StoreError: The name is invalid or clashes with a name prefix, or the digest
                is malformed or not in the store.
        """
        path = self._writable_name(name, digest)
        line = digest.encode("ascii") + b"\n"
        if self.on_write is not None:
            self.on_write("name", name, line)
        try:
            self._publish(line, path, exclusive=False)
        except _CONFLICT as exc:
            raise StoreError(f"name {name!r} clashes with an existing name") from exc

    def claim(self, name: str, digest: str) -> bool:
        """Bind ``name`` to ``digest`` only if it is unbound, atomically.

        Returns:
            True if this call bound the name, False if it was already bound (the
            existing binding is kept).

        Raises:
            StoreError: As for :meth:`bind`.
        """
        path = self._writable_name(name, digest)
        line = digest.encode("ascii") + b"\n"
        if self.on_write is not None:
            self.on_write("name", name, line)
        try:
            return self._publish(line, path, exclusive=True)
        except _CONFLICT as exc:
            raise StoreError(f"name {name!r} clashes with an existing name") from exc

    def resolve(self, name: str) -> str:
        """Return the digest ``name`` is bound to.

        Raises:
            StoreError: The name is invalid or unbound, or its file holds no valid digest.
        """
        _check_name(name)
        path = self._names / name
        self._check_no_links(path)
        try:
            digest = path.read_text("ascii").strip()
        except (FileNotFoundError, *_CONFLICT):
            raise StoreError(f"unbound name {name!r}") from None
        except (OSError, UnicodeError) as exc:
            raise StoreError(f"name {name!r} cannot be read: {_cause(exc)}") from None
        _check_digest(digest)
        return digest

    def bound(self, prefix: str = "") -> list[str]:
        """Return the sorted bound names equal to ``prefix`` or under ``prefix/``.

        ``prefix`` matches whole components: ``"round/3"`` lists ``round/3/averaging``
        but not ``round/30/averaging``. The empty prefix lists every name.

        Raises:
            StoreError: A non-empty ``prefix`` is not a valid name.
        """
        prefix = prefix.rstrip("/")
        if prefix:
            _check_name(prefix)
        root = self._names / prefix if prefix else self._names
        self._check_no_links(root)
        if root.is_file():
            return [prefix]
        if not root.is_dir():
            return []
        # walk only the prefix's subtree: listing a run's ledger must not cost as much as
        # listing everything the run ever bound
        names = []
        for path in root.rglob("*"):
            if path.is_symlink():
                raise StoreError(f"{path}: a symbolic link inside the run directory is refused")
            if path.is_file():
                names.append(path.relative_to(self._names).as_posix())
        return sorted(names)

    def _blob_path(self, digest: str) -> Path:
        return self._blobs / digest[:2] / digest

    def _writable_name(self, name: str, digest: str) -> Path:
        _check_name(name)
        if not self.has(digest):
            raise StoreError(f"cannot bind {name!r} to {digest}: digest not in the store")
        return self._names / name

    def _check_no_links(self, path: Path) -> None:
        """Refuse ``path`` if it, or any folder between the store's root and it, is a
        symbolic link: a link planted inside a run directory could make the store read
        or write outside it. (The root itself may be a link: that is the user's choice.)

        Raises:
            StoreError: naming the link.
        """
        root, full = os.fspath(self.root), os.fspath(path)
        inside = root if root.endswith(os.sep) else root + os.sep
        if full != root and not full.startswith(inside):  # paths built from the root do
            full = os.path.join(root, path.relative_to(self.root))  # ValueError if outside
        current = root
        for part in full[len(root) :].split(os.sep):  # strings, not Paths: 3 calls per write
            if not part:
                continue
            current = os.path.join(current, part)
            if os.path.islink(current):
                raise StoreError(f"{current}: a symbolic link inside the run directory is refused")

    def _ensure_dir(self, folder: Path) -> None:
        missing = []
        while not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            if self.sync:
                fsync_folder(new.parent)

    def _publish(self, data: bytes, dest: Path, *, exclusive: bool) -> bool:
        """Write ``data`` to a fsynced temp file, then publish it at ``dest``.

        Returns:
            False only if ``exclusive`` and ``dest`` already exists; True otherwise.
        """
        self._check_no_links(dest)
        self._check_no_links(self._tmp)
        try:
            return self._write_then_publish(data, dest, exclusive=exclusive)
        except _CONFLICT:
            raise  # a name clash: the caller says which
        except OSError as exc:  # disk full, read-only, ...: nothing was published
            raise StoreError(f"{dest}: cannot write: {_cause(exc)}") from None

    def _write_then_publish(self, data: bytes, dest: Path, *, exclusive: bool) -> bool:
        self._ensure_dir(dest.parent)
        fd, tmp = self._temp_file()
        try:
            fill(fd, data, sync=self.sync)
            return publish(tmp, dest, sync=self.sync, once=exclusive)
        finally:
            discard(tmp)
