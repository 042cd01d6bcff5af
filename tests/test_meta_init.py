"""A model built on the meta device is initialized rank by rank, each rank keeping only its blocks,
and the weights are those of the model built on a real device from the same seed."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import transformers
from multirank import run_ranks, train_side_by_side

import autopar
from autopar.core.errors import InitError
from autopar.core.layout import Layout, Replicate, Shard
from autopar.runtime.materialize import initialized_blocks, materialize_in_place
from autopar.runtime.program import local_value
from examples.models import GPT, GPTConfig, gpt_batch

MESH = (2, 2)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=64,
    )
    return transformers.LlamaForCausalLM(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=64
    )
    return transformers.BertForSequenceClassification(config)


def _torch_modules() -> nn.Module:
    """torch modules whose initialization touches a child's tensors (MultiheadAttention sets its
    out_proj bias), buffers (BatchNorm) and a padding row."""
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.MultiheadAttention(8, 2), nn.Embedding(6, 8, padding_idx=1)
    )


class TiedAfterConstruction(nn.Module):
    """Ties the head to the embedding after building both: the embedding's values are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.tok.weight


def _opt() -> nn.Module:
    """transformers ties after post_init has initialized both (OPT ties by default)."""
    config = transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=64,
        word_embed_proj_dim=32, max_position_embeddings=32,
    )
    return transformers.OPTForCausalLM(config)


BUILT_ON_A_DEVICE: dict[str, Callable[[], nn.Module]] = {
    "nanogpt-init-weights-and-tied-head": lambda: GPT(GPTConfig()),
    "tied-after-construction": TiedAfterConstruction,
    "opt-tied-after-post-init": _opt,
    "llama": _llama,
    "bert": _bert,
    "torch-modules": _torch_modules,
}


def _split(tensor: torch.Tensor) -> Layout:
    """The layout a plan might store it in: dim 0 over the first axis, the last dim over the second."""
    placements: list[Any] = [Replicate(), Replicate()]
    if tensor.dim() >= 1 and tensor.shape[0] % 2 == 0:
        placements[0] = Shard(0)
    if tensor.dim() >= 2 and tensor.shape[-1] % 2 == 0:
        placements[1] = Shard(tensor.dim() - 1)
    return Layout(tuple(placements), tuple(tensor.shape), tensor.dtype)


@pytest.mark.parametrize("build", list(BUILT_ON_A_DEVICE.values()), ids=list(BUILT_ON_A_DEVICE))
def test_every_rank_makes_its_block_of_the_weights_built_from_the_same_seed(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    serial = build()
    after_serial = torch.rand(4)  # the random state after building: what training draws next
    whole = dict(itertools.chain(serial.named_parameters(), serial.named_buffers()))
    layouts = {name: _split(t) for name, t in whole.items()}
    with torch.device("meta"):
        model = build()
    for coords in itertools.product(range(2), range(2)):
        torch.manual_seed(0)
        made = initialized_blocks(model, layouts, MESH, coords)
        assert torch.equal(torch.rand(4), after_serial)
        assert set(made.blocks) == set(whole)
        for name, block in made.blocks.items():
            assert torch.equal(block, local_value(whole[name], layouts[name], MESH, coords)), (name, coords)
    assert all(t.device.type == "meta" for t in model.parameters())  # the user's model stays on meta


def test_a_user_init_fn_runs_on_every_module_as_model_apply_would() -> None:
    def init_fn(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    serial = build()
    torch.manual_seed(3)
    serial.apply(init_fn)
    with torch.device("meta"):
        model = build()
    layouts = {n: Layout.replicated(tuple(t.shape), 1, t.dtype) for n, t in serial.named_parameters()}
    torch.manual_seed(3)
    made = initialized_blocks(model, layouts, (1,), (0,), init_fn)
    for name, value in serial.named_parameters():
        assert torch.equal(made.blocks[name], value), name


def test_only_one_module_s_tensors_are_whole_at_a_time() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    layouts = {n: _split(t) for n, t in model.named_parameters()}
    made = initialized_blocks(model, layouts, MESH, (0, 1))
    assert made.peak_whole_bytes == (64 * 64 + 64) * 4  # one Linear's weight and bias, never the model
    assert made.blocks["0.weight"].shape == (32, 32)


def test_a_second_initialization_pass_does_not_keep_every_tensor_whole_between_passes() -> None:
    """nanoGPT's constructors reset every module, then `_init_weights` overwrites the weights: a
    weight is dead between the two (the second overwrites it whole), so it is not kept."""
    config = GPTConfig(n_embd=64, n_layer=4)
    with torch.device("meta"):
        model = GPT(config)
    layouts = {n: _split(t) for n, t in model.named_parameters()}
    made = initialized_blocks(model, layouts, MESH, (1, 0))
    largest_module = max(
        sum(t.numel() * t.element_size() for t in m.parameters(recurse=False)) for m in model.modules()
    )
    assert made.peak_whole_bytes == largest_module  # the MLP's first Linear, of 4 layers' worth


def test_in_place_makes_only_the_named_tensors_and_keeps_ties() -> None:
    """What a pipeline rank makes of its stages: the named tensors whole in the model, a tied one
    named by its second name too (one tensor under both), the others left on meta."""
    config = GPTConfig(n_embd=32, n_layer=2)
    torch.manual_seed(0)
    serial = GPT(config)
    after_serial = torch.rand(4)
    with torch.device("meta"):
        model = GPT(config)
    wanted = {n for n, _ in model.named_parameters() if n.startswith("blocks.1.")} | {"lm_head.weight"}
    torch.manual_seed(0)
    made = materialize_in_place(model, wanted)
    assert torch.equal(torch.rand(4), after_serial)
    assert model.wte.weight is model.lm_head.weight and not model.lm_head.weight.is_meta
    ref = dict(serial.named_parameters(remove_duplicate=False))
    real = {n: p for n, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}
    assert set(real) == wanted | {"wte.weight"}
    for name, p in real.items():
        assert torch.equal(p, ref[name]) and p.requires_grad, name
    assert made == sum(p.numel() * p.element_size() for n, p in real.items() if n != "wte.weight")


def test_a_tensor_nothing_initializes_is_named() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(InitError, match="gain is on the meta device and no initialization writes it") as err:
        initialized_blocks(model, {}, (1,), (0,))
    assert "init_fn" in (err.value.hint or "")


def test_an_init_that_fails_names_the_module() -> None:
    def init_fn(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            raise ValueError("no such scheme")

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(InitError, match=r"initializing 0 \(Linear\).*ValueError: no such scheme"):
        initialized_blocks(model, {}, (1,), (0,), init_fn)


def _train_from_meta(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("x", "y"))
    config = GPTConfig()
    batch = gpt_batch(config, 8, torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    torch.manual_seed(0)
    serial = GPT(config)
    result: dict[str, Any] = {
        "init": max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters())),
        "local_fraction": sum(p.to_local().numel() for p in pmodel.parameters())
        / sum(p.numel() for p in serial.parameters()),
    }
    result["losses"] = train_side_by_side([(pmodel, batch), (serial, batch)])
    result["params"] = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters()))
    # ranks seeded differently would each keep blocks of their own weights: refused by name
    with torch.device("meta"):
        other = GPT(config)
    torch.manual_seed(rank % 2)
    try:
        autopar.parallelize(other, mesh, example_inputs=batch)
        result["mixed"] = "no error"
    except autopar.AutoparError as exc:
        result["mixed"] = str(exc)
    return result


@pytest.mark.multirank
def test_a_meta_device_gpt_trains_equal_to_the_serial_model_built_from_the_same_seed() -> None:
    for result in run_ranks(4, _train_from_meta, timeout=300):
        assert result["init"] == 0.0, result["init"]
        assert result["local_fraction"] < 0.5, result["local_fraction"]
        first, first_serial, second, second_serial = result["losses"]
        assert abs(first - first_serial) < 1e-6 and abs(second - second_serial) < 1e-5, result["losses"]
        assert result["params"] < 1e-5, result["params"]
        assert "wte.weight differs between rank 0 and rank 1" in result["mixed"], result["mixed"]
