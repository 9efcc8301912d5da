"""``lensemble-flwr``: audit and inspect run directories from the command line.

    lensemble-flwr verify RUN_DIR          every link holds (exit 0) or the first broken one (1)
    lensemble-flwr show RUN_DIR [--json]   round attempts: state, C_t, epsilon, frame drift
    lensemble-flwr report RUN_DIR          per-round curves (PNG) and a markdown summary
    lensemble-flwr average RUN_DIR --out MODEL.safetensors   a weighted average of the models
    lensemble-flwr export RUN_DIR OUT [--round N] [--format safetensors|torch]   the model
    lensemble-flwr prove ...               participant: an inclusion proof for one record
    lensemble-flwr check-proof RUN_DIR PROOF.json --participant ID
    lensemble-flwr --version

``python -m lensemble_flwr`` is the same command.

Exit codes: 0 success, 1 a check failed or the run could not be read as evidence,
2 bad usage (arguments, a path that is not a run directory or not readable) or a missing
optional dependency (``report`` needs ``pip install 'lensemble-flwr[report]'``).
See docs/cli.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import metadata

from lensemble_flwr.cli import average, export, proof, report, show, verify
from lensemble_flwr.cli.output import EXIT_FAILED, EXIT_USAGE, UsageError, stderr
from lensemble_flwr.errors import LensembleError
from lensemble_flwr.provenance.audit import NotARunDirectory

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``lensemble-flwr`` argument parser, with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="lensemble-flwr",
        description="Audit and inspect lensemble-flwr run directories (see docs/cli.md).",
    )
    parser.add_argument("--version", action="version", version=f"lensemble-flwr {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    verify.add_parser(commands)
    show.add_parser(commands)
    report.add_parser(commands)
    average.add_parser(commands)
    export.add_parser(commands)
    proof.add_parsers(commands)
    return parser


def _version() -> str:
    try:
        return metadata.version("lensemble-flwr")
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    err = stderr()
    try:
        return int(args.run(args))
    except (UsageError, NotARunDirectory) as exc:
        err.print(f"lensemble-flwr {args.command}: {exc}", style="red")
        return EXIT_USAGE
    except ImportError as exc:  # an optional dependency; the message names its extra
        err.print(f"lensemble-flwr {args.command}: {exc}", style="red")
        return EXIT_USAGE
    except LensembleError as exc:
        err.print(f"lensemble-flwr {args.command}: {type(exc).__name__}: {exc}", style="red")
        return EXIT_FAILED
    except OSError as exc:
        err.print(f"lensemble-flwr {args.command}: {exc}", style="red")
        return EXIT_USAGE
