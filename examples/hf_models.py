"""HuggingFace transformers models built from tiny configs with random weights (no downloads).

`LossOf` wraps a `*ForCausalLM` model so that forward returns the training loss: autopar compiles a
model whose output is the loss, and transformers computes it when `labels` are passed. Sizes are
divisible by 8 like the rest of the examples, except `make_hf_gpt2_vocab`: GPT-2's real vocabulary
of 50257 and a width of 36, which no axis of 8 divides (uneven `torch.chunk` blocks everywhere).
Dropout probabilities are 0 so that the serial reference is deterministic.
"""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH = 8
VOCAB = 64
SEQ = 16


class LossOf(nn.Module):
    """`model(input_ids, labels=labels).loss`: the causal-LM loss (transformers shifts the labels)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def _batch(seed: int, batch_size: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(vocab, (batch_size, SEQ), generator=gen)
    return idx, idx.clone()  # causal LM: the labels are the inputs, shifted inside the model


def tiny_gpt2(n_layer: int = 2, vocab: int = VOCAB, width: int = 32, **config: object) -> nn.Module:
    """transformers' GPT2LMHeadModel (tied head, 4 heads, `SEQ` positions), every other config value
    at the library's default unless `config` says otherwise. The one place the examples, tests and
    benchmarks build a small GPT-2, so that they exercise the same model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=width, n_layer=n_layer, n_head=4, **config)
    return GPT2LMHeadModel(sizes)


def tiny_causal_lm(
    family: str = "llama", n_layer: int = 2, heads: int = 4, kv_heads: int = 2, **config: object
) -> nn.Module:
    """transformers' LlamaForCausalLM or MistralForCausalLM (`family`) of width 32 (MLP 64) over
    `VOCAB` tokens, with `heads` query heads sharing `kv_heads` key/value heads, every other config
    value at the library's default unless `config` says otherwise (Mistral's `sliding_window`...)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    classes: dict[str, tuple[type, type]] = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"tiny_causal_lm: family {family!r} is none of {sorted(classes)}")
    config_class, model_class = classes[family]
    sizes = config_class(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **config,
    )
    model: nn.Module = model_class(sizes)
    return model


def _gpt2(
    seed: int, batch_size: int, n_layer: int, vocab: int, width: int
) -> tuple[LossOf, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = tiny_gpt2(
        n_layer,
        vocab,
        width,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return LossOf(model), _batch(seed, batch_size, vocab)


def make_hf_gpt2(
    seed: int, batch_size: int = BATCH, n_layer: int = 2
) -> tuple[LossOf, tuple[torch.Tensor, torch.Tensor]]:
    """transformers' GPT2LMHeadModel (tied head) of width 32."""
    return _gpt2(seed, batch_size, n_layer, VOCAB, 32)


def make_hf_llama(
    seed: int, batch_size: int = BATCH, n_layer: int = 2
) -> tuple[LossOf, tuple[torch.Tensor, torch.Tensor]]:
    """transformers' LlamaForCausalLM with grouped-query attention (4 heads, 2 k/v heads)."""
    torch.manual_seed(seed)
    model = tiny_causal_lm(
        "llama", n_layer, max_position_embeddings=SEQ, tie_word_embeddings=False, attention_dropout=0.0
    )
    return LossOf(model), _batch(seed, batch_size)


def make_hf_gpt2_vocab(
    seed: int, batch_size: int = BATCH, n_layer: int = 2
) -> tuple[LossOf, tuple[torch.Tensor, torch.Tensor]]:
    """GPT2LMHeadModel with GPT-2's vocabulary (50257 = 7 x 7193 + 6) and width 36."""
    return _gpt2(seed, batch_size, n_layer, 50257, 36)


MAKERS = {"hf_gpt2": make_hf_gpt2, "hf_llama": make_hf_llama, "hf_gpt2_vocab": make_hf_gpt2_vocab}
