"""Provenance: dataset commitments and inclusion proofs, the ledger and run manifest, and
the audit of a run directory."""
