"""``lensemble-flwr export RUN_DIR OUT``: the run's global model as a file a training
script loads (safetensors, by the app's names: ``safetensors.torch.load_file`` gives the
``state_dict``), checked against the
ledger first (:mod:`lensemble_flwr.provenance.export`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lensemble_flwr.atomic_write import user_file_mode, write_atomically, write_once
from lensemble_flwr.cli.output import EXIT_OK, UsageError, stdout
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.provenance.audit import open_run
from lensemble_flwr.provenance.export import FORMATS, committed_model, encode_model


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``export`` subcommand."""
    parser = commands.add_parser(
        "export",
        help="write the run's global model (safetensors)",
        description="Verify the run, then write the global model round N left (the newest "
        "round by default) by the names the app gave its arrays, after checking its "
        "checkpoint against the hash the ledger names. Written to a temporary file, then "
        "renamed: never half a file; an existing OUT is refused unless --force.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("out", metavar="OUT", type=Path)
    parser.add_argument(
        "--round", type=int, default=None, metavar="N", help="a committed round (the newest)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="safetensors",
        help="safetensors (the one format: loading it runs no code, unlike a pickle)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing OUT")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``export``: the checks on OUT, the model, the file."""
    out: Path = args.out
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent} is not a directory")
    if out.is_dir():
        raise UsageError(f"{out} is a directory, not a file to write")
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists (--force replaces it)")
    try:
        model = committed_model(open_run(args.run_dir), args.round)
    except ConfigError as exc:  # --round below 1: checked before any read
        raise UsageError(f"--{exc}") from None
    data = encode_model(model, args.format)
    if args.force:
        write_atomically(out, data, sync=True, mode=user_file_mode())
    elif not write_once(out, data, sync=True, mode=user_file_mode()):
        raise UsageError(f"{out} exists (--force replaces it)")  # made meanwhile: left as is
    which = (
        f"the model round {model.round}'s external step adopted"
        if model.external_step
        else f"round {model.round}'s global model"
    )
    stdout().print(
        f"wrote {out}: {which}, {len(model.params)} tensors "
        f"({args.format}), params hash {model.params_hash}"
    )
    return EXIT_OK
