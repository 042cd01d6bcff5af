"""The transformers model zoo at toy size: every architecture class of a few training tasks, built
from its config class's defaults with only the sizes shrunk, and called the way its docs call it.

Why generic: a hand-written config per model would test the configs we chose; shrinking the
library's defaults keeps every other knob (activation, norm, attention variant, dropout, tied
heads, `use_cache`) as a user who writes `Config(hidden_size=...)` gets it. Sizes divide every axis
of a 2x2x2 mesh (batch 8, sequence 16, width 32, 4 heads). Nothing is downloaded: weights are
random, and `HF_HUB_OFFLINE=1` keeps any stray hub lookup from reaching the network.

`architectures()` lists `Arch`s; `build(arch)` returns `(model, kwargs)` for `model(**kwargs)`,
whose output's first tensor is the training loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH, SEQ = 8, 16
VOCAB = 64
NUM_LABELS = 4
IMAGE, PATCH, CHANNELS = 32, 8, 3
# token ids below this are reserved for the special tokens `_TOKEN_IDS` sets; text is drawn above it
FIRST_TEXT_ID = 8

# task -> (the auto mapping of model type -> class name, the class-name suffix kept)
TASKS: dict[str, tuple[str, str]] = {
    "causal_lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "ForCausalLM"),
    "masked_lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "ForMaskedLM"),
    "sequence_classification": (
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "ForSequenceClassification",
    ),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "ForConditionalGeneration"),
    "image_classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "ForImageClassification"),
}

# Size attributes, each set to its value wherever a config has it (under any of its names), also
# where the class default is None: several classes' defaults do not build as they are (HunYuan's
# head_dim, Nemotron's num_key_value_heads, ESM's vocab_size are None).
_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "num_decoder_layers",
    "decoder_layers",
    "encoder_layers",
)
_SIZES: dict[int, tuple[str, ...]] = {
    32: ("hidden_size", "n_embd", "d_model", "embedding_size", "dim", "emb_dim", "d_latents"),
    2: (*_LAYERS, "n_layers", "num_key_value_heads", "num_experts_per_tok"),
    4: (
        "num_attention_heads",
        "n_head",
        "n_heads",
        "decoder_attention_heads",
        "encoder_attention_heads",
        "linear_num_key_heads",  # linear attention (Qwen3-Next's gated delta rule): 2 value heads a key head
    ),
    64: (
        "intermediate_size",
        "n_inner",
        "ffn_dim",
        "d_ff",
        "decoder_ffn_dim",
        "encoder_ffn_dim",
        "d_inner",
        "hidden_dim",
        "max_position_embeddings",
        "max_encoder_position_embeddings",  # LED's (16384 by default: 0.5 M of its 0.6 M parameters)
        "max_decoder_position_embeddings",
        "n_positions",
        "vocab_size",
        "src_vocab_size",
        "tgt_vocab_size",
        # the second vocabularies of LUKE (entities), RoCBERT (pronunciation, glyph), Gemma 4
        "entity_vocab_size",
        "pronunciation_vocab_size",
        "shape_vocab_size",
        "vocab_size_per_layer_input",
    ),
    # head sizes, those of multi-head latent attention (DeepSeek) included; Longformer's and LED's
    # sliding attention window (two windows in the sequence: at the default 512 the model pads
    # the 16 tokens to 512 and the row runs past its budget)
    8: (
        "attention_window",
        "head_dim",
        "d_kv",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "hidden_size_per_layer_input",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    ),
    16: (
        "kv_lora_rank",
        "q_lora_rank",
        "num_latents",
        "entity_emb_size",
        "pronunciation_embed_dim",
        "shape_embed_dim",
    ),
}
# Only where the class sets them (None there means "dense", "full rotary", ...): mixtures of
# experts (4 experts, top 2) and partial rotary embeddings.
_IF_SET: dict[str, int] = {
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "zero_expert_num": 4,
    "moe_topk": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "expert_ffn_hidden_size": 64,
    "ffn_hidden_size": 64,
    "qk_head_dim": 16,
    "rotary_dim": 4,
}
_IMAGE_SIZES: dict[str, int] = {"image_size": IMAGE, "patch_size": PATCH, "num_channels": CHANNELS}
# Per-stage lists of hierarchical vision models (ConvNeXt, Swin, CvT, BiT) and Funnel, as
# f(stage index): one block per stage, widths 32, 64, 128, ... (GroupNorm's 32 groups divide them)
# and heads 1, 2, 4, ...; Swin's windows of 2 patches fit its 4x4-patch stem at 32 x 32.
_STAGE_LISTS: dict[str, Any] = {
    "depths": lambda i: 1,
    "depth": lambda i: 1,
    "block_sizes": lambda i: 1,
    "hidden_sizes": lambda i: 32 * 2**i,
    "embed_dims": lambda i: 32 * 2**i,
    "embed_dim": lambda i: 32 * 2**i,
    "num_heads": lambda i: 2**i,
}
_STAGE_WIDTH = ("embed_dim",)  # Swin's stem width (an int), doubled per stage like `hidden_sizes`
_STAGE_INTS = {"window_size": 2}
# Special tokens: every one the config defines gets a small id of its own, inside the vocabulary.
_TOKEN_IDS: dict[str, int] = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sep_token_id": 3,
    "cls_token_id": 4,
    "mask_token_id": 5,
    "unk_token_id": 6,
    "decoder_start_token_id": 0,  # as T5 and BART do: decoding starts from the pad token
}
# Sub-configs of a composite config that are not text (seq2seq must be text-to-text).
_NON_TEXT = ("audio", "vision", "speech", "image", "video")
_NON_TEXT_MAPPINGS = ("SPEECH", "AUDIO", "IMAGE_TEXT", "VISION", "VIDEO", "MULTIMODAL", "CTC")


@dataclass(frozen=True)
class Arch:
    """One architecture class: the task it is trained for and the classes that build it."""

    task: str
    model_type: str
    config_class: str
    model_class: str


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()  # init and config warnings would flood the sweep
    return transformers


def architectures(tasks: tuple[str, ...] = tuple(TASKS)) -> list[Arch]:
    """Every class of `tasks` in transformers' auto mappings, each once (BART is in the masked-LM
    mapping too: it keeps the task of the first mapping whose suffix it has), sorted by task, then
    class name. Seq2seq keeps text-to-text models: no audio or vision config."""
    _transformers()
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    seen: set[str] = set()
    found: list[Arch] = []
    for task in tasks:
        mapping_name, suffix = TASKS[task]
        for model_type, names in getattr(modeling_auto, mapping_name).items():
            for name in names if isinstance(names, tuple) else (names,):
                if not name.endswith(suffix) or name in seen or model_type not in CONFIG_MAPPING_NAMES:
                    continue
                arch = Arch(task, model_type, CONFIG_MAPPING_NAMES[model_type], name)
                if task == "seq2seq" and not _is_text(arch):
                    continue
                seen.add(name)
                found.append(arch)
    return sorted(found, key=lambda a: (list(TASKS).index(a.task), a.model_class))


def _is_text(arch: Arch) -> bool:
    """False for a model type in an audio, speech or vision auto mapping, or whose config has an
    audio or vision part (speech recognition, VLMs)."""
    from transformers.models.auto import modeling_auto

    mappings = [
        n
        for n in dir(modeling_auto)
        if n.endswith("_MAPPING_NAMES") and any(k in n for k in _NON_TEXT_MAPPINGS)
    ]
    if any(arch.model_type in getattr(modeling_auto, n) for n in mappings):
        return False
    try:
        config_class = getattr(_transformers(), arch.config_class)
    except (AttributeError, ImportError):
        return True  # let the build fail and say why
    subs = getattr(config_class, "sub_configs", None) or {}
    return not any(part in key for key in subs for part in _NON_TEXT)


def find(name: str) -> Arch:
    """The `Arch` of a class name (or model type), for `--only` and the tests."""
    for arch in architectures():
        if name in (arch.model_class, arch.model_type):
            return arch
    raise KeyError(name)


# What to change when the toy config does not run serially, tried in order (None: keep the
# class default); one that changes nothing in a config is not tried. Multi-head latent attention
# (DeepSeek) has as many k/v heads as query heads; hybrids of attention and recurrent layers
# (Jamba, Qwen3-Next) put their first attention layer at index 3 or later; hierarchical vision
# models (ConvNeXt, Swin) halve the image per stage, so keep their stem and give them room.
VARIANTS: tuple[dict[str, Any], ...] = (
    {},
    {"num_key_value_heads": 4},
    dict.fromkeys(_LAYERS, 4),
    dict.fromkeys(_LAYERS, 8),
    {"patch_size": None},
    {"patch_size": None, "image_size": 64},
    # stage lists that constrain one another, still one or two blocks a stage: BiT's bottleneck
    # (a quarter of a stage's width) under GroupNorm (8 groups), CvT's drop-path rates read at
    # the stage's index (stage i needs i + 1 blocks), HGNetV2's stages chained from its stem
    # (each stage's input is the last one's output; the last is the classifier's width; one
    # convolution layer a block)
    {
        "num_groups": 8,
        "depth": lambda i: i + 1,
        "stem_channels": lambda i: (CHANNELS, 16, 32)[i],
        "stage_in_channels": lambda i: 32 * 2 ** max(i - 1, 0),
        "stage_mid_channels": lambda i: 16 * 2**i,
        "stage_out_channels": _STAGE_LISTS["hidden_sizes"],
        "stage_num_blocks": lambda i: 1,
        "stage_numb_of_layers": lambda i: 1,
    },
    {
        "patch_size": None,
        "image_size": 64,
        **dict.fromkeys((*_STAGE_LISTS, *_STAGE_WIDTH, *_STAGE_INTS), None),
    },
)


def _sizes(config: Any, task: str, variant: dict[str, Any], applied: set[str]) -> dict[str, Any]:
    """The overrides for one (sub-)config: the size attributes it has, at toy values. The names of
    `variant` that change something are added to `applied`."""
    stored = vars(config)
    out: dict[str, Any] = {}
    for value, names in _SIZES.items():
        out.update(
            {n: value for n in names if n in stored and (stored[n] is None or isinstance(stored[n], int))}
        )
    out.update({n: v for n, v in _IF_SET.items() if isinstance(stored.get(n), int)})
    out.update({n: v for n, v in _IMAGE_SIZES.items() if isinstance(stored.get(n), int)})
    stages = [
        n
        for n in _STAGE_LISTS
        if isinstance(stored.get(n), (list, tuple)) and all(isinstance(v, int) for v in stored[n])
    ]
    for name in stages:
        out[name] = [_STAGE_LISTS[name](i) for i in range(len(stored[name]))]
    if stages:
        out.update({n: 32 for n in _STAGE_WIDTH if isinstance(stored.get(n), int)})
        out.update({n: v for n, v in _STAGE_INTS.items() if isinstance(stored.get(n), int)})
        if isinstance(stored.get("num_attention_heads"), list):
            out["num_attention_heads"] = [2**i for i in range(len(stored["num_attention_heads"]))]
    for name, value in _TOKEN_IDS.items():
        current = stored.get(name)
        if isinstance(current, int) or (isinstance(current, list) and current):
            out[name] = value
    if task == "sequence_classification" and "pad_token_id" in stored and stored["pad_token_id"] is None:
        out["pad_token_id"] = _TOKEN_IDS["pad_token_id"]  # batches of more than one row need one
    if (task == "seq2seq" or stored.get("is_encoder_decoder")) and stored.get(
        "decoder_start_token_id"
    ) is None:
        # labels shift in from it; released checkpoints' configs set it (T5's class default lacks it)
        out["decoder_start_token_id"] = _TOKEN_IDS["decoder_start_token_id"]
    for name, value in variant.items():
        if callable(value) and isinstance(stored.get(name), (list, tuple)):  # per stage, as f(index)
            applied.add(name)
            out[name] = [value(i) for i in range(len(stored[name]))]
        elif name not in out and isinstance(value, int) and isinstance(stored.get(name), int):
            applied.add(name)  # a size the generic shrink leaves at the class default
            out[name] = value
        elif name in out and not callable(value):
            applied.add(name)
            if value is None:
                del out[name]
            else:
                out[name] = value
    if task in ("sequence_classification", "image_classification"):
        out["num_labels"] = NUM_LABELS
    return out


def tiny_config(config_class: type, task: str, variant: dict[str, Any] | None = None) -> Any:
    """`config_class()` with its sizes shrunk, sub-configs (text/encoder/decoder parts) included.

    The overrides go to the constructor, so values derived from them (head_dim, layer_types) follow;
    a class whose constructor refuses one gets it set afterwards instead. Raises LookupError when
    `variant` changes nothing (the sweep would only repeat the first try)."""
    variant = variant or {}
    applied: set[str] = set()
    config = _tiny(config_class, task, variant, applied)
    if variant and not applied:
        raise LookupError("the variant changes nothing in this config")
    return config


def _tiny(config_class: type, task: str, variant: dict[str, Any], applied: set[str]) -> Any:
    default = config_class()
    kwargs = _sizes(default, task, variant, applied)
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        sub = getattr(default, key, None)
        if isinstance(sub, dict) and isinstance(sub_class, type) and hasattr(sub_class, "to_dict"):
            sub = sub_class(**sub)  # a composite class that keeps a part as a plain dict
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[key] = _tiny(type(sub), task, variant, applied).to_dict()
    num_labels = kwargs.pop("num_labels", None)
    try:
        config = config_class(**kwargs)
    except Exception:
        config = config_class()
        for name, value in kwargs.items():
            setattr(config, name, value)
    if num_labels is not None:
        config.num_labels = num_labels  # builds id2label / label2id
    return config


def _text(gen: torch.Generator, config: Any) -> torch.Tensor:
    """A tokenizer-like batch: random text ids, the row opened by BOS/CLS and closed by EOS/SEP
    where the config has them (BART-style classifiers read the last EOS)."""
    ids = torch.randint(FIRST_TEXT_ID, VOCAB, (BATCH, SEQ), generator=gen)
    first = next(
        (
            getattr(config, n)
            for n in ("bos_token_id", "cls_token_id")
            if isinstance(getattr(config, n, None), int)
        ),
        None,
    )
    last = next(
        (
            getattr(config, n)
            for n in ("eos_token_id", "sep_token_id")
            if isinstance(getattr(config, n, None), int)
        ),
        None,
    )
    if first is not None:
        ids[:, 0] = first
    if last is not None:
        ids[:, -1] = last
    return ids


def batch(arch: Arch, config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """The keyword arguments of a training call, as the model's docs write it."""
    gen = torch.Generator().manual_seed(seed + 1)
    if arch.task == "image_classification":
        size = getattr(config, "image_size", IMAGE)
        size = size if isinstance(size, int) else IMAGE
        pixels = torch.randn(BATCH, getattr(config, "num_channels", CHANNELS), size, size, generator=gen)
        return {"pixel_values": pixels, "labels": torch.randint(NUM_LABELS, (BATCH,), generator=gen)}
    ids = _text(gen, config)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if arch.task == "causal_lm":
        kwargs["labels"] = ids.clone()  # shifted inside the model
    elif arch.task == "masked_lm":
        chosen = torch.rand(BATCH, SEQ, generator=gen) < 0.15  # the positions the loss reads
        kwargs["labels"] = torch.where(chosen, ids, torch.full_like(ids, -100))
    elif arch.task == "sequence_classification":
        kwargs["labels"] = torch.randint(NUM_LABELS, (BATCH,), generator=gen)
    else:  # seq2seq: the target text; the decoder's inputs are it shifted right
        kwargs["labels"] = _text(gen, config)
    return kwargs


def build(arch: Arch, seed: int = 0, variant: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """(model with random weights in training mode, kwargs of `model(**kwargs)`), deterministic in
    `seed`, sized by `VARIANTS[variant]`. Raises whatever transformers raises for a class that does
    not build at that size."""
    transformers = _transformers()
    model_class = getattr(transformers, arch.model_class)
    # the class's own config class: the model type's may be a composite (Llama4Config for the
    # text-only Llama4ForCausalLM, which takes Llama4TextConfig)
    config_class = getattr(model_class, "config_class", None) or getattr(transformers, arch.config_class)
    config = tiny_config(config_class, arch.task, VARIANTS[variant])
    torch.manual_seed(seed)
    model = model_class(config)
    model.train()  # as a training loop has it: dropout at the config's default probabilities
    return model, batch(arch, config, seed)


def build_working(arch: Arch, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor], int]:
    """The first of `VARIANTS` whose model builds and returns a loss serially: (model, kwargs,
    variant index). Raises the first variant's error when none does (the toy sizes' reason)."""
    first: Exception | None = None
    for variant in range(len(VARIANTS)):
        try:
            model, kwargs = build(arch, seed, variant)
            serial_loss(model, kwargs)
            return model, kwargs, variant
        except Exception as exc:
            first = first or exc
    assert first is not None
    raise first


def serial_loss(model: nn.Module, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of one serial call; raises ValueError when the model returns none for its labels."""
    with torch.no_grad():
        out = model(**kwargs)
    loss = out.get("loss") if hasattr(out, "get") else None
    if not isinstance(loss, torch.Tensor):
        raise ValueError("no loss returned for the labels")
    if not torch.isfinite(loss).all():
        raise ValueError(f"loss is {loss.item()}")
    return loss
