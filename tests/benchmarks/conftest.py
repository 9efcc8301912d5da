"""The benchmarks are scripts, not a package: they import their siblings (``tuning``,
``own_flwr_home``) from their own folder, which Python puts on ``sys.path`` when it runs
one. Tests that load a benchmark put that folder there the same way."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
