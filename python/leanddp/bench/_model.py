"""The benchmark's model: a GPT-style decoder trained on synthetic tokens."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Shape of the GPT-style model and of one global batch per rank."""

    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int


#: ``tiny`` trains in seconds on two CPU ranks; ``gpt2`` is GPT-2 small (124M parameters).
SIZES = {
    "tiny": ModelSize(vocab=2048, dim=256, layers=4, heads=4, seq=64, batch=8),
    "gpt2": ModelSize(vocab=50257, dim=768, layers=12, heads=12, seq=1024, batch=8),
}


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks, tied output projection."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.size = size
        self.tok = nn.Embedding(size.vocab, size.dim)
        self.pos = nn.Embedding(size.seq, size.dim)
        layer = nn.TransformerEncoderLayer(
            size.dim, size.heads, 4 * size.dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(size.dim)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), diagonal=1)
        h: torch.Tensor = self.tok(tokens) + self.pos.weight[:n]
        h = self.norm(self.blocks(h, is_causal=True, mask=mask.to(h.dtype)))
        return h @ self.tok.weight.T


def batches(size: ModelSize, rank: int, count: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` global batches of random tokens for ``rank``; the same for every configuration."""
    gen = torch.Generator().manual_seed(1 + rank)
    shape = (size.batch, size.seq + 1)
    return [torch.randint(0, size.vocab, shape, generator=gen).to(device) for _ in range(count)]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (float32 logits) of ``tokens``."""
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
