"""The package's layers, lowest first, and the check that every import points down.

A *part* is a module or subpackage directly under ``lensemble_flwr/`` (``protocol``,
``config``, ...); the package root's ``__init__`` is the part ``__init__``. Each part sits
in exactly one layer of :data:`LAYERS`. The rule:

* a part imports only parts of *lower* layers (and itself) — never a part of its own
  layer, never one above it, never the package root (the root is the top layer);
* only the Flower-facing parts (:data:`FLOWER_PARTS`) import ``flwr``.

Every import counts, wherever it is written: at the top of a module, inside a function
(a lazy import is exactly how a cycle hides), under ``if TYPE_CHECKING:``, relative or
absolute, and ``importlib.import_module("...")`` with a literal name.
``tests/test_layering.py`` runs :func:`layer_violations` on :func:`import_edges` of the
package, and ``docs/architecture.md`` shows :func:`layer_diagram`.

Standard library only, so the check and the docs never import the rest of the package.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "lensemble_flwr"
ROOT_PART = "__init__"

# Lowest first. A layer is a tuple of (part, what the part owns). Parts of one layer do
# not import each other; a part that imports another goes in a higher layer.
LAYERS: tuple[tuple[tuple[str, str], ...], ...] = (
    (
        ("errors", "the typed error taxonomy and RESPONSES, what each error gets"),
        ("canonical", "the canonical byte encoding and domain-separated SHA-256 digests"),
        ("layering", "this table of layers and the import check (standard library only)"),
        ("norms", "float64 L2 norms that depend on the values only: the same bits on any CPU"),
        ("atomic_write", "files written whole or not at all: temp file, fsync, rename, folder"),
    ),
    (("config", "LensembleConfig: one frozen configuration, from Python or a run_config"),),
    (("params", "named arrays, parameter groups, shared groups in and out of torch"),),
    (
        ("artifacts", "content-addressed store with atomic claims; safetensors checkpoints"),
        ("privacy", "the participant's persistent DP budget and CSPRNG Gaussian noise"),
    ),
    (("protocol", "wire messages, GlobalState/PseudoGradient, the round transition table"),),
    (("provenance", "Merkle commitments, inclusion proofs, ledger, manifest, verify, audit"),),
    (("aggregation", "exact order-independent fixed-point sums of updates, chunked kernels"),),
    (("secagg", "masked rounds: keys, AES-CTR PRG, Shamir, both roles, membership"),),
    (("release", "the release chain's stages: difference, clip, noise, quantize, mask, bind"),),
    (("gauge", "latent-frame alignment: probe, sketch, Procrustes, drift, align stage, checks"),),
    (("identity", "identity keys and message signatures; the participant registry and store"),),
    (("transports", "the Transport protocol, in-process network on a simulated clock, faults"),),
    (
        ("participant", "local training, the release chain, the participant's side of a round"),
        ("coordinator", "the phase loop, admission, round modes, commit, resume, outer step"),
    ),
    (("shared_folder", "no coordinator process: rounds that meet in a folder all nodes mount"),),
    (("testing", "scripted faults for tests and drills: fault plans, delivery log, clock"),),
    (
        (
            "cli",
            "the lensemble-flwr command: verify, show, report, average, export, prove, "
            "check-proof",
        ),
    ),
    (("__main__", "python -m lensemble_flwr: the lensemble-flwr command"),),
    (("strategies", "the coordinator as a Flower Strategy; Flower's Grid as a Transport"),),
    (("clients", "Flower ClientApps (and NumPyClient code) as lensemble Participants"),),
    (
        (
            "simulations",
            "runnable apps and drills: digits, world model, in-process, crash drill; "
            "the apps' run-config check",
        ),
    ),
    ((ROOT_PART, "the package root: lazily re-exports the core names (no flwr)"),),
)

# The only parts that may import flwr.
FLOWER_PARTS = frozenset({"strategies", "clients", "simulations"})

LAYER_OF: dict[str, int] = {part: i for i, layer in enumerate(LAYERS) for part, _ in layer}


@dataclasses.dataclass(frozen=True, order=True)
class Edge:
    """One import statement: ``importer`` (a module of the package) imports ``imported``.

    ``file`` is the importing file relative to the package's parent folder
    (``lensemble_flwr/release/binding.py``); ``lazy`` is set for an import inside a
    function, ``type_checking`` for one under ``if TYPE_CHECKING:``.
    """

    file: str
    line: int
    importer: str
    imported: str
    lazy: bool = False
    type_checking: bool = False

    def where(self) -> str:
        """`` (inside a function)``, `` (under TYPE_CHECKING)``, both, or nothing."""
        kinds = []
        if self.lazy:
            kinds.append("inside a function")
        if self.type_checking:
            kinds.append("under TYPE_CHECKING")
        return f" ({', '.join(kinds)})" if kinds else ""


def part_of(module: str) -> str | None:
    """The part of the package ``module`` belongs to, or None for a module outside it."""
    names = module.split(".")
    if names[0] != PACKAGE:
        return None
    return names[1] if len(names) > 1 else ROOT_PART


def is_flwr(module: str) -> bool:
    """Whether the dotted name ``module`` is Flower's package or one of its modules."""
    return module.split(".")[0] == "flwr"


def _module_name(package_root: Path, path: Path) -> tuple[str, bool]:
    rel = path.relative_to(package_root).with_suffix("")
    names = [PACKAGE, *rel.parts]
    is_package = names[-1] == "__init__"
    if is_package:
        names.pop()
    return ".".join(names), is_package


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.is_package = is_package
        self.lazy = 0
        self.type_checking = 0
        self.found: list[tuple[int, str, bool, bool]] = []

    def _add(self, line: int, imported: str) -> None:
        self.found.append((line, imported, self.lazy > 0, self.type_checking > 0))

    def _function(self, node: ast.AST) -> None:
        self.lazy += 1
        self.generic_visit(node)
        self.lazy -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self.type_checking += 1
        for child in node.body:
            self.visit(child)
        self.type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node.lineno, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            # The package a relative import starts from: a module's own package for
            # level 1, one package up per further level.
            base = self.module.split(".")
            if not self.is_package:
                base.pop()
            up = node.level - 1
            if up >= len(base):
                return  # beyond the top-level package: Python refuses it anyway
            base = base[: len(base) - up]
            imported = ".".join([*base, node.module] if node.module else base)
        else:
            imported = node.module or ""
        self._add(node.lineno, imported)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dynamic_import(node)
        if name is not None and not name.startswith("."):
            self._add(node.lineno, name)
        self.generic_visit(node)


def import_edges(package_root: Path) -> list[Edge]:
    """Every import of the package's own modules and of ``flwr`` in every ``.py`` file
    under ``package_root`` (the folder of the ``lensemble_flwr`` package), sorted.

    ``from lensemble_flwr import errors`` is an import of the package root
    (``lensemble_flwr``): that is what it runs first.
    """
    package_root = Path(package_root)
    edges: list[Edge] = []
    for path in sorted(package_root.rglob("*.py")):
        module, is_package = _module_name(package_root, path)
        visitor = _Imports(module, is_package)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        file = path.relative_to(package_root.parent).as_posix()
        for line, imported, lazy, type_checking in visitor.found:
            if part_of(imported) is not None or is_flwr(imported):
                edges.append(Edge(file, line, module, imported, lazy, type_checking))
    return sorted(edges)


def package_parts(package_root: Path) -> set[str]:
    """The parts present on disk: every top-level module, every subfolder holding a
    ``.py`` file, and the root ``__init__``."""
    package_root = Path(package_root)
    return {
        path.relative_to(package_root).parts[0].removesuffix(".py")
        for path in package_root.rglob("*.py")
    }


def _where(part: str) -> str:
    return f"{part} (layer {LAYER_OF[part] + 1})"


def layer_violations(edges: Iterable[Edge]) -> list[str]:
    """What breaks the rule, one line per offending import, naming file:line, importer and
    imported module. Empty when every import points down and flwr stays in FLOWER_PARTS."""
    problems: list[str] = []
    for edge in edges:
        at = f"{edge.file}:{edge.line}: {edge.importer} imports {edge.imported}{edge.where()}"
        source = part_of(edge.importer)
        if source is None:
            problems.append(f"{at}: the importer is not a module of {PACKAGE}")
            continue
        if source not in LAYER_OF:
            problems.append(f"{at}: part {source!r} is not listed in {PACKAGE}.layering.LAYERS")
            continue
        if is_flwr(edge.imported):
            if source not in FLOWER_PARTS:
                allowed = ", ".join(sorted(FLOWER_PARTS))
                problems.append(f"{at}: flwr may only be imported by {allowed}, not {source}")
            continue
        target = part_of(edge.imported)
        if target is None or target == source:
            continue
        if target not in LAYER_OF:
            problems.append(f"{at}: part {target!r} is not listed in {PACKAGE}.layering.LAYERS")
        elif target == ROOT_PART:
            problems.append(
                f"{at}: {_where(source)} imports the package root {PACKAGE}, the top layer; "
                f"import the module itself (e.g. {PACKAGE}.errors)"
            )
        elif LAYER_OF[target] > LAYER_OF[source]:
            problems.append(
                f"{at}: {_where(source)} imports {_where(target)}, a higher layer; "
                "imports must point down"
            )
        elif LAYER_OF[target] == LAYER_OF[source]:
            problems.append(
                f"{at}: {source} and {target} share layer {LAYER_OF[source] + 1}, "
                "whose parts may not import each other"
            )
    return problems


def layer_diagram() -> str:
    """The layers top to bottom as a fenced text block, with the flwr line."""
    width = max(len(part) for layer in LAYERS for part, _ in layer)
    lowest_flower = min(LAYER_OF[part] for part in FLOWER_PARTS)
    lines = ["```text", f"layer  {'part'.ljust(width)}  owns"]
    for number in range(len(LAYERS) - 1, -1, -1):
        if number == lowest_flower - 1:
            lines.append(f"{'─' * 10} no flwr below this line {'─' * 10}")
        for i, (part, owns) in enumerate(LAYERS[number]):
            label = str(number + 1) if i == 0 else ""
            lines.append(f"{label:>5}  {part.ljust(width)}  {owns}")
    lines.append("```")
    return "\n".join(lines)
