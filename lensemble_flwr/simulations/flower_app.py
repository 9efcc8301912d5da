"""What the example Flower Apps share: their own run_config keys, the node's partition, and
a LensembleStrategy built from the run config.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import Context

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.strategies import LensembleStrategy

APP_KEYS = frozenset(
    {
        "num-server-rounds",
        "num-partitions",
        "run-dir",
        "warmup-timeout",
        "fraction-evaluate",
        "data-seed",
    }
)
"""The run_config keys every example app reads itself (the rest are lensemble keys)."""


def partition_of(context: Context, default_count: int) -> tuple[int, int]:
    """This node's (partition id, partition count) from its node config (the simulation
    engine sets both; a SuperNode gets them from ``--node-config``)."""
    node = context.node_config
    count = int(node.get("num-partitions", context.run_config.get("num-partitions", default_count)))
    return int(node.get("partition-id", 0)) % count, count


def strategy_from_context(
    context: Context, app_keys: Iterable[str], **strategy_args: Any
) -> tuple[LensembleConfig, LensembleStrategy]:
    """The federation config (app keys ignored, anything else strict) and a strategy that
    writes to ``run-dir`` (or ``$LENSEMBLE_RUN_DIR``) / ``flwr-<run id>`` and prints one
    line per round."""
    run_config = dict(context.run_config)
    config = LensembleConfig.from_run_config(run_config, extra_keys=app_keys)
    run_dir = str(run_config.get("run-dir", "")) or os.environ.get("LENSEMBLE_RUN_DIR", "")
    strategy = LensembleStrategy(
        config,
        run_dir=Path(run_dir) / f"flwr-{context.run_id}" if run_dir else None,
        warmup_timeout=float(run_config.get("warmup-timeout", 120.0)),
        fraction_evaluate=float(run_config.get("fraction-evaluate", 1.0)),
        on_round=lambda line: print(line, flush=True),
        **strategy_args,
    )
    return config, strategy
