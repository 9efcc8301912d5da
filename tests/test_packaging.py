"""What a Python user expects of a package: a license file that matches the declared
license, a changelog, type information, ``python -m`` and ``--version``, and every
imported third-party package declared as a dependency."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Flower depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_license_file_is_the_declared_license() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_changelog_covers_the_current_version_and_types_are_shipped() -> None:
    version = PYPROJECT["project"]["version"]
    assert f"({version})" in (REPO / "CHANGELOG.md").read_text()
    assert (REPO / "lensemble_flwr" / "py.typed").is_file()


def test_python_dash_m_and_version() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "lensemble_flwr", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"lensemble-flwr {metadata.version('lensemble-flwr')}"


def _imported_top_levels() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "lensemble_flwr").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_imported_package_is_declared() -> None:
    declared = {
        re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        for requirement in PYPROJECT["project"]["dependencies"]
    }
    providers = metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names) | {"lensemble_flwr", "__future__"}
    missing = {}
    for module in sorted(_imported_top_levels() - stdlib):
        distributions = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if not distributions & declared:
            missing[module] = sorted(distributions)
    assert missing == {}, f"imported but not declared in pyproject.toml: {missing}"
