"""Benchmark: exact fixed-point aggregation plus the DiLoCo outer step, against memory bandwidth.

Run ``python benchmarks/bench_aggregation.py`` (``--help`` for sizes). It prints ratios
measured in the same run, never absolute targets, and ends with one PASS/FAIL line per
target. It is a report, not a test: the exit code is 0 whatever the outcome.

Throughput. C updates of P float32 (split over a few named arrays) are built up front;
building them runs :class:`Update`'s ingress validation (a finiteness scan), which is
timed and reported on its own. Then, best of N repeats: a fresh
:class:`FixedPointAggregator` admits all C updates, reveals, verifies (the same pass
computes the mean), takes the mean, and :func:`outer_step` applies it, writing m' over
the mean as the coordinator does (``consume_mean``). The baseline, measured in the same
repeats, is a streaming read of the same C*P float32: ``numpy`` ``.sum()`` over every
array. Target: aggregation + outer step runs at >= 0.5 of that bandwidth, judged twice
(a PASS/FAIL line each): as is, and with glibc keeping freed memory mapped (the figure
the issue quotes first; ``--no-reuse`` skips it). The SHA-256 of the sums is not part
of it (the coordinator hashes them on a thread while it writes the checkpoint); it is
timed and printed on its own.

Memory. Peak memory allocated during one aggregation (admit all, reveal, verify, mean,
outer step), with the updates pre-built so that they are not counted, for C = 8 and
C = 32, measured with ``tracemalloc`` (numpy reports its buffers to it). Also, unless
``--no-rss``, the growth of the peak RSS (VmHWM, the counter behind ``ru_maxrss``) over
the same aggregation in a fresh subprocess per C, after returning freed heap memory to
the OS and resetting the high-water mark. Target: the peak for C = 32 is within 10% of
the peak for C = 8 (tracemalloc).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lensemble_flwr.aggregation import compiled, recycling
from lensemble_flwr.aggregation.chunked import available_cores
from lensemble_flwr.aggregation.fixed_point import AggregateSum, FixedPointAggregator
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.outer_optimizer import outer_step, zero_momentum
from lensemble_flwr.protocol.messages import Update, message_digest

NamedArrays = dict[str, np.ndarray]
STAGES = ("init + admit/fold", "reveal + verify & mean", "mean (from verify)", "outer step")
"""verify computes the mean in its pass over the sums; ``mean()`` then hands it over."""
MB = 1e6


# -- inputs -----------------------------------------------------------------------------
def layout(params: int, tensors: int) -> dict[str, int]:
    """Split ``params`` scalars over ``tensors`` named arrays of unequal sizes (4:3:2:1...)."""
    weights = list(range(tensors, 0, -1))
    sizes = [params * w // sum(weights) for w in weights]
    sizes[0] += params - sum(sizes)
    return {f"encoder.layer{i}.weight": n for i, n in enumerate(sizes)}


def random_arrays(sizes: Mapping[str, int], rng: np.random.Generator, scale: float) -> NamedArrays:
    """Uniform values in [-scale, scale), generated in place (no full-size temporaries)."""
    out: NamedArrays = {}
    for name, n in sizes.items():
        a = rng.random(n, dtype=np.float32)
        a -= np.float32(0.5)
        a *= np.float32(2 * scale)
        out[name] = a
    return out


def make_update(index: int, delta: NamedArrays) -> Update:
    """An Update message; constructing it runs the ingress validation (finiteness scan)."""
    pid = f"p{index:03d}"
    return Update(
        run_id="bench",
        round=1,
        sender=pid,
        participant_id=pid,
        dataset_root=hashlib.sha256(pid.encode()).hexdigest(),
        delta=delta,
        l2_norm=1.0,
        num_examples=1,
    )


# -- the measured operations ------------------------------------------------------------
@dataclasses.dataclass
class Federation:
    config: LensembleConfig
    params: NamedArrays
    momentum: NamedArrays


def aggregate(fed: Federation, updates: list[Update]) -> tuple[list[float], AggregateSum]:
    """One aggregation + outer step; returns the stage times and the revealed sum."""
    t0 = time.perf_counter()
    agg = FixedPointAggregator(fed.params, fed.config.aggregation, check_seed=7)
    for update in updates:
        agg.admit(update, weight=1)
    t1 = time.perf_counter()
    result = agg.reveal()
    agg.verify(result)
    t2 = time.perf_counter()
    mean = result.mean()
    t3 = time.perf_counter()
    outer_step(fed.params, fed.momentum, mean, fed.config.outer, consume_mean=True)
    t4 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t3], result


def stream_sum(deltas: list[NamedArrays]) -> float:
    """The baseline: one single-threaded ``.sum()`` pass over every update's bytes."""
    t0 = time.perf_counter()
    for delta in deltas:
        for a in delta.values():
            a.sum()
    return time.perf_counter() - t0


def stream_sum_threaded(deltas: list[NamedArrays], pool: ThreadPoolExecutor, n: int) -> float:
    """Reference only: the same read split over ``n`` threads (numpy releases the GIL)."""
    parts = [
        a[i * (a.size // n) : a.size if i == n - 1 else (i + 1) * (a.size // n)]
        for delta in deltas
        for a in delta.values()
        for i in range(n)
    ]
    t0 = time.perf_counter()
    list(pool.map(lambda p: p.sum(), parts))
    return time.perf_counter() - t0


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# -- reports ----------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


@dataclasses.dataclass
class Repeats:
    """Interleaved repeats of (baseline, aggregation); best-of statistics."""

    base: list[float]
    stages: list[list[float]]
    faults: list[int]

    @property
    def totals(self) -> list[float]:
        return [sum(s) for s in self.stages]

    @property
    def best_base(self) -> float:
        return min(self.base)

    @property
    def best_total(self) -> float:
        return min(self.totals)

    @property
    def best_stages(self) -> list[float]:
        return [min(s[i] for s in self.stages) for i in range(len(STAGES))]

    @property
    def ratio(self) -> float:
        return self.best_base / self.best_total


def run_repeats(
    fed: Federation, updates: list[Update], deltas: list[NamedArrays], repeats: int
) -> tuple[Repeats, AggregateSum]:
    """Baseline and aggregation back to back in every repeat, so both see the same noise."""
    out = Repeats([], [], [])
    result = None
    for _ in range(repeats):
        result = None  # free the previous sum first: same live memory in every repeat
        out.base.append(stream_sum(deltas))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        stages, result = aggregate(fed, updates)
        out.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        out.stages.append(stages)
    assert result is not None
    return out, result


def keep_freed_memory() -> bool:
    """Ask glibc to serve every allocation from the heap and never give it back to the OS,
    so that repeated aggregations reuse already-mapped pages (no first-touch page faults).
    What a long-running coordinator gets with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...
    Returns False where that is not possible (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def kernels_in_use() -> str:
    if compiled.available():
        import numba

        return (
            f"compiled (numba {numba.__version__}) for arrays of >= "
            f"{compiled.COMPILED_MIN_SIZE:,} elements, numpy below"
        )
    return "numpy (numba not installed, or LENSEMBLE_FLWR_COMPILED_KERNELS=0)"


def warm_up_kernels(config: LensembleConfig, clients: int) -> None:
    """Compile the kernels (or load them from numba's on-disk cache) for the batch lengths
    the timed aggregations use, outside the timing: one small aggregation of ``clients``
    updates of one array just large enough to take the compiled path."""
    if not compiled.available():
        return
    sizes = {"warm-up": compiled.COMPILED_MIN_SIZE}
    rng = np.random.default_rng(0)
    params = random_arrays(sizes, rng, 1.0)
    fed = Federation(config, params, zero_momentum(params))
    aggregate(fed, [make_update(i, random_arrays(sizes, rng, 1e-3)) for i in range(clients)])


def throughput_report(args: argparse.Namespace, config: LensembleConfig) -> str:
    sizes = layout(args.params, args.tensors)
    rng = np.random.default_rng(args.seed)
    params = random_arrays(sizes, rng, 1.0)
    fed = Federation(config, params, zero_momentum(params))
    deltas = [random_arrays(sizes, rng, 1e-3) for _ in range(args.clients)]
    nbytes = args.clients * args.params * 4
    workers = max(1, min(4, available_cores()))  # as lensemble_flwr.aggregation.chunked

    print(
        f"== throughput: C={args.clients} updates x P={args.params:,} float32 "
        f"in {args.tensors} arrays ({nbytes / MB:,.0f} MB read), "
        f"fold_batch={config.aggregation.fold_batch}, best of {args.repeats}, "
        f"{os.cpu_count()} cores (aggregator kernels on {workers} threads)"
    )
    print(f"   kernels: {kernels_in_use()}")

    updates: list[Update] = []

    def build() -> None:
        updates[:] = [make_update(i, d) for i, d in enumerate(deltas)]

    t_ingress = best_of(args.repeats, build)
    warm_up_kernels(config, args.clients)
    as_is, result = run_repeats(fed, updates, deltas, args.repeats)
    with ThreadPoolExecutor(workers) as pool:
        t_base_mt = min(stream_sum_threaded(deltas, pool, workers) for _ in range(args.repeats))
    t_digest = best_of(args.repeats, lambda: dataclasses.replace(result).digest)  # uncached
    t_msg_digest = best_of(args.repeats, lambda: [message_digest(u) for u in updates])
    sum_bytes = sum(a.nbytes for a in result.sums.values())
    reused = None
    if not args.no_reuse and keep_freed_memory():
        aggregate(fed, updates)  # warm-up: map the pages once
        reused, _ = run_repeats(fed, updates, deltas, args.repeats)

    t_base = as_is.best_base
    gbs = nbytes / 1e9
    runs = [("as is", as_is)] + ([("memory reused", reused)] if reused else [])
    head = "".join(f"{name + ' ms':>20}{'share':>7}" for name, _ in runs)
    print(f"{'stage (best of N each)':<28}{head}")
    for i, stage in enumerate(STAGES):
        cells = "".join(
            f"{r.best_stages[i] * 1e3:>20.1f}{r.best_stages[i] / sum(r.best_stages):>7.0%}"
            for _, r in runs
        )
        print(f"{stage:<28}{cells}")
    print(
        f"{'total (best repeat)':<28}"
        + "".join(f"{r.best_total * 1e3:>20.1f}{'':>7}" for _, r in runs).rstrip()
    )
    for name, r in runs:
        print(
            f"  {name}: per repeat total "
            f"{', '.join(f'{t * 1e3:.0f}' for t in r.totals)} ms, minor page faults "
            f"{', '.join(str(f) for f in r.faults)}, baseline "
            f"{', '.join(f'{b * 1e3:.1f}' for b in r.base)} ms"
        )
    print(f"baseline: .sum() on 1 thread  {t_base * 1e3:7.1f} ms = {gbs / t_base:.1f} GB/s")
    print(
        f"reference: .sum() on {workers} threads {t_base_mt * 1e3:6.1f} ms = "
        f"{gbs / t_base_mt:.1f} GB/s (not the target's baseline)"
    )
    for name, r in runs:
        print(
            f"aggregation + outer step, {name}: {gbs / r.best_total:.2f} GB/s = "
            f"{r.ratio:.2f} x baseline bandwidth (per repeat "
            f"{', '.join(f'{b / t:.2f}' for b, t in zip(r.base, r.totals, strict=True))})"
        )
    print("not part of the target:")
    print(
        f"  ingress validation, Update(...) x{args.clients}: {t_ingress * 1e3:.1f} ms "
        f"= {t_base / t_ingress:.2f} x baseline bandwidth"
    )
    print(
        f"  AggregateSum.digest (SHA-256 of {sum_bytes / MB:.0f} MB int64 sums): "
        f"{t_digest * 1e3:.1f} ms = {sum_bytes / t_digest / 1e9:.2f} GB/s, "
        f"{t_digest / as_is.best_total:.2f} x the aggregation"
    )
    print(
        f"  message_digest x{args.clients} (the coordinator hashes every admitted update): "
        f"{t_msg_digest * 1e3:.1f} ms = {t_base / t_msg_digest:.2f} x baseline bandwidth, "
        f"{t_msg_digest / as_is.best_total:.2f} x the aggregation"
    )
    return "\n".join(
        f"{verdict(r.ratio >= 0.5)}: aggregation + outer step at {r.ratio:.3f} x "
        f"streaming-read bandwidth, {name} (target >= 0.50)"
        for name, r in runs
    )


def measured_aggregation(fed: Federation, updates: list[Update]) -> None:
    """The unit whose peak memory is measured: admit all, reveal, verify, mean, outer step."""
    agg = FixedPointAggregator(fed.params, fed.config.aggregation, check_seed=7)
    for update in updates:
        agg.admit(update, weight=1)
    result = agg.reveal()
    agg.verify(result)
    outer_step(fed.params, fed.momentum, result.mean(), fed.config.outer, consume_mean=True)


def memory_fixture(
    args: argparse.Namespace, config: LensembleConfig, clients: int
) -> tuple[Federation, list[Update]]:
    sizes = layout(args.mem_params, args.tensors)
    rng = np.random.default_rng(args.seed)
    params = random_arrays(sizes, rng, 1.0)
    fed = Federation(config, params, zero_momentum(params))
    updates = [make_update(i, random_arrays(sizes, rng, 1e-3)) for i in range(clients)]
    return fed, updates


def tracemalloc_peak(fed: Federation, updates: list[Update]) -> int:
    # Every C starts without kept buffers, so every C allocates the same ones: the figure
    # does not depend on what the previous measurement left in the pool.
    recycling.clear()
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        measured_aggregation(fed, updates)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before


def reset_peak_rss() -> bool:
    """Give freed heap memory back to the OS and reset the RSS high-water mark (Linux >= 4.0),
    so that the peak read afterwards is the peak of what follows. False if not possible."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except (OSError, AttributeError):
        return False


def peak_rss_kb() -> int:
    """The process's peak RSS in KiB: VmHWM where /proc has it, else ru_maxrss.

    ru_maxrss itself is not usable here: after fork + exec, Linux floors it at the
    parent's peak RSS at fork time, which is larger than anything this child does."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rss_child(args: argparse.Namespace, config: LensembleConfig) -> None:
    """In a fresh process: peak RSS growth over one aggregation; prints one JSON line."""
    fed, updates = memory_fixture(args, config, args.rss_child)
    small = memory_fixture(argparse.Namespace(**{**vars(args), "mem_params": 1 << 20}), config, 2)
    measured_aggregation(*small)  # warm up code paths and the kernel thread pool
    del small
    gc.collect()
    exact = reset_peak_rss()
    before = peak_rss_kb()
    measured_aggregation(fed, updates)
    after = peak_rss_kb()
    print(json.dumps({"before_kb": before, "after_kb": after, "exact": exact}))


def rss_growth(args: argparse.Namespace, clients: int) -> tuple[float, bool] | None:
    """Run ``rss_child`` in a subprocess; (MB of peak RSS growth, was the peak reset?)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--rss-child",
        str(clients),
        "--mem-params",
        str(args.mem_params),
        "--tensors",
        str(args.tensors),
        "--seed",
        str(args.seed),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"  (peak-RSS subprocess for C={clients} failed: {proc.stderr.strip()[-200:]})")
        return None
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    return (info["after_kb"] - info["before_kb"]) * 1024 / MB, info["exact"]


def memory_report(args: argparse.Namespace, config: LensembleConfig) -> str:
    clients = sorted(set(args.mem_clients))
    one_update = args.mem_params * 4
    print(
        f"\n== memory: P={args.mem_params:,} float32 (one update = {one_update / MB:.1f} MB) "
        f"in {args.tensors} arrays, updates pre-built, fold_batch="
        f"{config.aggregation.fold_batch}"
    )
    print(
        "   expected floor ~ 20 bytes/param: int64 accumulator 8 + float32 mean 4 + "
        f"new params and momentum 8 = {20 * args.mem_params / MB:.0f} MB"
    )
    fed, all_updates = memory_fixture(args, config, max(clients))
    measured_aggregation(fed, all_updates[:2])  # warm-up outside tracing
    peaks = {c: tracemalloc_peak(fed, all_updates[:c]) for c in clients}
    del all_updates
    gc.collect()
    rss = {} if args.no_rss else {c: rss_growth(args, c) for c in clients}

    print(f"{'C':>4}{'tracemalloc peak MB':>22}{'x one update':>14}{'peak RSS growth MB':>22}")
    for c in clients:
        r = rss.get(c)
        rss_txt = "skipped" if r is None else f"{r[0]:.1f}{'' if r[1] else ' (not reset)'}"
        print(f"{c:>4}{peaks[c] / MB:>22.1f}{peaks[c] / one_update:>14.2f}{rss_txt:>22}")
    lo, hi = clients[0], clients[-1]
    growth = peaks[hi] / peaks[lo] - 1
    r_lo, r_hi = rss.get(lo), rss.get(hi)
    if r_lo and r_hi and r_lo[0] > 0:
        print(
            f"peak RSS growth (fresh process per C): C={hi} vs C={lo}: "
            f"{r_hi[0] / r_lo[0] - 1:+.1%} (informational)"
        )
    return (
        f"{verdict(abs(growth) <= 0.10)}: peak extra memory C={hi} vs C={lo}: "
        f"{growth:+.1%} (tracemalloc; target within 10%)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=10_000_000, help="P, float32 per update")
    parser.add_argument("--clients", type=int, default=8, help="C, updates aggregated")
    parser.add_argument("--tensors", type=int, default=4, help="named arrays P is split over")
    parser.add_argument("--repeats", type=int, default=3, help="N, best of N")
    parser.add_argument("--mem-params", type=int, default=2_000_000, help="P for the memory part")
    parser.add_argument("--mem-clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument(
        "--no-reuse",
        action="store_true",
        help="skip the repeat with glibc keeping freed memory (no page faults)",
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = LensembleConfig()
    if args.rss_child:
        rss_child(args, config)
        return 0
    verdicts = []
    if not args.skip_throughput:
        verdicts.append(throughput_report(args, config))
    if not args.skip_memory:
        verdicts.append(memory_report(args, config))
    print()
    for line in verdicts:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
