"""Models built from torch.nn's own layers, written as their docs write them: an LSTM / GRU
language model, `nn.TransformerEncoderLayer` with a causal mask made in forward (default dropout),
`nn.MultiheadAttention`, and a top-k mixture of experts routed with `topk` + `scatter`.
Every forward returns the training loss; `batch` makes (tokens, targets)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, BATCH = 64, 32, 16, 8


class RecurrentLM(nn.Module):
    """Embedding -> 2-layer LSTM (or GRU) -> vocabulary head."""

    def __init__(self, cell: str = "lstm") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(DIM, DIM, num_layers=2, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(idx))
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class EncoderLayerLM(nn.Module):
    """torch's `nn.TransformerEncoderLayer` (dropout 0.1 by default) with a causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, 4, dim_feedforward=64, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1))
        h = self.layer(self.emb(idx), src_mask=mask, is_causal=True)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class AttentionLM(nn.Module):
    """`nn.MultiheadAttention` with a boolean causal mask made by `triu`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        mask = torch.ones(idx.size(1), idx.size(1), dtype=torch.bool).triu(1)
        h, _ = self.attn(x, x, x, attn_mask=mask)
        logits = self.head(x + h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class TopKMoE(nn.Module):
    """A router picks the top k of 4 experts per token; the chosen weights are scattered into a
    dense gate matrix (no data-dependent token counts: every expert runs on every token and the
    gates zero the others), experts as batched weights."""

    def __init__(self, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, DIM, 64) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, 64, DIM) * 0.1)
        self.k = k
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        probs = self.router(flat).softmax(-1)
        top, chosen = probs.topk(self.k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, top)
        hidden = torch.einsum("nd,edh->neh", flat, self.w1).relu()
        out = torch.einsum("neh,ehd->ned", hidden, self.w2)
        mixed = (out * gates.unsqueeze(-1)).sum(1)
        logits = self.head(x + mixed.reshape(b, t, d))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class SparseMoE(nn.Module):
    """Mixtral-style dispatch: each expert gets the tokens routed to it (`torch.where`) and adds its
    results back with `index_add`. How many tokens an expert gets depends on the values, which a
    plan made for fixed shapes cannot follow: autopar refuses it and says what to do instead."""

    def __init__(self, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(experts))
        self.k = k
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).reshape(-1, DIM)
        top, chosen = self.router(x).softmax(-1).topk(self.k, -1)
        mixed = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            mixed = mixed.index_add(0, token, expert(x[token]) * top[token, slot, None])
        logits = self.head(x + mixed)
        return F.cross_entropy(logits, targets.reshape(-1))


class GroupedMoE(nn.Module):
    """torchtitan-style dropless mixture of experts: the router's top-k (token, expert) pairs sorted
    by expert, every expert's SwiGLU on its rows by `torch._grouped_mm` over (E, ., .) weights with
    the rows per expert (`offs`), the results weighted and added back with `index_add`. Every shape
    is fixed (the routing only moves rows), so autopar traces it and can split the experts over
    ranks. In bfloat16: tracing `torch._grouped_mm` needs it (its meta kernel checks)."""

    def __init__(self, experts: int = 8, k: int = 2, ffn: int = 2 * DIM) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, DIM, ffn) * DIM**-0.5)
        self.w3 = nn.Parameter(torch.randn(experts, DIM, ffn) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, DIM) * ffn**-0.5)
        self.head = nn.Linear(DIM, VOCAB)
        self.experts, self.k = experts, k
        self.to(torch.bfloat16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).reshape(-1, DIM)
        top, chosen = self.router(x).softmax(-1).topk(self.k, -1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.k
        counts = torch.histc(flat.float(), bins=self.experts, min=0, max=self.experts)
        offs = counts.cumsum(0).to(torch.int32)
        rows = x[token]
        gate = F.silu(torch._grouped_mm(rows, self.w1, offs=offs))
        hidden = gate * torch._grouped_mm(rows, self.w3, offs=offs)
        out = torch._grouped_mm(hidden, self.w2, offs=offs) * top.reshape(-1)[order, None]
        mixed = torch.zeros_like(x).index_add(0, token, out)
        logits = self.head(x + mixed).float()
        return F.cross_entropy(logits, targets.reshape(-1))


MODELS = {
    "lstm": lambda: RecurrentLM("lstm"),
    "gru": lambda: RecurrentLM("gru"),
    "encoder_layer": EncoderLayerLM,
    "attention": AttentionLM,
    "topk_moe": TopKMoE,
}


def batch(seed: int = 0, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (batch_size, SEQ), generator=g), torch.randint(VOCAB, (batch_size, SEQ), generator=g)
