"""The participant's commitment secret: kept on its own disk, never sent.

The secret salts the leaves of the participant's dataset commitment (see
:mod:`lensemble_flwr.provenance.merkle`), so the published root hides the records. It
must outlive the participant's process (a Flower participant is rebuilt for every
message; ``prove`` runs long after the run), so it lives in a file under the
participant's state directory — the same directory as its privacy budgets
(``dp-state-dir``) — named by the participant's stable identity:
``<state dir>/commitments/<identity>.secret``. It is created once, atomically, readable
by its owner only; every later call reads it back.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from lensemble_flwr.atomic_write import write_once
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.provenance.merkle import SECRET_BYTES


def secret_path(state_dir: str | os.PathLike[str], identity: str) -> Path:
    """Where the commitment secret of ``identity`` lives (identities are free text: the
    file is named by their hash)."""
    name = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return Path(state_dir) / "commitments" / f"{name}.secret"


def read_commitment_secret(state_dir: str | os.PathLike[str], identity: str) -> bytes:
    """The commitment secret of ``identity`` that a participant created earlier (what
    ``prove`` needs); never creates one.

    Raises:
        ConfigError: there is none in ``state_dir``, or it is not a secret.
    """
    path = secret_path(state_dir, identity)
    if not path.exists():
        raise ConfigError(
            "dp-state-dir",
            f"no commitment secret for {identity!r} in {Path(state_dir)} (looked for {path})",
        )
    return _read(path)


def _read(path: Path) -> bytes:
    try:
        secret = path.read_bytes()
    except OSError as exc:
        raise ConfigError("dp-state-dir", f"cannot read {path}: {exc}") from None
    if len(secret) != SECRET_BYTES:
        raise ConfigError(
            "dp-state-dir", f"{path} holds {len(secret)} bytes, not a {SECRET_BYTES}-byte secret"
        )
    return secret


def commitment_secret(state_dir: str | os.PathLike[str], identity: str) -> bytes:
    """The participant's commitment secret: read, or created once if there is none.

    Raises:
        ConfigError: the file exists but is not a secret (another length), or the
            state directory cannot be written (``dp-state-dir``).
    """
    path = secret_path(state_dir, identity)
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # owner-only (a temp file's 0o600); never replaces: a racing writer wins
            write_once(path, secrets.token_bytes(SECRET_BYTES), sync=True)
        except OSError as exc:
            raise ConfigError(
                "dp-state-dir", f"cannot keep the commitment secret in {path.parent}: {exc}"
            ) from None
    return _read(path)
