"""The benchmark's model: a GPT-style decoder trained on synthetic tokens."""

from __future__ import annotations

import dataclasses
import math

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


MARKOV_BRANCHES = 2
#: What the bench trains on (``--data``), each choice with its description (the bench's --help,
#: benchmarks/convergence.py's report): :func:`batches` taken in turn, or :func:`markov_batches`.
DATA = {
    "repeat": "4 batches of random tokens in turn, learnt by heart (the loss falls towards 0)",
    "markov": "a new batch every step from a fixed Markov chain, each token followed by one of "
    f"{MARKOV_BRANCHES} tokens (the loss falls towards ln {MARKOV_BRANCHES} = "
    f"{math.log(MARKOV_BRANCHES):.3f})",
}


def batches(size: ModelSize, rank: int, count: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` global batches of random tokens for ``rank``; the same for every configuration."""
    gen = torch.Generator().manual_seed(1 + rank)
    shape = (size.batch, size.seq + 1)
    return [torch.randint(0, size.vocab, shape, generator=gen).to(device) for _ in range(count)]


def markov_batches(
    size: ModelSize, rank: int, count: int, device: torch.device
) -> list[torch.Tensor]:
    """``count`` global batches for ``rank`` drawn from one fixed Markov chain (the same on
    every rank): each sequence starts at a random token, and each token is followed by one of
    its ``MARKOV_BRANCHES`` successors, uniformly. The cross entropy of a model that has learnt
    the chain is ln MARKOV_BRANCHES; the same batches for every configuration."""
    chain = torch.Generator().manual_seed(0)
    successors = torch.stack(
        [torch.randperm(size.vocab, generator=chain)[:MARKOV_BRANCHES] for _ in range(size.vocab)]
    )
    gen = torch.Generator().manual_seed(1 + rank)
    out = []
    for _ in range(count):
        tokens = torch.empty(size.batch, size.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, size.vocab, (size.batch,), generator=gen)
        branch = torch.randint(0, MARKOV_BRANCHES, (size.batch, size.seq), generator=gen)
        for j in range(size.seq):
            tokens[:, j + 1] = successors[tokens[:, j], branch[:, j]]
        out.append(tokens.to(device))
    return out


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (float32 logits) of ``tokens``."""
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
