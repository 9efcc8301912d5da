"""The generated parts of the docs are in step with the code they describe.

Regenerate them with ``python docs/update_generated.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fault_scenarios import scenario_table

from lensemble_flwr.config import run_config_keys, run_config_table
from lensemble_flwr.coordinator.admission import admission_table
from lensemble_flwr.coordinator.modes import admission_tables
from lensemble_flwr.errors import response_table
from lensemble_flwr.layering import layer_diagram
from lensemble_flwr.protocol.round import transition_diagram
from lensemble_flwr.simulations.kill_points import kill_matrix_table

DOCS = Path(__file__).resolve().parents[2] / "docs"


def generated_block(page: str, name: str) -> str:
    text = (DOCS / page).read_text()
    match = re.search(
        rf"<!-- BEGIN GENERATED: {name} -->\n(.*?)\n<!-- END GENERATED: {name} -->", text, re.S
    )
    assert match, f"{page} has no generated block {name!r}"
    return match.group(1)


@pytest.mark.parametrize(
    ("page", "name", "expected"),
    [
        ("runtime.md", "transitions", f"```mermaid\n{transition_diagram()}\n```"),
        ("runtime.md", "errors", response_table()),
        ("configuration.md", "run-config", run_config_table()),
        ("fault-injection.md", "scenarios", scenario_table()),
        ("recovery.md", "kill-matrix", kill_matrix_table()),
        ("architecture.md", "layers", layer_diagram()),
        ("runtime.md", "admission", admission_table(admission_tables())),
    ],
)
def test_generated_blocks_match_the_code(page: str, name: str, expected: str) -> None:
    assert generated_block(page, name) == expected


def test_every_run_config_key_is_documented() -> None:
    text = (DOCS / "configuration.md").read_text()
    assert all(f"`{key}`" in text for key in run_config_keys())
