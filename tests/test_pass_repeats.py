"""Repeated blocks traced once and copied (passes/repeats.py): the copied joint graph is the whole
trace up to node names, and every model that does not check out is traced whole."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from pass_fixtures import assert_matches_serial, eager_step, isomorphism_failure, run_joint, run_programs
from torch import nn

from autopar.core.mesh import Mesh
from autopar.core.meta import info, signature
from autopar.passes.emit import emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.propagate import propagate
from autopar.passes.repeats import REPEATS_KEY, RepeatedBlocks
from autopar.passes.schedule import schedule
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.rules.registry import default_registry
from autopar.testing import all_coords
from examples.models import make_gpt
from examples.zoo import make_bert, make_llama, make_vit

MAKERS: dict[str, Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "gpt": make_gpt,
    "llama": make_llama,
    "bert": make_bert,
    "vit": make_vit,
}


def _both(model: nn.Module, inputs: tuple[Any, ...], **options: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    return trace(model, inputs, **options), trace(model, inputs, repeats=False, **options)


def _assert_same_program(copied: fx.GraphModule, whole: fx.GraphModule) -> None:
    assert isomorphism_failure(copied, whole) is None, isomorphism_failure(copied, whole)
    a, b = signature(copied), signature(whole)
    assert (a.param_names, a.grad_of, a.buffer_names, a.aliases) == (
        b.param_names,
        b.grad_of,
        b.buffer_names,
        b.aliases,
    )
    assert (a.param_parts, a.requires_grad) == (b.param_parts, b.requires_grad)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_copied_blocks_are_the_whole_trace(name: str) -> None:
    model, inputs = MAKERS[name](0, n_layer=4)
    copied, whole = _both(model, inputs)
    container = "layers" if name == "bert" else "blocks"
    assert copied.meta[REPEATS_KEY] == (RepeatedBlocks(container, 4),)
    assert REPEATS_KEY not in whole.meta
    _assert_same_program(copied, whole)
    # the copies carry their own block's module path and parameters
    paths = {
        info(n).module_path.split(".")[1]
        for n in copied.graph.nodes
        if info(n).module_path.startswith(container + ".")
    }
    assert paths == {"0", "1", "2", "3"}
    loss, grads = run_joint(copied, model, inputs)
    want_loss, want_grads = eager_step(model, inputs)
    torch.testing.assert_close(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[key], msg=key)


@pytest.mark.parametrize("decompose", [False, True])
def test_fused_linears_are_cut_in_every_copied_block(decompose: bool) -> None:
    model, inputs = make_gpt(0, n_layer=5)
    copied, whole = _both(model, inputs, split_fused=True, decompose=decompose)
    assert copied.meta[REPEATS_KEY] == (RepeatedBlocks("blocks", 5),)
    _assert_same_program(copied, whole)
    parts = signature(copied).param_parts
    assert {p.source for p in parts.values()} == {
        f"blocks.{k}.attn.qkv.{w}" for k in range(5) for w in ("weight", "bias")
    }


def test_a_model_with_two_blocks_is_traced_whole() -> None:
    model, inputs = make_gpt(0, n_layer=2)
    assert REPEATS_KEY not in trace(model, inputs).meta


class _Block(nn.Module):
    def __init__(self, h: int, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.scale = scale

    def forward(self, x: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.fc(x)) * self.scale
        return x + (y if gain is None else y * gain)


class _Stack(nn.Module):
    """Four blocks; `variant` makes them not quite repeats in one of the ways a model can."""

    def __init__(self, variant: str, h: int = 8) -> None:
        super().__init__()
        self.variant = variant
        self.blocks = nn.ModuleList(
            _Block(h, 0.5 if variant == "attribute" and k == 2 else 1.0) for k in range(4)
        )
        self.gain = nn.Parameter(torch.full((h,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        blocks = [self.blocks[k] for k in range(4)] if self.variant == "indexed" else self.blocks
        for k, block in enumerate(blocks):
            x = block(x, self.gain if self.variant == "shared_param" else None)
            if self.variant == "loop" and k == 2:
                x = x * 0.5
            outs.append(x)
        if self.variant == "depth":
            x = x / len(self.blocks)
        loss = sum(o.pow(2).mean() for o in outs) if self.variant == "all_outputs" else x.pow(2).mean()
        return loss + self.gain.sum() * 0.0


@pytest.mark.parametrize(
    "variant, stamped",
    [
        ("plain", True),
        ("attribute", False),  # block 2 scales by another constant: the blocks' calls differ
        ("loop", False),  # the model's loop treats block 2 apart: block 3 does not read block 2's output
        ("all_outputs", False),  # every block's output is read after the blocks
        ("shared_param", False),  # the forward run checks out; block 1's backward also sums gain's gradient
        ("depth", False),  # the code after the blocks reads how many there are: the cut model differs
        ("indexed", False),  # the model indexes blocks 0..3: the cut model does not run
    ],
)
def test_blocks_that_are_not_repeats_are_traced_whole(variant: str, stamped: bool) -> None:
    torch.manual_seed(0)
    model = _Stack(variant)
    inputs = (torch.randn(4, 8),)
    copied, whole = _both(model, inputs)
    assert (REPEATS_KEY in copied.meta) is stamped
    _assert_same_program(copied, whole)
    loss, grads = run_joint(copied, model, inputs)
    want_loss, want_grads = eager_step(model, inputs)
    torch.testing.assert_close(loss, want_loss)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[key], msg=key)


def test_a_copied_gpt_computes_the_serial_model_on_every_rank() -> None:
    """Every stage after the trace runs on the copied graph: all 8 ranks of (2, 2, 2) in lockstep
    give the serial model's loss and gradients."""
    model, inputs = make_gpt(0, n_layer=3)
    shape = (2, 2, 2)
    mesh = Mesh.from_shape(shape)
    registry = default_registry()
    gm = trace(model, inputs)
    assert gm.meta[REPEATS_KEY] == (RepeatedBlocks("blocks", 3),)
    planned = propagate(gm, choose_layouts(gm, mesh, registry), mesh.shape)
    programs = {
        c: emit(schedule(insert_comm(copy.deepcopy(planned), mesh, c)), mesh, registry, c)
        for c in all_coords(shape)
    }
    fwd, bwd = run_programs(programs, model, inputs, shape)
    assert_matches_serial(next(iter(programs.values())), fwd, bwd, model, inputs, shape)
