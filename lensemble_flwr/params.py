"""Named arrays, parameter groups, and moving a model's shared groups in and out of torch.

Named arrays (``dict[str, np.ndarray]`` with sorted keys) are the currency between
layers; torch stays inside participants. Only floating-point tensors of the shared
groups ever leave a model: integer buffers such as BatchNorm's
``num_batches_tracked`` are counts, and the mean of two counts is not a count, so
they are never exported, averaged or stepped. Optimizer state is not part of a
module's ``state_dict`` and is never exported either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from lensemble_flwr.config import ParamGroupsConfig
from lensemble_flwr.errors import ConfigError, ParameterMismatch, ResidencyViolation

NamedArrays = dict[str, np.ndarray]


def frozen(arrays: Mapping[str, np.ndarray]) -> NamedArrays:
    """Read-only snapshots of ``arrays`` in canonical order (copies, never views)."""
    out: NamedArrays = {}
    for name in sorted(arrays):
        copy = np.array(arrays[name], copy=True)
        copy.setflags(write=False)
        out[name] = copy
    return out


def in_group(name: str, group: str) -> bool:
    """True if ``name`` belongs to parameter group ``group``: it is ``group`` itself or
    starts with ``group + "."`` (``"enc"`` holds ``"enc.weight"``, not ``"encoder.weight"``)."""
    return name == group or name.startswith(group + ".")


def is_local(name: str, groups: ParamGroupsConfig) -> bool:
    """True if ``name`` belongs to a local (never shared) group."""
    return any(in_group(name, entry) for entry in groups.local)


def is_shared(name: str, groups: ParamGroupsConfig) -> bool:
    """True if ``name`` belongs to a shared group (``"*"`` shares all non-local names)."""
    if is_local(name, groups):
        return False
    return any(entry == "*" or in_group(name, entry) for entry in groups.shared)


def _shared_float_entries(
    module: torch.nn.Module, groups: ParamGroupsConfig
) -> dict[str, torch.Tensor]:
    return {
        name: tensor
        for name, tensor in sorted(module.state_dict(keep_vars=True).items())
        if is_shared(name, groups) and torch.is_floating_point(tensor)
    }


def shared_names(module: torch.nn.Module, groups: ParamGroupsConfig) -> list[str]:
    """Names of the module's floating-point tensors in shared groups, sorted."""
    return list(_shared_float_entries(module, groups))


def export_shared(module: torch.nn.Module, groups: ParamGroupsConfig) -> NamedArrays:
    """Snapshot the module's shared floating-point tensors as named numpy arrays.

    The arrays are copies: training the module afterwards does not change them.
    """
    return {
        name: tensor.detach().cpu().numpy().copy()
        for name, tensor in _shared_float_entries(module, groups).items()
    }


def load_shared(
    module: torch.nn.Module, arrays: Mapping[str, np.ndarray], groups: ParamGroupsConfig
) -> None:
    """Load named arrays into the module's shared groups, all or nothing.

    Raises:
        ParameterMismatch: a name the module does not have, a name that is not a shared
            floating-point tensor, a missing shared name, a non-floating array, or a wrong
            shape (both shapes are given). Nothing is written when it raises.
    """
    state = module.state_dict(keep_vars=True)
    targets = _shared_float_entries(module, groups)
    unknown = sorted(set(arrays) - set(state))
    if unknown:
        raise ParameterMismatch(f"the model has no tensor named {unknown}")
    not_shared = sorted(set(arrays) - set(targets))
    if not_shared:
        raise ParameterMismatch(f"not shared floating-point tensors, refusing {not_shared}")
    missing = sorted(set(targets) - set(arrays))
    if missing:
        raise ParameterMismatch(f"missing shared tensors {missing}")
    _check_and_copy(targets, arrays)


def load_broadcast(
    module: torch.nn.Module, arrays: Mapping[str, np.ndarray], groups: ParamGroupsConfig
) -> list[str]:
    """Load the global arrays a coordinator broadcast into the module, all or nothing, and
    return their names: what the participant federates this round. The module's other
    tensors (local groups, integer buffers, anything the broadcast leaves out) stay the
    participant's own.

    Raises:
        ResidencyViolation: the broadcast holds a name of a local group (local groups
            never leave a participant, so no coordinator may set them either).
        ParameterMismatch: a name the module does not have, a name that is not a
            floating-point tensor or not in a shared group, a non-floating array, or a
            wrong shape. Nothing is written when it raises.
    """
    local = sorted(name for name in arrays if is_local(name, groups))
    if local:
        raise ResidencyViolation(
            f"the global arrays hold {local}, which are in the local groups "
            f"{list(groups.local)}: local groups never leave a participant"
        )
    state = module.state_dict(keep_vars=True)
    unknown = sorted(set(arrays) - set(state))
    if unknown:
        raise ParameterMismatch(f"the model has no tensor named {unknown}")
    not_shared = sorted(
        name
        for name in arrays
        if not (is_shared(name, groups) and torch.is_floating_point(state[name]))
    )
    if not_shared:
        raise ParameterMismatch(f"not shared floating-point tensors, refusing {not_shared}")
    _check_and_copy({name: state[name] for name in arrays}, arrays)
    return sorted(arrays)


def _check_and_copy(
    targets: Mapping[str, torch.Tensor], arrays: Mapping[str, np.ndarray]
) -> None:
    """Copy ``arrays`` into the ``targets`` tensors, all or nothing: every shape and dtype
    is checked before the first write.

    Raises:
        ParameterMismatch: a wrong shape (both are given) or a non-floating array.
    """
    for name, tensor in targets.items():
        value = np.asarray(arrays[name])
        if tuple(value.shape) != tuple(tensor.shape):
            raise ParameterMismatch(
                f"{name}: model shape {tuple(tensor.shape)}, got {tuple(value.shape)}"
            )
        if not np.issubdtype(value.dtype, np.floating):
            raise ParameterMismatch(f"{name}: expected a floating-point array, got {value.dtype}")
    with torch.no_grad():
        for name, tensor in targets.items():
            tensor.copy_(torch.from_numpy(np.array(arrays[name], copy=True)).to(tensor.dtype))


def export_named(module: torch.nn.Module, names: Iterable[str]) -> NamedArrays:
    """Copies of the module's tensors ``names``, in canonical order."""
    state = module.state_dict()
    return {name: state[name].detach().cpu().numpy().copy() for name in sorted(names)}


def check_group_patterns(
    names: Iterable[str], groups: ParamGroupsConfig, *, which: Iterable[str] = ("shared", "local")
) -> None:
    """Refuse a group pattern that matches none of ``names`` (a typo, or groups written
    for another model): the run would silently federate nothing, or keep nothing local.

    Raises:
        ConfigError: naming the key, the patterns that match nothing and the names.
    """
    names = sorted(names)
    for kind in which:
        patterns = groups.shared if kind == "shared" else groups.local
        unmatched = [
            g for g in patterns if g != "*" and not any(in_group(n, g) for n in names)
        ]
        if unmatched:
            shown = names if len(names) <= 12 else [*names[:12], f"... ({len(names)} in all)"]
            raise ConfigError(
                f"{kind}-groups",
                f"the pattern(s) {unmatched} match none of the model's arrays {shown} "
                "(a name is in group g if it is g or starts with 'g.')",
            )


def check_initial_groups(initial: Mapping[str, np.ndarray], groups: ParamGroupsConfig) -> None:
    """The coordinator's check of θ_0 against the groups, before anything is broadcast.

    Raises:
        ResidencyViolation: θ_0 holds names of local groups (they never leave a
            participant, so they have no place in what the coordinator broadcasts).
        ConfigError: a shared pattern matches none of θ_0's names, or a name is in no
            shared group (it would be broadcast but never federated).
    """
    local = sorted(name for name in initial if is_local(name, groups))
    if local:
        raise ResidencyViolation(
            f"the initial params hold {local}, which are in the local groups "
            f"{list(groups.local)}: local groups never leave a participant, so leave them "
            "out of the initial params"
        )
    check_group_patterns(initial, groups, which=("shared",))
    stray = sorted(name for name in initial if not is_shared(name, groups))
    if stray:
        raise ConfigError(
            "shared-groups",
            f"the initial params hold {stray}, which are in none of the shared groups "
            f"{list(groups.shared)}: add their group to shared-groups (or '*'), or leave "
            "them out of the initial params",
        )


def check_same_layout(
    expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray], what: str
) -> None:
    """Raise ParameterMismatch unless ``actual`` has exactly the names and shapes of
    ``expected``."""
    if set(expected) != set(actual):
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected))
        raise ParameterMismatch(f"{what}: missing {missing}, unexpected {extra}")
    for name in expected:
        if expected[name].shape != actual[name].shape:
            raise ParameterMismatch(
                f"{what}: {name} expected shape {expected[name].shape}, got {actual[name].shape}"
            )


def subtract(left: Mapping[str, np.ndarray], right: Mapping[str, np.ndarray]) -> NamedArrays:
    """``left - right`` name by name, in float32, over identical layouts."""
    check_same_layout(left, right, "subtract")
    return {
        name: left[name].astype(np.float32) - right[name].astype(np.float32)
        for name in sorted(left)
    }
