"""``lensemble-flwr show RUN_DIR``: the run's round attempts as a table (or JSON)."""

from __future__ import annotations

import argparse
import json

from rich.table import Table
from rich.text import Text

from lensemble_flwr.cli.output import EXIT_OK, stdout
from lensemble_flwr.identity.endorsement_report import endorsements_json, review_run
from lensemble_flwr.identity.endorsement_report import summary as endorsement_summary
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.audit import open_run
from lensemble_flwr.provenance.summary import AttemptSummary, RunSummary, summarize_run

NONE = "–"


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``show`` subcommand."""
    parser = commands.add_parser(
        "show",
        help="list every round attempt: state, C_t, participants, epsilon, frame drift",
        description="Print the run's round attempts, closed and aborted, from its manifest "
        "and ledger (reads only; `verify` checks them).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--json", action="store_true", help="print the same as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``show``: the run's attempts as a table (or ``--json``)."""
    summary = summarize_run(args.run_dir)
    endorsed = review_run(open_run(args.run_dir))
    if args.json:
        data = summary.to_json()
        if endorsed is not None:
            data["endorsements"] = endorsements_json(*endorsed)
        print(json.dumps(data, indent=2))
    else:
        stdout().print(table(summary))
        _print_footer(summary)
        if endorsed is not None:
            policy, reviews, _ = endorsed
            stdout().print(f"endorsements: {endorsement_summary(policy, reviews)}")
            for review in reviews:
                if review.status in ("endorsed", "unendorsed", "pending"):
                    stdout().print(f"  round {review.round}: {review.describe()}")
    return EXIT_OK


def _number(value: float | None, digits: int = 3) -> str:
    return NONE if value is None else f"{value:.{digits}g}"


def _epsilon_each(attempt: AttemptSummary) -> str:
    spent = {p: e for p, e in attempt.epsilon.items() if e is not None}
    return " ".join(f"{p}={e:.3g}" for p, e in spent.items()) or NONE


def _notes(attempt: AttemptSummary) -> str:
    """Short tags; an aborted attempt's full reason is printed under the table."""
    notes = []
    if attempt.reason:
        notes.append(attempt.reason.split(":", 1)[0])
    if attempt.late:
        notes.append("late: " + ", ".join(attempt.late))
    if attempt.refused:
        notes.append("refused: " + ", ".join(attempt.refused))
    if attempt.unbound:
        notes.append("UNBOUND: " + ", ".join(attempt.unbound))
    if attempt.secure_sum:
        notes.append("secure sum")
    if attempt.external_change is not None:
        notes.append(f"external step {attempt.external_change:.3g}")
    return "; ".join(notes)


def table(summary: RunSummary) -> Table:
    """The rich table ``show`` prints."""
    grid = Table(title=(f"run {summary.run_id}"), title_justify="left")
    for name, justify in [
        ("round", "right"),
        ("attempt", "right"),
        ("state", "left"),
        ("C_t", "right"),
        ("participants", "left"),
        ("ε max", "right"),
        ("ε each", "left"),
        ("frame drift", "right"),
        ("notes", "left"),
    ]:
        grid.add_column(name, justify=justify)  # type: ignore[arg-type]
    for a in summary.attempts:
        closed = a.state is RoundState.CLOSED
        grid.add_row(
            str(a.round),
            str(a.attempt),
            Text(a.state.value, style="green" if closed else "red"),
            str(a.count) if closed else NONE,
            (", ".join(a.contributors)) or NONE,
            _number(a.epsilon_max),
            (_epsilon_each(a)),
            _number(a.frame_drift),
            (_notes(a)),
        )
    return grid


def _print_footer(summary: RunSummary) -> None:
    out = stdout()
    for a in summary.attempts:
        if a.reason:
            out.print(f"round {a.round} attempt {a.attempt} {a.state}: {a.reason}")
        for pid, why in a.refused.items():
            out.print(f"round {a.round} attempt {a.attempt}: refused {pid}: {why}")
        if a.external_change is not None and a.attempt == 1:
            out.print(
                f"round {a.round}: trained from a model changed after the previous commit "
                f"(external step, change norm {a.external_change:.4g}; a wrapping "
                "strategy's post-aggregation step such as central DP noise)"
            )
    out.print(
        f"closed rounds: {len(summary.closed)}, aborted attempts: {len(summary.aborted)}; "
        f"final global hash {summary.final_global_hash}"
    )
    spent = summary.epsilon_spent()
    guarantees = summary.guarantees()
    for guarantee in guarantees:
        out.print(f"privacy: {guarantee.describe()}")
    if spent:
        against = sorted({party for g in guarantees for party in g.against})
        label = f" (against {', '.join(against)})" if against else ""
        out.print(
            f"epsilon spent{label}: " + ", ".join(f"{p} {e:.4g}" for p, e in spent.items())
        )
