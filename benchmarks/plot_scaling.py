"""Scaling: time per round against C (participants) and P (parameters), one plot and one
table, from the JSON the scaling benchmarks write.

Run ``python benchmarks/plot_scaling.py`` after

* ``bench_scale_plaintext.py --out benchmarks/results/scale-plaintext.json`` (required:
  plaintext rounds in process, P = 10,100, C up to 10,000);
* ``bench_scale_masked.py`` with its JSON output (optional, ``--masked``): per C, the wall
  seconds per round of its ``plain``/``plaintext``, ``sparse`` and ``full`` arms — either
  its ``{"params": P, "results": [{"c": C, "best": {arm: {"wall": s}}}]}`` or rows
  ``{"c": C, arm: s}`` under ``"results"`` or ``"rows"``;
* ``bench_large_model.py`` (optional, ``--large-model``; ``results/large-model.json``):
  one coordinator round at P = 100M, C = 4 (its ``round_seconds``, best of them).

It writes ``--png`` (log-log time per round against C, one line per arm measured at two
C or more) and prints a
markdown table: one row per arm and P, one column per C, seconds per round (best of the
measured rounds where a benchmark keeps several), and the least-squares exponent of
time in C for every arm measured at two C or more. Only the files given (or found at
their defaults) are read; a missing optional one leaves its arms out.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
ARM_NAMES = {"plain": "plaintext", "plaintext": "plaintext", "sparse": "sparse", "full": "full"}

Arm = tuple[str, int, dict[int, float]]
"""(label, P, {C: seconds per round})."""


def _seconds(value: Any) -> float | None:
    if isinstance(value, Mapping):
        value = value.get("wall")
    return float(value) if isinstance(value, (int, float)) else None


def plaintext_arm(figures: Mapping[str, Any]) -> Arm:
    """The plaintext in-process arm of ``bench_scale_plaintext.py``'s JSON."""
    sizes, walls = figures["sizes"], figures["wall_seconds_per_round"]
    return ("plaintext, in process", int(figures["params"]), dict(zip(sizes, walls, strict=True)))


def masked_arms(figures: Mapping[str, Any]) -> list[Arm]:
    """The arms of ``bench_scale_masked.py``'s JSON (see the module for the shapes)."""
    rows = figures.get("results", figures.get("rows"))
    if not isinstance(rows, list):
        raise ValueError("masked JSON: expected a list under 'results' or 'rows'")
    per_arm: dict[str, dict[int, float]] = {}
    for row in rows:
        arms = row.get("best", row)
        for key, name in ARM_NAMES.items():
            seconds = _seconds(arms.get(key))
            if seconds is not None:
                per_arm.setdefault(name, {})[int(row["c"])] = seconds
    if not per_arm:
        raise ValueError("masked JSON: no plaintext, sparse or full seconds per round found")
    params = int(figures.get("params", 0))
    labels = {"plaintext": "plaintext (masked bench)", "sparse": "masked, sparse graph",
              "full": "masked, full graph"}  # fmt: skip
    names = dict.fromkeys(ARM_NAMES.values())  # plaintext, sparse, full: in that order
    return [(labels[name], params, per_arm[name]) for name in names if name in per_arm]


def large_model_arm(figures: Mapping[str, Any]) -> Arm:
    """``bench_large_model.py``'s one coordinator round (best of its rounds)."""
    best = min(float(s) for s in figures["round_seconds"])
    points = {int(figures["participants"]): best}
    return ("plaintext, coordinator only", int(figures["params"]), points)


def exponent(points: Mapping[int, float]) -> float | None:
    """Least-squares slope of log(seconds) against log(C); None below two C."""
    if len(points) < 2:
        return None
    cs = sorted(points)
    return float(np.polyfit(np.log(cs), np.log([points[c] for c in cs]), 1)[0])


def _params(p: int) -> str:
    if p >= 1_000_000:
        return f"{p / 1e6:g}M"
    return f"{p / 1e3:g}k" if p >= 1000 else str(p)


def table(arms: list[Arm]) -> str:
    """Markdown: a row per arm and P, a column per C, seconds per round, the exponent."""
    cs = sorted({c for _, _, points in arms for c in points})
    head = "| arm | P | " + " | ".join(f"C = {c:,}" for c in cs) + " | exponent in C |"
    lines = [head, "| --- | ---: | " + " | ".join("---:" for _ in cs) + " | ---: |"]
    for label, p, points in arms:
        cells = [f"{points[c]:.3g}" if c in points else "–" for c in cs]
        k = exponent(points)
        fitted = "–" if k is None else f"{k:.2f}"
        lines.append(f"| {label} | {_params(p)} | " + " | ".join(cells) + f" | {fitted} |")
    return "\n".join(lines)


def plot(arms: list[Arm], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in arms if len(a[2]) >= 2]  # a single C (the large model): table only
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, p, points in arms:
        cs = sorted(points)
        k = exponent(points)
        name = f"{label}, P = {_params(p)}" + ("" if k is None else f" (exponent {k:.2f})")
        ax.plot(cs, [points[c] for c in cs], marker="o", label=name)
    lo = min(c for _, _, pts in arms for c in pts)
    hi = max(c for _, _, pts in arms for c in pts)
    if arms:  # a slope-1 guide through the first arm's smallest C
        c0 = min(arms[0][2])
        s0 = arms[0][2][c0]
        ax.plot([c0, hi], [s0, s0 * hi / c0], ls=":", color="grey", label="linear in C")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo / 1.5, hi * 1.5)
    ax.set_xlabel("C (participants in the round)")
    ax.set_ylabel("wall seconds per round")
    ax.set_title("Time per round against C (one process, 2 cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plaintext", type=Path, default=RESULTS / "scale-plaintext.json")
    parser.add_argument("--masked", type=Path, default=RESULTS / "scale-masked.json")
    parser.add_argument("--large-model", type=Path, default=RESULTS / "large-model.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "scaling.png")
    args = parser.parse_args(argv)
    arms = [plaintext_arm(json.loads(args.plaintext.read_text()))]
    if args.masked.is_file():
        arms += masked_arms(json.loads(args.masked.read_text()))
    else:
        print(f"(no masked results at {args.masked.name}: plaintext only)")
    if args.large_model.is_file():
        arms.append(large_model_arm(json.loads(args.large_model.read_text())))
    for _, _, points in arms:
        if any(not (math.isfinite(s) and s > 0) for s in points.values()):
            raise ValueError("every seconds-per-round figure must be finite and positive")
    print(table(arms))
    plot(arms, args.png)
    print(f"\nwrote {args.png.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
