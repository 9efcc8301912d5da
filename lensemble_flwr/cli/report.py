"""``lensemble-flwr report RUN_DIR``: every per-round series of a run as a PNG, and a short
markdown summary (the figure is drawn by ``lensemble_flwr.cli.figure``)."""

from __future__ import annotations

import argparse
import dataclasses
import io
from pathlib import Path

from lensemble_flwr.cli.figure import render_figure
from lensemble_flwr.cli.output import EXIT_OK, status, stderr, stdout, write_output
from lensemble_flwr.provenance.audit import AuditReport, audit_run
from lensemble_flwr.provenance.ledger import FRAME_DRIFT
from lensemble_flwr.provenance.round_metrics import RoundMetrics, read_round_metrics
from lensemble_flwr.provenance.summary import RunSummary, summarize_run

PNG_NAME = "rounds.png"
MARKDOWN_NAME = "report.md"
_FIRST_DIAGNOSTICS = ("mean_delta_l2", FRAME_DRIFT)  # shown first, in this order


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``report`` subcommand."""
    parser = commands.add_parser(
        "report",
        help="write per-round curves (PNG) and a markdown summary of a run",
        description=f"Write {PNG_NAME} (one labelled panel per family of series the run "
        "recorded, against the round: the server's and the federated evaluation's metrics "
        "and the train replies' from its round-metrics.jsonl, C_t, epsilon, every numeric "
        "diagnostic, lensemble's bookkeeping; rounds with aborted attempts marked) "
        f"and {MARKDOWN_NAME} (outcome, aborts and their reasons, final hashes, epsilon "
        "spent, the evaluation's first and last values, the audit's verdict).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="output folder (RUN_DIR/report)"
    )
    parser.set_defaults(run=run)


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    """The two files a report writes."""

    png: Path
    markdown: Path


def run(args: argparse.Namespace) -> int:
    """``report``: write both files (to ``--out``, else ``RUN_DIR/report``); a run that
    does not verify is still reported, with a warning."""
    out_dir = args.out if args.out is not None else Path(args.run_dir) / "report"
    with status(f"reading and auditing {args.run_dir}"):
        files, audit = write_report(args.run_dir, out_dir)
    stdout().print(f"wrote {files.png} and {files.markdown}")
    if not audit.ok:
        stderr().print(f"warning: the run does not verify: {audit.first}", style="red")
    return EXIT_OK


def write_report(run_dir: str | Path, out_dir: Path) -> tuple[ReportFiles, AuditReport]:
    """Render both files, then publish them (PNG first, since the markdown links to it).

    Nothing is written unless both rendered. The audit's verdict is part of the report;
    a run that does not verify is still reported.
    """
    summary = summarize_run(run_dir)
    audit = audit_run(run_dir)
    metrics = read_round_metrics(run_dir)
    png = render_png(summary, metrics)
    markdown = render_markdown(summary, audit, PNG_NAME, metrics)
    files = ReportFiles(out_dir / PNG_NAME, out_dir / MARKDOWN_NAME)
    write_output(files.png, png)
    write_output(files.markdown, markdown.encode("utf-8"))
    return files, audit


def _diagnostics_in_order(summary: RunSummary) -> list[str]:
    names = summary.diagnostic_names()
    return [n for n in _FIRST_DIAGNOSTICS if n in names] + [
        n for n in names if n not in _FIRST_DIAGNOSTICS
    ]


def render_png(summary: RunSummary, metrics: RoundMetrics | None = None) -> bytes:
    """:func:`render_figure` as PNG bytes."""
    fig = render_figure(summary, metrics)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return buf.getvalue()


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(
    summary: RunSummary, audit: AuditReport, png_name: str, metrics: RoundMetrics | None = None
) -> str:
    """The summary a reader opens first."""
    if audit.ok:
        verdict = f"passed ({audit.records} records, {audit.checkpoints} checkpoints)"
    else:
        verdict = f"**FAILED**: {_cell(audit.first)} ({len(audit.findings)} findings)"
    lines = [
        f"# Run {_cell(summary.run_id)}",
        "",
        f"![per-round curves]({png_name})",
        "",
        "| | |",
        "| --- | --- |",
        f"| rounds closed | {len(summary.closed)} |",
        f"| attempts aborted | {len(summary.aborted)} |",
        f"| initial global hash | `{summary.initial_params_hash}` |",
        f"| final global hash | `{summary.final_global_hash}` |",
        f"| ledger head | `{summary.head_record_hash or '-'}` |",
        f"| audit (`lensemble-flwr verify`) | {verdict} |",
        "",
        "## Aborted attempts",
        "",
    ]
    if summary.aborted:
        lines += [
            f"- round {a.round}, attempt {a.attempt}: {_cell(a.reason or 'no reason recorded')}"
            for a in summary.aborted
        ]
    else:
        lines.append("None.")
    lines += ["", "## Privacy", ""]
    spent = summary.epsilon_spent()
    if spent:
        lines += ["| participant | epsilon spent |", "| --- | --- |"]
        lines += [f"| {_cell(p)} | {e:.4g} |" for p, e in spent.items()]
    else:
        lines.append("No differentially private release was recorded.")
    lines += ["", "## Evaluation", "", *_evaluation_lines(metrics or {})]
    names = _diagnostics_in_order(summary)
    lines += ["", "## Closed rounds", ""]
    header = ["round", "attempt", "C_t", *names, "epsilon max"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for a in summary.closed:
        values = [f"{a.diagnostics[n]:.4g}" if n in a.diagnostics else "–" for n in names]
        eps = "–" if a.epsilon_max is None else f"{a.epsilon_max:.4g}"
        lines.append(
            f"| {a.round} | {a.attempt} | {a.count} | " + " | ".join([*values, eps]) + " |"
        )
    return "\n".join(lines) + "\n"


def _evaluation_lines(metrics: RoundMetrics) -> list[str]:
    """The server's and the federated evaluation's metrics, first and last recorded value
    each (round 0: the initial model's)."""
    rows = []
    for kind, source in (("server", "server evaluation"), ("evaluate", "federated evaluation")):
        names = sorted({n for m in metrics.values() for n in m.get(kind, {})})
        for name in names:
            points = [(r, m[kind][name]) for r, m in metrics.items() if name in m.get(kind, {})]
            (r0, v0), (r1, v1) = points[0], points[-1]
            rows.append(
                f"| {source} | {_cell(name)} | {v0:.4g} (round {r0}) | {v1:.4g} (round {r1}) |"
            )
    if not rows:
        return ["No evaluation was recorded (round-metrics.jsonl holds none)."]
    return ["| source | metric | first | last |", "| --- | --- | --- | --- |", *rows]
