"""Signed shared-folder documents: who wrote a record, an outcome or the genesis.

Everybody who takes part must be able to write the shared folder, so the folder itself
authenticates nothing. Every document a participant process writes there is therefore
wrapped with its author's identity-key signature (the ECDSA keys of signed messages,
docs/identity.md), and every reader checks it against the author's key from the
federation's allow-list (``identities``: participant id → OpenSSH public key), which comes
from outside the folder. The signature covers the author, the document's *place* (run,
kind, round, sitting, slot) and its bytes, so a genuine document copied to another slot or
sitting does not verify either.

:class:`FolderSeal` is one participant process's use of both: it signs what the process
writes and checks what it reads, or passes bytes through when the run is unauthenticated.

Bytes: ``LSF1`` · 4-byte big-endian header length · canonical-JSON header
``{author, place, signature}`` · the document's own bytes.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping

from lensemble_flwr.canonical import canonical_json, digest_bytes
from lensemble_flwr.errors import ForgedMessage
from lensemble_flwr.identity.signing import IdentityKey, digest_signed_by

MAGIC = b"LSF1"


def _digest(author: str, place: str, body: bytes) -> bytes:
    head = canonical_json({"author": author, "place": place})
    return bytes.fromhex(digest_bytes("shared-folder-document", head + b"\x00" + body))


def sign_document(identity: IdentityKey, author: str, place: str, body: bytes) -> bytes:
    """``body`` wrapped with ``author``'s signature for ``place``."""
    signature = identity.sign_digest(_digest(author, place, body))
    header = canonical_json({"author": author, "place": place, "signature": signature})
    return MAGIC + struct.pack(">I", len(header)) + header + body


def open_document(
    data: bytes, *, place: str, identities: Mapping[str, str], author: str | None = None
) -> tuple[str, bytes]:
    """The author and the bytes of a signed document found at ``place``.

    Args:
        author: the author the place belongs to (a participant's slot), if any.

    Raises:
        ForgedMessage: not a signed document, signed for another place, by an author
            who is not in ``identities`` (or not the slot's), or a signature that does
            not verify; the message names the place and the claimed author.
    """
    claimed = "an unknown author"
    try:
        if data[:4] != MAGIC:
            raise ValueError("not a signed shared-folder document")
        (size,) = struct.unpack(">I", data[4:8])
        header = json.loads(data[8 : 8 + size])
        body = data[8 + size :]
        claimed = str(header["author"])
        signature, signed_place = str(header["signature"]), str(header["place"])
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise ForgedMessage(f"{place}: unreadable, claimed by {claimed}: {exc}") from None
    if author is not None and claimed != author:
        raise ForgedMessage(f"{place}: the slot of {author} holds a document by {claimed}")
    if signed_place != place:
        raise ForgedMessage(f"{place}: {claimed}'s document was signed for {signed_place}")
    key = identities.get(claimed)
    if key is None:
        raise ForgedMessage(f"{place}: signed by {claimed}, who is not a participant")
    if not digest_signed_by(key, _digest(claimed, place, body), signature):
        raise ForgedMessage(f"{place}: not signed by {claimed}'s identity key (forged)")
    return claimed, body


def document_body(data: bytes) -> bytes:
    """The document's own bytes, its signature NOT checked (for inspection and tests;
    readers that act on a document use :func:`open_document`). Unsigned bytes are
    returned as they are."""
    if data[:4] != MAGIC or len(data) < 8:
        return data
    (size,) = struct.unpack(">I", data[4:8])
    return data[8 + size :]


@dataclasses.dataclass(frozen=True, eq=False)
class FolderSeal:
    """How one participant process signs what it writes in a run's folder and checks what
    it reads there; a document's place is ``<run_id>/<where>``.

    Args:
        run_id: the run the documents belong to.
        author: this process's participant, the author of what it signs.
        key: its identity key (None: it signs nothing).
        identities: the federation's allow-list (None: the run is unauthenticated, and
            nothing is signed or checked).
    """

    run_id: str
    author: str
    key: IdentityKey | None
    identities: Mapping[str, str] | None

    def place(self, where: str) -> str:
        """The place a document at ``where`` in this run is signed for."""
        return f"{self.run_id}/{where}"

    def sign(self, body: bytes, where: str) -> bytes:
        """``body`` signed by this process for ``where`` (as it is, when unauthenticated)."""
        if self.identities is None or self.key is None:
            return body  # unauthenticated, as asked
        return sign_document(self.key, self.author, self.place(where), body)

    def open(self, data: bytes, where: str, *, author: str | None = None) -> bytes:
        """The bytes of a document found at ``where``, its signature checked.

        Raises:
            ForgedMessage: it is not signed by a participant (``author``, for a slot).
        """
        if self.identities is None:
            return data
        _, body = open_document(
            data, place=self.place(where), identities=self.identities, author=author
        )
        return body
