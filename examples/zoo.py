"""A zoo of small, plain-PyTorch models of the architectures people train, for the rule library.

Each architecture brings ops the GPT in `models.py` does not: RMSNorm, rotary embeddings, SwiGLU
and grouped-query attention (LLaMA); post-LayerNorm, token types, a padding mask and a masked-LM
loss (BERT); a convolutional patch embedding and a class token (ViT); token-mixing MLPs (Mixer).
They are written as a user would write them (no autopar imports). Every size is divisible by 8
so that (2, 2, 2) and (8,) meshes split every dim evenly, and there is no dropout (random ops are
refused today). `make_*(seed) -> (model, batch)` is deterministic in the seed, like `models.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8


def _init_small(module: nn.Module) -> None:
    """N(0, 0.02) weights, zero biases: keeps the untrained models' losses near log(classes)."""
    if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv2d)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


# ------------------------------------------------------------------------------------------ LLaMA


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    seq_len: int = 16
    dim: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query attention: each k/v head serves n_head // n_kv_head q heads
    hidden: int = 64  # SwiGLU inner size
    rope_base: float = 10000.0
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, kv_heads, T, hd) -> (B, heads, T, hd), each k/v head repeated for its group."""
        B, kvh, T, hd = x.shape
        rep = self.n_head // kvh
        return x[:, :, None].expand(B, kvh, rep, T, hd).reshape(B, kvh * rep, T, hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A LLaMA-style decoder whose forward returns the next-token loss; the head is untied."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_head
        inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.apply(_init_small)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        angles = torch.outer(torch.arange(T, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (T, head_dim), as in rotate_half's halves
        x = self.embed(idx)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # a bfloat16 model stays bfloat16
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_llama(seed: int, batch_size: int = BATCH, **cfg: Any) -> tuple[Llama, tuple[torch.Tensor, ...]]:
    """A LLaMA-style model and one (idx, targets) batch."""
    config = LlamaConfig(**cfg)
    torch.manual_seed(seed)
    model = Llama(config)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (batch_size, config.seq_len)
    return model, (
        torch.randint(config.vocab_size, shape, generator=gen),
        torch.randint(config.vocab_size, shape, generator=gen),
    )


# ------------------------------------------------------------------------------------------- BERT


@dataclass
class BertConfig:
    vocab_size: int = 64
    seq_len: int = 16
    type_vocab_size: int = 8  # BERT uses 2; 8 keeps the table splittable (ids stay 0/1)
    dim: int = 32
    n_layer: int = 2
    n_head: int = 4
    hidden: int = 64
    eps: float = 1e-12
    mask_token: int = 1
    pad_token: int = 0


class BertLayer(nn.Module):
    """Post-LayerNorm: x = ln(x + attn(x)), then x = ln(x + mlp(x))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.ln_attn = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.fc = nn.Linear(cfg.dim, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.dim)
        self.ln_mlp = nn.LayerNorm(cfg.dim, eps=cfg.eps)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = self.ln_attn(x + self.out(y.transpose(1, 2).reshape(B, T, C)))
        return self.ln_mlp(x + self.proj(F.gelu(self.fc(x))))


class Bert(nn.Module):
    """A BERT-style encoder with a masked-LM head; forward returns the loss over masked tokens."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.position = nn.Embedding(cfg.seq_len, cfg.dim)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        self.ln_embed = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layer))
        self.mlm_dense = nn.Linear(cfg.dim, cfg.dim)
        self.mlm_ln = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.mlm_head = nn.Linear(cfg.dim, cfg.vocab_size)
        self.apply(_init_small)

    def forward(
        self, idx: torch.Tensor, token_types: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.ln_embed(self.word(idx) + self.position(pos) + self.token_type(token_types))
        # (B, T) 1 = real token, 0 = padding -> (B, 1, 1, T) bool: every query sees real keys only
        keep = attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, keep)
        logits = self.mlm_head(self.mlm_ln(F.gelu(self.mlm_dense(x))))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


def make_bert(seed: int, batch_size: int = BATCH, **cfg: Any) -> tuple[Bert, tuple[torch.Tensor, ...]]:
    """A BERT-style model and one (idx, token_types, attention_mask, labels) batch: sentence pairs
    with padded tails, ~1/4 of the real tokens masked and predicted (labels -100 elsewhere)."""
    config = BertConfig(**cfg)
    torch.manual_seed(seed)
    model = Bert(config)
    gen = torch.Generator().manual_seed(seed + 1)
    B, T = batch_size, config.seq_len
    tokens = torch.randint(2, config.vocab_size, (B, T), generator=gen)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    positions = torch.arange(T)
    attention_mask = (positions[None, :] < lengths[:, None]).long()
    token_types = (positions[None, :] >= (lengths[:, None] // 2)).long() * attention_mask
    masked = (torch.rand(B, T, generator=gen) < 0.25) & attention_mask.bool()
    masked[:, 0] = True  # at least one predicted token per sequence
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    idx = torch.where(masked, torch.full_like(tokens, config.mask_token), tokens)
    idx = torch.where(attention_mask.bool(), idx, torch.full_like(idx, config.pad_token))
    return model, (idx, token_types, attention_mask, labels)


# -------------------------------------------------------------------------------------------- ViT


@dataclass
class ViTConfig:
    # 24 x 40 images in 8 x 8 patches: 3 x 5 = 15 patches + the class token = 16 tokens
    image: tuple[int, int] = (24, 40)
    patch: int = 8
    channels: int = 8
    dim: int = 32
    n_layer: int = 2
    n_head: int = 4
    hidden: int = 64
    n_classes: int = 16
    pool: str = "token"  # "token": the class token's output; "mean": the mean over tokens


class ViTBlock(nn.Module):
    """Pre-LayerNorm encoder block (no mask: every patch sees every patch)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class ViT(nn.Module):
    """A ViT-style image classifier: conv patch embedding, class token, learned positions."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)
        n_patches = (cfg.image[0] // cfg.patch) * (cfg.image[1] // cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.n_classes)
        self.apply(_init_small)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        pooled = x[:, 0] if self.cfg.pool == "token" else x.mean(dim=1)
        return F.cross_entropy(self.head(pooled), labels)


def make_vit(seed: int, batch_size: int = BATCH, **cfg: Any) -> tuple[ViT, tuple[torch.Tensor, ...]]:
    """A ViT-style model and one (images, labels) batch."""
    config = ViTConfig(**cfg)
    torch.manual_seed(seed)
    model = ViT(config)
    gen = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(batch_size, config.channels, *config.image, generator=gen)
    return model, (images, torch.randint(config.n_classes, (batch_size,), generator=gen))


# ------------------------------------------------------------------------------------------ Mixer


@dataclass
class MixerConfig:
    image: int = 32
    patch: int = 8  # 4 x 4 = 16 patches
    channels: int = 8
    dim: int = 32
    n_layer: int = 2
    token_hidden: int = 32
    channel_hidden: int = 64
    n_classes: int = 16


class MixerBlock(nn.Module):
    """Token mixing (an MLP across patches, per channel), then channel mixing (per patch)."""

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        tokens = (cfg.image // cfg.patch) ** 2
        self.ln_tok = nn.LayerNorm(cfg.dim)
        self.tok_fc = nn.Linear(tokens, cfg.token_hidden)
        # No bias: a per-token shift of every channel is removed by the LayerNorms downstream, so
        # its gradient would be exactly zero and it would train on rounding noise alone.
        self.tok_out = nn.Linear(cfg.token_hidden, tokens, bias=False)
        self.ln_ch = nn.LayerNorm(cfg.dim)
        self.ch_fc = nn.Linear(cfg.dim, cfg.channel_hidden)
        self.ch_out = nn.Linear(cfg.channel_hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_tok(x).transpose(1, 2)  # (B, dim, tokens)
        x = x + self.tok_out(F.gelu(self.tok_fc(y))).transpose(1, 2)
        return x + self.ch_out(F.gelu(self.ch_fc(self.ln_ch(x))))


class Mixer(nn.Module):
    """An MLP-Mixer classifier; patches are cut with reshapes and embedded by a Linear."""

    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.channels * cfg.patch * cfg.patch, cfg.dim)
        self.blocks = nn.ModuleList(MixerBlock(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.n_classes)
        self.apply(_init_small)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, C, H, W = images.shape
        p = self.cfg.patch
        patches = images.view(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.embed(patches.reshape(B, (H // p) * (W // p), C * p * p))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x).mean(dim=1)), labels)


def make_mixer(seed: int, batch_size: int = BATCH, **cfg: Any) -> tuple[Mixer, tuple[torch.Tensor, ...]]:
    """An MLP-Mixer and one (images, labels) batch."""
    config = MixerConfig(**cfg)
    torch.manual_seed(seed)
    model = Mixer(config)
    gen = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(batch_size, config.channels, config.image, config.image, generator=gen)
    return model, (images, torch.randint(config.n_classes, (batch_size,), generator=gen))


MAKERS = {"llama": make_llama, "bert": make_bert, "vit": make_vit, "mixer": make_mixer}
