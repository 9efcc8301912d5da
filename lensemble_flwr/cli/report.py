"""``lensemble-flwr report RUN_DIR``: per-round curves as a PNG and a short markdown summary."""

from __future__ import annotations

import argparse
import dataclasses
import io
from pathlib import Path
from typing import Any

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
        description=f"Write {PNG_NAME} (training and validation loss and accuracy from the "
        "run's round-metrics.jsonl when it has one, C_t, every numeric diagnostic and "
        "epsilon per round) "
        f"and {MARKDOWN_NAME} (outcome, aborts and their reasons, final hashes, epsilon "
        "spent, the audit's verdict).",
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
    png = render_png(summary, read_round_metrics(run_dir))
    markdown = render_markdown(summary, audit, PNG_NAME)
    files = ReportFiles(out_dir / PNG_NAME, out_dir / MARKDOWN_NAME)
    write_output(files.png, png)
    write_output(files.markdown, markdown.encode("utf-8"))
    return files, audit


def _diagnostics_in_order(summary: RunSummary) -> list[str]:
    names = summary.diagnostic_names()
    return [n for n in _FIRST_DIAGNOSTICS if n in names] + [
        n for n in names if n not in _FIRST_DIAGNOSTICS
    ]


def _series(summary: RunSummary) -> list[tuple[str, list[int], list[float]]]:
    """(title, rounds, values) per panel, over the closed attempts."""
    closed = summary.closed
    panels = [("C_t (contributors)", [a.round for a in closed], [float(a.count) for a in closed])]
    for name in _diagnostics_in_order(summary):
        points = [(a.round, a.diagnostics[name]) for a in closed if name in a.diagnostics]
        panels.append((name, [r for r, _ in points], [v for _, v in points]))
    eps = [(a.round, a.epsilon_max) for a in closed if a.epsilon_max is not None]
    if eps:
        panels.append(("epsilon (largest cumulative)", [r for r, _ in eps], [e for _, e in eps]))
    return panels


Curve = tuple[str, list[int], list[float]]
LOSS_PANEL, ACCURACY_PANEL = "loss (training and validation)", "accuracy"


def metric_panels(metrics: RoundMetrics) -> list[tuple[str, list[Curve]]]:
    """The loss and accuracy panels of the run's per-round metrics: every metric whose
    name holds ``loss`` (or ``accuracy``), labelled ``evaluate: <name>`` or ``train
    replies: <name>``; a panel with no series is left out."""
    panels: list[tuple[str, list[Curve]]] = []
    for title, word in ((LOSS_PANEL, "loss"), (ACCURACY_PANEL, "accuracy")):
        curves: list[Curve] = []
        for kind, label in (("evaluate", "evaluate"), ("train", "train replies")):
            names = sorted({n for r in metrics.values() for n in r.get(kind, {}) if word in n})
            for name in names:
                points = [(r, m[kind][name]) for r, m in metrics.items() if name in m.get(kind, {})]
                curves.append((f"{label}: {name}", [r for r, _ in points], [v for _, v in points]))
        if curves:
            panels.append((title, curves))
    return panels


def render_png(summary: RunSummary, metrics: RoundMetrics | None = None) -> bytes:
    """:func:`render_figure` as PNG bytes."""
    fig = render_figure(summary, metrics)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return buf.getvalue()


def render_figure(summary: RunSummary, metrics: RoundMetrics | None = None) -> Any:
    """The report's matplotlib ``Figure`` (Agg, no pyplot state): the loss and accuracy
    panels of ``metrics`` (the run's ``round-metrics.jsonl``) when there are any, then one
    panel per ledger series against the round index; aborted attempts marked on C_t
    (integer ticks)."""
    try:
        from matplotlib.figure import Figure  # Agg canvas, no pyplot state, no display
    except ImportError as exc:
        raise ImportError(
            "lensemble-flwr report draws its PNG with matplotlib, an optional dependency: "
            "pip install 'lensemble-flwr[report]'"
        ) from exc

    panels = _series(summary)
    curves = metric_panels(metrics or {})
    count = len(curves) + len(panels)
    fig = Figure(figsize=(7.0, 1.9 * count + 0.6), layout="constrained")
    all_axes = fig.subplots(count, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, series) in zip(all_axes, curves, strict=False):
        for label, rounds, values in series:
            ax.plot(rounds, values, marker="o", markersize=3, linewidth=1.2, label=label)
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes = all_axes[len(curves) :]
    for ax, (title, rounds, values) in zip(axes, panels, strict=True):
        ax.plot(rounds, values, marker="o", markersize=3, linewidth=1.2)
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    aborted = summary.aborted
    if aborted:
        axes[0].scatter(
            [a.round for a in aborted],
            [a.count for a in aborted],
            marker="x",
            color="tab:red",
            label=f"aborted attempts ({len(aborted)})",
            zorder=3,
            clip_on=False,  # an aborted attempt has C_t = 0: on the axis, drawn whole
        )
        axes[0].legend(fontsize=8, loc="best")
    # C_t counts contributors: integer ticks, and room below 0 for the aborted attempts
    axes[0].set_ylim(bottom=-0.5, top=max([a.count for a in summary.attempts] + [1]) + 0.5)
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    all_axes[-1].set_xlabel("round")
    all_axes[-1].xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"run {summary.run_id}", fontsize=10)
    return fig


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(summary: RunSummary, audit: AuditReport, png_name: str) -> str:
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
