"""The byte language model Flower App (apps/lm): pretraining across organisations, small.

``flwr run apps/lm`` (or ``APP=apps/lm ./dev.sh main``) runs it on Flower's simulation
engine. Every node holds the source of a few whole top-level packages of the running
interpreter's standard library (:mod:`lm_data`) and trains a small byte-level transformer
(:mod:`lm_model`) for ``inner-steps`` AdamW steps a round; the ServerApp is a
:class:`LensembleStrategy` with its DiLoCo outer step. Beside it each node trains a
local-only model on the same batches that never leaves it (:mod:`lm_training`).

Every round prints, in bits per byte: the global model on a package no node trains on
(the server measures it), and per node the global model and the node's local-only model
on the node's held-out files. Under secure aggregation or DP the nodes send no
evaluation (their metrics are not noised) and only the server's number is printed.

Run config: the lensemble keys under ``lensemble.`` (``docs/configuration.md``) and the
app's own keys (``docs/lm.md``): the split (``data-seed``, ``held-out-package``,
``validation-fraction``, ``max-file-bytes``, ``max-package-bytes``), the model
(``d-model``, ``layers``, ``heads``, ``seq-len``, ``init-seed``), ``eval-bytes`` and
``local-only``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from lensemble_flwr.clients.app import config_from_context, make_client_app
from lensemble_flwr.clients.state import load_state
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.params import load_broadcast
from lensemble_flwr.participant.participant import training_state
from lensemble_flwr.simulations import flower_app
from lensemble_flwr.simulations.lm_data import (
    CorpusSettings,
    as_bytes,
    evaluation_windows,
    held_out_files,
    node_corpus,
    split_packages,
)
from lensemble_flwr.simulations.lm_model import (
    ByteLM,
    ModelShape,
    evaluate_bits_per_byte,
    lm_device,
)
from lensemble_flwr.simulations.lm_training import ALL_SHARED, LmTrainer, LmTraining
from lensemble_flwr.simulations.local_only import local_only_of
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays

DEFAULT_NODES = 10
DEFAULT_EVAL_BYTES = 4096
NODE, NODES = "node", "nodes"
GLOBAL, LOCAL = "global-bpb", "local-only-bpb"
HELD_OUT, LOCAL_HELD_OUT = "held-out-package-bpb", "local-only-held-out-bpb"


def corpus_settings(run_config: Mapping[str, Any], num_nodes: int) -> CorpusSettings:
    """The split's settings from the app's run config keys."""
    return CorpusSettings(
        num_nodes=num_nodes,
        seed=int(run_config.get("data-seed", 0)),
        validation_fraction=float(run_config.get("validation-fraction", 0.2)),
        max_file_bytes=int(run_config.get("max-file-bytes", 32768)),
        max_package_bytes=int(run_config.get("max-package-bytes", 262144)),
        held_out_package=str(run_config.get("held-out-package", "")),
    )


def model_shape(run_config: Mapping[str, Any]) -> ModelShape:
    """The model's size from the app's run config keys."""
    default = ModelShape()
    return ModelShape(
        d_model=int(run_config.get("d-model", default.d_model)),
        layers=int(run_config.get("layers", default.layers)),
        heads=int(run_config.get("heads", default.heads)),
        seq_len=int(run_config.get("seq-len", default.seq_len)),
    )


def _eval_bytes(run_config: Mapping[str, Any]) -> int:
    return int(run_config.get("eval-bytes", DEFAULT_EVAL_BYTES))


def held_out_windows(run_config: Mapping[str, Any]) -> torch.Tensor:
    """The windows of the held-out package every model is measured on (the same on the
    server and on every node, whatever the node count)."""
    return _held_out_windows(
        corpus_settings(run_config, 1), model_shape(run_config).seq_len, _eval_bytes(run_config)
    )


@functools.lru_cache(maxsize=4)
def _held_out_windows(settings: CorpusSettings, seq_len: int, eval_bytes: int) -> torch.Tensor:
    return evaluation_windows(as_bytes(held_out_files(settings)), seq_len, eval_bytes)


def trainer_fn(context: Context) -> LmTraining:
    """This node's packages and model, with its saved state (its inner optimizer and
    local-only model) restored from ``context.state``."""
    run = context.run_config
    partition, count = flower_app.partition_of(context, default_count=DEFAULT_NODES)
    trainer = LmTrainer(
        node_corpus(partition, corpus_settings(run, count)),
        model_shape(run),
        init_seed=int(run.get("init-seed", 0)),
        eval_bytes=_eval_bytes(run),
        held_out=held_out_windows(run),
    )
    training = LmTraining(
        trainer, config_from_context(context), local_only=local_only_of(run)
    )
    training.import_state(training_state(load_state(context.state)))
    return training


def evaluate_fn(
    training: LmTraining, params: Mapping[str, np.ndarray], config: Mapping[str, Any]
) -> dict[str, float]:
    """The global model's bits per byte on the node's held-out files and, when the node
    keeps one, its local-only model's on the same bytes and on the held-out package
    (what the global model is measured on at the server)."""
    trainer = training.lm
    metrics = {
        NODE: float(trainer.corpus.node),
        NODES: float(trainer.corpus.num_nodes),
        GLOBAL: trainer.validation_bpb(params),
        "num-examples": float(trainer.validation[:, 1:].numel()),
    }
    local = training.local_only_bpb()
    if local is not None:
        metrics[LOCAL] = local
        held_out = None if trainer.held_out is None else training.local_only_bpb(trainer.held_out)
        if held_out is not None:
            metrics[LOCAL_HELD_OUT] = held_out
    return metrics


client_app = make_client_app(trainer_fn, evaluate_fn=evaluate_fn)

server_app = ServerApp()


class PerNodeBpb(flower_app.PerNodeMetrics):
    """The app's ``evaluate_metrics_aggr_fn``: the mean of each node's bits per byte
    (each node counts once) and how many nodes the global model serves better than
    their local-only one; the round's per-node values stay in :attr:`by_node`."""

    def __init__(self) -> None:
        super().__init__((GLOBAL, LOCAL, LOCAL_HELD_OUT), GLOBAL, LOCAL, NODE)


def round_report(
    server_round: int,
    held_out: str,
    held_out_bpb: float,
    by_node: Mapping[int, Mapping[str, float]],
    packages: tuple[tuple[str, ...], ...],
) -> str:
    """The round's lines: the global model on the held-out package, then one line per
    node: the global and the node's local-only model on the node's held-out files, its
    local-only model on the held-out package, and its packages."""
    head = f"round {server_round}, bits per byte: global model on held-out package "
    lines = [f"{head}{held_out!r} {held_out_bpb:.3f}"]
    if by_node:
        lines.append(f"  node  own files: global  local-only  {held_out!r}: local-only  packages")
    for node, m in by_node.items():
        local, local_held_out = m.get(LOCAL), m.get(LOCAL_HELD_OUT)
        local_text = "-" if local is None else f"{local:.3f}"
        held_out_text = "-" if local_held_out is None else f"{local_held_out:.3f}"
        names = "+".join(packages[node]) if 0 <= node < len(packages) else "?"
        lines.append(
            f"  {node:4d}  {m[GLOBAL]:17.3f}  {local_text:>10}  "
            f"{held_out_text:>{len(repr(held_out)) + 12}}  {names}"
        )
    return "\n".join(lines)


class HeldOutEvaluation:
    """The ServerApp's ``evaluate_fn``: the global model's bits per byte on the held-out
    package; it prints the round's report (with the nodes' values of the round, which
    the federated evaluation gathered just before)."""

    def __init__(self, run_config: Mapping[str, Any], per_node: PerNodeBpb) -> None:
        self.run_config = dict(run_config)
        settings = corpus_settings(run_config, 1)  # the held-out package: any node count
        self.held_out = split_packages(settings).held_out
        self.model = ByteLM(model_shape(run_config)).to(lm_device())
        self.windows = held_out_windows(run_config)
        self.per_node = per_node

    def packages(self, by_node: Mapping[int, Mapping[str, float]]) -> tuple[tuple[str, ...], ...]:
        """Each node's packages, as the nodes split them (their count is in their metrics)."""
        counts = {int(m.get(NODES, 0)) for m in by_node.values()}
        if len(counts) != 1 or min(counts) < 1:
            return ()
        return split_packages(corpus_settings(self.run_config, counts.pop())).nodes

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_broadcast(self.model, record_to_arrays(arrays), ALL_SHARED)
        bpb = evaluate_bits_per_byte(self.model, self.windows)
        by_node = self.per_node.by_node if server_round > 0 else {}
        report = round_report(server_round, self.held_out, bpb, by_node, self.packages(by_node))
        print(report, flush=True)
        self.per_node.by_node = {}  # a round whose nodes send nothing prints no stale rows
        return MetricRecord({HELD_OUT: bpb})


def check_app_keys(run_config: Mapping[str, Any]) -> None:
    """Refuse app keys the split, the model or the evaluation would refuse (before the
    ServerApp asks the Grid anything).

    Raises:
        ConfigError: the key and why.
    """
    split_packages(corpus_settings(run_config, int(run_config.get("num-partitions", 1))))
    model_shape(run_config)
    local_only_of(run_config)
    if _eval_bytes(run_config) < 1:
        raise ConfigError("eval-bytes", f"must be at least 1, got {_eval_bytes(run_config)}")


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation; print every round's bits per byte."""
    run_config = dict(context.run_config)
    # first: a bad value stops the run in seconds
    config = flower_app.checked_config(context, lambda _: check_app_keys(run_config))
    use_torch_threads()  # the ServerApp evaluates beside the nodes (clients/threads.py)
    per_node = PerNodeBpb()
    server_evaluate = HeldOutEvaluation(run_config, per_node)
    config, strategy = flower_app.strategy_from_context(
        context, config, evaluate_metrics_aggr_fn=per_node
    )
    shape, seed = model_shape(run_config), int(run_config.get("init-seed", 0))
    flower_app.start_and_report(
        strategy,
        grid,
        context,
        config,
        initial_arrays=arrays_to_record(initial_params(shape, seed)),
        evaluate_fn=server_evaluate,
        final_label="final bits per byte (mean over the nodes' held-out files)",
        final_metrics=lambda result: result.evaluate_metrics_clientapp,
    )


def initial_params(shape: ModelShape, seed: int = 0) -> dict[str, np.ndarray]:
    """θ_0: every tensor of a :class:`ByteLM` of ``shape`` from ``seed``, in sorted order."""
    net = ByteLM(shape, seed=seed)
    return {
        n: t.detach().numpy().astype(np.float32, copy=True)
        for n, t in sorted(net.state_dict().items())
    }
