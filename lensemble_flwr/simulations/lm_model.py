"""The byte language model app's model (apps/lm): a small decoder-only transformer.

Bytes in, a distribution over the next byte out (vocabulary 256: any file is text to it,
no tokenizer to ship). Pre-norm blocks of causal self-attention
(``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal``) and a GELU MLP,
learned positions, an untied output layer, no dropout. The defaults (width 256, two
blocks, 64 bytes of context) have 1.73M parameters: wide and shallow learns faster in the
few hundred steps a CPU run affords than narrow and deep at the same cost.

The same code runs on a GPU: :func:`lm_device` is CUDA when torch sees one and the CPU
otherwise; the model is built on the CPU from its seed (so its initial weights do not
depend on the device) and moved there, and every batch follows it. Results agree up to
float tolerance, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch import nn
from torch.nn import functional as F

from lensemble_flwr.errors import ConfigError

VOCAB = 256
CUBLAS_WORKSPACE = ":4096:8"
"""What cuBLAS needs to run deterministically (``inner-deterministic``, the default), set
before CUDA starts unless the environment already sets it."""


def lm_device() -> torch.device:
    """CUDA when torch sees a GPU, else the CPU."""
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        return torch.device("cuda")
    return torch.device("cpu")


def bits_per_byte(nats: float) -> float:
    """A mean cross-entropy in nats per byte, in bits per byte."""
    return nats / math.log(2.0)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The transformer's size (the app's run config keys in the errors).

    Raises:
        ConfigError: a size below 1, or ``d-model`` not a multiple of ``heads``.
    """

    d_model: int = 256
    layers: int = 2
    heads: int = 4
    seq_len: int = 64

    def __post_init__(self) -> None:
        for key, value in (
            ("d-model", self.d_model),
            ("layers", self.layers),
            ("heads", self.heads),
            ("seq-len", self.seq_len),
        ):
            if value < 1:
                raise ConfigError(key, f"must be at least 1, got {value}")
        if self.d_model % self.heads:
            raise ConfigError(
                "heads", f"d-model {self.d_model} is not a multiple of heads {self.heads}"
            )


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head width)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class ByteLM(nn.Module):
    """A decoder-only transformer over bytes: (batch, length) int64 bytes to (batch,
    length, 256) next-byte logits; position t sees bytes 0..t only. Its weights are a
    function of ``seed`` alone (drawn from a private generator, on the CPU)."""

    def __init__(self, shape: ModelShape | None = None, *, seed: int = 0) -> None:
        super().__init__()
        shape = shape or ModelShape()
        self.shape = shape
        # torch's default initialisation draws from the global generator; every weight is
        # drawn again from the seed below, so the global generator is left as it was
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(VOCAB, shape.d_model)
            self.position = nn.Embedding(shape.seq_len, shape.d_model)
            blocks = (Block(shape.d_model, shape.heads) for _ in range(shape.layers))
            self.blocks = nn.ModuleList(blocks)
            self.norm = nn.LayerNorm(shape.d_model)
            self.head = nn.Linear(shape.d_model, VOCAB, bias=False)
        self._init_weights(seed, shape.layers)

    def _init_weights(self, seed: int, layers: int) -> None:
        """Normal(0, 0.02) weights (the residual projections scaled down by the depth),
        zero biases, unit norms: GPT-2's initialisation, from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif ".norm" in name or name.startswith("norm"):
                    param.fill_(1.0)
                else:
                    residual = name.endswith(("proj.weight", "out.weight"))
                    std = 0.02 / math.sqrt(2 * layers) if residual else 0.02
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.shape.seq_len:
            raise ConfigError(
                "seq-len", f"the model sees at most {self.shape.seq_len} bytes, got {length}"
            )
        positions = torch.arange(length, device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_byte_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy (nats per byte) of ``model``'s next-byte predictions."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def evaluate_bits_per_byte(
    model: nn.Module, windows: torch.Tensor, *, batch_size: int = 64
) -> float:
    """Bits per byte of ``model`` on ``windows`` (int64, (n, width): each window's first
    width - 1 bytes predict its last width - 1), every predicted byte weighted alike.
    The model is put in eval mode and left there."""
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            chunk = windows[start : start + batch_size].to(device)
            loss = next_byte_loss(model, chunk[:, :-1], chunk[:, 1:])
            predicted = chunk[:, 1:].numel()
            total += float(loss) * predicted
            count += predicted
    return bits_per_byte(total / count)
