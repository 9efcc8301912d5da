"""lm_data: the standard library split by whole packages, deterministic from a seed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations.lm_data import (
    EXCLUDED_PACKAGES,
    CorpusSettings,
    as_bytes,
    evaluation_windows,
    held_out_files,
    node_corpus,
    read_package,
    split_packages,
    stdlib_packages,
    stdlib_root,
    training_windows,
)

SMALL = {"max_file_bytes": 2048, "max_package_bytes": 8192}


def settings(num_nodes: int = 4, **kwargs: object) -> CorpusSettings:
    return CorpusSettings(num_nodes=num_nodes, **{**SMALL, **kwargs})  # type: ignore[arg-type]


def test_the_split_is_the_seeds_and_another_seed_gives_another() -> None:
    first = [node_corpus(i, settings(seed=1)) for i in range(4)]
    again = [node_corpus(i, settings(seed=1)) for i in range(4)]
    assert first == again
    other = split_packages(settings(seed=2))
    assert other != split_packages(settings(seed=1))


def test_every_node_holds_whole_packages_no_other_node_holds_and_none_the_held_out() -> None:
    config = settings(num_nodes=5)
    split = split_packages(config)
    everything = stdlib_packages(config)
    held = [set(packages) for packages in split.nodes]
    assert all(held)  # every node has at least one package
    assert sum(map(len, held)) == len(set().union(*held))  # disjoint
    assert split.held_out not in set().union(*held)
    assert set().union(*held) | {split.held_out} == set(everything)
    assert not EXCLUDED_PACKAGES & set(everything)
    for node in range(5):
        corpus = node_corpus(node, config)
        files = corpus.train + corpus.validation
        # whole packages: every file of the node's packages, and only those
        assert {f.package for f in files} == set(corpus.packages)
        for package in corpus.packages:
            whole = read_package(config.library, package, **_caps(config))
            assert {f.path for f in files if f.package == package} == {f.path for f in whole}
        # held-out files: at least one, disjoint from the training files, one left to train
        assert corpus.train and corpus.validation
        assert not {f.path for f in corpus.train} & {f.path for f in corpus.validation}
    assert {f.package for f in held_out_files(config)} == {split.held_out}


def _caps(config: CorpusSettings) -> dict[str, int]:
    return {
        "max_file_bytes": config.max_file_bytes,
        "max_package_bytes": config.max_package_bytes,
    }


def test_a_named_held_out_package_is_the_one_no_node_trains_on() -> None:
    config = settings(held_out_package="json")
    split = split_packages(config)
    assert split.held_out == "json"
    assert all("json" not in packages for packages in split.nodes)


def test_files_and_packages_are_read_up_to_their_caps() -> None:
    config = settings(max_file_bytes=300, max_package_bytes=1000)
    for package in stdlib_packages(config)[:5]:
        files = read_package(config.library, package, 300, 1000)
        assert all(0 < len(f.data) <= 300 for f in files)
        assert sum(len(f.data) for f in files) <= 1000
        full = (config.library / files[0].path).read_bytes()
        assert full.startswith(files[0].data)  # a prefix of the file, byte for byte


def fake_library(root: Path) -> Path:
    """A tiny standard library: good packages, and what the split leaves out."""

    def write(path: str, text: str = "x = 1\n") -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)

    for name in ("alpha", "beta", "gamma"):
        write(f"{name}/__init__.py", f"'{name}'\n")
        write(f"{name}/core.py")
    write("alpha/tests/test_core.py")  # a package's tests: not read
    (root / "alpha" / "folder.py").mkdir()  # cannot be read as a file: skipped
    os.symlink(root / "nowhere.py", root / "alpha" / "broken.py")  # nor can this
    write("alpha/empty.py", "")  # empty: skipped
    write("_private/__init__.py")
    write("_private/a.py")
    write("test/__init__.py")  # the test suite
    write("test/a.py")
    write("single/__init__.py")  # one file only
    write("notapackage/a.py")  # no __init__.py
    write("module.py")
    return root


def test_the_split_reads_source_files_and_skips_what_it_cannot_or_should_not(
    tmp_path: Path,
) -> None:
    root = str(fake_library(tmp_path))
    config = settings(num_nodes=2, root=root)
    assert stdlib_packages(config) == ("alpha", "beta", "gamma")
    alpha = read_package(config.library, "alpha", 2048, 8192)
    assert [f.path for f in alpha] == ["alpha/__init__.py", "alpha/core.py"]
    split = split_packages(config)
    assert sorted([*(p for node in split.nodes for p in node), split.held_out]) == [
        "alpha",
        "beta",
        "gamma",
    ]


def test_more_nodes_than_packages_are_refused(tmp_path: Path) -> None:
    root = str(fake_library(tmp_path))
    with pytest.raises(ConfigError) as raised:
        split_packages(settings(num_nodes=3, root=root))  # 3 packages, one held out
    assert raised.value.field == "num-partitions"


def test_an_unknown_held_out_package_is_refused() -> None:
    with pytest.raises(ConfigError) as raised:
        split_packages(settings(held_out_package="no_such_package"))
    assert raised.value.field == "held-out-package"
    with pytest.raises(ConfigError):
        split_packages(settings(held_out_package="test"))  # excluded: not one of them


def test_a_library_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        stdlib_packages(settings(root=str(tmp_path / "absent")))
    assert raised.value.field == "stdlib"


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_nodes": 0}, "num-partitions"),
        ({"validation_fraction": 0.0}, "validation-fraction"),
        ({"validation_fraction": 1.0}, "validation-fraction"),
        ({"max_file_bytes": 0, "max_package_bytes": 10}, "max-file-bytes"),
        ({"max_file_bytes": 100, "max_package_bytes": 99}, "max-package-bytes"),
    ],
)
def test_settings_out_of_range_are_refused(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        CorpusSettings(**{"num_nodes": 2, **kwargs})  # type: ignore[arg-type]
    assert raised.value.field == key


@pytest.mark.parametrize("node", [-1, 4])
def test_a_node_outside_the_split_is_refused(node: int) -> None:
    with pytest.raises(ConfigError) as raised:
        node_corpus(node, settings())
    assert raised.value.field == "partition-id"


def test_the_default_library_is_the_running_interpreters() -> None:
    import sysconfig

    assert stdlib_root() == Path(sysconfig.get_paths()["stdlib"])
    assert CorpusSettings(num_nodes=1).library == stdlib_root()
    assert "json" in stdlib_packages(settings())


def test_training_windows_are_seeded_and_their_targets_the_next_bytes() -> None:
    data = as_bytes(node_corpus(0, settings()).train)
    x, y = training_windows(data, torch.Generator().manual_seed(5), 6, 16)
    again, _ = training_windows(data, torch.Generator().manual_seed(5), 6, 16)
    other, _ = training_windows(data, torch.Generator().manual_seed(6), 6, 16)
    assert x.shape == y.shape == (6, 16) and x.dtype == torch.int64
    assert x.equal(again) and not x.equal(other)
    assert x[:, 1:].equal(y[:, :-1])  # each target is the byte after its input
    text = bytes(data.tolist())
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        assert bytes(row_x + row_y[-1:]) in text  # a window of the node's text


def test_a_text_shorter_than_a_window_gives_shorter_windows_and_a_byte_is_refused() -> None:
    data = torch.tensor(list(b"abcde"), dtype=torch.uint8)
    x, y = training_windows(data, torch.Generator().manual_seed(0), 3, 16)
    assert x.shape == (3, 4) and bytes(x[0].tolist()) == b"abcd" and bytes(y[0].tolist()) == b"bcde"
    with pytest.raises(ConfigError):
        training_windows(data[:1], torch.Generator(), 3, 16)


def test_evaluation_windows_are_spread_over_the_text_first_and_last_bytes_included() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    windows = evaluation_windows(data, 9, 45)  # 45 bytes to predict: 5 windows of 9
    assert windows.shape == (5, 10)
    assert windows[0, 0] == 0 and windows[-1, -1] == 199
    assert windows.equal(evaluation_windows(data, 9, 45))
    assert evaluation_windows(data, 9, 44).shape == (4, 10)
    assert evaluation_windows(data, 9, 10**6).shape == (191, 10)  # at most one per start
    assert evaluation_windows(data, 9, 1).shape == (1, 10)


def test_evaluation_windows_refuse_no_bytes_and_an_empty_text() -> None:
    data = torch.arange(20, dtype=torch.uint8)
    with pytest.raises(ConfigError) as raised:
        evaluation_windows(data, 9, 0)
    assert raised.value.field == "eval-bytes"
    with pytest.raises(ConfigError):
        evaluation_windows(data[:1], 9, 10)
