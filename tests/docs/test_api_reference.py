"""The API reference (docs/api.md) builds from the docstrings: every public module has its
page, the names users start from are there with their docstrings, pdoc has nothing to
warn about, and every public module, class and function it shows has a docstring.

The reference is built once for the module, in-process, without the "View Source"
blocks (the rest of the build is the one ``./dev.sh api`` runs).
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pdoc.doc
import pytest

import lensemble_flwr

REPO = Path(__file__).resolve().parents[2]

# Public names allowed to lack a docstring (none): a new name without one fails the test.
KNOWN_UNDOCUMENTED: set[str] = set()


def _load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_api", REPO / "docs" / "build_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load_builder()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[str]]:
    out = tmp_path_factory.mktemp("api")
    modules, problems = builder.build(out, show_source=False)
    return out, modules, problems


def _page(out: Path, module: str) -> str:
    return (out / f"{module.replace('.', '/')}.html").read_text(encoding="utf-8")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def _first_paragraph(obj: object) -> list[str]:
    """The words of the first paragraph of ``obj``'s docstring, without reST roles
    (``:mod:`x``` renders as ``x``)."""
    doc = inspect.getdoc(obj) or ""
    return _words(re.sub(r":[\w:]+:(?=`)", "", re.split(r"\n\s*\n", doc.strip())[0]))


def _text(fragment: str) -> list[str]:
    """The words a reader sees in an HTML fragment."""
    return _words(html.unescape(re.sub(r"<[^>]+>", " ", fragment)))


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def _public_modules_by_import() -> set[str]:
    """Independently of the builder: what pkgutil finds, minus ``_`` names."""
    found = pkgutil.walk_packages(lensemble_flwr.__path__, "lensemble_flwr.")
    names = {m.name for m in found if not any(p.startswith("_") for p in m.name.split("."))}
    return {"lensemble_flwr"} | names


def test_every_public_module_has_its_page_with_its_docstring(
    reference: tuple[Path, dict[str, Any], list[str]],
) -> None:
    out, modules, _ = reference
    expected = _public_modules_by_import()
    assert set(modules) == expected
    assert len(expected) > 90  # the whole package, not the top level only
    for name in sorted(expected):
        page = _page(out, name)
        heading = re.search(r'<h1 class="modulename">(.*?)</h1>', page, re.S)
        assert heading and _text(heading.group(1)) == _words(name), name
        assert _contains(_text(page), _first_paragraph(modules[name].obj)), name


def test_every_module_is_reachable_from_the_index(
    reference: tuple[Path, dict[str, Any], list[str]],
) -> None:
    out, modules, _ = reference
    assert 'url=./lensemble_flwr.html"' in (out / "index.html").read_text()
    assert (out / "search.js").stat().st_size > 0
    for name in modules:
        parent, _, last = name.rpartition(".")
        if parent:
            nav = _page(out, parent).split("<h2>Submodules</h2>", 1)
            assert len(nav) == 2, f"{parent} lists no submodules"
            assert f'{last}.html">{last}</a>' in nav[1].split("</ul>", 1)[0], name


@pytest.mark.parametrize(
    ("name", "defined_in", "also_in"),
    [
        ("LensembleStrategy", "lensemble_flwr.strategies.lensemble", "lensemble_flwr.strategies"),
        ("LensembleConfig", "lensemble_flwr.config", "lensemble_flwr"),
        ("make_client_app", "lensemble_flwr.clients.app", "lensemble_flwr.clients"),
        ("wrap_numpy_client", "lensemble_flwr.clients.numpy_client", "lensemble_flwr.clients"),
        ("Coordinator", "lensemble_flwr.coordinator.coordinator", "lensemble_flwr"),
        ("Participant", "lensemble_flwr.participant.participant", "lensemble_flwr"),
    ],
)
def test_the_names_users_start_from_are_documented(
    reference: tuple[Path, dict[str, Any], list[str]], name: str, defined_in: str, also_in: str
) -> None:
    out, modules, _ = reference
    obj = getattr(modules[defined_in].obj, name)
    words = _first_paragraph(obj)
    assert len(words) >= 5, f"{name} needs a docstring that says what it is"
    for module in (defined_in, also_in):
        page = _page(out, module)
        section = re.search(rf'<section id="{name}">(.*?)(?=<section id=|</main>)', page, re.S)
        assert section, f"{name} is not on the page of {module}"
        assert _contains(_text(section.group(1)), words), f"{name}'s docstring, on {module}"


def test_pdoc_has_nothing_to_warn_about(
    reference: tuple[Path, dict[str, Any], list[str]],
) -> None:
    assert reference[2] == []


def test_every_public_module_class_and_function_has_a_docstring(
    reference: tuple[Path, dict[str, Any], list[str]],
) -> None:
    missing = set(builder.undocumented(reference[1]))
    assert missing - KNOWN_UNDOCUMENTED == set(), "public names without a docstring"
    assert KNOWN_UNDOCUMENTED - missing == set(), "documented now: drop from KNOWN_UNDOCUMENTED"


def test_the_docstring_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "api_probe.py").write_text(
        '"""A module."""\n'
        "def bare(): pass\n"
        'def told():\n    """Told."""\n'
        "def _hidden(): pass\n"
        'class Public:\n    """A class."""\n'
        "    def __init__(self): pass\n"
        "    def method(self): pass\n"
        "    def _helper(self): pass\n"
        "class Undocumented: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = {"api_probe": pdoc.doc.Module.from_name("api_probe")}
    assert builder.undocumented(modules) == [
        "api_probe.Public.method",
        "api_probe.Undocumented",
        "api_probe.bare",
    ]
