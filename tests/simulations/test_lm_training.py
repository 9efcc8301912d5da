"""lm_training: a node's trainer, and its local-only model kept in the node's saved state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.simulations.lm_data import CorpusSettings, node_corpus
from lensemble_flwr.simulations.lm_model import ByteLM, ModelShape
from lensemble_flwr.simulations.lm_training import LmTrainer, LmTraining
from lensemble_flwr.simulations.local_only import LOCAL_ONLY

SHAPE = ModelShape(d_model=16, layers=1, heads=2, seq_len=16)
CONFIG = LensembleConfig.from_run_config(
    {"lensemble.inner-steps": 3, "lensemble.inner-lr": 0.01, "lensemble.inner-batch-size": 4}
)


def corpus(node: int = 0):  # type: ignore[no-untyped-def]
    return node_corpus(
        node, CorpusSettings(num_nodes=3, max_file_bytes=1024, max_package_bytes=4096)
    )


def trainer(device: torch.device | None = None) -> LmTrainer:
    return LmTrainer(corpus(), SHAPE, eval_bytes=128, device=device)


def initial() -> dict[str, np.ndarray]:
    return {n: t.numpy().copy() for n, t in ByteLM(SHAPE).state_dict().items()}


def test_the_trainer_commits_to_its_training_files_and_weighs_by_windows() -> None:
    node = trainer()
    records = list(node.dataset_records())
    assert records == list(trainer().dataset_records())
    assert [r.split(b"\0", 1)[0].decode() for r in records] == [f.path for f in node.corpus.train]
    total = sum(len(f.data) for f in node.corpus.train)
    assert node.num_examples() == total // SHAPE.seq_len


def test_batches_go_where_the_model_is() -> None:
    """The CPU here; the same code puts them on CUDA when lm_device says so."""
    node = trainer(torch.device("cpu"))
    x, y = node.sample_batch(torch.Generator().manual_seed(0), 4)
    device = next(node.model.parameters()).device
    assert x.device == y.device == device == node.device


def test_the_local_only_model_takes_as_many_steps_on_the_same_batches_never_the_global() -> None:
    training = LmTraining(trainer(), CONFIG)
    start = initial()
    shared = training.fit(start, steps=3, seed=9)
    assert training.local_steps == 3
    local = training.local_only.model.state_dict()  # type: ignore[union-attr]
    # from the same start, the same batches: the first round's local-only model is the
    # federated node's trained model
    assert all(np.allclose(shared[n], local[n].numpy(), atol=1e-6) for n in shared)
    moved = {n: v + 0.5 for n, v in start.items()}  # another global model arrives
    training.fit(moved, steps=3, seed=10)
    assert training.local_steps == 6
    after = training.local_only.model.state_dict()  # type: ignore[union-attr]
    assert all(np.abs(after[n].numpy() - moved[n]).max() > 0.1 for n in ("embed.weight",))
    assert training.local_only_bpb() == pytest.approx(
        training.lm.validation_bpb({n: t.numpy() for n, t in after.items()}), rel=1e-6
    )


def test_a_node_rebuilt_from_its_state_goes_on_exactly_as_the_one_that_saved_it() -> None:
    kept = LmTraining(trainer(), CONFIG)
    kept.fit(initial(), steps=3, seed=1)
    state = kept.export_state()
    assert any(k.startswith(f"{LOCAL_ONLY}optimizer/") for k in state.arrays)
    rebuilt = LmTraining(trainer(), CONFIG)
    rebuilt.import_state(state)
    assert rebuilt.local_steps == 3
    assert rebuilt.local_only_bpb() == kept.local_only_bpb()
    kept.fit(initial(), steps=3, seed=2)
    rebuilt.fit(initial(), steps=3, seed=2)
    one = kept.local_only.model.state_dict()  # type: ignore[union-attr]
    two = rebuilt.local_only.model.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(one[n], two[n]) for n in one)  # the AdamW state came along


def test_without_local_only_nothing_of_it_is_trained_or_kept() -> None:
    training = LmTraining(trainer(), CONFIG, local_only=False)
    training.fit(initial(), steps=2, seed=1)
    assert training.local_only_bpb() is None and training.local_steps == 0
    state = training.export_state()
    assert not any(k.startswith(LOCAL_ONLY) for k in state.arrays)
    assert "local-only" not in state.meta


def test_a_state_without_a_local_only_part_leaves_the_initial_model() -> None:
    saved = LmTraining(trainer(), CONFIG, local_only=False)
    saved.fit(initial(), steps=2, seed=1)
    training = LmTraining(trainer(), CONFIG)
    training.import_state(saved.export_state())
    fresh = ByteLM(SHAPE).state_dict()
    local = training.local_only.model.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(fresh[n], local[n]) for n in fresh)
    assert training.local_optimizer is None and training.local_steps == 0


def test_validation_of_global_params_leaves_the_nodes_model_alone() -> None:
    node = trainer()
    before = {n: t.clone() for n, t in node.model.state_dict().items()}
    moved = {n: v + 0.01 for n, v in initial().items()}
    assert node.validation_bpb(moved) != node.validation_bpb()
    assert all(torch.equal(before[n], t) for n, t in node.model.state_dict().items())
