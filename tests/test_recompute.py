"""Activation recomputation: chosen by cost under a memory limit, and the user's own
`torch.utils.checkpoint` regions (plain torch and transformers' `gradient_checkpointing_enable`).

Every rank's program runs in lockstep against the serial model; the saved bytes are read from the
emitted forward program, and the planner's exact accounting is checked against `plan_memory`.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from pass_fixtures import assert_call_matches_serial
from torch.utils.checkpoint import checkpoint

import autopar
from autopar.compiler.driver import Compiled, compile_for_rank
from autopar.core.meta import has_info, info, is_backward
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.planning.memory import plan_memory
from autopar.planning.recompute import RecomputeModel, compute_seconds
from autopar.planning.search import fit_memory
from autopar.planning.search_cost import ElementCost
from autopar.rules.registry import default_registry
from examples.models import GPT, make_gpt

SHAPE = (2, 2)


class CheckpointedGPT(GPT):
    """examples.models.GPT with each block run under `torch.utils.checkpoint`, as nanoGPT forks do."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _saved(compiled: Compiled) -> list[fx.Node]:
    program = compiled.program
    output = next(n for n in program.forward.graph.nodes if n.op == "output")
    return [n for n in list(output.args[0])[len(program.output_layouts) :] if n.op != "placeholder"]


def _saved_bytes(compiled: Compiled) -> int:
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in _saved(compiled))


def test_the_planner_counts_saved_bytes_as_plan_memory_does() -> None:
    model, batch = make_gpt(0)
    gm = trace(model, batch, decompose=True)
    mesh = autopar.Mesh.from_shape(SHAPE)
    plan = choose_layouts(gm, mesh, default_registry())
    cost = ElementCost(SHAPE)
    recompute = RecomputeModel(gm, plan, SHAPE, compute_seconds(cost, SHAPE, plan), cost.redistribute)
    assert recompute.total_bytes() == plan_memory(gm, plan, SHAPE).activation_bytes()
    blocks = [u for u in recompute.units if u.name.startswith("block:")]
    assert [u.name for u in blocks] == ["block:blocks.0", "block:blocks.1"]
    freed, seconds = recompute.marginal(blocks[0].nodes, set(), ())
    assert freed > 0 and seconds > 0
    assert recompute.total_bytes(blocks[0].nodes) == pytest.approx(recompute.total_bytes() - freed)
    selective = [u for u in recompute.units if u.name.startswith("op:")]
    # one op each; a multi-output op with its readers (the loss's [sum, count] `unbind` and its getitems)
    unbinds = {n.name for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.unbind.int)}
    assert selective and all(len(u.nodes) == 1 or u.nodes & unbinds for u in selective)
    # the greedy planner under a limit keeps its layouts and recomputes to fit; a recomputed block's
    # values exist again while its backward runs, so with two blocks the peak keeps one of them
    each = [recompute.rematerialized(b.nodes, ()) for b in blocks]
    assert min(each) >= freed > 0, "a block's values, made again, take at least what recomputing it frees"
    assert recompute.rematerialized(blocks[0].nodes | blocks[1].nodes, ()) == max(each), "one block at a time"
    memory = plan_memory(gm, plan, SHAPE)
    limit = memory.breakdown().total - 0.25 * memory.activation_bytes()
    fitted = fit_memory(gm, plan, mesh, cost, limit)
    assert fitted.recompute and fitted.layouts == plan.layouts
    assert fitted.memory is not None and fitted.memory.total <= limit
    assert fitted.savings is not None and fitted.memory.activations == fitted.savings.activation_bytes


def test_a_memory_limit_recomputes_and_matches_serial() -> None:
    planner = "search"
    model, batch = make_gpt(0)
    mesh = autopar.Mesh.from_shape(SHAPE)
    free = compile_for_rank(model, mesh, batch, coords=(0, 0), planner=planner, memory_limit=math.inf)
    saved = _saved_bytes(free)
    # the free plan's modeled total (params, grads, AdamW's two states, saved activations, working
    # memory) less half its saved activations
    limit = free.graph.meta["autopar_search"].memory - 0.5 * saved
    compiled = assert_call_matches_serial(model, SHAPE, batch, planner=planner, memory_limit=limit)
    lean = compiled[(0, 0)]
    activations = lean.report.activations
    assert activations is not None and activations.recomputed and activations.copied_ops > 0
    assert activations.before == pytest.approx(saved, rel=1e-3)
    assert activations.after == _saved_bytes(lean) <= 0.5 * saved
    # recomputed ops are copies in backward: the forward no longer hands their results over
    def backward_matmuls(c: Compiled) -> int:
        return len([n for n in c.graph.graph.nodes if has_info(n) and is_backward(n) and "mm" in str(n.target)])

    assert backward_matmuls(lean) > backward_matmuls(free)  # whole blocks ran again, matmuls and all
    assert "saved activations per rank" in str(lean.report) and "recomputed in backward" in str(lean.report)


def test_torch_checkpoint_regions_are_recomputed_and_their_outputs_kept() -> None:
    model, batch = make_gpt(0)
    checkpointed = CheckpointedGPT(model.cfg)
    checkpointed.load_state_dict(model.state_dict())
    gm = trace(checkpointed, batch, decompose=True)
    regions = {info(n).checkpoint for n in gm.graph.nodes if has_info(n)}
    assert regions == {None, "blocks.0", "blocks.1"}
    assert all(not is_backward(n) for n in gm.graph.nodes if has_info(n) and info(n).checkpoint)

    plain = compile_for_rank(model, autopar.Mesh.from_shape(SHAPE), batch, coords=(0, 0))
    compiled = assert_call_matches_serial(checkpointed, SHAPE, batch)[(0, 0)]
    activations = compiled.report.activations
    assert activations is not None
    assert set(activations.recomputed) == {"region:blocks.0", "region:blocks.1"}
    assert _saved_bytes(compiled) < 0.6 * _saved_bytes(plain)
    # each block's output stays saved (torch keeps a checkpointed function's output too); nothing
    # else computed inside a block is saved but random ops' and weight chains'
    kept = [n for n in _saved(compiled) if has_info(n) and info(n).module_path.startswith("blocks.")]
    assert {info(n).module_path.split(".")[1] for n in kept} <= {"0", "1"}


transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_transformers_gradient_checkpointing_is_honoured() -> None:
    """`model.gradient_checkpointing_enable()` as transformers' docs turn it on, then the default call."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(64, (8, 16), generator=torch.Generator().manual_seed(1))
    compiled = assert_call_matches_serial(model, SHAPE, (), {"input_ids": ids, "labels": ids})[(0, 0)]
    activations = compiled.report.activations
    assert activations is not None
    assert set(activations.recomputed) == {"region:model.layers.0", "region:model.layers.1"}
    inside = [n for n in _saved(compiled) if has_info(n) and info(n).module_path.startswith("model.layers.")]
    # of what a layer computes from the batch only its output stays (gathered weights and rotary
    # tables do not come from the batch)
    from_batch = [info(n).module_path.split(".")[2] for n in inside if _reads_the_batch(n)]
    assert sorted(from_batch) == ["0", "1"]


def _reads_the_batch(node: fx.Node) -> bool:
    seen, frontier = set(), [node]
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" and has_info(current) and info(current).role == "input":
            return True
        frontier.extend(current.all_input_nodes)
    return False
