"""Benchmark: the cost of masked rounds (secure aggregation), in process and vs Flower's SecAgg+.

Run ``python benchmarks/bench_secagg.py`` (``--help`` for sizes). C = 10 participants
(``--participants``), a model of P = 1M float32 parameters (``--params``, one shared array
``w``) and a trainer that costs nearly nothing: a ``LocalTraining`` whose ``fit`` returns
the global params plus a small seeded random delta (1e-3 x N(0, 1), seeded by the round
seed the participant is given), so what is measured is aggregation, masking and messaging.

Part 1, in process (``InProcessNetwork``, simulated clock, real temp-dir store with
fsyncs), all in one process, so every participant's work is serialized on one core:

* three federations with the same participants and the same seeds: plaintext
  (``secagg_threshold = 0``), masked (``secagg_threshold = C//2 + 1``) and masked with a
  *what-if* PRG (see below); ``min_participants`` = the threshold, so K <= C and every
  round closes with all C contributors (checked). One warm-up round each (the masked
  ones set up keys in it: 3 exchanges), then ``--rounds`` repetitions of one round of
  each, back to back, wall seconds per round. A steady-state masked round is 2 exchanges
  (RoundOpen -> masked update, unmask request -> shares), a plaintext round 1 (checked
  from the network's delivery log). The three global states must stay bitwise equal.
* the verdict is the ratio of the best masked round to the best plaintext round (the
  machine is noisy: best of N, as the other benchmarks); medians are printed too.
* a cProfile pass over ``--profile-rounds`` rounds of each shows where a masked round's
  time goes (PRG expansion, masking arithmetic, key agreement, Shamir, sealing,
  unmasking, hashing, store writes), next to the plaintext round.
* what-if: ``lensemble_flwr.secagg.prg.expand`` is swapped (for the third federation
  only, and restored after every round) for a version that draws the same
  keystream with ``update_into`` into one preallocated array, instead of allocating a
  zero input, the keystream bytes and a copy (three fresh 8 MB buffers per 1M
  parameters). Same keystream, so the same sums bit for bit; information only. Masking
  and unmasking now call ``prg.add_streams``, not ``expand``: the swap changes nothing
  (the profile says so when the what-if was never called).

Part 2, Flower's simulation engine (Ray), one ``run_simulation`` with C supernodes,
``--blocks`` blocks of each variant alternating (F L, L F, ...), each block
``--warmup + --flower-rounds`` rounds of which the first ``--warmup`` are not measured:

* Flower SecAgg+: a ServerApp ``main`` that runs the legacy ``DefaultWorkflow(
  fit_workflow=SecAggPlusWorkflow(num_shares, reconstruction_threshold))`` under a
  ``LegacyContext`` whose strategy is the legacy ``FedAvg`` (fraction_fit 1,
  fraction_evaluate 0, initial parameters given), against a NumPyClient ClientApp with
  ``mods=[secaggplus_mod]`` whose fit returns its params plus a small seeded delta. By
  default num_shares = 1.0 (every other client is a neighbour: SecAgg, the same full
  mask graph as lensemble), reconstruction_threshold = the lensemble threshold, and
  max_weight = 1 (each client reports 1 example; Flower's default 1000 would make its
  quantization 1000x coarser). Every SecAgg+ round is 4 exchanges (setup, share keys,
  collect masked vectors, unmask), each timed by a Grid proxy; Flower's result is
  checked against the exact FedAvg of the deltas (max abs error printed).
* lensemble: ``LensembleStrategy`` (masked config, fraction_evaluate 0) against
  ``make_client_app`` participants with the same LocalTraining; 3 exchanges in its first
  round (keys), 2 after.

Both run in one ClientApp that routes on the instruction, so they share one Ray start-up
and the same per-message costs. Ray start-up and actor warm-up are excluded: the
ServerApp first waits for every node to answer a query, and each block's first round is
discarded. A round is timed on the ServerApp thread from the end of the previous round
to its own end (the legacy strategy's ``evaluate`` after ``aggregate_fit`` for Flower,
``on_round`` for LensembleStrategy), so it includes everything either framework does per
round. Verdict: ratio of mean seconds per round, lensemble / Flower (medians printed too).

It is a report, not a test: the exit code is 0 whatever the outcome. About 1 minute
with the defaults on 2 cores (``--no-flower`` skips part 2: ~20 s).
"""

# ruff: noqa: E402  (flwr reads its environment variables when it is imported)
from __future__ import annotations

import os
import tempfile

from own_flwr_home import use_own_flwr_home

use_own_flwr_home("bench-secagg-flwr-home-")

import argparse
import contextlib
import cProfile
import itertools
import logging
import pstats
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.participant.local_training import LocalTraining, PortableState
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.secagg import prg
from lensemble_flwr.transports.inprocess import InProcessNetwork

DELTA_SCALE = 1e-3


# -- the trainer: global + a seeded small delta ---------------------------------------------
def small_delta(seed: Any, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(
        DELTA_SCALE
    )


class DeltaTraining:
    """A LocalTraining whose fit is ``global + 1e-3 * N(0, 1)`` (seeded): no torch."""

    def __init__(self, index: int) -> None:
        self.index = index

    def num_examples(self) -> int:
        return 1

    def dataset_records(self) -> Iterator[bytes]:
        yield self.index.to_bytes(4, "little")

    def fit(self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int) -> NamedArrays:
        return {
            n: a + small_delta([seed, i], a.shape)
            for i, (n, a) in enumerate(sorted(global_params.items()))
        }

    def forget(self) -> None:
        return None

    def export_state(self) -> PortableState:
        return PortableState()

    def import_state(self, state: PortableState) -> None:
        return None


assert isinstance(DeltaTraining(0), LocalTraining)


def bench_config(
    threshold: int, min_participants: int, *, masked: bool, neighbours: int = 0
) -> LensembleConfig:
    return LensembleConfig(
        federation={
            "min_participants": min_participants,
            "secagg_threshold": threshold if masked else 0,
            "secagg_neighbours": neighbours if masked else 0,
            "open_timeout": 60.0,
            "collect_timeout": 120.0,
        },
        inner={"steps": 1, "batch_size": 1},
        groups={"shared": "*", "local": ""},
    )


# -- part 1: in process ---------------------------------------------------------------------
class Federation:
    def __init__(self, name: str, config: LensembleConfig, run_dir: Path, c: int, p: int) -> None:
        self.name = name
        self.network = InProcessNetwork(join_endpoint=str(run_dir))
        for i in range(c):
            pid = f"p{i:02d}"
            node = Participant(
                config,
                participant_id=pid,
                transport=self.network.transport_for(pid),
                trainer=DeltaTraining(i),
            )
            self.network.attach(node)
        self.coordinator = Coordinator(
            config,
            transport=self.network.coordinator,
            initial_params={"w": np.zeros(p, np.float32)},
            store=Store(run_dir),
        )
        self.c = c

    def round(self) -> float:
        """One round; wall seconds. Raises unless it closed with all C contributors."""
        start = len(self.coordinator.outcomes)
        t0 = time.perf_counter()
        self.coordinator.run(1)
        wall = time.perf_counter() - t0
        for o in self.coordinator.outcomes[start:]:
            if o.state is not RoundState.CLOSED or o.count != self.c:
                raise RuntimeError(
                    f"{self.name}: round {o.round} ended {o.state.value} "
                    f"with C_t={o.count}: {o.reason}"
                )
        return wall

    def exchanges(self, rnd: int) -> int:
        """Instructions (RoundOpen, UnmaskRequest) a participant got in round ``rnd``."""
        per_node = Counter(
            dest
            for _, _, dest, kind, r in self.network.delivered
            if r == rnd and kind in ("round-open", "unmask-request")
        )
        return max(per_node.values(), default=0)


def fast_expand(seed: bytes, size: int, _zeros: list[bytes] = [b""]) -> np.ndarray:  # noqa: B006
    """What-if PRG: the same keystream as ``prg.expand``, written with
    ``update_into`` into one preallocated int64 array (the zero input is cached)."""
    if len(seed) != prg.SEED_BYTES:
        raise ValueError("bad seed")
    if len(_zeros[0]) < 8 * size:
        _zeros[0] = bytes(8 * size)
    out = np.empty(size + 8, np.int64)  # update_into wants a little slack
    encryptor = prg.keystream(seed)
    encryptor.update_into(memoryview(_zeros[0])[: 8 * size], memoryview(out).cast("B"))
    return out[:size]


@contextlib.contextmanager
def what_if_prg() -> Iterator[None]:
    original = prg.expand
    prg.expand = fast_expand  # type: ignore[assignment]
    try:
        yield
    finally:
        prg.expand = original  # type: ignore[assignment]


REPO = str(Path(__file__).resolve().parents[1]) + os.sep

# (label, module path suffix, function name); indentation in the label shows nesting
BREAKDOWN = [
    ("participants: handle RoundOpen (all C)", "participant/participant.py", "_on_round_open"),
    ("  _release (fit + the release chain)", "participant/participant.py", "_release"),
    ("    trainer fit (numpy normal draw)", "bench_secagg.py", "fit"),
    ("  mask stage (release chain)", "release/masking.py", "update"),
    ("    to_fixed_point", "aggregation/fixed_point.py", "to_fixed_point"),
    ("    protocol.mask", "secagg/protocol.py", "mask"),
    ("      prg.add_streams (self + pairwise masks)", "secagg/prg.py", "add_streams@mask"),
    ("      pair_seed (X25519 + HKDF)", "secagg/keys.py", "pair_seed"),
    ("      _seal_shares (Shamir split + seal)", "secagg/protocol.py", "_seal_shares"),
    ("        shamir.split", "secagg/shamir.py", "split"),
    ("        keys.seal (X25519 + HKDF + AEAD)", "secagg/keys.py", "seal"),
    ("    share_mask_key (new member set only)", "secagg/protocol.py", "share_mask_key"),
    ("participants: handle UnmaskRequest (all C)", "participant/participant.py", "_on_unmask"),
    ("  protocol.disclose (open sealed shares)", "secagg/protocol.py", "disclose"),
    ("coordinator: receive (validate, admit, digest)", "coordinator/core.py", "receive"),
    ("  messages.from_wire (pydantic)", "protocol/messages.py", "from_wire"),
    ("  admission.admit (envelope, signature, table)", "coordinator/admission.py", "admit"),
    ("  aggregator admit", "aggregat", "admit"),
    ("  message_digest (SHA-256 of the update)", "protocol/messages.py", "message_digest"),
    ("coordinator: unmask exchange (requests out, answers in)", "coordinator/driver.py", "_unmask"),
    (
        "coordinator: conclude (reveal, outer step, commit, manifest)",
        "coordinator/core.py",
        "conclude",
    ),
    ("  mode.reveal (reveal, verify)", "coordinator/modes.py", "reveal"),
    (
        "    revealed_and_checked (reveal + self-check)",
        "coordinator/modes.py",
        "revealed_and_checked",
    ),
    ("      aggregator reveal", "aggregat", "reveal"),
    ("      aggregator verify", "aggregat", "verify"),
    ("      MaskedSum.reveal (reveal + verify)", "secagg/protocol.py", "reveal"),
    ("        prg.add_streams (self masks of survivors)", "secagg/prg.py", "add_streams@reveal"),
    ("        shamir.combine", "secagg/shamir.py", "combine"),
    ("  outer_step", "coordinator/outer_optimizer.py", "outer_step"),
    ("  write_commit (checkpoint, ledger)", "coordinator/commit.py", "write_commit"),
    ("  RunManifest.with_round (manifest entry)", "provenance/ledger.py", "with_round"),
    ("all: Store._publish (fsynced writes)", "artifacts/store.py", "_publish"),
    (
        "all: canonical.digest_arrays (hashing arrays)",
        "lensemble_flwr/canonical.py",
        "digest_arrays",
    ),
]
OWN_HOTSPOTS = [
    ("PRG keystream (CipherContext.update)", "~", "update' of 'cryptography"),
    ("PRG keystream (CipherContext.update_into)", "~", "update_into' of 'cryptography"),
    ("numpy ndarray.copy", "~", "'copy' of 'numpy.ndarray'"),
    ("numpy concatenate (_flatten)", "~", "numpy.concatenate"),
    ("SHA-256 (hashlib update)", "~", "'update' of '_hashlib"),
    ("X25519 (exchange + key loading)", "~", "x25519"),
    ("os.fsync", "~", "posix.fsync"),
]


def _short(filename: str, line: int, func: str) -> str:
    if filename == "~":
        return func
    if "site-packages" + os.sep in filename:
        filename = filename.split("site-packages" + os.sep, 1)[1]
    elif filename.startswith(REPO):
        filename = filename[len(REPO) :]
    else:
        filename = os.path.basename(filename)
    return f"{filename}:{line}({func})"


def profile_rounds(fed: Federation, rounds: int) -> tuple[float, dict]:
    profiler = cProfile.Profile()
    profiler.enable()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fed.round()
    wall = time.perf_counter() - t0
    profiler.disable()
    return wall, pstats.Stats(profiler).stats  # type: ignore[attr-defined]


def breakdown_value(raw: dict, suffix: str, func: str) -> tuple[float, float] | None:
    """(cumulative, own) seconds of the functions ``func`` in files ending ``suffix``;
    ``func@caller`` keeps only the calls from ``caller``."""
    func, _, caller = func.partition("@")
    cum = own = 0.0
    found = False
    for (filename, _line, name), (_cc, _nc, tt, ct, callers) in raw.items():
        if name != func or suffix not in filename:
            continue
        if caller:
            for (_cf, _cl, cname), (_c1, _c2, ctt, cct) in callers.items():
                if cname == caller:
                    cum, own, found = cum + cct, own + ctt, True
        else:
            cum, own, found = cum + ct, own + tt, True
    return (cum, own) if found else None


def hotspot_value(raw: dict, needle: str) -> float | None:
    total, found = 0.0, False
    for (filename, _line, name), (_cc, _nc, tt, _ct, _callers) in raw.items():
        if filename == "~" and needle in name:
            total, found = total + tt, True
    return total if found else None


def print_profiles(profiles: dict[str, tuple[float, dict]], rounds: int, top: int) -> None:
    """The breakdown table: plaintext, masked (cum, own, share) and what-if columns."""
    wall_p, raw_p = profiles["plaintext"]
    wall_m, raw_m = profiles["masked"]
    wall_w, raw_w = profiles.get("masked, what-if PRG", (0.0, {}))
    print(
        f"\n== where the time goes: cProfile over {rounds} round(s) of each, ms per round "
        f"(cum = callees included; nested rows overlap; cProfile inflates call-heavy code, "
        f"read shares)"
    )
    print(
        f"profiled wall per round: plaintext {wall_p / rounds * 1e3:.0f} ms, masked "
        f"{wall_m / rounds * 1e3:.0f} ms, masked with the what-if PRG "
        f"{wall_w / rounds * 1e3:.0f} ms"
    )
    print(f"{'':<58}{'plaintext':>10}{'masked':>9}{'own':>7}{'share':>7}{'what-if':>9}")

    def cell(value: float | None, width: int) -> str:
        return f"{value / rounds * 1e3:>{width}.1f}" if value is not None else f"{'-':>{width}}"

    for label, suffix, func in BREAKDOWN:
        p, m, w = (breakdown_value(raw, suffix, func) for raw in (raw_p, raw_m, raw_w))
        if p is None and m is None:
            continue
        share = f"{m[0] / wall_m:>7.1%}" if m else f"{'':>7}"
        print(
            f"{label:<58}{cell(p and p[0], 10)}{cell(m and m[0], 9)}{cell(m and m[1], 7)}"
            f"{share}{cell(w and w[0], 9)}"
        )

    def rest(wall: float, raw: dict) -> float | None:
        if not raw:
            return None
        handlers = [
            breakdown_value(raw, "participant/participant.py", f)
            for f in ("_on_round_open", "_on_unmask")
        ]
        return wall - sum(h[0] for h in handlers if h)

    print(
        f"{'coordinator + network (round minus the handlers above)':<58}"
        f"{cell(rest(wall_p, raw_p), 10)}{cell(rest(wall_m, raw_m), 9)}{'':>7}"
        f"{rest(wall_m, raw_m) / wall_m:>7.1%}{cell(rest(wall_w, raw_w), 9)}"
    )
    print("hot spots by own time (C code called from the rows above):")
    for label, _f, needle in OWN_HOTSPOTS:
        p, m, w = (hotspot_value(raw, needle) for raw in (raw_p, raw_m, raw_w))
        if p is None and m is None and w is None:
            continue
        share = f"{m / wall_m:>7.1%}" if m is not None else f"{'':>7}"
        print(f"  {label:<56}{cell(p, 10)}{cell(m, 9)}{'':>7}{share}{cell(w, 9)}")
    for name, raw in (("masked", raw_m), ("what-if", raw_w)):
        for func, what in (("add_streams", "add_streams calls"), ("expand", "PRG expansions")):
            calls = breakdown_value(raw, "secagg/prg.py", func)
            n = sum(v[1] for k, v in raw.items() if k[2] == func and "secagg/prg.py" in k[0])
            if calls:
                print(
                    f"  ({name}: {n / rounds:.0f} {what} per round, "
                    f"{calls[0] / max(n, 1) * 1e3:.2f} ms each, callees included)"
                )
        fast = breakdown_value(raw, "bench_secagg.py", "fast_expand")  # the what-if's
        if fast:
            n = sum(v[1] for k, v in raw.items() if k[2] == "fast_expand")
            print(f"  ({name}: {n / rounds:.0f} what-if expansions per round)")
    if raw_w and breakdown_value(raw_w, "bench_secagg.py", "fast_expand") is None:
        print(
            "  (the what-if PRG replaces prg.expand, which masking and unmasking no longer "
            "call (they use prg.add_streams): its federation ran as a second masked one)"
        )

    def table(title: str, rows: list[tuple[tuple[str, int, str], tuple[Any, ...]]]) -> None:
        print(title)
        print(f"{'calls/rnd':>10}{'own ms/rnd':>11}{'cum ms/rnd':>11}  function")
        for (filename, line, func), (_cc, ncalls, tt, ct, _callers) in rows[:top]:
            print(
                f"{ncalls / rounds:>10.1f}{tt / rounds * 1e3:>11.1f}{ct / rounds * 1e3:>11.1f}"
                f"  {_short(filename, line, func)}"
            )

    table(
        f"masked round, top {top} functions by own time:",
        sorted(raw_m.items(), key=lambda kv: -kv[1][2]),
    )
    package = os.sep + "lensemble_flwr" + os.sep
    table(
        f"masked round, top {top} lensemble_flwr functions by cumulative time:",
        sorted([kv for kv in raw_m.items() if package in kv[0][0]], key=lambda kv: -kv[1][3]),
    )


def run_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    c, p = args.participants, args.params
    names = ("plaintext", "masked", "masked, what-if PRG")
    out: dict[str, Any] = {"wall": {n: [] for n in names}}
    with tempfile.TemporaryDirectory(prefix="bench-secagg-") as tmp:
        feds = {
            n: Federation(
                n,
                bench_config(
                    args.threshold,
                    args.min_participants,
                    masked=n != "plaintext",
                    neighbours=args.neighbours,
                ),
                Path(tmp) / f"run-{i}",
                c,
                p,
            )
            for i, n in enumerate(names)
        }

        def one_round(name: str) -> float:
            if name.endswith("what-if PRG"):
                with what_if_prg():
                    return feds[name].round()
            return feds[name].round()

        out["warm-up"] = {n: one_round(n) for n in names}
        for _ in range(args.rounds):
            for n in names:
                out["wall"][n].append(one_round(n))
        # rounds count from 1; the global state's round is the last one closed
        last = feds["plaintext"].coordinator.global_state().round
        out["exchanges"] = {n: (f.exchanges(1), f.exchanges(last)) for n, f in feds.items()}
        hashes = {f.coordinator.global_state().params_hash for f in feds.values()}
        out["bitwise"] = len(hashes) == 1
        if args.profile_rounds > 0:
            out["profile"] = {}
            for n in names:
                with what_if_prg() if n.endswith("what-if PRG") else contextlib.nullcontext():
                    out["profile"][n] = profile_rounds(feds[n], args.profile_rounds)
    return out


def report_inprocess(args: argparse.Namespace, out: dict[str, Any]) -> float:
    wall = out["wall"]
    plain = wall["plaintext"]
    print(
        f"\n{'in process, seconds per round':<34}{'warm-up':>9}{'best':>8}{'median':>8}"
        f"{'worst':>8}{'best/plain':>12}{'median/plain':>14}{'exchanges':>11}"
    )
    for name, values in wall.items():
        first, steady = out["exchanges"][name]
        print(
            f"{name:<34}{out['warm-up'][name]:>9.3f}{min(values):>8.3f}"
            f"{statistics.median(values):>8.3f}{max(values):>8.3f}"
            f"{min(values) / min(plain):>12.2f}"
            f"{statistics.median(values) / statistics.median(plain):>14.2f}"
            f"{f'{first} / {steady}':>11}"
        )
    paired = [m / q for m, q in zip(wall["masked"], plain, strict=True)]
    print(
        f"(warm-up = the first round, in which masked participants commit keys and seal "
        f"key shares; exchanges = instructions per participant in the first / the last "
        f"round; paired masked/plain ratios per repetition: "
        f"{' '.join(f'{r:.2f}' for r in paired)})"
    )
    print(
        f"global states after {args.rounds + 1} rounds bitwise equal across the three "
        f"federations: {out['bitwise']}"
    )
    if "profile" in out:
        print_profiles(out["profile"], args.profile_rounds, args.top)
    return min(wall["masked"]) / min(plain)


# -- part 2: Flower's simulation engine -----------------------------------------------------
def flower_client_app(args: argparse.Namespace) -> Any:
    """One ClientApp: lensemble instructions go to ``make_client_app``, everything else
    (the legacy fit and SecAgg+ stage messages) to a NumPyClient app with secaggplus_mod."""
    from flwr.app import ConfigRecord, Context, Message
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp

    from lensemble_flwr.clients.app import make_client_app
    from lensemble_flwr.clients.state import ARRAYS_KEY, META_KEY
    from lensemble_flwr.strategies import records

    config = bench_config(
        args.threshold, args.min_participants, masked=True, neighbours=args.neighbours
    )

    class DeltaClient(NumPyClient):
        def __init__(self, index: int) -> None:
            self.index = index

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> Any:
            rnd = int(config["round"])
            out = [a + small_delta([self.index, rnd, i], a.shape) for i, a in enumerate(parameters)]
            return out, 1, {}

    def client_fn(context: Context) -> Any:
        return DeltaClient(int(context.node_config["partition-id"])).to_client()

    flower = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
    lensemble = make_client_app(
        lambda ctx: DeltaTraining(int(ctx.node_config["partition-id"])),
        config_fn=lambda ctx: config,
        evaluate_fn=None,
    )
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        logging.getLogger("flwr").setLevel(logging.WARNING)  # secaggplus_mod logs per stage
        content = msg.content
        cfg = content.config_records.get(records.CONFIG)
        if cfg is not None and records.PREFIX + "run_id" in cfg:
            # a new LensembleStrategy block: start as a fresh participant (new keys)
            run = str(cfg[records.PREFIX + "run_id"])
            seen = context.state.config_records.get("bench.run")
            if seen is None or seen["run"] != run:
                for key in (ARRAYS_KEY, META_KEY):
                    if key in context.state:
                        del context.state[key]
                context.state["bench.run"] = ConfigRecord({"run": run})
            return lensemble(msg, context)
        if records.UNMASK_RECORD in content.config_records:
            return lensemble(msg, context)
        return flower(msg, context)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return lensemble(msg, context)

    return app


def expected_flower_params(c: int, p: int, rounds: int) -> np.ndarray:
    """What FedAvg over the DeltaClients gives after ``rounds`` rounds, exactly."""
    w = np.zeros(p, np.float64)
    for rnd in range(1, rounds + 1):
        w += np.mean([small_delta([i, rnd, 0], (p,)) for i in range(c)], axis=0)
    return w


def flower_server_app(args: argparse.Namespace, out: dict[str, Any]) -> Any:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import Grid, ServerApp

    from lensemble_flwr.strategies import LensembleStrategy

    c, p = args.participants, args.params
    per_block = args.warmup + args.flower_rounds
    shares: int | float = 1.0 if args.flower_num_shares <= 0 else args.flower_num_shares
    threshold = args.flower_threshold or args.threshold

    class MarkedFedAvg(FedAvg):
        """Legacy FedAvg that stamps the start of round 1 and the end of every round."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.marks: list[float] = []
            self.final: np.ndarray | None = None

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            if server_round == 1:
                self.marks.append(time.perf_counter())
            return super().configure_fit(server_round, parameters, client_manager)

        def evaluate(self, server_round: int, parameters: Any) -> Any:
            if server_round >= 1:  # called after aggregate_fit of every round (0: init)
                self.marks.append(time.perf_counter())
                self.final = parameters_to_ndarrays(parameters)[0]
            return None

    class StageTimer:
        """A Grid proxy timing every ``send_and_receive`` (SecAgg+ runs one per stage)."""

        def __init__(self, grid: Grid) -> None:
            self._grid = grid
            self.seconds: list[float] = []

        def __getattr__(self, name: str) -> Any:
            return getattr(self._grid, name)

        def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
            t0 = time.perf_counter()
            try:
                return self._grid.send_and_receive(messages, timeout=timeout)
            finally:
                self.seconds.append(time.perf_counter() - t0)

    def flower_block(grid: Grid, context: Context) -> dict[str, Any]:
        strategy = MarkedFedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=c,
            min_available_clients=c,
            initial_parameters=ndarrays_to_parameters([np.zeros(p, np.float32)]),
            on_fit_config_fn=lambda rnd: {"round": rnd},
            fit_metrics_aggregation_fn=lambda _metrics: {},
        )
        legacy = LegacyContext(
            context=context, config=ServerConfig(num_rounds=per_block), strategy=strategy
        )
        workflow = DefaultWorkflow(
            fit_workflow=SecAggPlusWorkflow(
                num_shares=shares,
                reconstruction_threshold=threshold,
                max_weight=args.flower_max_weight,
                timeout=args.timeout,
            )
        )
        timer = StageTimer(grid)
        workflow(timer, legacy)  # type: ignore[arg-type]
        m = strategy.marks
        if len(m) != per_block + 1 or strategy.final is None:
            raise RuntimeError(f"Flower SecAgg+: {len(m) - 1} of {per_block} rounds completed")
        if len(timer.seconds) != 4 * per_block:
            raise RuntimeError(
                f"Flower SecAgg+: {len(timer.seconds)} exchanges in "
                f"{per_block} rounds, expected 4 per round"
            )
        err = float(np.abs(strategy.final - expected_flower_params(c, p, per_block)).max())
        stages = [timer.seconds[4 * r : 4 * r + 4] for r in range(per_block)]
        return {"rounds": [b - a for a, b in itertools.pairwise(m)], "error": err, "stages": stages}

    def lensemble_block(grid: Grid, run_id: str, run_dir: Path) -> dict[str, Any]:
        marks: list[float] = []
        strategy = LensembleStrategy(
            bench_config(
                args.threshold, args.min_participants, masked=True, neighbours=args.neighbours
            ),
            run_dir=run_dir,
            run_id=run_id,
            fraction_evaluate=0.0,
            poll_interval=args.poll,
            warmup_timeout=60.0,
            on_round=lambda _line: marks.append(time.perf_counter()),
        )
        t0 = time.perf_counter()
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord({"w": Array(np.zeros(p, np.float32))}),
            num_rounds=per_block,
        )
        metrics = [dict(result.train_metrics_clientapp[r]) for r in range(1, per_block + 1)]
        for r, m in enumerate(metrics, start=1):
            if m["lensemble.C_t"] != c or m["lensemble.attempts"] != 1:
                raise RuntimeError(f"lensemble round {r}: {m}")
        rounds = [marks[0] - t0] + [b - a for a, b in itertools.pairwise(marks)]
        return {
            "rounds": rounds,
            "exchanges": [int(m["lensemble.exchanges"]) for m in metrics],
            "own": [float(m["lensemble.seconds"]) for m in metrics],
        }

    def warm_up(grid: Grid) -> float:
        t0 = time.perf_counter()
        while len(list(grid.get_node_ids())) < c:
            if time.perf_counter() - t0 > 120:
                raise RuntimeError("nodes did not connect")
            time.sleep(0.2)
        messages = [
            Message(
                RecordDict({"bench.ping": ConfigRecord({"ping": 1})}),
                dst_node_id=node,
                message_type=MessageType.QUERY,
            )
            for node in grid.get_node_ids()
        ]
        replies = list(grid.send_and_receive(messages, timeout=120))
        if len(replies) != c or any(r.has_error() for r in replies):
            raise RuntimeError(f"warm-up: {len(replies)} replies from {c} nodes")
        return time.perf_counter() - t0

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        logging.getLogger("flwr").setLevel(logging.WARNING)
        out["flower"], out["lensemble"] = [], []
        try:
            with tempfile.TemporaryDirectory(prefix="bench-secagg-sim-") as tmp:
                out["warm-up"] = warm_up(grid)
                t0 = time.perf_counter()
                for block in range(args.blocks):
                    order = ("flower", "lensemble") if block % 2 == 0 else ("lensemble", "flower")
                    for which in order:
                        if which == "flower":
                            out["flower"].append(flower_block(grid, context))
                        else:
                            run_id = f"bench-secagg-{block}"
                            out["lensemble"].append(
                                lensemble_block(grid, run_id, Path(tmp) / run_id)
                            )
                out["blocks"] = time.perf_counter() - t0
        except BaseException as exc:  # handed back to the main thread, which reports it
            out["error"] = "".join(traceback.format_exception(exc))

    return app


def run_flower(args: argparse.Namespace) -> dict[str, Any]:
    from flwr.simulation import run_simulation

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        run_simulation(
            server_app=flower_server_app(args, out),
            client_app=flower_client_app(args),
            num_supernodes=args.participants,
            backend_config={"client_resources": {"num_cpus": args.num_cpus, "num_gpus": 0.0}},
        )
    except Exception:
        out.setdefault("error", traceback.format_exc())
    out["total"] = time.perf_counter() - t0
    return out


def report_flower(args: argparse.Namespace, out: dict[str, Any]) -> float | None:
    if "error" in out or not out.get("flower") or not out.get("lensemble"):
        print(f"FAIL: the simulation did not complete:\n{out.get('error', 'no result')}")
        return None
    w = args.warmup
    flower = [s for b in out["flower"] for s in b["rounds"][w:]]
    lens = [s for b in out["lensemble"] for s in b["rounds"][w:]]
    print(
        f"\nRay start-up + node warm-up, not measured: "
        f"{out['total'] - out.get('blocks', 0.0):.1f} s (query warm-up "
        f"{out['warm-up']:.1f} s); blocks {out.get('blocks', 0.0):.1f} s"
    )
    print(
        f"{'simulation, seconds per round':<34}{'rounds':>7}{'first':>8}{'mean':>8}"
        f"{'median':>8}{'min':>8}{'max':>8}  exchanges per round"
    )
    stages = [st for b in out["flower"] for st in b["stages"][w:]]
    first_f = statistics.fmean(b["rounds"][0] for b in out["flower"])
    first_l = statistics.fmean(b["rounds"][0] for b in out["lensemble"])
    exchanges_l = out["lensemble"][0]["exchanges"]
    for name, values, first, exch in (
        ("Flower SecAgg+ (DefaultWorkflow)", flower, first_f, "4 (every round)"),
        (
            "lensemble masked (Strategy)",
            lens,
            first_l,
            f"{exchanges_l[0]} first, then {'/'.join(str(e) for e in exchanges_l[1:])}",
        ),
    ):
        print(
            f"{name:<34}{len(values):>7}{first:>8.3f}{statistics.fmean(values):>8.3f}"
            f"{statistics.median(values):>8.3f}{min(values):>8.3f}{max(values):>8.3f}  "
            f"{exch}"
        )
    own = [s for b in out["lensemble"] for s in b["own"][w:]]
    print(
        f"(first = each block's first round, not measured: lensemble's includes the "
        f"strategy's node warm-up query and the key set-up; lensemble's own 'seconds' "
        f"metric, RoundOpen to commit, median {statistics.median(own):.3f} s; Flower's "
        f"result vs exact FedAvg of the deltas: max abs error "
        f"{max(b['error'] for b in out['flower']):.1e} (SecAgg+ quantization), lensemble "
        f"is exact by construction)"
    )
    names = ("setup", "share keys", "collect masked vectors", "unmask")
    means = [statistics.fmean(st[i] for st in stages) for i in range(4)]
    print(
        "Flower SecAgg+ stages (send_and_receive, mean s): "
        + ", ".join(f"{n} {v:.3f}" for n, v in zip(names, means, strict=True))
        + f"; rest of the round (aggregate_fit, workflow) "
        f"{statistics.fmean(flower) - sum(means):.3f}"
    )
    ratio = statistics.fmean(lens) / statistics.fmean(flower)
    print(
        f"lensemble / Flower SecAgg+: ratio of means {ratio:.2f}, of medians "
        f"{statistics.median(lens) / statistics.median(flower):.2f}, of mins "
        f"{min(lens) / min(flower):.2f}"
    )
    return ratio


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--participants", type=int, default=10, help="C")
    parser.add_argument("--params", type=int, default=1_000_000, help="P float32 parameters")
    parser.add_argument(
        "--threshold", type=int, default=0, help="secagg_threshold (default C//2 + 1)"
    )
    parser.add_argument(
        "--min-participants", type=int, default=0, help="min_participants (default: the threshold)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="in process: measured rounds of each federation"
    )
    parser.add_argument(
        "--profile-rounds",
        type=int,
        default=2,
        help="in process: rounds under cProfile (0: no profile)",
    )
    parser.add_argument("--top", type=int, default=12, help="cProfile rows")
    parser.add_argument("--target", type=float, default=2.0, help="masked/plaintext target")
    parser.add_argument("--no-flower", action="store_true", help="skip part 2")
    parser.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="secagg-neighbours of the masked federations (even; default 0: "
        "the full graph); with it, SecAgg+ gets num_shares = neighbours + 1",
    )
    parser.add_argument("--blocks", type=int, default=2, help="simulation: blocks of each")
    parser.add_argument(
        "--flower-rounds", type=int, default=4, help="simulation: measured rounds per block"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="simulation: unmeasured rounds at the start of each block",
    )
    parser.add_argument(
        "--flower-num-shares",
        type=int,
        default=0,
        help="SecAgg+ num_shares (default 0: 1.0 = every client, as SecAgg)",
    )
    parser.add_argument(
        "--flower-threshold",
        type=int,
        default=0,
        help="SecAgg+ reconstruction_threshold (default: --threshold)",
    )
    parser.add_argument(
        "--flower-max-weight",
        type=float,
        default=1.0,
        help="SecAgg+ max_weight (clients report 1 example; Flower's default "
        "1000 would coarsen its quantization 1000x)",
    )
    parser.add_argument(
        "--num-cpus",
        type=float,
        default=1.0,
        help="client_resources num_cpus (Ray runs cores/num_cpus actors)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=0.05,
        help="LensembleStrategy poll_interval (its default; Flower's "
        "InMemoryGrid polls every 0.1 s)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="SecAgg+ per-stage timeout (s)"
    )
    args = parser.parse_args(argv)
    c = args.participants
    args.threshold = args.threshold or c // 2 + 1
    args.min_participants = args.min_participants or args.threshold
    if args.neighbours and not args.flower_num_shares:
        args.flower_num_shares = args.neighbours + 1
    if args.neighbours and not args.flower_threshold:  # SecAgg+ shares among neighbours
        args.flower_threshold = min(args.threshold, args.flower_num_shares - 1)
    if not 2 <= args.threshold <= c or max(args.threshold, args.min_participants) > c:
        parser.error("need 2 <= threshold <= C and min_participants <= C")
    logging.basicConfig(level=logging.ERROR)
    import cryptography

    cores = os.cpu_count() or 1
    print(
        f"== masked rounds: C={c} participants, P={args.params:,} float32 params (one "
        f"array), secagg_threshold={args.threshold}, min_participants="
        f"{args.min_participants}, secagg_neighbours={args.neighbours or 'all'}; "
        f"{cores} cores, Python {sys.version.split()[0]}, numpy "
        f"{np.__version__}, cryptography {cryptography.__version__}; load average {_load()}"
    )
    t_start = time.perf_counter()
    in_ratio = report_inprocess(args, run_inprocess(args))
    sys.stdout.flush()
    sim_ratio = None
    if not args.no_flower:
        import flwr
        import ray

        actors = max(1, int(cores / args.num_cpus))
        shares = "1.0 (all)" if args.flower_num_shares <= 0 else str(args.flower_num_shares)
        print(
            f"\n== Flower simulation engine: {c} supernodes, {args.blocks} blocks x "
            f"({args.warmup} + {args.flower_rounds}) rounds of each, {actors} Ray actors; "
            f"SecAgg+ num_shares={shares}, reconstruction_threshold="
            f"{args.flower_threshold or args.threshold}; LensembleStrategy poll "
            f"{args.poll:g} s; flwr {flwr.__version__}, ray {ray.__version__}; load "
            f"average {_load()}"
        )
        sys.stdout.flush()
        sim_ratio = report_flower(args, run_flower(args))
    print(
        f"\n{'PASS' if in_ratio <= args.target else 'FAIL'}: in process, masked / plaintext "
        f"seconds per round {in_ratio:.2f} (best of {args.rounds}; target <= "
        f"{args.target:g})"
    )
    if sim_ratio is not None:
        print(
            f"{'PASS' if sim_ratio < 1.0 else 'FAIL'}: simulation engine, lensemble masked / "
            f"Flower SecAgg+ seconds per round {sim_ratio:.2f} (mean; target < 1)"
        )
    elif not args.no_flower:
        print("FAIL: simulation engine comparison did not run (see above)")
    print(f"total wall {time.perf_counter() - t_start:.1f} s; load average now {_load()}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # a report, not a test: say what broke, exit 0
        traceback.print_exc()
        code = 0
    raise SystemExit(code)
