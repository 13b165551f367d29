"""A tiny GPT-like model on synthetic data: the demo run, and the model tests and benchmarks use."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "TinyGPT", "synthetic_batches", "train"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def synthetic_batches(cfg: GPTConfig, batch: int, n: int, seed: int = 0):
    """Sequences with a learnable pattern (next token = previous + 1 mod vocab, plus noise)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
        seq = (start + torch.arange(cfg.seq + 1)) % cfg.vocab
        noise = torch.rand(batch, cfg.seq + 1, generator=g) < 0.1
        yield torch.where(noise, torch.randint(0, cfg.vocab, seq.shape, generator=g), seq)


def train(
    model: TinyGPT,
    optimizer: torch.optim.Optimizer,
    steps: int,
    grad_acc_steps: int = 1,
    batch: int = 8,
    seed: int = 0,
    record_loss: Callable[[torch.Tensor], None] | None = None,
) -> list[float]:
    """A plain training loop; returns the loss of every step (mean over micro-batches).

    ``record_loss`` (e.g. ``monitor.record_loss``) is handed each micro-batch's loss.
    """
    losses = []
    data = synthetic_batches(model.cfg, batch, steps * grad_acc_steps, seed)
    for _ in range(steps):
        total = 0.0
        for _ in range(grad_acc_steps):
            micro = model.loss(next(data))
            if record_loss is not None:
                record_loss(micro.detach())
            loss = micro / grad_acc_steps
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses
