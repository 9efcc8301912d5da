"""Run the aggregation with the compiled kernels for every array, or with numpy's passes
for every array (importing this needs no numba: without it, the compiled path is numpy's)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from lensemble_flwr.aggregation import compiled


@contextlib.contextmanager
def kernels(use: bool, *, magic_bound: int | None = None) -> Iterator[None]:
    """Compiled kernels for every array (``use``), or numpy's passes for every array."""
    with pytest.MonkeyPatch.context() as mp:
        if use:
            mp.setattr(compiled, "COMPILED_MIN_SIZE", 1)
            if magic_bound is not None:
                mp.setattr(compiled, "MAGIC_BOUND", magic_bound)
        else:
            mp.setattr(compiled, "for_size", lambda size: None)
        yield
