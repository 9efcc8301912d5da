"""benchmarks/bench_privacy_examples.py finds docs/privacy.md's private examples and lays
each over the digits app's run config, as the page says it is run."""

from __future__ import annotations

from pathlib import Path

import bench_privacy_examples as bench


def test_it_finds_the_pages_private_examples_in_page_order() -> None:
    examples = bench.private_examples()
    assert len(examples) == 3
    assert examples[0]["lensemble.dp-mode"] == "distributed"
    assert examples[1]["lensemble.dp-adjacency"] == "zero-out"
    assert examples[2]["lensemble.sample-fraction"] == 0.3


def test_an_example_is_laid_over_the_digits_apps_config() -> None:
    example = bench.private_examples()[0]
    config = bench.run_config(example)
    assert config["num-partitions"] == 100  # the example's
    assert config["model"] == "net" and config["data-seed"] == 0  # the app's
    assert config["lensemble.inner-steps"] == 20


def test_a_block_without_noise_is_not_an_example(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```toml\n[tool.flwr.app.config.lensemble]\nclip-norm = 1.0\n```\n"
        "```toml\n[tool.flwr.app.config.lensemble]\nclip-norm = 1.0\n"
        "noise-multiplier = 2.0\ndp-epsilon = 8.0\n```\n"
    )
    assert bench.private_examples(page) == [
        {"lensemble.clip-norm": 1.0, "lensemble.noise-multiplier": 2.0, "lensemble.dp-epsilon": 8.0}
    ]
