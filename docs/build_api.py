"""Build the API reference from the docstrings: ``python docs/build_api.py [OUT]``.

It renders every public module of ``lensemble_flwr`` with pdoc (the ``docs`` extra, also in
the ``test`` extra) into ``OUT`` (default ``docs/api/``, which git ignores); open
``OUT/index.html``. ``tests/docs/test_api_reference.py`` builds it and checks it (docs/api.md).

What differs from a bare ``pdoc lensemble_flwr``, and why:

- The modules are listed from the source tree, not discovered by pdoc. pdoc follows a
  package's ``__all__`` to find its submodules, and the packages here use ``__all__`` for
  the names they re-export (``lensemble_flwr.__all__`` is ``Coordinator``,
  ``LensembleConfig`` and so on), so pdoc alone renders the top-level package and nothing
  below it. For the same reason ``api_templates/module.html.jinja2`` lists every
  documented submodule in a package's navigation.
- The names in each ``__all__`` are looked up before pdoc reads them: pdoc takes them
  from the module's ``__dict__``, and ``lensemble_flwr`` resolves its exports on first use
  (a module ``__getattr__``, PEP 562).
- pdoc's warnings are returned instead of printed, except one that is pdoc's limitation
  and not a fault of the docstrings: it cannot resolve the postponed annotations of a
  ``NamedTuple``'s generated ``__init__`` (https://github.com/mitmproxy/pdoc/issues/765;
  the signature shows them as written).
"""

from __future__ import annotations

import importlib
import re
import sys
import types
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pdoc.doc
import pdoc.render

DOCS = Path(__file__).resolve().parent
PACKAGE = DOCS.parent / "lensemble_flwr"
DEFAULT_OUT = DOCS / "api"
TEMPLATES = DOCS / "api_templates"
_NAMEDTUPLE_INIT = re.compile(r"Error parsing type annotation .* for (\S+)\.__init__\. ")


def public_modules() -> list[str]:
    """Every module of the package whose dotted name has no part starting with ``_``
    (so no ``__main__``), packages before their modules, in path order."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return names


def build(
    out: Path = DEFAULT_OUT, *, show_source: bool = True
) -> tuple[dict[str, pdoc.doc.Module], list[str]]:
    """Render the reference into ``out``: one HTML page per public module, ``index.html``
    and the search index. Returns the documented modules by name and pdoc's warnings.

    A module that fails to import fails the build (pdoc would skip it with a warning).
    ``show_source=False`` leaves out each page's "View Source" (highlighting every module's
    source is most of the build's time; the test builds without it).
    """
    pdoc.render.configure(
        docformat="restructuredtext",  # the docstrings' ``literals`` and :func:`roles`
        footer_text=f"lensemble-flwr {metadata.version('lensemble-flwr')}",
        show_source=show_source,
        template_directory=TEMPLATES,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in public_modules():
            _resolve_exports(importlib.import_module(name))
        modules = {name: pdoc.doc.Module.from_name(name) for name in public_modules()}
        pages = {name: pdoc.render.html_module(m, modules) for name, m in modules.items()}
        index = pdoc.render.html_index(modules)
        search = pdoc.render.search_index(modules)
    written = set()
    for name, html in pages.items():
        page = out / f"{name.replace('.', '/')}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(html, encoding="utf-8")
        written.add(page)
    for stale in set((out / "lensemble_flwr").rglob("*.html")) - written:
        stale.unlink()  # the page of a module that no longer exists
    (out / "index.html").write_text(index, encoding="utf-8")
    (out / "search.js").write_text(search, encoding="utf-8")
    pdoc_dir = Path(pdoc.__file__).parent
    messages = [
        str(w.message)
        for w in caught
        if Path(w.filename).is_relative_to(pdoc_dir)  # not the imported modules' own
    ]
    return modules, [m for m in messages if not _is_namedtuple_init(m, modules)]


def _resolve_exports(module: types.ModuleType) -> None:
    """Look up every name of the module's ``__all__``, which puts a lazily resolved one
    into the module's ``__dict__`` (where pdoc looks). One that does not resolve fails
    the build."""
    for name in getattr(module, "__all__", ()):
        getattr(module, name)


def _is_namedtuple_init(message: str, modules: dict[str, pdoc.doc.Module]) -> bool:
    match = _NAMEDTUPLE_INIT.match(message)
    if not match:
        return False
    module_name, _, qualname = match.group(1).rpartition(".")
    cls = getattr(modules[module_name].obj, qualname, None) if module_name in modules else None
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def defined_at(doc: pdoc.doc.Doc) -> str:
    """The dotted name of the module, class or function where ``doc``'s object is defined."""
    return ".".join(part for part in doc.taken_from if part)


def documented(modules: dict[str, pdoc.doc.Module]) -> Iterator[pdoc.doc.Doc]:
    """Every module, class, function and method the reference shows, once each (by where
    it is defined; a name a package re-exports is the same object). Public as pdoc has it:
    named in ``__all__`` when a module has one, else not starting with ``_``. Constructors
    (``__init__``) are documented by their class."""
    seen: set[str] = set()

    def walk(doc: pdoc.doc.Doc) -> Iterator[pdoc.doc.Doc]:
        where = defined_at(doc)
        if where in seen:
            return
        seen.add(where)
        yield doc
        if isinstance(doc, pdoc.doc.Module):
            exported = getattr(doc.obj, "__all__", None)
            members = [
                m
                for m in doc.members.values()
                if (m.name in exported if exported is not None else not m.name.startswith("_"))
            ]
        elif isinstance(doc, pdoc.doc.Class):
            members = [m for m in doc.own_members if not m.name.startswith("_")]
        else:
            return
        for member in members:
            if isinstance(member, pdoc.doc.Class | pdoc.doc.Function):
                yield from walk(member)

    for module in modules.values():
        yield from walk(module)


def undocumented(modules: dict[str, pdoc.doc.Module]) -> list[str]:
    """The names :func:`documented` yields whose docstring is empty, where they are defined."""
    return sorted(defined_at(d) for d in documented(modules) if not d.docstring.strip())


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else DEFAULT_OUT
    modules, problems = build(out)
    for message in problems:
        print(f"warning: {message}", file=sys.stderr)
    missing = undocumented(modules)
    if missing:
        print(f"{len(missing)} public names have no docstring:", file=sys.stderr)
        for name in missing:
            print(f"  {name}", file=sys.stderr)
    print(f"wrote {len(modules)} modules; open {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
