"""``lensemble-flwr report``'s figure: every series a run recorded, one panel per family.

Two sources feed it. The run's ``round-metrics.jsonl`` (:mod:`~lensemble_flwr.provenance.
round_metrics`): the server-side ``evaluate_fn``'s metrics (``server``, round 0 being the
initial model's), the federated evaluation's (``evaluate``) and the train replies'
(``train``, lensemble's bookkeeping under ``lensemble.`` among them). And the ledger and
manifest (:class:`~lensemble_flwr.provenance.summary.RunSummary`): C_t, every numeric
diagnostic, the largest cumulative ε, and the aborted attempts.

A metric's *family* decides its panel: every loss in one panel, every accuracy in
another, lensemble's bookkeeping by what it counts (attempts, participants left out,
seconds, megabytes, messages), and any other metric in a panel of its own name. Known
names get a readable title and a y-axis label with their unit (:data:`BOOKKEEPING`,
:data:`DIAGNOSTICS`); an unknown one gets its name made readable. Every line carries, as
its ``gid``, the series it draws (``server:loss``, ``ledger:C_t`` ...), so that what was
recorded and what was drawn can be compared (two bookkeeping metrics repeat a ledger
series, :data:`SAME_AS_LEDGER`, and are drawn once, as the ledger's). Every panel marks
the rounds that had an aborted attempt with a dashed red line, and the C_t panel each
aborted attempt with a red ×.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from lensemble_flwr.provenance.ledger import FRAME_DRIFT
from lensemble_flwr.provenance.round_metrics import RoundMetrics
from lensemble_flwr.provenance.summary import RunSummary

BOOKKEEPING_PREFIX = "lensemble."
SOURCES = {  # the round-metrics kinds, as a curve's label names them, in drawing order
    "server": "server evaluation",
    "evaluate": "federated evaluation",
    "train": "training replies",
}
LOSS, ACCURACY = ("Loss", "loss"), ("Accuracy", "accuracy")
BOOKKEEPING: dict[str, tuple[str, str, str, float, bool]] = {
    # name -> (panel title, y label, curve label, scale, a count)
    "attempts": ("Attempts per round", "attempts", "attempts", 1.0, True),
    "aborted-attempts": ("Attempts per round", "attempts", "aborted attempts", 1.0, True),
    "seconds": ("Round duration", "seconds", "whole attempt", 1.0, False),
    "round-time": ("Round duration", "seconds", "until its last admitted update", 1.0, False),
    "open-deadline": ("Deadlines", "seconds", "open deadline", 1.0, False),
    "collect-deadline": ("Deadlines", "seconds", "collect deadline", 1.0, False),
    "late": ("Participants left out", "participants", "late", 1.0, True),
    "rejected": ("Participants left out", "participants", "rejected", 1.0, True),
    "refused": ("Participants left out", "participants", "refused", 1.0, True),
    "exchanges": ("Messages exchanged", "messages", "exchanges", 1.0, True),
    "bytes-sent": ("Traffic", "megabytes (MB)", "sent", 1e-6, False),
    "bytes-received": ("Traffic", "megabytes (MB)", "received", 1e-6, False),
}
DIAGNOSTICS = {  # ledger diagnostic -> (panel title, y label)
    "mean_delta_l2": ("Mean update norm", "L2 norm of the mean update"),
    FRAME_DRIFT: ("Latent frame drift", "frame drift"),
}
SAME_AS_LEDGER = {
    "lensemble.C_t": "C_t",
    "lensemble.frame-drift": FRAME_DRIFT,
    "lensemble.epsilon": "epsilon",
}
"""Bookkeeping metrics that repeat a ledger series: drawn once, as the ledger's."""
CONTRIBUTORS = ("Contributors per round", "contributors (C_t)")
EPSILON = ("Privacy spent", "ε (largest cumulative)")
ABORTED = "aborted-attempt"
"""The ``gid`` of the lines that mark a round with an aborted attempt."""


@dataclasses.dataclass
class Curve:
    """One line: its legend label, its points, and the recorded series it draws."""

    label: str
    rounds: list[int]
    values: list[float]
    draws: tuple[str, ...]  # the series drawn ("server:loss", "ledger:C_t", ...)


@dataclasses.dataclass
class Panel:
    """One axes: its title, its y label (with the unit), its lines."""

    title: str
    ylabel: str
    curves: list[Curve]
    integer: bool = False  # a count: integer ticks


def readable(name: str) -> str:
    """A metric name as words: ``global-val-loss`` → ``Global val loss``."""
    words = name.replace("_", " ").replace("-", " ").replace(".", " ").split()
    text = " ".join(words) or name
    return text[:1].upper() + text[1:]


def _family(name: str) -> tuple[str, str]:
    """(panel title, y label) of a user metric."""
    lowered = name.lower()
    if "loss" in lowered:
        return LOSS
    if "acc" in lowered:
        return ACCURACY
    return readable(name), readable(name).lower()


def _in_order(name: str) -> tuple[int, str]:
    """Known bookkeeping in :data:`BOOKKEEPING`'s order, then every other name by name."""
    order = list(BOOKKEEPING)
    short = name[len(BOOKKEEPING_PREFIX) :] if name.startswith(BOOKKEEPING_PREFIX) else None
    return (order.index(short), "") if short in order else (len(order), name)


def metric_panels(metrics: RoundMetrics) -> tuple[list[Panel], list[Panel]]:
    """The panels of the round metrics: the users' families (loss, accuracy, then by
    name), and lensemble's bookkeeping; :data:`SAME_AS_LEDGER` left to the ledger's."""
    panels: dict[str, Panel] = {}
    bookkeeping: dict[str, Panel] = {}
    for kind, source in SOURCES.items():
        names = sorted({n for r in metrics.values() for n in r.get(kind, {})}, key=_in_order)
        for name in names:
            if name in SAME_AS_LEDGER:
                continue
            points = [(r, m[kind][name]) for r, m in metrics.items() if name in m.get(kind, {})]
            rounds, values = [r for r, _ in points], [v for _, v in points]
            short = name[len(BOOKKEEPING_PREFIX) :]
            if name.startswith(BOOKKEEPING_PREFIX) and short in BOOKKEEPING:
                title, ylabel, label, scale, count = BOOKKEEPING[short]
                panel = bookkeeping.setdefault(title, Panel(title, ylabel, [], count))
                curve = Curve(label, rounds, [v * scale for v in values], (f"{kind}:{name}",))
            elif name.startswith(BOOKKEEPING_PREFIX):
                title = readable(short)
                panel = bookkeeping.setdefault(title, Panel(title, title.lower(), []))
                curve = Curve(title.lower(), rounds, values, (f"{kind}:{name}",))
            else:
                title, ylabel = _family(name)
                panel = panels.setdefault(title, Panel(title, ylabel, []))
                curve = Curve(f"{source}: {name}", rounds, values, (f"{kind}:{name}",))
            panel.curves.append(curve)
    first = {LOSS[0]: 0, ACCURACY[0]: 1}  # loss, accuracy, then the others by name
    users = sorted(panels.values(), key=lambda p: (first.get(p.title, 2), p.title))
    return users, list(bookkeeping.values())


def ledger_panels(summary: RunSummary, metrics: RoundMetrics) -> list[Panel]:
    """C_t, ε and every diagnostic, over the closed attempts."""
    closed = summary.closed
    recorded = {f"{k}:{n}" for m in metrics.values() for k, names in m.items() for n in names}

    def draws(series: str) -> tuple[str, ...]:
        same = [f"train:{m}" for m, s in SAME_AS_LEDGER.items() if s == series]
        return (f"ledger:{series}", *[s for s in same if s in recorded])

    rounds = [a.round for a in closed]
    contributors = Curve("closed attempts", rounds, [float(a.count) for a in closed], draws("C_t"))
    panels = [Panel(*CONTRIBUTORS, [contributors], integer=True)]
    eps = [(a.round, a.epsilon_max) for a in closed if a.epsilon_max is not None]
    if eps:
        curve = Curve("ε", [r for r, _ in eps], [float(e) for _, e in eps], draws("epsilon"))
        panels.append(Panel(*EPSILON, [curve]))
    names = summary.diagnostic_names()
    for name in [n for n in DIAGNOSTICS if n in names] + [n for n in names if n not in DIAGNOSTICS]:
        title, ylabel = DIAGNOSTICS.get(name, (readable(name), readable(name).lower()))
        points = [(a.round, a.diagnostics[name]) for a in closed if name in a.diagnostics]
        curve = Curve(ylabel, [r for r, _ in points], [v for _, v in points], draws(name))
        panels.append(Panel(title, ylabel, [curve]))
    return panels


def all_panels(summary: RunSummary, metrics: RoundMetrics) -> list[Panel]:
    """Every panel, in the figure's order: the users' metrics, the ledger's, then
    lensemble's bookkeeping."""
    users, bookkeeping = metric_panels(metrics)
    return users + ledger_panels(summary, metrics) + bookkeeping


def render_figure(summary: RunSummary, metrics: RoundMetrics | None = None) -> Any:
    """The report's matplotlib ``Figure`` (Agg, no pyplot state): :func:`all_panels`,
    two columns once there are more than three, every axis labelled."""
    try:
        from matplotlib.figure import Figure  # Agg canvas, no pyplot state, no display
    except ImportError as exc:
        raise ImportError(
            "lensemble-flwr report draws its PNG with matplotlib, an optional dependency: "
            "pip install 'lensemble-flwr[report]'"
        ) from exc

    panels = all_panels(summary, metrics or {})
    columns = 1 if len(panels) <= 3 else 2
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(6.0 * columns, 2.4 * rows + 0.7), layout="constrained")
    grid = fig.subplots(rows, columns, sharex=True, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(panels) :]:
        fig.delaxes(ax)  # an odd count leaves one cell empty
    aborted = sorted({a.round for a in summary.aborted})
    for ax, panel in zip(axes, panels, strict=False):
        _draw(ax, panel, aborted)
    c_t = next(i for i, p in enumerate(panels) if "ledger:C_t" in p.curves[0].draws)
    _mark_aborted_attempts(axes[c_t], summary)
    fig.suptitle(_suptitle(summary), fontsize=11)
    return fig


def _draw(ax: Any, panel: Panel, aborted: Iterable[int]) -> None:
    for curve in panel.curves:
        (line,) = ax.plot(
            curve.rounds, curve.values, marker="o", markersize=3, linewidth=1.3, label=curve.label
        )
        line.set_gid(" ".join(curve.draws))
    for r in aborted:
        ax.axvline(r, color="tab:red", linestyle="--", linewidth=0.8, alpha=0.5, gid=ABORTED)
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_xlabel("round")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.tick_params(labelbottom=True)  # every panel shows its rounds (the columns end apart)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if panel.integer:  # a count: from 0, with room for whole ticks
        values = [v for c in panel.curves for v in c.values] or [0.0]
        ax.set_ylim(bottom=min(0.0, min(values)) - 0.5, top=max(values) + 0.5)
        ax.yaxis.get_major_locator().set_params(integer=True)
    if len(panel.curves) > 1:
        ax.legend(fontsize=7, loc="best")


def _mark_aborted_attempts(ax: Any, summary: RunSummary) -> None:
    """On the C_t panel ``ax``: each aborted attempt as a red × at C_t = 0, drawn whole,
    and room below 0 for it."""
    aborted = summary.aborted
    if aborted:
        ax.scatter(
            [a.round for a in aborted],
            [a.count for a in aborted],
            marker="x",
            color="tab:red",
            label=f"aborted attempts ({len(aborted)})",
            zorder=3,
            clip_on=False,  # an aborted attempt has C_t = 0: on the axis, drawn whole
        )
        ax.legend(fontsize=7, loc="best")
    ax.set_ylim(bottom=-0.5, top=max([a.count for a in summary.attempts] + [1]) + 0.5)


def _suptitle(summary: RunSummary) -> str:
    closed, aborted = len(summary.closed), len(summary.aborted)
    plural = "s" if aborted != 1 else ""
    title = f"Run {summary.run_id}: {closed} rounds closed, {aborted} aborted attempt{plural}"
    return title + (" (dashed red: a round with an aborted attempt)" if aborted else "")
