"""``lensemble-flwr prove`` (participant side) and ``check-proof`` (auditor side): show that
one record is in the dataset a participant committed to."""

from __future__ import annotations

import argparse
import base64
import binascii
import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lensemble_flwr.cli.output import EXIT_OK, UsageError, status, stdout, write_output
from lensemble_flwr.config import default_state_dir
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.provenance.audit import open_run
from lensemble_flwr.provenance.commitment_secret import read_commitment_secret
from lensemble_flwr.provenance.inclusion import (
    InclusionProof,
    check_against_ledger,
    prove_inclusion,
)


def add_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``prove`` and ``check-proof`` subcommands."""
    prove = commands.add_parser(
        "prove",
        help="participant side: a proof bundle that one of your records is in your commitment",
        description="Build a Merkle inclusion proof for record INDEX of your dataset, in the "
        "order your trainer's dataset_records() yields it (the order fixes the root).",
    )
    source = prove.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--records-from",
        metavar="MODULE:NAME",
        help="a Python callable returning your records (an iterable of bytes), or an object "
        "with dataset_records(), e.g. my_node.data:records",
    )
    source.add_argument(
        "--records-file", type=Path, metavar="FILE", help="one base64-encoded record per line"
    )
    prove.add_argument("--index", type=int, required=True, help="which record (0-based)")
    prove.add_argument("--participant", metavar="ID", help="your participant id (informative)")
    salt = prove.add_mutually_exclusive_group()
    salt.add_argument(
        "--stable-id",
        metavar="ID",
        help="the identity your participant keeps its commitment secret under (default: "
        "--participant; a Flower node: partition-id-<n>, lensemble-id-<name> or key-<fingerprint>)",
    )
    salt.add_argument(
        "--unsalted",
        action="store_true",
        help="the commitment is an unsalted tree (no secret: public data, or a test)",
    )
    prove.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="your participant's state directory (its dp-state-dir; default: the default one)",
    )
    prove.add_argument("--out", type=Path, metavar="PROOF.json", help="write here, not stdout")
    prove.set_defaults(run=run_prove)

    check = commands.add_parser(
        "check-proof",
        help="auditor side: check a proof bundle against the root the run's ledger recorded",
        description="Verify the run's ledger, take the dataset root it records for the "
        "participant, and check that the bundle's record leads to that root. Exits 0 if so, "
        "1 naming what does not hold.",
    )
    check.add_argument("run_dir", metavar="RUN_DIR")
    check.add_argument("proof", type=Path, metavar="PROOF.json")
    check.add_argument("--participant", required=True, metavar="ID")
    check.set_defaults(run=run_check)


def load_records_from(spec: str) -> Iterable[bytes]:
    """The records named by ``module:attribute`` (a callable, or an object with
    ``dataset_records()``; a callable may return either)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--records-from {spec!r}: expected MODULE:NAME")
    if os.getcwd() not in sys.path:  # a console script does not put the cwd on the path
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--records-from {spec!r}: cannot import {module_name}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--records-from {spec!r}: {module_name} has no {attr}")
        target = getattr(target, part)
    if not hasattr(target, "dataset_records") and callable(target):
        try:
            target = target()
        except Exception as exc:  # the participant's own code: report it, do not crash
            raise UsageError(f"--records-from {spec!r}: {type(exc).__name__}: {exc}") from None
    if hasattr(target, "dataset_records"):
        target = target.dataset_records()
    if target is None or isinstance(target, (bytes, str)) or not hasattr(target, "__iter__"):
        raise UsageError(f"--records-from {spec!r} did not give an iterable of records")
    return target  # type: ignore[no-any-return]


def load_records_file(path: Path) -> list[bytes]:
    """The records of ``--records-file``: one base64 record per line."""
    try:
        lines = path.read_text("ascii").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--records-file {path}: {exc}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(base64.b64decode(line.strip(), validate=True))
        except (binascii.Error, ValueError):
            raise UsageError(f"--records-file {path}, line {number}: not base64") from None
    return records


def run_prove(args: argparse.Namespace) -> int:
    """``prove``: the inclusion proof bundle of record ``--index``, salted with the
    participant's commitment secret unless ``--unsalted``, to stdout or ``--out``."""
    if args.records_from is not None:
        records = list(load_records_from(args.records_from))
    else:
        records = load_records_file(args.records_file)
    for i, record in enumerate(records):
        if not isinstance(record, bytes):
            raise UsageError(f"record {i} is a {type(record).__name__}, not bytes")
    if not 0 <= args.index < len(records):
        raise UsageError(f"--index {args.index}: the dataset has {len(records)} records")
    secret = None
    if not args.unsalted:
        identity = args.stable_id or args.participant
        if identity is None:
            raise UsageError(
                "name the identity of your commitment secret: --stable-id or --participant "
                "(or --unsalted)"
            )
        try:
            secret = read_commitment_secret(args.state_dir or default_state_dir(), identity)
        except ConfigError as exc:
            raise UsageError(f"{exc.reason}; pass --state-dir, or --unsalted") from None
    bundle = prove_inclusion(records, args.index, participant_id=args.participant, secret=secret)
    if args.out is None:
        print(bundle.to_json(), end="")
    else:
        write_output(args.out, bundle.to_json().encode("utf-8"))
        stdout().print(
            f"wrote {args.out}: record {bundle.index} of {bundle.size}, root {bundle.root}"
        )
    return EXIT_OK


def run_check(args: argparse.Namespace) -> int:
    """``check-proof``: accept the bundle against the root the run's ledger records for
    ``--participant`` (a refusal raises, and ``main`` exits 1)."""
    store = open_run(args.run_dir)
    proof = InclusionProof.from_json(args.proof.read_bytes())  # OSError: main exits 2
    with status("verifying the ledger"):
        accepted = check_against_ledger(proof, store, args.participant)
    rounds = accepted.rounds
    stdout().print(
        f"accepted: record {accepted.index} of {accepted.size} is in the dataset "
        f"{accepted.participant_id} committed to (root {accepted.root}); the ledger binds "
        f"that root to its updates in {len(rounds)} round(s), {rounds[0]} to {rounds[-1]}",
        style="green",
    )
    return EXIT_OK
