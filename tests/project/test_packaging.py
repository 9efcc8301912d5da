"""What a Python user expects of a package: a license file that matches the declared
license, a changelog, type information, ``python -m`` and ``--version``, and every
imported third-party package declared as a dependency, or as an extra where the import is
guarded (lazy, and failing with the ``pip install`` that brings it)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Flower depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
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


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


CORE = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
EXTRAS = {
    extra: {_name(r) for r in requirements}
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items()
}
USER_EXTRAS = {extra: names for extra, names in EXTRAS.items() if extra != "test"}


def _imports() -> list[tuple[str, str, ast.stmt, list[ast.AST]]]:
    """(file, top-level module, import statement, its ancestors) for every absolute import
    in the package."""
    found: list[tuple[str, str, ast.stmt, list[ast.AST]]] = []

    def visit(node: ast.AST, ancestors: list[ast.AST], path: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((path, alias.name.split(".")[0], node, ancestors))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((path, node.module.split(".")[0], node, ancestors))
        for child in ast.iter_child_nodes(node):
            visit(child, [*ancestors, node], path)

    for path in sorted((REPO / "lensemble_flwr").rglob("*.py")):
        visit(ast.parse(path.read_text()), [], str(path.relative_to(REPO)))
    return found


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(t, ast.Name) and t.id in {"ImportError", "ModuleNotFoundError"} for t in types
    )


def _raised_text(handler: ast.ExceptHandler) -> str:
    """The strings a handler raises, or logs (an accelerator whose absence only slows
    things down says so in a log line and goes on)."""

    def says(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.Raise):
            return True
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        return (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "log"
        )

    return " ".join(
        str(node.value)
        for stmt in handler.body
        if says(stmt)
        for node in ast.walk(stmt)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _guarded_by(statement: ast.stmt, ancestors: list[ast.AST]) -> set[str]:
    """The extras a guarded import names: the import sits in a function (so importing the
    module never needs it) in the body of a ``try`` whose ``except ImportError`` raises (or
    logs) a message with ``pip install 'lensemble-flwr[EXTRA]'``. Empty when it is not
    guarded."""
    if not any(isinstance(a, ast.FunctionDef | ast.AsyncFunctionDef) for a in ancestors):
        return set()
    for i, node in enumerate(ancestors):
        inner = ancestors[i + 1] if i + 1 < len(ancestors) else statement
        if isinstance(node, ast.Try) and inner in node.body:
            text = " ".join(_raised_text(h) for h in node.handlers if _catches_import_error(h))
            return {e for e in USER_EXTRAS if f"pip install 'lensemble-flwr[{e}]'" in text}
    return set()


def test_every_imported_package_is_declared() -> None:
    """A core dependency, or an extra's where every import of it is guarded by that extra."""
    providers = metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names) | {"lensemble_flwr", "__future__"}
    problems = {}
    for path, module, statement, ancestors in _imports():
        if module in stdlib:
            continue
        distributions = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if distributions & CORE:
            continue
        extras = {e for e, names in USER_EXTRAS.items() if distributions & names}
        where = f"{path}:{statement.lineno} {module}"
        if not extras:
            problems[where] = f"not declared in pyproject.toml: {sorted(distributions)}"
        elif not extras & _guarded_by(statement, ancestors):
            problems[where] = (
                f"declared only in the extra(s) {sorted(extras)}: import it inside a function, "
                'in a try whose except ImportError raises with "pip install '
                f"'lensemble-flwr[{sorted(extras)[0]}]'\""
            )
    assert problems == {}


def test_the_optional_imports_are_the_expected_ones() -> None:
    """The check above can fail: scikit-learn, matplotlib and numba are extras only, and
    their imports pass because they are guarded."""
    assert {"scikit-learn", "matplotlib", "numba"}.isdisjoint(CORE)
    guarded = {
        (module, extra)
        for _, module, statement, ancestors in _imports()
        for extra in _guarded_by(statement, ancestors)
    }
    assert guarded == {("sklearn", "examples"), ("matplotlib", "report"), ("numba", "fast")}


def test_the_test_extra_installs_every_other_extra_and_is_what_ci_installs() -> None:
    """``./dev.sh`` installs ``.[test]`` (and CI runs ``./dev.sh test``), so the test extra
    must bring what the other extras' code, its tests and the API reference need."""
    test = set(PYPROJECT["project"]["optional-dependencies"]["test"])
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        assert set(requirements) <= test, f"extra {extra!r} is not part of the test extra"
    assert 'pip install --quiet -e ".[test]"' in (REPO / "dev.sh").read_text()
    assert "exec ./dev.sh test" in (REPO / ".ci" / "run").read_text()


def test_a_missing_extra_names_itself(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from run_dir_helpers import synthetic_run

    from lensemble_flwr.cli import main
    from lensemble_flwr.cli.output import EXIT_USAGE
    from lensemble_flwr.simulations import digits_data

    for name in ("sklearn", "sklearn.datasets", "matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ModuleNotFoundError
    with pytest.raises(ImportError, match=re.escape("pip install 'lensemble-flwr[examples]'")):
        digits_data._load_digits.__wrapped__()
    run = synthetic_run(tmp_path / "run", [{"a": "aa" * 32}])
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == EXIT_USAGE
    assert "pip install 'lensemble-flwr[report]'" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize(
    "app",
    [
        "lensemble_flwr.simulations.world",
        "lensemble_flwr.simulations.digits",
        "lensemble_flwr.simulations.lm",
    ],
)
def test_a_clientapp_process_imports_neither_opacus_nor_the_superlink(app: str) -> None:
    """A SuperNode may start a process for every message, and each one imports the app's
    module. Opacus (its accountants import its training engine and torch.distributed) and
    Flower's in-memory SuperLink (SQLAlchemy, FastAPI) took about 4.5 s of each such
    import on 2 cores; a run without DP needs neither in a ClientApp, and the
    coordinator's modules are imported only where a strategy is built."""
    probe = (
        f"import sys, {app}\n"
        "heavy = ['opacus', 'sqlalchemy', 'flwr.superlink.grid.inmemory_grid',\n"
        "         'lensemble_flwr.strategies.lensemble']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
