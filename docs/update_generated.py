"""Rewrite the generated blocks of the docs from the code: ``python docs/update_generated.py``.

``tests/docs/test_docs.py`` fails when a block is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from lensemble_flwr.config import run_config_table
from lensemble_flwr.coordinator.admission import admission_table
from lensemble_flwr.coordinator.modes import admission_tables
from lensemble_flwr.errors import response_table
from lensemble_flwr.layering import layer_diagram
from lensemble_flwr.protocol.round import transition_diagram
from lensemble_flwr.simulations.kill_points import kill_matrix_table

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent / "tests" / "helpers"))  # the fault catalogue: a test helper
from fault_scenarios import scenario_table  # noqa: E402

BLOCKS = {
    ("runtime.md", "transitions"): lambda: f"```mermaid\n{transition_diagram()}\n```",
    ("runtime.md", "errors"): response_table,
    ("configuration.md", "run-config"): run_config_table,
    ("fault-injection.md", "scenarios"): scenario_table,
    ("recovery.md", "kill-matrix"): kill_matrix_table,
    ("architecture.md", "layers"): layer_diagram,
    ("runtime.md", "admission"): lambda: admission_table(admission_tables()),
}


def main() -> None:
    for (page, name), render in BLOCKS.items():
        path = DOCS / page
        begin, end = f"<!-- BEGIN GENERATED: {name} -->\n", f"\n<!-- END GENERATED: {name} -->"
        text = path.read_text()
        block = begin + render() + end
        new = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _, b=block: b, text,
                     flags=re.S)
        if new != text:
            path.write_text(new)
            print(f"updated {page} [{name}]")


if __name__ == "__main__":
    main()
