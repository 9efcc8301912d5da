"""Keyless records: who may contribute without an identity key, and refusing a record
rewritten to pass as keyless.

A record none of whose contributors holds an identity key cannot be endorsed
(:mod:`.endorsement`), so it must not be something a forger can produce at will from a
keyed run. Two things close that:

* The keys come from the whole run (:func:`run_keys`): every registry a record names,
  the current one (``coordinator/participants``, which never loses a participant nor
  changes a key: :func:`~lensemble_flwr.provenance.verify.registry_breaks`) and the
  allow-list the reader holds from outside the run (the coordinator's ``identities``, a
  shared folder's). A record cannot shed its contributors' keys by naming no registry.
* Which keyless or unbound contributors an honest run can have is decided by the run's
  config (the manifest header, which a resume checks against the operator's own
  config): :func:`keyless_breaks`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import StoreError
from lensemble_flwr.provenance.ledger import REGISTRY, ContributionRecord
from lensemble_flwr.provenance.verify import LinkBreak


def _registry_keys(store: Store, digest: str) -> dict[str, str | None]:
    """Participant → identity key (None: registered without one) of one stored registry;
    empty when it cannot be read (``verify`` names it)."""
    try:
        commitments = json.loads(store.get(digest))["commitments"]
        return {
            pid: (c.get("identity_key") or "").strip() or None
            for pid, c in commitments.items()
            if isinstance(c, dict)
        }
    except (StoreError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _digests(store: Store, records: Iterable[ContributionRecord]) -> list[str]:
    digests = [r.registry_digest for r in records if r.registry_digest]
    try:
        if store.bound(REGISTRY):
            digests.append(store.resolve(REGISTRY))
    except StoreError:
        pass  # verify names a registry it cannot resolve
    return list(dict.fromkeys(digests))


def run_keys(
    store: Store,
    records: Sequence[ContributionRecord],
    identities: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Participant → identity key, from every registry of the run: those the records name
    and the current one (a key never changes once registered, so any registry of the run
    is as good as the record's own), then the allow-list ``identities`` for participants
    no registry holds a key of. A registry that cannot be read adds nothing (``verify``
    names it)."""
    keys: dict[str, str] = {}
    for digest in _digests(store, records):
        for pid, key in _registry_keys(store, digest).items():
            if key is not None:
                keys.setdefault(pid, key)
    for pid, key in (identities or {}).items():
        keys.setdefault(pid, key.strip())
    return keys


def keyless_breaks(
    store: Store,
    records: Sequence[ContributionRecord],
    config: Mapping[str, Any],
    identities: Mapping[str, str] | None = None,
) -> list[LinkBreak]:
    """The records of an endorsed run (one with a policy) that an honest run could not
    have written, for what they say about keys and bindings:

    1. a record names no registry although one of its contributors is bound (has a
       dataset root) or holds a key in the run, or although an earlier record named one
       (the registry is stored before the first record that depends on it and is never
       removed);
    2. a contributor holds no identity key in the run while ``require-signatures`` is
       set (the coordinator admits no message without a registered key's signature);
    3. a contributor is unbound (no dataset root) while ``require-binding`` is set.

    ``config``: the manifest header's recorded config (run_config keys); ``identities``:
    the reader's allow-list, a source of keys only (a coordinator may be given one when
    it resumes a run that admitted keyless contributors before, so it decides no rule).
    """
    keys = run_keys(store, records, identities)
    breaks: list[LinkBreak] = []
    named = False
    for rec in records:
        breaks += _registry_named(rec, keys, named)
        named = named or rec.registry_digest is not None
        breaks += _admitted(rec, keys, config)
    return breaks


def _registry_named(
    rec: ContributionRecord, keys: Mapping[str, str], named: bool
) -> list[LinkBreak]:
    if rec.registry_digest is not None:
        return []
    keyed = [p for p in rec.contributors if p in keys]
    bound = [p for p, root in sorted(rec.dataset_roots.items()) if root is not None]
    if not (keyed or bound or named):
        return []
    why = (
        f"its contributors {', '.join(keyed)} hold identity keys in the run"
        if keyed
        else f"its contributors {', '.join(bound)} are bound to dataset roots"
        if bound
        else "an earlier record named one (a registry is never removed)"
    )
    return [
        LinkBreak(
            rec.round,
            "registry_digest",
            "the registry the round used",
            None,
            f"round {rec.round}: ledger record {rec.record_hash[:12]}… names no participant "
            f"registry, yet {why}: FORGED to pass as keyless (refused)",
        )
    ]


def _admitted(
    rec: ContributionRecord,
    keys: Mapping[str, str],
    config: Mapping[str, Any],
) -> Iterator[LinkBreak]:
    keyless = [p for p in rec.contributors if p not in keys]
    if keyless and config.get("require-signatures"):
        yield LinkBreak(
            rec.round,
            "contributors",
            "contributors with an identity key",
            keyless,
            f"round {rec.round}: ledger record {rec.record_hash[:12]}… names contributors "
            f"{', '.join(keyless)} that hold no identity key in the run, yet require-signatures "
            "is set: FORGED (refused)",
        )
    unbound = rec.unbound
    if unbound and config.get("require-binding"):
        yield LinkBreak(
            rec.round,
            "dataset_roots",
            "contributors bound to their dataset",
            unbound,
            f"round {rec.round}: ledger record {rec.record_hash[:12]}… names unbound "
            f"contributors {', '.join(unbound)}, yet require-binding is set: FORGED (refused)",
        )
