"""Small, unmodified PyTorch models that autopar's examples, tests and benchmarks parallelize.

They are written the way a user would write them (no autopar imports, no parallel annotations), so
whatever autopar handles here it handles because it understood plain PyTorch. Every size is
divisible by 8 so that each dimension can be split over any axis of a 2x2x2 mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # fused: one matmul for q, k and v
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style language model whose forward returns the training loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying, as in GPT-2: one parameter used twice, so its gradient is a sum of two uses.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's small init: torch's default N(0, 1) embeddings would make the tied head's logits huge.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MLP(nn.Module):
    """A plain classifier: the smallest model with a chain of matmuls for autopar to lay out."""

    def __init__(self, d_in: int = 32, hidden: int = 128, n_classes: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_in)
        self.head = nn.Linear(d_in, n_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))
        return F.cross_entropy(logits, y)


def gpt_batch(
    cfg: GPTConfig, batch_size: int = 8, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (idx, targets) token batches of full block length."""
    shape = (batch_size, cfg.block_size)
    idx = torch.randint(cfg.vocab_size, shape, generator=generator)
    targets = torch.randint(cfg.vocab_size, shape, generator=generator)
    return idx, targets


def make_gpt(seed: int, batch_size: int = 8, **cfg: Any) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """A GPT and one batch, identical for identical arguments (on every rank of a job, too)."""
    config = GPTConfig(**cfg)
    torch.manual_seed(seed)
    model = GPT(config)
    return model, gpt_batch(config, batch_size, torch.Generator().manual_seed(seed + 1))


def make_mlp(
    seed: int, batch_size: int = 8, d_in: int = 32, hidden: int = 128, n_classes: int = 16
) -> tuple[MLP, tuple[torch.Tensor, torch.Tensor]]:
    """An MLP and one batch (x, y), identical for identical arguments."""
    torch.manual_seed(seed)
    model = MLP(d_in, hidden, n_classes)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch_size, d_in, generator=gen)
    y = torch.randint(n_classes, (batch_size,), generator=gen)
    return model, (x, y)
