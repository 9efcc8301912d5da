"""Imports only point down the layers of lensemble_flwr.layering, and flwr stays on top.

Every import counts — lazy ones inside functions and ``if TYPE_CHECKING:`` ones too, since
that is how the old cycles (federation <-> secagg, release -> gauge) used to hide.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import lensemble_flwr
from lensemble_flwr.layering import (
    FLOWER_PARTS,
    LAYER_OF,
    LAYERS,
    ROOT_PART,
    Edge,
    import_edges,
    is_flwr,
    layer_diagram,
    layer_violations,
    package_parts,
    part_of,
)

PACKAGE_ROOT = Path(lensemble_flwr.__file__).resolve().parent


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(PACKAGE_ROOT)


def test_the_package_has_no_layer_violations(edges: list[Edge]) -> None:
    # The walk sees the package's imports, flwr's included (else the check is vacuous).
    assert len(edges) > 100
    assert any(is_flwr(edge.imported) for edge in edges)
    violations = layer_violations(edges)
    assert not violations, "\n".join(["imports that break the layering:", *violations])


def test_every_part_on_disk_is_in_a_layer() -> None:
    unlisted = package_parts(PACKAGE_ROOT) - set(LAYER_OF)
    assert not unlisted, f"add these parts to lensemble_flwr.layering.LAYERS: {sorted(unlisted)}"


def test_each_part_is_in_one_layer_and_the_root_is_on_top() -> None:
    parts = [part for layer in LAYERS for part, _ in layer]
    assert len(parts) == len(set(parts))
    assert LAYERS[-1] == ((ROOT_PART, LAYERS[-1][0][1]),)
    assert set(parts) >= FLOWER_PARTS


def edge(importer: str, imported: str, line: int = 7, **kind: bool) -> Edge:
    file = importer.replace(".", "/") + ".py"
    return Edge(file, line, importer, imported, **kind)


# The old cycles, in today's parts. Each case is an import the package really has (the
# right way round) and the one that would close a cycle with it, bring flwr below the
# Flower line, or add a part nobody placed; only the second may be reported.
SYNTHETIC = {
    "protocol-imports-coordinator": (
        edge("lensemble_flwr.coordinator.coordinator", "lensemble_flwr.protocol.round"),
        edge("lensemble_flwr.protocol.round", "lensemble_flwr.coordinator.coordinator", 12),
        "protocol (layer 5) imports coordinator (layer 13), a higher layer",
    ),
    "release-imports-gauge-lazily": (
        edge("lensemble_flwr.gauge.stage", "lensemble_flwr.release.pipeline"),
        edge("lensemble_flwr.release.binding", "lensemble_flwr.gauge.stage", 25, lazy=True),
        "(inside a function): release (layer 9) imports gauge (layer 10), a higher layer",
    ),
    "secagg-imports-identity": (
        edge("lensemble_flwr.identity.registry", "lensemble_flwr.secagg.membership"),
        edge("lensemble_flwr.secagg.membership", "lensemble_flwr.identity.registry", 9),
        "secagg (layer 8) imports identity (layer 11), a higher layer",
    ),
    "shared_folder-imports-the-root": (
        edge("lensemble_flwr.shared_folder.runner", "lensemble_flwr.errors"),
        edge("lensemble_flwr.shared_folder.runner", "lensemble_flwr", 30),
        "shared_folder (layer 14) imports the package root lensemble_flwr, the top layer",
    ),
    "coordinator-imports-flwr": (
        edge("lensemble_flwr.strategies.lensemble", "flwr.app"),
        edge("lensemble_flwr.coordinator.coordinator", "flwr.app", 5),
        "flwr may only be imported by clients, simulations, strategies, not coordinator",
    ),
    "participant-imports-coordinator": (
        edge("lensemble_flwr.participant.participant", "lensemble_flwr.transports.base"),
        edge("lensemble_flwr.participant.participant", "lensemble_flwr.coordinator.durable"),
        "participant and coordinator share layer 13",
    ),
    "unlisted-part": (
        edge("lensemble_flwr.cli.verify", "lensemble_flwr.provenance.audit"),
        edge("lensemble_flwr.federation.round", "lensemble_flwr.errors"),
        "part 'federation' is not listed",
    ),
}


@pytest.mark.parametrize(("allowed", "bad", "reason"), SYNTHETIC.values(), ids=SYNTHETIC.keys())
def test_the_checker_trips_on_each_old_cycle(allowed: Edge, bad: Edge, reason: str) -> None:
    assert layer_violations([allowed]) == []
    violations = layer_violations([allowed, bad])
    print("\n".join(violations))
    assert len(violations) == 1
    (violation,) = violations
    assert violation.startswith(f"{bad.file}:{bad.line}: {bad.importer} imports {bad.imported}")
    assert reason in violation


FAKE_MODULE = '''\
"""A module that hides two upward imports."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from lensemble_flwr.errors import RoundError

if TYPE_CHECKING:
    from lensemble_flwr.coordinator.coordinator import Coordinator


def close(coordinator: Coordinator) -> str:
    from ..gauge.stage import align

    if not coordinator:
        raise RoundError(json.dumps(align))
    return "closed"
'''


def line_of(text: str, needle: str) -> int:
    (number,) = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return number


def test_import_edges_finds_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    root = tmp_path / "lensemble_flwr"
    (root / "protocol").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "protocol" / "__init__.py").write_text("")
    (root / "protocol" / "round.py").write_text(FAKE_MODULE)

    found = import_edges(root)

    file, module = "lensemble_flwr/protocol/round.py", "lensemble_flwr.protocol.round"
    assert found == [
        Edge(file, line_of(FAKE_MODULE, "errors"), module, "lensemble_flwr.errors"),
        Edge(
            file,
            line_of(FAKE_MODULE, "import Coordinator"),
            module,
            "lensemble_flwr.coordinator.coordinator",
            type_checking=True,
        ),
        Edge(
            file, line_of(FAKE_MODULE, "..gauge"), module, "lensemble_flwr.gauge.stage", lazy=True
        ),
    ]
    violations = layer_violations(found)
    upward = [line_of(FAKE_MODULE, "import Coordinator"), line_of(FAKE_MODULE, "..gauge")]
    assert [v.split(": ")[0] for v in violations] == [f"{file}:{n}" for n in upward]
    assert "(under TYPE_CHECKING)" in violations[0]
    assert "(inside a function)" in violations[1]


def test_part_of() -> None:
    assert part_of("lensemble_flwr") == ROOT_PART
    assert part_of("lensemble_flwr.gauge.stage") == "gauge"
    assert part_of("flwr.app") is None


def test_the_diagram_lists_every_part_top_down_with_the_flwr_line() -> None:
    diagram = layer_diagram()
    lines = diagram.splitlines()
    assert lines[0] == "```text" and lines[-1] == "```"
    positions = {part: diagram.index(f"  {part}  ") for part in LAYER_OF}
    assert positions[ROOT_PART] < positions["simulations"] < positions["protocol"]
    assert positions["protocol"] < positions["errors"]
    marker = diagram.index("no flwr below this line")
    assert all(positions[part] < marker for part in FLOWER_PARTS)
    assert all(positions[part] > marker for part in set(LAYER_OF) - FLOWER_PARTS - {ROOT_PART})


def test_the_architecture_md_violations_command_runs_as_written() -> None:
    """docs/architecture.md's one-line listing of layering violations, run from the
    repository root with this interpreter in place of ``.venv/bin/python``."""
    import re
    import shlex
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    text = (repo / "docs" / "architecture.md").read_text()
    (command,) = [
        b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "layer_violations" in b
    ]
    argv = shlex.split(command)
    assert argv[0] == ".venv/bin/python"
    out = subprocess.run(
        [sys.executable, *argv[1:]], cwd=repo, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout == "no violations\n", (out.stdout, out.stderr)
