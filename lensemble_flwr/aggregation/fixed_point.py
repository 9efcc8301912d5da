"""Exact, order-independent aggregation of released updates in bounded memory.

:class:`FixedPointAggregator` sums updates on the fixed-point grid 2**-F in int64.
Integer addition is associative, so the sum — and its digest — is bitwise the same
whatever order updates arrive in, and the same on every machine. Memory does not grow
with the number of participants: an admitted update is held only until it is folded
into the accumulators (the sum and the re-sum, see below), at most ``fold_batch`` at a
time (folding several updates per pass over an accumulator is what makes the fold run
near memory bandwidth).

Each value is rounded half-to-even from ``float64(x) * weight * 2**F``; the rounding is
per update, so it is deterministic. While a batch's bound allows it, the batch is summed
in float64 (exact for integers below 2**53), otherwise in int64; both give the same
integers.

The self-check: while folding, the aggregator accumulates two linear checksums of what
it adds (the plain sum and a sum weighted by a seeded vector, modulo 2**64). ``verify``
recomputes them from the revealed sums. Any lost, doubled or corrupted fold shows up as
a mismatch, :class:`NonDeterministicAggregation`. Every batch is folded twice, from the
same inputs, into two accumulators (each with its checksums): the sum, and the re-sum
that :meth:`FixedPointAggregator.resum` reveals when the sum fails its check, so that
a corruption of the first accumulator is recovered from the inputs without keeping
them. The two computations must agree (their checksums are compared), else neither
passes.

An admitted update's arrays are held by reference until they are folded: a caller must
not modify them after ``admit`` (messages validated at ingress own their arrays).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from lensemble_flwr.aggregation import compiled, recycling
from lensemble_flwr.aggregation.chunked import CHUNK, run_ranges
from lensemble_flwr.canonical import HASH_ON_A_THREAD_MIN_BYTES, digest_arrays, digest_record
from lensemble_flwr.config import AggregationConfig
from lensemble_flwr.errors import NonDeterministicAggregation, ParameterMismatch, RoundError
from lensemble_flwr.params import NamedArrays, check_same_layout
from lensemble_flwr.protocol.messages import Update

_MOD = 1 << 64
_FLOAT_EXACT = 1 << 53
_INT_CAPACITY = (1 << 63) - 1


def _room(config: AggregationConfig) -> str:
    """How far max-abs-update and max-weight may be raised, for a rejection's message."""
    room = 2.0**62 / 2.0**config.fraction_bits
    return (
        f"set lensemble.max-abs-update (and lensemble.max-weight) in the run config: "
        f"max-abs-update x the largest weight (1 under uniform weighting, else max-weight) "
        f"must stay below 2**62 / 2**fraction-bits = {room:.4g}"
    )


@dataclasses.dataclass(frozen=True)
class AggregateSum:
    """The revealed sum of one round's contributing updates.

    ``sums`` are int64 on the grid 2**-fraction_bits, read-only; ``total_weight`` is the
    sum of the contributors' weights (C_t under uniform weighting).
    """

    sums: NamedArrays
    total_weight: int
    contributors: tuple[str, ...]
    fraction_bits: int
    checksum: int

    @property
    def count(self) -> int:
        """C_t, the number of contributing updates."""
        return len(self.contributors)

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the sum and everything it depends on (canonical encoding)."""
        return digest_record(
            "aggregate",
            {
                "sums": self._sums_digest(),
                "total_weight": self.total_weight,
                "contributors": list(self.contributors),
                "fraction_bits": self.fraction_bits,
            },
        )

    def hash_in_background(self) -> None:
        """Start hashing the sums (two model sizes of int64) on a thread of its own;
        :attr:`digest` waits for it. The commit starts it as it writes the checkpoint, so
        that the hash overlaps the write and its fsync, not the aggregation's threads.
        Small sums are left to be hashed when the digest is read (a thread would cost
        more). The digest is the same either way."""
        if "_sums_pending" in self.__dict__ or "digest" in self.__dict__:
            return
        if sum(a.nbytes for a in self.sums.values()) < HASH_ON_A_THREAD_MIN_BYTES:
            return
        pending: concurrent.futures.Future[str] = concurrent.futures.Future()

        def run() -> None:
            try:
                pending.set_result(digest_arrays(self.sums, "aggregate-sums"))
            except BaseException as exc:  # re-raised where the digest is read
                pending.set_exception(exc)

        self.__dict__["_sums_pending"] = pending
        threading.Thread(target=run, name="lensemble-sums-digest", daemon=True).start()

    def _sums_digest(self) -> str:
        pending = self.__dict__.get("_sums_pending")
        if pending is not None:
            return pending.result()
        return digest_arrays(self.sums, "aggregate-sums")

    def mean(self) -> NamedArrays:
        """The weighted mean update, float32: ``sums / (total_weight * 2**F)``, in arrays
        the caller may keep or overwrite. The first call after the plaintext aggregator's
        :meth:`~FixedPointAggregator.verify` returns the mean that check computed as it
        read the sums (the same bytes); any other call computes it.

        Raises:
            RoundError: nothing was summed (a total weight of 0 has no mean).
        """
        if self.total_weight <= 0:
            raise RoundError(f"a sum of total weight {self.total_weight} has no mean")
        ready = self.__dict__.pop("_verified_mean", None)
        if ready is not None:
            return ready
        return _mean_and_checksum(self, None)[0]


_NO_WEIGHTS = np.zeros(1, np.int64)


def _mean_and_checksum(result: AggregateSum, r: np.ndarray | None) -> tuple[NamedArrays, int]:
    """The mean of ``result`` and, with checksum weights ``r``, the self-check's checksum of
    its sums modulo 2**64 (0 without), in one pass over the sums. A sum of no weight is
    divided by 1 instead: only its checksum is used."""
    weight = max(result.total_weight, 1)
    denom = np.float64(weight) * np.float64(2.0**result.fraction_bits)
    weights = _NO_WEIGHTS if r is None else r
    out: NamedArrays = {}
    total = 0
    for name, sums in result.sums.items():
        flat_in = sums.reshape(-1)
        flat_out = recycling.output(f"mean:{name}", flat_in.shape, np.float32)
        fast = compiled.for_size(flat_in.size)

        def kernel(lo: int, hi: int, src=flat_in, dst=flat_out, fast=fast) -> int:
            if fast is not None:
                return int(fast.mean(src, dst, denom, weights, lo, hi, r is not None))
            np.divide(src[lo:hi], denom, out=dst[lo:hi], dtype=np.float64, casting="unsafe")
            if r is None:
                return 0
            return sum(
                _chunk_checksum(src[s : min(s + CHUNK, hi)], r) for s in range(lo, hi, CHUNK)
            )

        total += sum(run_ranges(flat_in.size, kernel))
        out[name] = flat_out.reshape(sums.shape)
    return out, total % _MOD


def to_fixed_point(values: Mapping[str, np.ndarray], factors: Mapping[str, float]) -> NamedArrays:
    """``rint(float64(x) * factor)`` as int64, name by name: the integers the plaintext fold
    adds for an update (``factor`` = weight * 2**F, times the int8 scale if quantized).
    A masked participant computes them itself. Chunk by chunk on the kernel threads, with
    the float64 temporaries in cache (the same operations as the fold, so the same
    integers)."""
    out: NamedArrays = {}
    for name in sorted(values):
        source = np.asarray(values[name])
        flat_in = source.reshape(-1)
        flat_out = np.empty(flat_in.size, np.int64)
        factor = np.float64(factors[name])

        def kernel(lo: int, hi: int, src=flat_in, dst=flat_out, factor=factor) -> None:
            t = np.empty(min(CHUNK, hi - lo), np.float64)
            for s in range(lo, hi, CHUNK):
                e = min(s + CHUNK, hi)
                tk = t[: e - s]
                np.copyto(tk, src[s:e])
                np.multiply(tk, factor, out=tk)
                np.rint(tk, out=tk)
                np.copyto(dst[s:e], tk, casting="unsafe")

        run_ranges(flat_in.size, kernel)
        out[name] = flat_out.reshape(source.shape)
    return out


class Aggregator(Protocol):
    """What the coordinator sums updates with (plaintext here; masked in secure aggregation)."""

    def admit(self, update: Update, *, weight: int) -> None:
        """Fold ``update`` into the round's sum, or raise (and change nothing)."""

    def reveal(self) -> AggregateSum:
        """Freeze the contributing set and return the sum."""

    def resum(self) -> AggregateSum:
        """Compute the sum again from what was admitted (not from the revealed sum), for
        a second check when the first failed; it becomes the revealed sum."""

    def verify(self, result: AggregateSum) -> None:
        """Recompute the self-check; raise NonDeterministicAggregation on a mismatch."""


def _checksum_vector(seed: int, size: int = CHUNK) -> np.ndarray:
    """The self-check's random weights: one per element of a chunk, ``size`` of them (a
    model smaller than a chunk needs no more than its largest array's size)."""
    return np.random.default_rng(seed).integers(1, 1 << 31, size=size, dtype=np.int64)


def _float32_exact(values: np.ndarray, scale: np.float64) -> bool:
    """Whether ``rint(x * scale)`` may be computed in float32 with the float64 result:
    float32 input and a power-of-two scale (no int8 scale, weight a power of two). Then
    the product only shifts exponents, so it is exact (|x| <= max-abs-update keeps it far
    from overflow), and rint of an exact float32 equals rint of the same value in float64.
    Half the bytes per temporary, twice the SIMD width."""
    return values.dtype == np.float32 and math.frexp(float(scale))[0] == 0.5


def _chunk_checksum(q: np.ndarray, r: np.ndarray) -> int:
    return int(q.sum()) + int(np.dot(q, r[: q.size]))


def _twice(
    fused: Callable[[np.ndarray, int, int], int], first: np.ndarray, second: np.ndarray
) -> Callable[[int, int], tuple[int, int]]:
    """A range kernel that runs the compiled fold ``fused`` into ``first`` and then into
    ``second``, chunk by chunk (the second pass over a chunk finds its inputs in cache);
    returns both checksums. Chunks start at multiples of CHUNK from the range's start,
    so each element keeps its checksum weight."""

    def kernel(lo: int, hi: int) -> tuple[int, int]:
        checks = [0, 0]
        for s in range(lo, hi, CHUNK):
            e = min(s + CHUNK, hi)
            checks[0] += fused(first, s, e)
            checks[1] += fused(second, s, e)
        return checks[0], checks[1]

    return kernel


@dataclasses.dataclass
class _Pending:
    participant_id: str
    delta: Mapping[str, np.ndarray]
    scale: dict[str, np.float64]  # per tensor: weight * 2**F (* the int8 scale, if any)
    bound: int


class FixedPointAggregator:
    """Exact int64 fixed-point sum of updates with the layout of ``template``.

    Args:
        template: names and shapes every update must have (the global params).
        config: the aggregation section of the federation's config.
        check_seed: seeds the checksum vector of the self-check.
    """

    def __init__(
        self, template: Mapping[str, np.ndarray], config: AggregationConfig, *, check_seed: int
    ) -> None:
        self._template = {name: template[name] for name in sorted(template)}
        self._config = config
        self._scale_unit = np.float64(2.0**config.fraction_bits)
        # Not zeroed: the first batch writes the accumulators, later batches add to them
        # (one pass over model-sized memory fewer); a round that folds nothing zeroes them.
        self._acc = {
            n: recycling.output(f"sum:{n}", a.shape, np.int64) for n, a in self._template.items()
        }
        # the re-sum: the same inputs folded again, on their own, into an accumulator of
        # their own (what ``resum`` reveals when the first sum fails its check)
        self._resum_acc = {
            n: recycling.output(f"resum:{n}", a.shape, np.int64) for n, a in self._template.items()
        }
        self._acc_written = False
        self._broken: str | None = None  # why a fold failed half-way, if one did
        largest = max((a.size for a in self._template.values()), default=0)
        self._r = _checksum_vector(check_seed, max(1, min(CHUNK, largest)))
        self._pending: list[_Pending] = []
        self._contributors: list[str] = []
        self._contributed: set[str] = set()  # the same ids: membership in O(1)
        self._weight = 0
        self._bound = 0
        self._checksum = 0
        self._resum_checksum = 0
        self._revealed: AggregateSum | None = None

    @property
    def contributors(self) -> tuple[str, ...]:
        return tuple(sorted(self._contributors))

    @property
    def pending_count(self) -> int:
        """Admitted updates not yet folded into the accumulator (the aggregator holds at
        most ``fold_batch`` updates at a time; none once revealed)."""
        return len(self._pending)

    def admit(self, update: Update, *, weight: int) -> None:
        """Admit ``update`` with integer ``weight``.

        Raises:
            RoundError: a masked update; after reveal, a second update from the same
                participant, a weight outside [1, max_weight], a value beyond
                max_abs_update (``AggregationConfig.plaintext_bound``: set by the
                coordinator to the run's ingress bound), an update that would overflow
                the accumulator, or any
                update after a fold failed. Nothing is admitted when it raises.
            ParameterMismatch: the update's names or shapes differ from the template.
            Exception: the fold this admission started failed (out of memory, say);
                from then on the aggregator refuses every call with RoundError.
        """
        self._check_usable()
        pid = update.participant_id
        if update.masked:
            raise RoundError(f"{pid}: a masked update has no place in a plaintext sum")
        if self._revealed is not None:
            raise RoundError(f"{pid}: the contributing set is frozen; update not admitted")
        if pid in self._contributed:
            raise RoundError(f"{pid}: already contributed to this round")
        if not 1 <= weight <= self._config.max_weight:
            raise RoundError(
                f"{pid}: weight {weight} outside [1, {self._config.max_weight}] "
                f"(max-weight; {_room(self._config)})"
            )
        if update.max_abs > (bound := self._config.plaintext_bound()):
            raise RoundError(
                f"{pid}: |value| {update.max_abs:.3g} exceeds max_abs_update "
                f"{bound:.3g} (max-abs-update; {_room(self._config)})"
            )
        check_same_layout(self._template, update.delta, f"update from {pid}")
        bound = weight * (math.ceil(update.max_abs * float(self._scale_unit)) + 1)
        if self._bound + bound > _INT_CAPACITY:
            raise RoundError(f"{pid}: admitting this update would overflow the accumulator")
        self._bound += bound
        self._weight += weight
        self._contributors.append(pid)
        self._contributed.add(pid)
        factor = np.float64(weight) * self._scale_unit
        scale = {n: factor * np.float64(update.scale_of(n)) for n in self._template}
        self._pending.append(_Pending(pid, update.delta, scale, bound))
        if len(self._pending) >= self._config.fold_batch:
            self._fold()

    def _fold(self) -> None:
        """Fold the pending batch. A fold that raises half-way leaves the accumulators
        partly written, so the aggregator refuses everything after it (see
        :meth:`_check_usable`): the attempt aborts instead of revealing that sum."""
        self._check_usable()
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            self._fold_batch(batch)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RoundError(f"a fold failed ({self._broken}): this sum cannot be revealed")

    def _fold_batch(self, batch: list[_Pending]) -> None:
        """Fold ``batch`` into the sum and, computed again from the same inputs, into the
        re-sum: two computations, each with the checksum of what it added. They take
        turns chunk by chunk, so the second reads the inputs from cache, not memory."""
        assign, self._acc_written = not self._acc_written, True
        first, second = self._fold_into(self._acc, self._resum_acc, batch, assign)
        self._checksum = (self._checksum + first) % _MOD
        self._resum_checksum = (self._resum_checksum + second) % _MOD

    def _fold_into(
        self, accs: NamedArrays, again: NamedArrays, batch: list[_Pending], assign: bool
    ) -> tuple[int, int]:
        """Fold ``batch`` into the accumulators ``accs`` and, computed anew, into
        ``again`` (``assign``: write over them); returns the checksums of what each
        computation added."""
        exact_in_float = sum(p.bound for p in batch) < _FLOAT_EXACT
        r = self._r
        totals = [0, 0]
        for name, acc in accs.items():
            flat_acc, flat_again = acc.reshape(-1), again[name].reshape(-1)
            flats = [p.delta[name].reshape(-1) for p in batch]
            scales = [p.scale[name] for p in batch]
            bound = max(p.bound for p in batch)
            fused = compiled.fold_kernel(
                flats, scales, r, bound, assign=assign, slots=self._config.fold_batch
            )
            if fused is not None:
                for pair in run_ranges(flat_acc.size, _twice(fused, flat_acc, flat_again)):
                    totals = [t + c for t, c in zip(totals, pair, strict=True)]
                continue
            inputs = [
                (x, sc, _float32_exact(p.delta[name], sc))
                for x, sc, p in zip(flats, scales, batch, strict=True)
            ]

            def kernel(
                lo: int, hi: int, flat_acc=flat_acc, flat_again=flat_again, inputs=inputs
            ) -> tuple[int, int]:
                t = np.empty(CHUNK, np.float64)
                b = np.empty(CHUNK, np.float64)
                b32 = np.empty(CHUNK, np.float32)
                q = np.empty(CHUNK, np.int64)
                ti = np.empty(CHUNK, np.int64)
                checks = [0, 0]

                def rounded(x: np.ndarray, sc: np.float64, in_f32: bool, k: int) -> np.ndarray:
                    """rint(x * sc) for one chunk, in float32 where that is exact."""
                    if in_f32:
                        out32 = b32[:k]
                        np.multiply(x, np.float32(sc), out=out32)
                        np.rint(out32, out=out32)
                        return out32
                    out = b[:k]
                    np.copyto(out, x)  # copy-then-scale: faster than a mixed-dtype ufunc
                    np.multiply(out, sc, out=out)
                    np.rint(out, out=out)
                    return out

                for s in range(lo, hi, CHUNK):
                    e = min(s + CHUNK, hi)
                    k = e - s
                    tk, qk, tik = t[:k], q[:k], ti[:k]
                    for which, dest in enumerate((flat_acc, flat_again)):
                        (x0, s0, f0), rest = inputs[0], inputs[1:]
                        np.copyto(tk, rounded(x0[s:e], s0, f0, k))
                        if exact_in_float:
                            for x, sc, f32 in rest:
                                np.add(tk, rounded(x[s:e], sc, f32, k), out=tk)
                            np.copyto(qk, tk, casting="unsafe")
                        else:
                            np.copyto(tik, tk, casting="unsafe")
                            for x, sc, f32 in rest:
                                np.copyto(qk, rounded(x[s:e], sc, f32, k), casting="unsafe")
                                np.add(tik, qk, out=tik)
                            qk[...] = tik
                        if assign:
                            dest[s:e] = qk
                        else:
                            np.add(dest[s:e], qk, out=dest[s:e])
                        checks[which] += _chunk_checksum(qk, r)
                return checks[0], checks[1]

            for pair in run_ranges(flat_acc.size, kernel):
                totals = [t + c for t, c in zip(totals, pair, strict=True)]
        return totals[0] % _MOD, totals[1] % _MOD

    def reveal(self) -> AggregateSum:
        """Fold what is pending and freeze the contributing set.

        Raises:
            RoundError: a fold failed half-way (its sum would be partial).
        """
        if self._revealed is None:
            self._revealed = self._frozen(resum=False)
        return self._revealed

    def resum(self) -> AggregateSum:
        """The re-sum: the second computation of the sum, folded from the admitted inputs
        apart from the first (not a re-reading of it), which becomes the revealed sum. The
        coordinator asks for it once, when the first failed :meth:`verify`; it is verified
        in turn.

        Raises:
            RoundError: a fold failed half-way (its sum would be partial).
        """
        self.reveal()  # folds what is pending and freezes the contributing set
        self._revealed = self._frozen(resum=True)
        return self._revealed

    def _frozen(self, *, resum: bool) -> AggregateSum:
        """Everything folded so far, read-only, as the round's sum: the first computation's
        or (``resum``) the second's."""
        self._fold()  # raises RoundError after a fold that failed
        accs, checksum = (
            (self._resum_acc, self._resum_checksum) if resum else (self._acc, self._checksum)
        )
        for acc in accs.values():
            if acc.flags.writeable:
                if not self._acc_written:  # nothing was folded: the sum of nothing
                    acc.fill(0)
                acc.setflags(write=False)
        return AggregateSum(
            sums=dict(accs),
            total_weight=self._weight,
            contributors=self.contributors,
            fraction_bits=self._config.fraction_bits,
            checksum=checksum,
        )

    def verify(self, result: AggregateSum) -> None:
        """Recompute the linear checksums from ``result`` and compare them with ingress,
        where both computations of the sum (the sum and the re-sum) must have added the
        same.

        The same pass over the sums computes their mean, which ``result.mean()`` then
        returns once without reading the sums again: the mean is computed from the very
        bytes that were checked."""
        try:
            check_same_layout(self._template, result.sums, "revealed sum")
        except ParameterMismatch as exc:
            raise NonDeterministicAggregation(f"revealed sum does not reproduce: {exc}") from exc
        mean, total = _mean_and_checksum(result, self._r)
        expected = (self._checksum, self._weight, self.contributors)
        actual = (total, result.total_weight, result.contributors)
        if (
            actual != expected
            or result.checksum != self._checksum
            or self._resum_checksum != self._checksum
        ):
            raise NonDeterministicAggregation(
                f"revealed sum does not reproduce: checksum {total:#x} vs ingress "
                f"{self._checksum:#x} (re-sum's {self._resum_checksum:#x}), weight "
                f"{result.total_weight} vs {self._weight}, "
                f"{result.count} vs {len(self._contributors)} contributors"
            )
        if result.total_weight > 0:
            result.__dict__["_verified_mean"] = mean  # for the result's next mean()
