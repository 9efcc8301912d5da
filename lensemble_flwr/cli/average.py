"""``lensemble-flwr average RUN_DIR --out MODEL.safetensors``: publish an exponentially
weighted average of the run's committed models (post-processing: under DP it costs no
epsilon; see docs/privacy.md, *Publishing an average of the last models*)."""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.numpy import save

from lensemble_flwr.cli.output import EXIT_OK, UsageError, stdout, write_output
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.provenance.audit import open_run
from lensemble_flwr.provenance.averaging import averaged_model


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``average`` subcommand."""
    parser = commands.add_parser(
        "average",
        help="write an exponentially weighted average of the run's committed models",
        description="Verify the run's ledger, then average the global models of its newest "
        "rounds, round r of R weighted by DECAY^(R-r), and write them as safetensors "
        "(written to a temporary file, then renamed: never half a file).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", required=True, metavar="MODEL.safetensors")
    parser.add_argument("--decay", type=float, default=0.8, help="β in [0, 1) (default 0.8)")
    parser.add_argument("--last", type=int, default=None, help="rounds to average (default: all)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``average``: the average, written to ``--out``; which rounds and weights went in."""
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent} is not a directory")
    if out.is_dir():
        raise UsageError(f"{out} is a directory, not a file to write")
    try:
        averaged = averaged_model(open_run(args.run_dir), decay=args.decay, last=args.last)
    except ConfigError as exc:  # --decay or --last out of range: checked before any read
        raise UsageError(f"--{exc}") from None
    metadata = {
        "rounds": ",".join(map(str, averaged.rounds)),
        "weights": ",".join(f"{w:.17g}" for w in averaged.weights),
    }
    write_output(out, save(dict(averaged.params), metadata=metadata))
    first, last = averaged.rounds[0], averaged.rounds[-1]
    stdout().print(
        f"wrote {out}: the models of rounds {first}-{last}, weighted by {args.decay:g}^(age) "
        f"(newest {averaged.weights[-1]:.3f})"
    )
    return EXIT_OK
