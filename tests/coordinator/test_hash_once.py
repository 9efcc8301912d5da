"""A round hashes every model-sized buffer once, but for the checkpoint, which is hashed
as it is streamed to the store and once more as the commit reads it back (it is not
decoded again), and the bytes and hashes stay those of the old code path
(``tensors.pack``, ``Store.put``, a recorded run)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation
from hypothesis import given, settings
from hypothesis import strategies as st
from portable_trainer import PortableTrainer, portable_params

import lensemble_flwr.aggregation.fixed_point as fixed_point_module
import lensemble_flwr.artifacts.store as store_module
from lensemble_flwr.aggregation.fixed_point import AggregateSum
from lensemble_flwr.artifacts.checkpoint import (
    checkpoint_parts,
    decode_checkpoint,
    encode_checkpoint,
)
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.artifacts.tensors import pack, pack_parts
from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.config import LensembleConfig, OuterOptimizerConfig
from lensemble_flwr.coordinator.coordinator import Coordinator, RoundOutcome
from lensemble_flwr.coordinator.outer_optimizer import outer_step
from lensemble_flwr.errors import StoreError
from lensemble_flwr.protocol.messages import Update
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify

_DTYPES = ["<f4", "<f8", "<f2", ">f4", ">f8", "<i8", "|i1", "|b1"]
_NAMES = st.text("abcé/._-", min_size=1, max_size=6)


@st.composite
def _tensors(draw: st.DrawFn) -> dict[str, np.ndarray]:
    names = draw(st.lists(_NAMES, min_size=1, max_size=5, unique=True))
    out = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        seed = draw(st.integers(0, 2**32 - 1))
        values = np.random.default_rng(seed).standard_normal(shape) * 10
        out[name] = np.ascontiguousarray(np.asarray(values).astype(draw(st.sampled_from(_DTYPES))))
    return out


@settings(max_examples=300, deadline=None)
@given(_tensors(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_pack_parts_are_the_bytes_of_pack(tensors: dict[str, np.ndarray], meta: dict) -> None:
    assert b"".join(pack_parts(tensors, meta)) == pack(tensors, meta)


def test_pack_parts_view_the_arrays_without_copying() -> None:
    big = np.arange(1000, dtype=np.float32)
    parts = pack_parts({"w": big}, {})
    assert len(parts) == 2 and np.shares_memory(np.frombuffer(parts[1], np.float32), big)


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a.w": rng.standard_normal((3, 5)).astype(np.float32), "b": np.float32(rng.random(7))}


def test_checkpoint_parts_are_the_bytes_of_encode_checkpoint() -> None:
    params, momentum = _model(1), _model(2)
    data = b"".join(checkpoint_parts(4, params, momentum))
    assert data == encode_checkpoint(4, params, momentum)
    assert decode_checkpoint(data).round == 4


def test_put_parts_stores_what_put_stores(tmp_path: Path) -> None:
    parts = [b"head", memoryview(np.arange(5, dtype=np.float32)).cast("B"), b"", b"tail"]
    joined = b"".join(bytes(p) for p in parts)
    streamed, plain = Store(tmp_path / "a"), Store(tmp_path / "b")
    digest = streamed.put_parts(parts)
    assert digest == plain.put(joined) == hashlib.sha256(joined).hexdigest()
    assert streamed.get(digest) == joined
    assert not any((tmp_path / "a" / "tmp").iterdir())  # the temp file was published
    blob = tmp_path / "a" / "blobs" / digest[:2] / digest
    inode = blob.stat().st_ino
    assert streamed.put_parts([joined]) == digest  # already stored: not rewritten
    assert blob.stat().st_ino == inode and not any((tmp_path / "a" / "tmp").iterdir())


def test_put_parts_hashes_slice_by_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "_SLICE", 3)  # many slices per part
    data = bytes(range(50))
    store = Store(tmp_path)
    assert store.put_parts([data[:7], data[7:]]) == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "blobs" / store.put(data)[:2] / store.put(data)).read_bytes() == data


def test_put_parts_shows_the_write_hook_the_bytes_and_a_refusal_leaves_nothing(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, str, bytes]] = []
    store = Store(tmp_path, on_write=lambda *w: seen.append(w))
    digest = store.put_parts([b"ab", b"cd"])
    assert seen == [("blob", digest, b"abcd")]

    def refuse(kind: str, key: str, data: bytes) -> None:
        raise OSError("no")

    store.on_write = refuse
    with pytest.raises(StoreError, match="cannot write a blob: no"):
        store.put_parts([b"other"])
    assert not store.has(hashlib.sha256(b"other").hexdigest())
    assert not any((tmp_path / "tmp").iterdir())


def test_put_parts_that_cannot_write_raises_store_error(tmp_path: Path) -> None:
    store = Store(tmp_path)
    (tmp_path / "tmp").rmdir()
    with pytest.raises(StoreError, match="cannot write a blob"):
        store.put_parts([b"x"])


def test_a_hash_thread_failure_is_raised_and_publishes_nothing(tmp_path: Path) -> None:
    class Unhashable:  # a part whose slices the hashing thread cannot take
        def __init__(self) -> None:
            self.view = memoryview(b"abc")

    store = Store(tmp_path)
    with pytest.raises(TypeError):
        store.put_parts([Unhashable()])  # type: ignore[list-item]
    assert not any((tmp_path / "tmp").iterdir()) and not list((tmp_path / "blobs").iterdir())


def test_outer_step_over_the_consumed_mean_is_bitwise_the_same() -> None:
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal(300_000).astype(np.float32), "s": np.ones(4, np.float32)}
    momentum = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in params.items()}
    for nesterov in (True, False):
        config = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
        mean = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in params.items()}
        kept = {n: a.copy() for n, a in mean.items()}
        expected = outer_step(params, momentum, kept, config, averaged={"s"})
        got = outer_step(params, momentum, mean, config, averaged={"s"}, consume_mean=True)
        for want, have in zip(expected, got, strict=True):
            for name in want:
                assert want[name].tobytes() == have[name].tobytes()
        assert np.shares_memory(got[1]["w"], mean["w"])  # m' was written over the mean
        read_only = {n: a.copy() for n, a in kept.items()}
        for array in read_only.values():
            array.setflags(write=False)
        again = outer_step(params, momentum, read_only, config, averaged={"s"}, consume_mean=True)
        assert again[1]["w"].tobytes() == expected[1]["w"].tobytes()
        assert np.array_equal(read_only["w"], kept["w"])  # not writeable: left alone


PEERS = ["p0", "p1", "p2"]


def unbound_coordinator(store: Store, size: int = 3000, **retention: int) -> Coordinator:
    """A coordinator of a (``size`` + 500)-value model for three unbound participants (no
    commitment secret: every hash of its run is a function of the seeds alone)."""
    config = LensembleConfig(
        federation={"min_participants": 3, "root_seed": 1}, retention=retention
    )
    theta = {"w": np.linspace(-1, 1, size, dtype=np.float32), "v": np.ones((10, 50), np.float32)}
    return Coordinator(config, initial_params=theta, store=store, run_id="r")


def feed_round(
    coordinator: Coordinator, rng: np.random.Generator, *, attempt: int = 1, closes: bool = True
) -> RoundOutcome:
    """One attempt of seeded updates from :data:`PEERS`, through the batch feeder's steps;
    it must close unless ``closes`` is False."""
    round = coordinator.global_state().next_round
    params = coordinator.global_state().params
    shapes = {n: params[n].shape for n in ("w", "v")}  # the draws' order of the recording
    updates = [
        Update(
            run_id=coordinator.run_id,
            round=round,
            sender=pid,
            participant_id=pid,
            dataset_root=None,
            delta={n: rng.standard_normal(shape).astype(np.float32) for n, shape in shapes.items()},
            num_examples=1,
            attempt=attempt,
        )
        for pid in PEERS
    ]
    coordinator.begin_attempt()
    coordinator.invite(PEERS)
    outcome = coordinator.conclude_collected(updates, PEERS)
    assert outcome.state is RoundState.CLOSED or not closes
    return outcome


def _unbound_run(store: Store, rounds: int) -> Coordinator:
    coordinator = unbound_coordinator(store)
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        feed_round(coordinator, rng)
    return coordinator


# Recorded on the code before checkpoints were streamed and no longer read back: the
# same runs must keep every checkpoint byte and every ledger hash. The record hashes were
# re-pinned when the config gained ``dp-overrun`` (a record links to the manifest header,
# which records every key); with that key left out of the header they are still those of
# the recording (f49ba0ef..., b900267b..., 024840d9...). The record hashes were re-pinned
# again when norms became fixed trees (the same bits on every CPU; BLAS's dot was not):
# a record links to its manifest entry, whose mean_delta_l2 diagnostic is a norm. The
# checkpoints are the recording's. The record hashes were re-pinned when
# ``max-abs-update`` became unset (0) by default (the header records 0.0; the checkpoints
# are unchanged). They were re-pinned when the manifest header began to record the run's
# endorsement policy (``"next-round"``; the checkpoints are unchanged).
RECORDED_INITIAL = "6505982ac231245b481079d8b2bb9c255fadd9bb35529cb5cf7c774f28d7dfa3"
RECORDED = [  # (round, checkpoint blob, record hash)
    (
        1,
        "0bd0add2fa4becdf283b2d659fe83fe837938e055781880f04f2de0ee2b36b3f",
        "77fc7692c27f74634a5322e1cf0ac6a6708a6c35f29312a62cb5ac304876240f",
    ),
    (
        2,
        "e0cf57bd1ce92fef3518496d534cb4e76d69aeb941c205c8c849d96803d9bb21",
        "10e0c22687d4381dc8fc04d7fe66c32013b686db0bd1b6861f180d7efc7eff43",
    ),
    (
        3,
        "af4ba6047b12e26a38e78ba63dc53d4f3d23a969e36fc492cfdf5f94ceefee56",
        "040ecaea52e85f5fb5184ad04607284b598ca83bbef6bfae9f105d943455f0af",
    ),
]
# The in-process federation of tests/federation_helpers with PortableTrainer participants
# (tests/helpers/portable_trainer.py: the same bits on every CPU, which the toy task's torch
# training was not); its dataset roots are salted by a per-machine secret, so only the
# checkpoints and global hashes are pinned
RECORDED_PORTABLE_INITIAL = "cee49859e9248a49ed29c8052a5ca6cae6c37bca804b459ef78893d3c81144c4"
RECORDED_PORTABLE_CHECKPOINTS = [
    "86c61ab0440ca0cb979bb6f668ab59c34e9e80a71cbea208a46a7693091558c0",
    "6d258e45c45fbd52f9ffcfcdc1040a87ba24ec208c0a88aa207eb06e0b5e8307",
    "353690cbd3a5ae90d48c023fb55618a79f2c8c29cd00acc6d58c918ec56f9d82",
]
RECORDED_PORTABLE_GLOBALS = [
    "b2cd344f880894131c1912faee4519b5a1e3daac80ff22ffb393e102c96283a1",
    "c0a117c657668680297cce032bbef884921644366dcd913ced54f944e36d7d11",
    "78c7b54e09640dedf5dd100e1daaa0e0d94252a39bc197c1201aa86581b0dc5e",
]


def test_a_run_keeps_its_recorded_hashes_and_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    coordinator = _unbound_run(Store(tmp_path), 3)
    records = Ledger(coordinator.store).records()
    assert coordinator.manifest.initial_checkpoint == RECORDED_INITIAL
    assert [(r.round, r.checkpoint, r.record_hash) for r in records] == RECORDED
    for _, digest, _ in RECORDED:
        blob = tmp_path / "blobs" / digest[:2] / digest
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest
    assert [r.round for r in verify(coordinator.store)] == [1, 2, 3]


def test_a_portable_federation_keeps_its_recorded_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    coordinator, _, _ = federation(
        tmp_path, trainer_of=PortableTrainer, params=portable_params()
    )
    coordinator.run(3)
    records = Ledger(coordinator.store).records()
    assert coordinator.manifest.initial_checkpoint == RECORDED_PORTABLE_INITIAL
    assert [r.checkpoint for r in records] == RECORDED_PORTABLE_CHECKPOINTS
    assert [r.new_global_hash for r in records] == RECORDED_PORTABLE_GLOBALS


class _CountingSha256:
    """``hashlib.sha256`` that adds every byte it hashes to a shared tally."""

    hashed = 0

    def __init__(self, data: bytes | memoryview = b"") -> None:
        self._h = hashlib.new("sha256")
        self.update(data)

    def update(self, data: bytes | memoryview) -> None:
        _CountingSha256.hashed += memoryview(data).nbytes
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def test_a_round_hashes_each_model_sized_buffer_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Per round the coordinator hashes C updates, the int64 sums (two model sizes), θ',
    m' and the checkpoint blob (θ' and m': two) as it is written, and the blob again as
    the commit reads it back from disk (two): C + 8 model sizes, where it once hashed
    C + 10 (θ' and m' again on decoding the blob it read back)."""
    caplog.set_level(logging.ERROR)
    coordinator = unbound_coordinator(Store(tmp_path), size=300_000)
    model = sum(a.nbytes for a in coordinator.global_state().params.values())
    rng = np.random.default_rng(0)
    monkeypatch.setattr(hashlib, "sha256", _CountingSha256)
    for _ in range(2):
        monkeypatch.setattr(_CountingSha256, "hashed", 0)
        feed_round(coordinator, rng)
        per_round = _CountingSha256.hashed / model
        assert len(PEERS) + 8 <= per_round < len(PEERS) + 8.2, per_round


_HASH_THREADS = ("lensemble-sums-digest", "lensemble-momentum-digest", "lensemble-store-hash")


@pytest.mark.parametrize(("size", "threads"), [(1_000, 0), (300_000, 4)])
def test_only_a_large_model_is_hashed_on_threads_of_their_own(
    size: int,
    threads: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A round of a small model starts no thread to hash on (starting one costs more than
    the overlap saves); a model of a megabyte and more overlaps its four hashes (the
    sums, m', the checkpoint as it is written, and as it is read back with the read).
    The recorded-run tests above pin that the digests do not depend on it."""
    caplog.set_level(logging.ERROR)
    coordinator = unbound_coordinator(Store(tmp_path), size=size)
    started: list[str] = []
    start = threading.Thread.start

    def counting_start(thread: threading.Thread) -> None:
        if thread.name.startswith(_HASH_THREADS):
            started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    feed_round(coordinator, np.random.default_rng(0))
    assert len(started) == threads, started
    assert coordinator.outcomes[-1].state is RoundState.CLOSED


def test_checkpoint_parts_take_a_precomputed_momentum_hash() -> None:
    params, momentum = _model(3), _model(4)
    given = checkpoint_parts(2, params, momentum, momentum_hash=digest_arrays(momentum, "momentum"))
    assert b"".join(given) == encode_checkpoint(2, params, momentum)


def test_the_sums_hashed_in_the_background_have_the_same_digest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fixed_point_module, "HASH_ON_A_THREAD_MIN_BYTES", 0)
    sums = {"w": np.arange(10, dtype=np.int64), "b": np.full(3, -7, np.int64)}
    fields = {"total_weight": 3, "contributors": ("a", "b", "c"), "fraction_bits": 16}
    background = AggregateSum(sums=sums, checksum=0, **fields)
    background.hash_in_background()
    background.hash_in_background()  # once is enough: a second call starts nothing
    assert background.digest == AggregateSum(sums=sums, checksum=0, **fields).digest
    class Unhashable:  # has a size, but no bytes the hash can read
        nbytes = 8

    broken = AggregateSum(sums={"w": Unhashable()}, checksum=0, **fields)  # type: ignore[dict-item]
    broken.hash_in_background()
    with pytest.raises(AttributeError):  # the thread's error is raised where it is read
        broken.digest  # noqa: B018


@pytest.mark.parametrize("sync", [True, False])
def test_put_parts_and_delete_fsync_only_a_syncing_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    fsyncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    store = Store(tmp_path / "run", sync=sync)
    digest = store.put_parts([b"a ", memoryview(b"checkpoint")])
    assert (len(fsyncs) > 0) is sync and store.get(digest) == b"a checkpoint"
    fsyncs.clear()
    assert store.delete(digest) and not store.has(digest)
    assert (len(fsyncs) > 0) is sync
    assert store.delete(digest) is False  # gone already
    assert not any((tmp_path / "run" / "tmp").iterdir())
