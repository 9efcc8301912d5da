"""The same script on every node: a toy federation whose rounds meet in a shared folder.

Four processes on one machine: make their identity keys once (outside the shared folder:
the folder authenticates nothing), then run one process per participant::

    python -m lensemble_flwr.simulations.shared_folder_demo --make-keys keys --participants 4
    for i in 0 1 2 3; do
      python -m lensemble_flwr.simulations.shared_folder_demo --folder /tmp/fed \\
          --keys keys --participant-index $i --participants 4 --rounds 5 &
    done; wait

On a Slurm cluster, one task per participant (the index and the count come from
``SLURM_PROCID`` and ``SLURM_NTASKS``)::

    srun --ntasks=4 python -m lensemble_flwr.simulations.shared_folder_demo \\
        --folder $SCRATCH/fed --keys $HOME/fed-keys --rounds 5

Each process prints one line per round and, at the end, one JSON line: the global state
it left with, and the rounds it decided (exactly one process decides each).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from lensemble_flwr.atomic_write import user_file_mode, write_atomically
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.shared_folder.records import Outcome
from lensemble_flwr.shared_folder.runner import SharedFolderParticipant
from lensemble_flwr.simulations.toy import ToyTrainer, global_loss, initial_params


def participant_ids(count: int) -> list[str]:
    """The demo's participant ids: p00, p01, …"""
    return [f"p{i:02d}" for i in range(count)]


def make_keys(folder: Path, ids: list[str]) -> None:
    """A P-256 identity key pair per participant: ``<id>.key`` (owner-only) and ``<id>.pub``."""
    folder.mkdir(parents=True, exist_ok=True)
    for pid in ids:
        key = IdentityKey.generate()
        # owner-only from its first byte: the temp file is made 0o600 before it is filled
        write_atomically(folder / f"{pid}.key", key.private_openssh(), sync=True, mode=0o600)
        public = (key.public_openssh + "\n").encode()
        write_atomically(folder / f"{pid}.pub", public, sync=True, mode=user_file_mode())


def keys_of(folder: Path, me: str, ids: list[str]) -> dict[str, Any]:
    """This participant's identity key and everyone's public keys, from ``folder``."""
    return {
        "identity": IdentityKey.load(folder / f"{me}.key"),
        "identities": {pid: (folder / f"{pid}.pub").read_text().strip() for pid in ids},
    }


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def main(argv: list[str] | None = None) -> int:
    """Run this node's participant (or, with ``--make-keys``, write the key pairs) and
    print a JSON summary; exits 1 when the run ended in a LensembleError."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", help="the folder every process mounts")
    parser.add_argument(
        "--keys", metavar="DIR",
        help="identity keys, outside the shared folder: this participant's private key "
        "<id>.key and every participant's public key <id>.pub",
    )  # fmt: skip
    parser.add_argument(
        "--make-keys", metavar="DIR",
        help="write a key pair for each of --participants into DIR, and exit",
    )  # fmt: skip
    parser.add_argument(
        "--unauthenticated", action="store_true",
        help="run without keys: anyone who can write the folder can act for anyone",
    )  # fmt: skip
    parser.add_argument(
        "--participant-index", type=int, default=_env_int("SLURM_PROCID"),
        help="this process's participant (default: $SLURM_PROCID)",
    )  # fmt: skip
    parser.add_argument(
        "--participants", type=int, default=_env_int("SLURM_NTASKS"),
        help="how many participants the run has (default: $SLURM_NTASKS)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--run-id", default="shared-folder-demo")
    parser.add_argument(
        "--quorum", type=int, default=None,
        help="at the deadline, go on without stragglers if at least this many came",
    )  # fmt: skip
    parser.add_argument("--round-timeout", type=float, default=120.0)
    parser.add_argument("--publish-timeout", type=float, default=60.0)
    parser.add_argument("--poll-interval", type=float, default=0.05)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.make_keys is not None:
        if args.participants is None:
            parser.error("--make-keys needs --participants")
        make_keys(Path(args.make_keys), participant_ids(args.participants))
        return 0
    if args.folder is None:
        parser.error("--folder is required")
    if args.participants is None or args.participant_index is None:
        parser.error("--participants and --participant-index are required outside Slurm")
    if not 0 <= args.participant_index < args.participants:
        parser.error(f"--participant-index must be in [0, {args.participants})")
    if (args.keys is None) == (not args.unauthenticated):
        parser.error("pass --keys DIR (see --make-keys), or --unauthenticated")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    use_torch_threads(args.participants)  # one participant per process; N share the machine

    ids = participant_ids(args.participants)
    me = ids[args.participant_index]
    config = LensembleConfig(
        federation={"min_participants": min(args.participants, 2), "root_seed": 0},
        inner={"steps": args.inner_steps, "lr": 0.02, "weight_decay": 0.0},
        outer={"lr": 0.7, "momentum": 0.9},
    )
    everyone = [ToyTrainer(i) for i in range(args.participants)]  # the toy's data is public

    def report(outcome: Outcome) -> None:
        line = f"[{me}] round {outcome.round} sitting {outcome.sitting}: {outcome.state}"
        if outcome.state is RoundState.CLOSED:
            line += f" C_t={len(outcome.contributors)} global={outcome.global_hash[:12]}"
        else:
            line += f" ({outcome.error}: {outcome.reason})"
        print(f"{line} decided by {outcome.decided_by}", flush=True)

    node = SharedFolderParticipant(
        args.folder,
        config=config,
        participant_id=me,
        trainer=ToyTrainer(args.participant_index),
        participants=ids,
        initial_params=initial_params(),
        run_id=args.run_id,
        quorum=args.quorum,
        round_timeout=args.round_timeout,
        publish_timeout=args.publish_timeout,
        poll_interval=args.poll_interval,
        on_outcome=report,
        **keys_of(Path(args.keys), me, ids) if args.keys else {"unauthenticated": True},
    )
    summary: dict[str, Any] = {"participant": me, "pid": os.getpid()}
    try:
        state = node.run(args.rounds)
    except LensembleError as exc:
        summary["error"] = {"type": type(exc).__name__, "message": str(exc)}
        status = 1
    else:
        summary |= {
            "round": state.round,
            "global_hash": state.params_hash,
            "loss": global_loss(state.params, everyone),
        }
        status = 0
    summary["decided"] = [[d.key.round, d.key.sitting, d.state] for d in node.decisions]
    summary["deposited"] = [[k.round, k.sitting] for k in node.deposits]
    print(json.dumps(summary, sort_keys=True), flush=True)
    if status:
        print(f"[{me}] {summary['error']['type']}: {summary['error']['message']}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
