"""Kill a coordinator with SIGKILL at a chosen point of a round, then resume it:
``python -m lensemble_flwr.simulations.crash_drill``.

One process holds a whole toy federation on the in-process network (simulated clock,
no Flower, no Ray)::

    crash_drill --run-dir D --rounds 4 --kill-at 1:aggregating   # dies with SIGKILL
    crash_drill --run-dir D --rounds 4 --resume                  # exits 0, 4 rounds CLOSED

``--kill-at ROUND:POINT`` sends SIGKILL to the process itself the moment the round
machine of round ROUND *enters* the state POINT (``open`` … ``closed``, ``aborted``); for
``mid-collecting``, as the attempt's second update is admitted; for ``checkpoint-write``,
half-way through writing the round's checkpoint blob (:mod:`.kill_points` lists them all).
The hooks wrap :class:`RoundMachine` and the aggregators' ``admit`` from the outside, and
watch the run store's writes through its ``on_write`` seam; the coordinator itself is
not modified.
``--resume`` rebuilds the coordinator with :meth:`Coordinator.resume` on the same run
directory and runs until ``--rounds`` rounds are CLOSED in total.

Participants. On Flower (simulation or deployment) participants are separate processes
that keep running while the coordinator is down; a restarted coordinator reaches them
through the next RoundOpen. Here they live in the coordinator's process and die with it,
so a participant that "kept running" is simulated by rebuilding it: its trainer is a pure
function of its index, and everything else it must remember (inner optimizer, local
groups, the last attempt it answered, its secure-aggregation keys) is saved after every
message it handles, as a Flower ClientApp saves its ``Context.state``, in its own store
under ``--participants-dir`` (never in the coordinator's run directory), and restored
when the process starts again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lensemble_flwr.aggregation.fixed_point import FixedPointAggregator
from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store, WriteHook
from lensemble_flwr.artifacts.tensors import pack, unpack
from lensemble_flwr.atomic_write import user_file_mode, write_atomically
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import CheckpointIntegrityError, LensembleError
from lensemble_flwr.participant.local_training import PortableState
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.messages import WirePayload
from lensemble_flwr.protocol.round import RoundMachine, RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.secagg.aggregator import SecureAggregator
from lensemble_flwr.simulations.kill_points import (
    CHECKPOINT_WRITE,
    KILL_POINTS_BY_NAME,
    MID_COLLECTING,
)
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.transports.faults import FaultPlan
from lensemble_flwr.transports.inprocess import InProcessNetwork

log = logging.getLogger(__name__)

NOT_REACHED = 3
"""Exit status when the run finished without reaching the requested kill point."""


def drill_config(secagg_threshold: int = 0) -> LensembleConfig:
    """The toy federation's config (the same on every start: resume checks it)."""
    return LensembleConfig(
        federation={
            "min_participants": 3,
            "secagg_threshold": secagg_threshold,
            "open_timeout": 10.0,
            "collect_timeout": 10.0,
            "retry_wait": 1.0,
            "root_seed": 7,
            "require_binding": True,
        },
        inner={"steps": 2, "lr": 0.05, "batch_size": 8},
    )


# -- participants that outlive the process ------------------------------------------------
_STATE = "participant/state"


def encode_state(state: PortableState) -> bytes:
    """A participant's PortableState as safetensors bytes (:func:`pack`)."""
    return pack({name: state.arrays[name] for name in sorted(state.arrays)}, state.meta)


def decode_state(data: bytes) -> PortableState:
    """What :func:`encode_state` encoded."""
    arrays, meta = unpack(data)
    return PortableState(arrays=arrays, meta=meta)


class KeptParticipant:
    """A participant whose state is saved after every message it handles.

    Args:
        participant: the participant (rebuilt from its index at every start).
        store: its own store; its saved state, if any, is restored at once.
    """

    def __init__(self, participant: Participant, store: Store) -> None:
        self.participant = participant
        self.participant_id = participant.participant_id
        self.store = store
        self._saved: bytes | None = None
        if store.bound(_STATE):
            self._saved = store.get(store.resolve(_STATE))
            participant.import_state(decode_state(self._saved))

    def handle(self, payload: WirePayload) -> None:
        """Let the participant handle ``payload``, then save its state if it changed."""
        self.participant.handle(payload)
        self._save()

    def join(self, coordinator_endpoint: str) -> GlobalState:
        """Rejoin through the participant's ``join``, then save its state if it changed."""
        state = self.participant.join(coordinator_endpoint)
        self._save()
        return state

    def _save(self) -> None:
        encoded = encode_state(self.participant.export_state())
        if encoded != self._saved:  # e.g. a RoundClose changes nothing that must be kept
            self.store.bind(_STATE, self.store.put(encoded))
            self._saved = encoded


def write_report(path: Path, text: str) -> None:
    """Write a drill's JSON report whole or not at all, readable as a plain file would be.

    A reader (the test that launched the drill) finds the old report or the new one, never
    part of one, even when the process is killed while writing it. Not fsynced: the drill
    kills processes, not the machine, and a killed process's writes are not lost.
    """
    write_atomically(path, text.encode("utf-8"), sync=False, mode=user_file_mode())


# -- the kill hooks -----------------------------------------------------------------------
def _die(report: Path | None, round: int, attempt: int, point: str, **detail: Any) -> None:
    """Record where the process dies, then SIGKILL it (no cleanup runs)."""
    note = {"outcome": "killed", "round": round, "attempt": attempt, "point": point, **detail}
    if report is not None:
        write_report(report, json.dumps(note))
    sys.stderr.write(f"crash-drill: SIGKILL in round {round} attempt {attempt} at {point}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(run_dir: Path, round: int, point: str, *, report: Path | None = None) -> WriteHook:
    """Arrange for this process to SIGKILL itself at ``point`` of round ``round`` (the
    first attempt of that round this process runs that reaches the point).

    Returns:
        The ``on_write`` hook of the run's store (``Store(run_dir, on_write=...)``): it
        kills at ``checkpoint-write``, and does nothing for the other points.
    """
    if point not in KILL_POINTS_BY_NAME:
        raise ValueError(f"unknown kill point {point!r}; one of {sorted(KILL_POINTS_BY_NAME)}")
    target = RoundState(point) if point in {s.value for s in RoundState} else None
    machines: list[RoundMachine] = []  # the attempts this process started
    admitted = [0]  # updates admitted in the newest attempt
    real_init, real_fire = RoundMachine.__init__, RoundMachine.fire

    def here() -> bool:
        return bool(machines) and machines[-1].round == round

    def init(self: RoundMachine, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        machines.append(self)
        admitted[0] = 0
        if target is RoundState.OPEN and here():
            _die(report, self.round, self.attempt, point)

    def fire(self: RoundMachine, *args: Any, **kwargs: Any) -> RoundState:
        new = real_fire(self, *args, **kwargs)
        if new is target and here():
            _die(report, self.round, self.attempt, point)
        return new

    def on_write(kind: str, key: str, data: bytes) -> None:
        # the checkpoint of round ``round``'s outcome, θ_round: half of its bytes
        # reach a fsynced temp file, the rest never comes
        if (
            point == CHECKPOINT_WRITE
            and here()
            and kind == "blob"
            and _checkpoint_round(data) == round
        ):
            _half_written(run_dir / "tmp", data)
            blob = {"blob": key, "size": len(data), "written": len(data) // 2}
            _die(report, round, machines[-1].attempt, point, **blob)

    RoundMachine.__init__ = init  # type: ignore[method-assign]
    RoundMachine.fire = fire  # type: ignore[method-assign]
    if point == MID_COLLECTING:
        for aggregator in (FixedPointAggregator, SecureAggregator):
            aggregator.admit = _dying_admit(aggregator.admit, here, admitted, report, machines)
    return on_write


def _half_written(tmp: Path, data: bytes) -> None:
    """Leave half of ``data`` in a fsynced temp file under ``tmp``, as a write cut short
    would. A blob streamed to the store (``Store.put_parts``) is already whole in its own
    temp file when the hook sees it: that file is cut to half; otherwise a new one is
    written."""
    streamed = [p for p in tmp.iterdir() if p.is_file() and p.stat().st_size == len(data)]
    if streamed:
        fd = os.open(streamed[0], os.O_WRONLY)
        try:
            os.ftruncate(fd, len(data) // 2)
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    fd, _ = tempfile.mkstemp(dir=tmp)
    with os.fdopen(fd, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())


def _dying_admit(
    real_admit: Callable[..., None],
    here: Callable[[], bool],
    admitted: list[int],
    report: Path | None,
    machines: list[RoundMachine],
) -> Callable[..., None]:
    """An aggregator's ``admit`` that kills the process at the attempt's second update."""

    def admit(self: Any, *args: Any, **kwargs: Any) -> None:
        admitted[0] += 1
        if admitted[0] == 2 and here():
            _die(report, machines[-1].round, machines[-1].attempt, MID_COLLECTING)
        real_admit(self, *args, **kwargs)

    return admit


def _checkpoint_round(data: bytes) -> int | None:
    """The round of the checkpoint ``data`` encodes, or None if it is no checkpoint."""
    try:
        return decode_checkpoint(data).round
    except CheckpointIntegrityError:
        return None


# -- the drill ----------------------------------------------------------------------------
def build_network(
    config: LensembleConfig,
    run_dir: Path,
    participants_dir: Path,
    *,
    participants: int,
    faults: FaultPlan | None = None,
) -> tuple[InProcessNetwork, list[KeptParticipant]]:
    """The in-process network with ``participants`` kept toy participants attached."""
    network = InProcessNetwork(faults=faults, join_endpoint=str(run_dir))
    nodes = []
    for i in range(participants):
        pid = f"p{i:02d}"
        node = KeptParticipant(
            Participant(
                config,
                participant_id=pid,
                transport=network.transport_for(pid),
                trainer=ToyTrainer(i),
            ),
            Store(participants_dir / pid),
        )
        network.attach(node)
        nodes.append(node)
    return network, nodes


def run_drill(
    run_dir: Path,
    *,
    rounds: int,
    participants: int,
    resume: bool,
    secagg_threshold: int = 0,
    participants_dir: Path | None = None,
    faults: FaultPlan | None = None,
    on_write: WriteHook | None = None,
) -> Coordinator:
    """Start (or resume) the coordinator on ``run_dir`` and run until ``rounds`` rounds are
    CLOSED in total; ``on_write`` watches the run store's writes (:func:`install_kill`).
    Raises what the coordinator raises."""
    config = drill_config(secagg_threshold)
    participants_dir = participants_dir or default_participants_dir(run_dir)
    network, _ = build_network(
        config, run_dir, participants_dir, participants=participants, faults=faults
    )
    store = Store(run_dir, on_write=on_write)
    if resume:
        coordinator = Coordinator.resume(config, transport=network.coordinator, store=store)
    else:
        coordinator = Coordinator(
            config, transport=network.coordinator, initial_params=initial_params(), store=store
        )
    coordinator.run(max(0, rounds - coordinator.global_state().round))
    network.flush()
    return coordinator


def default_participants_dir(run_dir: Path) -> Path:
    """Where the participants keep their state when ``--participants-dir`` is not given."""
    return run_dir.with_name(run_dir.name + ".participants")


def summary(coordinator: Coordinator) -> dict[str, Any]:
    """What a completed drill reports: the attempts, the global state, the ledger head."""
    return {
        "outcome": "completed",
        "closed_rounds": coordinator.global_state().round,
        "global_hash": coordinator.global_state().params_hash,
        "attempts": [
            {"round": e.round, "attempt": e.attempt, "state": e.state, "reason": e.reason}
            for e in coordinator.manifest.rounds
        ],
    }


def _kill_spec(text: str) -> tuple[int, str]:
    round_text, _, point = text.partition(":")
    point = point.lower()
    if not round_text.isdigit() or point not in KILL_POINTS_BY_NAME:
        raise argparse.ArgumentTypeError(
            f"expected ROUND:POINT with POINT one of {', '.join(KILL_POINTS_BY_NAME)}; got {text!r}"
        )
    return int(round_text), point


def _drop_spec(text: str) -> tuple[str, int, RoundState]:
    parts = text.split(":")
    states = {"open": RoundState.OPEN, "collecting": RoundState.COLLECTING}
    if len(parts) != 3 or not parts[1].isdigit() or parts[2].lower() not in states:
        raise argparse.ArgumentTypeError(f"expected PID:ROUND:open|collecting; got {text!r}")
    return parts[0], int(parts[1]), states[parts[2].lower()]


def _rejoin_spec(text: str) -> tuple[str, int]:
    pid, _, round_text = text.partition(":")
    if not pid or not round_text.isdigit():
        raise argparse.ArgumentTypeError(f"expected PID:ROUND; got {text!r}")
    return pid, int(round_text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The drill's command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(
        prog="python -m lensemble_flwr.simulations.crash_drill",
        description=(__doc__ or "").split("\n")[0],
    )
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, required=True, help="rounds CLOSED in total")
    parser.add_argument("--participants", type=int, default=4)
    parser.add_argument("--secagg-threshold", type=int, default=0, help=">0: masked rounds")
    parser.add_argument("--resume", action="store_true", help="Coordinator.resume the run dir")
    parser.add_argument("--kill-at", type=_kill_spec, metavar="ROUND:POINT")
    parser.add_argument(
        "--drop",
        type=_drop_spec,
        action="append",
        default=[],
        metavar="PID:ROUND:STATE",
        help="take a participant offline when ROUND opens (open) or before its update "
        "(collecting); repeatable",
    )
    parser.add_argument(
        "--rejoin",
        type=_rejoin_spec,
        action="append",
        default=[],
        metavar="PID:ROUND",
        help="bring a dropped participant back when ROUND (or its next attempt) opens",
    )
    parser.add_argument("--participants-dir", type=Path, default=None)
    parser.add_argument("--report", type=Path, default=None, help="write a JSON report here")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.participants < 1:
        parser.error("--rounds and --participants must be at least 1")
    if args.kill_at is not None and not 1 <= args.kill_at[0] <= args.rounds:
        parser.error(
            f"--kill-at round {args.kill_at[0]} is not one of rounds 1 … {args.rounds} "
            "(Flower's numbering)"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the drill and print (or write to ``--report``) its JSON summary. Exits 0,
    2 on a LensembleError, ``NOT_REACHED`` when the kill point never came; at a kill
    point the process dies by SIGKILL instead."""
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, stream=sys.stderr, force=True
    )
    import torch

    torch.set_num_threads(1)  # a toy model: threads only cost start-up time
    faults = FaultPlan()
    for pid, round, state in args.drop:
        faults.drop(pid, round=round, at=state)
    for pid, round in args.rejoin:
        faults.rejoin(pid, round=round)
    on_write = None
    if args.kill_at is not None:
        on_write = install_kill(args.run_dir, *args.kill_at, report=args.report)
    try:
        coordinator = run_drill(
            args.run_dir,
            rounds=args.rounds,
            participants=args.participants,
            resume=args.resume,
            secagg_threshold=args.secagg_threshold,
            participants_dir=args.participants_dir,
            faults=faults,
            on_write=on_write,
        )
    except LensembleError as exc:
        sys.stderr.write(f"crash-drill: {type(exc).__name__}: {exc}\n")
        return 2
    report = summary(coordinator)
    if args.kill_at is not None:
        sys.stderr.write(f"crash-drill: the run never reached {args.kill_at}\n")
        report["outcome"] = "kill point not reached"
    text = json.dumps(report, indent=2)
    if args.report is not None:
        write_report(args.report, text)
    else:
        print(text)
    return NOT_REACHED if args.kill_at is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
