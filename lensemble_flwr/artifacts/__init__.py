"""Artifacts: the content-addressed store, and checkpoints and named arrays as safetensors."""
