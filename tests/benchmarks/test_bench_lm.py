"""benchmarks/bench_lm.py: its four arms differ as the benchmark says, at equal compute.

A tiny configuration (2 nodes, a 1-block model of width 16, 4 inner steps per node) runs
every arm in a few seconds; the checks are on what the arms did, not on how well they
learned: the steps each node took, the exchanges, and the outer step each round took.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.simulations.lm_model import ByteLM, ModelShape

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_lm.py"


def load_bench() -> ModuleType:
    """The benchmark script as a module (benchmarks/ is not a package)."""
    if "bench_lm" in sys.modules:
        return sys.modules["bench_lm"]
    spec = importlib.util.spec_from_file_location("bench_lm", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_lm"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


bench = load_bench()
SETUP = bench.Setup(
    nodes=2,
    steps=4,
    batch=2,
    shape=ModelShape(d_model=16, layers=1, heads=2, seq_len=16),
    node_eval_bytes=64,
    held_out_eval_bytes=64,
    eval_every=2,
    max_file_bytes=1024,
    max_package_bytes=4096,
)


@pytest.fixture(scope="module")
def data() -> Any:
    return bench.Data.of(SETUP)


def flat(params: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(params[n], dtype=np.float64).ravel() for n in sorted(params)])


def test_every_arm_takes_the_same_steps_and_communicates_as_designed(data: Any) -> None:
    results = [
        bench.run_arm(SETUP, data, arm, h, seed=0)
        for arm, h in (("diloco", 2), ("fedavg", 2), ("diloco", 4), ("sync", None), ("local", None))
    ]
    for result in results:  # counted as each node drew its batches
        assert result.steps_per_node == [SETUP.steps] * SETUP.nodes, result.arm
        assert result.curve[0].step == 0 and result.curve[-1].step == SETUP.steps
    rounds = {(r.arm, r.h): r.rounds for r in results}
    assert rounds == {
        ("diloco", 2): 2,
        ("fedavg", 2): 2,
        ("diloco", 4): 1,
        ("sync", None): SETUP.steps,  # the nodes' gradients meet every step
        ("local", None): 0,
    }
    assert [p.rounds for p in results[3].curve] == [0, 2, 4]  # sync: exchanges == steps
    # every arm starts from the same initial model: the same first measure
    assert len({(r.curve[0].nodes_bpb, r.curve[0].held_out_bpb) for r in results}) == 1
    # and they end apart: the arms are different trainings
    assert len({r.curve[-1].held_out_bpb for r in results}) == len(results)
    rows = bench.summarise(results)
    ratios = {(row["arm"], row["h"]): row["communication_ratio"] for row in rows}
    assert ratios[("diloco", 2)] == 2.0 and ratios[("diloco", 4)] == 4.0
    assert ratios[("sync", None)] == 1.0 and ratios[("local", None)] is None


def rounds_seen(data: Any, arm: str, h: int, seed: int = 0) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []
    bench.run_federated(SETUP, data, arm, h, seed, observe=lambda *a: seen.append(a))
    return seen


def weighted_mean(nodes: list[dict[str, np.ndarray]], weights: list[float]) -> np.ndarray:
    return sum(w * flat(n) for n, w in zip(nodes, weights, strict=True))  # type: ignore[return-value]


def test_the_fedavg_arm_makes_the_weighted_mean_of_the_nodes_models_the_global_one(
    data: Any,
) -> None:
    seen = rounds_seen(data, "fedavg", 2)
    assert [r[0] for r in seen] == [1, 2]
    for _round, _before, after, nodes, weights in seen:
        assert len(set(weights)) == 2  # the nodes hold different amounts of text
        assert not np.allclose(flat(nodes[0]), flat(nodes[1]))
        np.testing.assert_allclose(flat(after), weighted_mean(nodes, weights), atol=1e-6)


def test_the_diloco_arm_takes_nesterov_steps_of_lr_0_7_and_momentum_0_9(data: Any) -> None:
    seen = rounds_seen(data, "diloco", 2)
    momentum = None
    for _round, before, after, nodes, weights in seen:
        delta = flat(before) - weighted_mean(nodes, weights)  # the outer gradient
        momentum = delta if momentum is None else 0.9 * momentum + delta
        expected = flat(before) - 0.7 * (delta + 0.9 * momentum)
        np.testing.assert_allclose(flat(after), expected, atol=1e-5)
        assert not np.allclose(flat(after), weighted_mean(nodes, weights), atol=1e-4)


def test_the_sync_arm_steps_on_the_weighted_mean_of_the_nodes_gradients(data: Any) -> None:
    taken: dict[int, torch.Tensor] = {}
    bench.run_sync(SETUP, data, seed=3, observe=lambda step, grad: taken.setdefault(step, grad))
    assert sorted(taken) == list(range(1, SETUP.steps + 1))
    # step 1 again, by hand: each node's gradient on its own first batch, at θ_0
    trainers = bench.trainers_of(SETUP, data, 3)
    weights = bench.node_weights(trainers)
    grads = []
    for i, trainer in enumerate(trainers):
        model = ByteLM(SETUP.shape, seed=3)
        generator = torch.Generator().manual_seed(derive_seed(3, "bench-lm-sync", i))
        trainer.loss(model, trainer.sample_batch(generator, SETUP.batch)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert not torch.allclose(grads[0], grads[1])
    mean = sum(w * g for w, g in zip(weights, grads, strict=True))
    torch.testing.assert_close(taken[1], mean, rtol=1e-5, atol=1e-7)
    uniform = (grads[0] + grads[1]) / 2
    assert not torch.allclose(taken[1], uniform, rtol=1e-5, atol=1e-7)  # the weights count


def test_h_must_divide_the_steps(data: Any) -> None:
    with pytest.raises(ValueError, match="not a multiple of H = 3"):
        bench.run_federated(SETUP, data, "diloco", 3, seed=0)


def test_the_verdict_reads_the_paired_gaps_of_every_seed() -> None:
    assert bench.verdict([-0.1, -0.01, -0.2]) == "beats"
    assert bench.verdict([0.1, 0.01, 0.2]) == "loses to"
    assert bench.verdict([0.1, -0.01, 0.2]) == "matches"
