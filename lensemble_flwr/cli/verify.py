"""``lensemble-flwr verify RUN_DIR``: every link of a run's evidence, or the first broken one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from lensemble_flwr.cli.output import EXIT_FAILED, EXIT_OK, status, stdout
from lensemble_flwr.identity.endorsement import RecordEndorsement
from lensemble_flwr.identity.endorsement_report import (
    endorsements_json,
    review_run,
    round_spans,
    summary,
)
from lensemble_flwr.provenance.audit import AuditReport, Finding, audit_run, open_run
from lensemble_flwr.provenance.ledger import EndorsementPolicy
from lensemble_flwr.provenance.verify import LinkBreak


def _record_hash(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise argparse.ArgumentTypeError("expected a full record hash: 64 lower-case hex digits")
    return value


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``verify`` subcommand."""
    parser = commands.add_parser(
        "verify",
        help="check a run directory's ledger, checkpoints and manifest against each other",
        description=(
            "Recompute the ledger's hash chain, re-hash every kept checkpoint (listing "
            "those a retention policy pruned), check that the manifest and the ledger "
            "agree round by round, and that every record carries the endorsements of "
            "the participants it names that its policy requires. Exits 0 when every "
            "link holds, 1 naming the first broken link."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument(
        "--expect-head",
        type=_record_hash,
        metavar="HASH",
        help="the record hash the newest ledger record must carry (e.g. from a "
        "participant's last RoundClose); without it the newest record is only as "
        "trustworthy as the directory",
    )
    parser.add_argument("--all", action="store_true", help="list every finding, not the first")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``verify``: audit the run; ``EXIT_OK`` when every link holds, else ``EXIT_FAILED``."""
    with status(f"auditing {args.run_dir}"):
        report = audit_run(args.run_dir, expected_head=args.expect_head)
        endorsed = review_run(open_run(args.run_dir))
    if endorsed is not None:  # forged endorsements and unendorsed records are findings
        found = tuple(
            Finding(f"round {b.round}", b.field, str(b.expected), str(b.found), b.round)
            for b in endorsed[2]
        )
        report = dataclasses.replace(report, findings=report.findings + found)
    if args.json:
        data = report.to_json()
        if endorsed is not None:
            data["endorsements"] = endorsements_json(*endorsed)
        print(json.dumps(data, indent=2))
    else:
        _print(report, every=args.all, endorsed=endorsed)
    return EXIT_OK if report.ok else EXIT_FAILED


def _print(
    report: AuditReport,
    *,
    every: bool,
    endorsed: tuple[EndorsementPolicy | None, list[RecordEndorsement], list[LinkBreak]] | None,
) -> None:
    out = stdout()
    out.print(f"run {report.run_id or '?'} at {report.run_dir}")
    out.print(f"  rounds closed      {report.rounds_closed}")
    out.print(f"  attempts aborted   {report.attempts_aborted}")
    out.print(f"  ledger records     {report.records}, head {report.head_record_hash or '-'}")
    out.print(f"  checkpoints        {report.checkpoints}")
    if report.pruned:
        out.print(
            f"  pruned             {len(report.pruned)} (rounds {round_spans(report.pruned)}; "
            "the ledger keeps their hashes)"
        )
    out.print(f"  final global hash  {report.final_global_hash or '-'}")
    if endorsed is not None:
        out.print(f"  endorsements       {summary(endorsed[0], endorsed[1])}")
    if report.ok:
        out.print(
            "verified: hash chain, checkpoints, manifest and endorsements agree", style="green"
        )
        return
    first, rest = report.findings[0], report.findings[1:]
    out.print(f"BROKEN {first}", style="red")
    if every:
        for finding in rest:
            out.print(f"  also: {finding}")
    elif rest:
        out.print(f"  ({len(rest)} more finding{'s' if len(rest) != 1 else ''}; --all lists them)")
