"""A whole federation in one process, on a simulated clock: ``python -m
lensemble_flwr.simulations.inprocess``.

It runs the toy task with scripted churn — a participant whose update is late in round 1,
one that drops mid-round in round 2 and rejoins in round 4 — and prints one line per
round attempt. At the end it verifies the run directory's ledger.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import (
    AggregatorFactory,
    Coordinator,
    RoundOutcome,
    fixed_point_aggregator,
)
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.participant.local_training import LocalTraining, Trainer
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import ToyTrainer, global_loss, initial_params
from lensemble_flwr.transports.faults import FaultPlan
from lensemble_flwr.transports.inprocess import InProcessNetwork


def build(
    config: LensembleConfig,
    run_dir: Path,
    *,
    participants: int,
    faults: FaultPlan | None = None,
    compute_s: float = 1.0,
    on_round: Callable[[RoundOutcome], None] | None = None,
    aggregator_factory: AggregatorFactory = fixed_point_aggregator,
    trainer_of: Callable[[int], Trainer | LocalTraining] = ToyTrainer,
    params: NamedArrays | None = None,
) -> tuple[Coordinator, InProcessNetwork, list[Participant]]:
    """Wire a coordinator and ``participants`` participants on one in-process network:
    participant i trains ``trainer_of(i)`` (the toy task's by default) from ``params``
    (θ_0; default: the toy model's)."""
    network = InProcessNetwork(faults=faults, compute_s=compute_s, join_endpoint=str(run_dir))
    nodes = []
    for i in range(participants):
        pid = f"p{i:02d}"
        node = Participant(
            config, participant_id=pid, transport=network.transport_for(pid), trainer=trainer_of(i)
        )
        network.attach(node)
        nodes.append(node)
    coordinator = Coordinator(
        config,
        transport=network.coordinator,
        initial_params=initial_params() if params is None else params,
        store=Store(run_dir),
        on_round=on_round,
        aggregator_factory=aggregator_factory,
    )
    return coordinator, network, nodes


def main(argv: list[str] | None = None) -> int:
    """Run the demo federation, print a line per round attempt, and verify the ledger."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--participants", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    use_torch_threads(args.participants)  # they all train in this process (clients/threads.py)

    config = LensembleConfig(
        federation={
            "min_participants": 3,
            "open_timeout": 30,
            "collect_timeout": 20,
            "require_binding": True,  # its participants commit to their data
        },
        inner={"steps": 20, "lr": 0.02, "weight_decay": 0.0},
        outer={"lr": 0.7, "momentum": 0.9},
    )
    faults = (
        FaultPlan()
        .delay("p01", round=1, seconds=25)
        .drop("p03", round=2, at=RoundState.COLLECTING)
        .rejoin("p03", round=4)
    )
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="lensemble-run-"))
    trainers = [ToyTrainer(i) for i in range(args.participants)]

    def report(o: RoundOutcome) -> None:
        loss = global_loss(coordinator.global_state().params, trainers)
        late = f" late={','.join(o.late)}" if o.late else ""
        why = f" reason={o.reason}" if o.reason else ""
        print(
            f"round {o.round} attempt {o.attempt}: {o.state.value:<7} C_t={o.count}"
            f"{late} t={network.clock.time:7.2f}s loss={loss:.4f} "
            f"global={o.global_hash[:12]}{why}"
        )

    coordinator, network, _ = build(
        config, run_dir, participants=args.participants, faults=faults, on_round=report
    )
    print(f"run directory: {run_dir}")
    start_loss = global_loss(coordinator.global_state().params, trainers)
    print(f"before round 1: loss of the initial model on the union of the data {start_loss:.4f}")
    coordinator.run(args.rounds)
    records = verify(Store(run_dir))
    print(f"ledger verified: {len(records)} records, head {records[-1].record_hash[:12]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
