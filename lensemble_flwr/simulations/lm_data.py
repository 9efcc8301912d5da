"""The byte language model app's data (apps/lm): the running interpreter's standard library.

Every node holds the Python source of a few whole top-level packages of the standard
library that runs it (``sysconfig.get_paths()["stdlib"]``): one node ``email`` and
``json``, another ``asyncio``, and so on. Whole packages per node make the split non-IID
in earnest (each package has its own vocabulary, idioms and layout). One more package is
held out from every node: the federation's model is measured on it as on code no node
trained on. Within each node a seeded fraction of its files is held out for validation.

Everything is read from the local disk (no network), with a size cap per file and per
package so that a run stays fast; an unreadable file is skipped. The split is a pure
function of the package list, the node count, the seed and the caps, so a node that
lives for one message rebuilds the same private data (and the same commitment) every
time. Another Python version ships another standard library, hence another split.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.errors import ConfigError

EXCLUDED_PACKAGES = frozenset({"test", "encodings", "pydoc_data"})
"""Top-level packages no node gets: the test suite (tests of everything else, not a
package of its own), and generated tables (codec maps, pydoc's topic dump)."""
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__"})
"""Folders inside a package that are not read: a package's own tests and bytecode."""
MIN_FILES = 2
"""A package needs this many non-empty source files: a node must keep one to train on
when one is held out for validation."""


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One source file: its package, its path under the library folder, its bytes (at
    most the cap's)."""

    package: str
    path: str
    data: bytes


@dataclasses.dataclass(frozen=True)
class CorpusSettings:
    """How the standard library is split (the app's run config keys in the errors).

    Raises:
        ConfigError: a value out of range (the run config key named).
    """

    num_nodes: int
    seed: int = 0
    validation_fraction: float = 0.2
    max_file_bytes: int = 32768
    max_package_bytes: int = 262144
    held_out_package: str = ""  # empty: the seed picks it
    root: str = ""  # empty: the running interpreter's standard library

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ConfigError("num-partitions", f"must be at least 1, got {self.num_nodes}")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ConfigError(
                "validation-fraction", f"must be in (0, 1), got {self.validation_fraction}"
            )
        if self.max_file_bytes < 1:
            raise ConfigError("max-file-bytes", f"must be at least 1, got {self.max_file_bytes}")
        if self.max_package_bytes < self.max_file_bytes:
            raise ConfigError(
                "max-package-bytes",
                f"must be at least max-file-bytes ({self.max_file_bytes}), "
                f"got {self.max_package_bytes}",
            )

    @property
    def library(self) -> Path:
        """The folder the packages are read from."""
        return Path(self.root) if self.root else stdlib_root()


def _read_prefix(path: Path, limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``path``; None if it cannot be read."""
    try:
        with path.open("rb") as handle:
            return handle.read(limit)
    except OSError:
        return None


@functools.lru_cache(maxsize=256)
def read_package(
    library: Path, name: str, max_file_bytes: int, max_package_bytes: int
) -> tuple[SourceFile, ...]:
    """The package's non-empty ``.py`` files, folder by folder in sorted order (its tests
    and bytecode folders left out), each cut to ``max_file_bytes``, until
    ``max_package_bytes`` are read (the file that reaches the cap is cut there).
    Unreadable files are skipped."""
    files: list[SourceFile] = []
    left = max_package_bytes
    package_dir = library / name
    for folder, dirs, names in os.walk(package_dir):  # top-down, folders in sorted order
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for file_name in sorted(n for n in names if n.endswith(".py")):
            if left <= 0:
                return tuple(files)
            path = Path(folder) / file_name
            data = _read_prefix(path, min(max_file_bytes, left))
            if data:
                files.append(SourceFile(name, path.relative_to(library).as_posix(), data))
                left -= len(data)
    return tuple(files)


def stdlib_packages(settings: CorpusSettings) -> tuple[str, ...]:
    """The top-level packages the split draws from, sorted: public (no leading
    underscore), not in :data:`EXCLUDED_PACKAGES`, with at least :data:`MIN_FILES`
    non-empty source files."""
    library = settings.library
    try:
        entries = sorted(os.listdir(library))
    except OSError as exc:
        raise ConfigError(
            "stdlib", f"the standard library at {library} cannot be read: {exc}"
        ) from None
    names = [
        n
        for n in entries
        if n.isidentifier()
        and not n.startswith("_")
        and n not in EXCLUDED_PACKAGES
        and (library / n / "__init__.py").is_file()
    ]
    return tuple(
        n
        for n in names
        if len(read_package(library, n, settings.max_file_bytes, settings.max_package_bytes))
        >= MIN_FILES
    )


@dataclasses.dataclass(frozen=True)
class PackageSplit:
    """Which packages each node holds, and the one no node holds."""

    nodes: tuple[tuple[str, ...], ...]
    held_out: str


@functools.lru_cache(maxsize=32)
def split_packages(settings: CorpusSettings) -> PackageSplit:
    """A seeded shuffle of the packages; the held-out package (the one named, else the
    shuffle's first) is taken out and the rest are dealt to the nodes in turn, so that
    every node gets whole packages and no package goes to two nodes.

    Raises:
        ConfigError: the named held-out package is not one of the packages, or there are
            fewer packages left than nodes.
    """
    packages = stdlib_packages(settings)
    if settings.held_out_package and settings.held_out_package not in packages:
        raise ConfigError(
            "held-out-package",
            f"{settings.held_out_package!r} is not one of the packages: {', '.join(packages)}",
        )
    rng = np.random.default_rng(derive_seed(settings.seed, "lm-packages"))
    order = [packages[i] for i in rng.permutation(len(packages))]
    held_out = settings.held_out_package or (order[0] if order else "")
    rest = [p for p in order if p != held_out]
    if len(rest) < settings.num_nodes:
        raise ConfigError(
            "num-partitions",
            f"{settings.num_nodes} nodes need as many packages, and {settings.library} has "
            f"{len(rest)} besides the held-out one",
        )
    nodes = tuple(tuple(sorted(rest[i :: settings.num_nodes])) for i in range(settings.num_nodes))
    return PackageSplit(nodes=nodes, held_out=held_out)


@dataclasses.dataclass(frozen=True)
class NodeCorpus:
    """One node's private source (node ``node`` of ``num_nodes``): its packages, its
    training files and its held-out validation files (disjoint, both in read order)."""

    node: int
    num_nodes: int
    packages: tuple[str, ...]
    train: tuple[SourceFile, ...]
    validation: tuple[SourceFile, ...]


def _files_of(settings: CorpusSettings, packages: tuple[str, ...]) -> list[SourceFile]:
    library = settings.library
    return [
        f
        for p in packages
        for f in read_package(library, p, settings.max_file_bytes, settings.max_package_bytes)
    ]


def node_corpus(node: int, settings: CorpusSettings) -> NodeCorpus:
    """Node ``node``'s packages, split into training and validation files: a seeded
    ``validation-fraction`` of its files (at least one, and one is always left to train on).

    Raises:
        ConfigError: ``node`` is not in [0, num_nodes), or the split refuses the settings.
    """
    if not 0 <= node < settings.num_nodes:
        raise ConfigError("partition-id", f"{node} is not in [0, {settings.num_nodes})")
    packages = split_packages(settings).nodes[node]
    files = _files_of(settings, packages)
    count = len(files)
    n_val = min(count - 1, max(1, round(settings.validation_fraction * count)))
    rng = np.random.default_rng(derive_seed(settings.seed, "lm-validation", node))
    held = set(rng.choice(count, n_val, replace=False).tolist())
    return NodeCorpus(
        node=node,
        num_nodes=settings.num_nodes,
        packages=packages,
        train=tuple(f for i, f in enumerate(files) if i not in held),
        validation=tuple(f for i, f in enumerate(files) if i in held),
    )


def held_out_files(settings: CorpusSettings) -> tuple[SourceFile, ...]:
    """Every file of the package no node trains on (the server's test set)."""
    return tuple(_files_of(settings, (split_packages(settings).held_out,)))


def as_bytes(files: tuple[SourceFile, ...] | list[SourceFile]) -> torch.Tensor:
    """The files' bytes one after the other, as a uint8 tensor."""
    return torch.frombuffer(bytearray(b"".join(f.data for f in files)), dtype=torch.uint8)


def training_windows(
    data: torch.Tensor, generator: torch.Generator, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` windows of ``seq_len + 1`` bytes at uniform start offsets drawn with
    ``generator``: the inputs (first ``seq_len`` bytes) and the targets (the next byte of
    each), int64 of shape (batch_size, seq_len). A text shorter than a window gives
    windows as long as the text allows."""
    width = min(seq_len + 1, len(data))
    if width < 2:
        raise ConfigError("max-file-bytes", "a node needs at least 2 bytes of training text")
    starts = torch.randint(len(data) - width + 1, (batch_size,), generator=generator)
    windows = data[starts[:, None] + torch.arange(width)].long()
    return windows[:, :-1], windows[:, 1:]


def evaluation_windows(data: torch.Tensor, seq_len: int, max_bytes: int) -> torch.Tensor:
    """Windows of ``seq_len + 1`` bytes spread evenly over ``data`` (first and last
    included), as many as predict about ``max_bytes`` bytes (at least one), int64 of
    shape (windows, width). Deterministic: every model is measured on the same bytes.

    Raises:
        ConfigError: ``max_bytes`` < 1, or fewer than 2 bytes of text.
    """
    if max_bytes < 1:
        raise ConfigError("eval-bytes", f"must be at least 1, got {max_bytes}")
    width = min(seq_len + 1, len(data))
    if width < 2:
        raise ConfigError("max-file-bytes", "held-out text needs at least 2 bytes")
    last = len(data) - width
    count = min(last + 1, max(1, max_bytes // (width - 1)))
    starts = torch.from_numpy(np.linspace(0, last, count).round().astype(np.int64))
    return data[starts[:, None] + torch.arange(width)].long()
