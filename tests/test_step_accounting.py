"""The pipelined step's accounting against hand-computed numbers (issue 29, item 3): weight state
under mixed precision, the data axis's gradient reduction once per step, the optimizer step, full
recomputation. A 2-layer GPT (h = 32, vocabulary 64, block 16, batch 8) in bfloat16, traced once.

Its parameters by hand: a block has 12 h^2 + 13 h = 12704 (ln 2h, qkv 3h^2 + 3h, proj h^2 + h,
ln 2h, fc 4h^2 + 4h, proj 4h^2 + h); wte V h = 2048, wpe T h = 512, ln_f 2h = 64; the head is
tied to wte. Cut before blocks.1: stage 0 holds wte + wpe + blocks.0 = 15264 elements, stage 1
blocks.1 + ln_f + the tied wte = 14816."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx

from autopar.compiler.pipeline_mesh import StateBytes, per_microbatch, per_step_best, tensor_only_candidate
from autopar.core.errors import AutoparError
from autopar.core.graph_copy import graph_copy
from autopar.core.layout import Layout, Partial, Replicate
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.cost.formulas import collective_time
from autopar.cost.hardware import axis_links, load_hardware
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.planning.memory import StateRatios, plan_memory, set_state_ratios, state_ratios
from autopar.planning.mesh_choice import MeshCandidate, MeshChoice
from autopar.planning.search import search_layouts, weight_state_bytes
from autopar.planning.search_cost import TimeCost
from autopar.planning.stage_cut import StageCut, cut_graph
from autopar.planning.stage_units import StageGraph, stage_graph
from autopar.planning.step_accounting import (
    MIXED_ADAMW,
    PLAIN,
    exposed_reduction,
    gradient_reduction_time,
    weight_state_for,
)
from autopar.rules.registry import default_registry
from examples.models import make_gpt, make_mlp

HW = "a100-cluster"
STAGE0, STAGE1 = 15264, 14816  # parameter elements per stage, by hand (module docstring)


@functools.cache
def gpt_bf16() -> fx.GraphModule:
    model, batch = make_gpt(0, n_layer=2, vocab_size=64)
    return trace(model.to(torch.bfloat16), batch, decompose=True)


@functools.cache
def graph(tensor_size: int) -> StageGraph:
    return stage_graph(gpt_bf16(), HW, tensor_size)


def two_stages(microbatches: int, **accounting: object) -> StageCut:
    return cut_graph(
        graph(4), pp=2, microbatches=microbatches, stage_boundaries=["blocks.1"], memory_limit=1e12,
        **accounting,  # type: ignore[arg-type]
    )  # fmt: skip


def test_mixed_precision_state_is_18_bytes_per_parameter_split_over_tensor_ranks() -> None:
    # 4 ranks a stage: 2 tensor x 2 data replicas; bf16 weight 2 + fp32 grad 4 + fp32 master 4 +
    # AdamW 8 = 18 bytes per element, each replica holding half of every parameter
    cut = two_stages(4, weight_state=MIXED_ADAMW, data_parallel=2)
    assert [s.state_bytes for s in cut.stages] == [STAGE0 / 2 * 18, STAGE1 / 2 * 18]
    assert [s.param_bytes for s in cut.stages] == [STAGE0 / 2 * 2, STAGE1 / 2 * 2]
    # what the cut counted before: bf16 weight, bf16 grad, AdamW in bf16, split over all 4 ranks
    plain = two_stages(4)
    assert [s.state_bytes for s in plain.stages] == [STAGE0 / 4 * 8, STAGE1 / 4 * 8]
    # the rank's memory adds its activations on top of the states
    for s, memory in zip(cut.stages, cut.rank_memory, strict=True):
        assert memory == pytest.approx(
            s.state_bytes + s.in_flight * s.activation_bytes + s.fixed_activation_bytes
        )


def test_gradients_reduce_once_per_step_whatever_the_microbatches() -> None:
    hw = load_hardware(HW)
    link = axis_links((2, 2, 2), hw)[1]  # (pp, data, tensor): the data axis
    for m in (2, 8):
        cut = two_stages(m, weight_state=MIXED_ADAMW, data_parallel=2)
        # one all-reduce per step of the fp32 gradients one replica holds: half of each parameter
        want = [collective_time("all_reduce", n / 2 * 4, 1, 2, link) for n in (STAGE0, STAGE1)]
        assert list(cut.reduce_time) == pytest.approx(want, rel=1e-12)
        # the optimizer pass reads the grad (4), reads and writes master (4) and AdamW (8), writes
        # the bf16 weight (2): 30 bytes per element held, at the memory bandwidth
        steps = [n / 2 * 30 / hw.memory_bandwidth for n in (STAGE0, STAGE1)]
        assert list(cut.optimizer_time) == pytest.approx(steps, rel=1e-12)
        assert cut.buckets == (3, 3)
        ends = []
        for r in range(2):
            row = cut.timeline.ranks[r]
            last = cut.stages[r].backward / m  # 1F1B: a rank's last action is its stage's backward
            assert row[-1].action.kind.name == "BACKWARD" or row[-2].action.kind.name == "BACKWARD"
            ends.append(row[-1].end + max(want[r] - last + last / 3, want[r] / 3) + steps[r])
        assert cut.step_time == pytest.approx(max(ends), rel=1e-12)
        assert cut.step_time > cut.makespan


def test_exposed_reduction_by_hand() -> None:
    # 3 buckets of 1 s over a 6 s backward: ready at 2, 4, 6; the last ends at 7
    assert exposed_reduction(3.0, 6.0, 3) == pytest.approx(1.0)
    # 3 buckets of 3 s over a 3 s backward: ready at 1, 2, 3; serial from 1: ends at 10
    assert exposed_reduction(9.0, 3.0, 3) == pytest.approx(7.0)
    assert exposed_reduction(0.0, 3.0, 3) == 0.0


def test_full_recomputation_keeps_block_inputs_and_runs_their_forward_twice() -> None:
    g = graph(1)
    bounds = ["blocks.0", "blocks.1"]  # stage 1 is blocks.0 alone
    plain = cut_graph(g, pp=3, microbatches=2, stage_boundaries=bounds, memory_limit=1e12)
    again = cut_graph(g, pp=3, microbatches=2, stage_boundaries=bounds, memory_limit=1e12, recompute=True)
    p, r = plain.stages[1], again.stages[1]
    # in flight: only the block's input, one microbatch of the residual stream: 4 x 16 x 32 bf16
    assert r.activation_bytes == 4 * 16 * 32 * 2
    # its own activations exist again, once, while its backward runs
    assert r.recompute_bytes == p.activation_bytes
    assert r.backward == pytest.approx(p.backward + p.forward)
    assert r.backward_input == pytest.approx(p.backward_input + p.forward)
    assert again.rank_memory[1] == pytest.approx(
        r.state_bytes + r.in_flight * 4 * 16 * 32 * 2 + r.fixed_activation_bytes + p.activation_bytes
    )
    # the embeddings are not recomputed; the last stage recomputes blocks.1 only
    assert again.stages[0].backward == plain.stages[0].backward
    blocks1 = g.units[g.names.index("blocks.1")]
    assert again.stages[2].backward == pytest.approx(plain.stages[2].backward + blocks1.forward)
    assert again.makespan > plain.makespan
    assert max(again.rank_memory) < max(plain.rank_memory)


def test_gradient_reduction_of_a_data_parallel_plan_is_one_all_reduce_per_parameter() -> None:
    # the gradient side of a data-parallel plan on 4 ranks: every gradient partial, stored replicated
    model, batch = make_mlp(0)
    gm = trace(model, batch, decompose=True)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    plan = Plan()
    sizes = []
    for i, src in enumerate(outputs):
        shape = tuple(src.meta["val"].shape)
        if i == 0:  # the loss
            plan.output_layouts.append(None)
            continue
        plan.layouts[src.name] = (Layout((Partial(),), shape, torch.float32),)
        plan.output_layouts.append(Layout((Replicate(),), shape, torch.float32))
        sizes.append(src.meta["val"].numel())
    assert sorted(sizes) == sorted(p.numel() for p in model.parameters())  # one gradient per parameter
    hw = load_hardware(HW)
    link = axis_links((4,), hw)[0]
    want = sum(collective_time("all_reduce", n, torch.float32, 4, link) for n in sizes)
    assert gradient_reduction_time(gm, plan, (4,), hw) == pytest.approx(want, rel=1e-12)
    assert PLAIN.step_bytes(4) == 4 + 2 * 4 + 2 * 8  # fp32: grad read, weight and AdamW read + written


def test_selective_recomputation_keeps_matmul_and_attention_outputs_and_reruns_element_wise_ops() -> None:
    g = graph(1)
    bounds = ["blocks.0", "blocks.1"]  # stage 1 is blocks.0 alone
    cut = functools.partial(cut_graph, g, pp=3, microbatches=2, stage_boundaries=bounds, memory_limit=1e12)
    plain, full, sel = cut(), cut(recompute="full"), cut(recompute="selective")
    assert cut(recompute=True).stages == full.stages  # True is "full"
    p, s = plain.stages[1], sel.stages[1]
    # what blocks.0 saves for its backward, batch 8 x 16, h = 32, bf16 (2 bytes):
    x = 8 * 16 * 32 * 2  # 8192: one residual-stream-sized value
    matmuls = 3 * x + x + 8 * 4 * 16 * 4 + x + 4 * x  # q, k, v; attention out, its fp32 logsumexp; proj in; fc out
    elementwise = 4 * x + 4 * (8 * 16 * 2) + 4 * x  # two ln inputs and outputs, their mean and 1/std; gelu out
    assert p.activation_bytes == (matmuls + elementwise) / 2  # per microbatch of 4 sequences
    # selective: in flight, the block's input and what its matmuls and attention made
    assert s.activation_bytes == (x + matmuls) / 2
    # the element-wise values exist again, one microbatch's, while its backward runs
    assert s.recompute_bytes == elementwise / 2
    # the element-wise forward runs again in backward, on the input-gradient path
    blocks0 = g.units[g.names.index("blocks.0")]
    assert 0 < blocks0.forward_elementwise < blocks0.forward
    assert s.backward == pytest.approx(p.backward + blocks0.forward_elementwise)
    assert s.backward_input == pytest.approx(p.backward_input + blocks0.forward_elementwise)
    assert sel.stages[0].backward == plain.stages[0].backward  # the embeddings are not recomputed
    assert plain.makespan < sel.makespan < full.makespan
    # what recomputation adds to the step's compute, apart (a sub-mesh's overhead is measured without it)
    blocks = [u for u in g.units if u.name.startswith("blocks.")]
    assert plain.recompute_time == 0.0
    assert sel.recompute_time == pytest.approx(sum(u.forward_elementwise for u in blocks))
    assert full.recompute_time == pytest.approx(sum(u.forward for u in blocks))
    assert full.total_time - full.recompute_time == pytest.approx(plain.total_time)
    assert sum(st.recompute_time for st in full.stages) == pytest.approx(full.recompute_time)
    # a sub-mesh's overhead lands on each stage as it does without recomputation: never cheaper with it
    extra = plain.total_time  # as much again as the whole compute
    for again in (sel, full):
        slow, slow_plain = again.slowed(extra), plain.slowed(extra)
        for a, b, st, pst in zip(slow.stages, slow_plain.stages, again.stages, plain.stages, strict=True):
            assert a.time - st.time == pytest.approx(b.time - pst.time)
            assert a.backward_input - st.backward_input == pytest.approx(b.backward_input - pst.backward_input)
        assert slow.makespan > slow_plain.makespan
    assert max(full.rank_memory) < max(sel.rank_memory) < max(plain.rank_memory)
    with pytest.raises(AutoparError, match="recompute='some'"):
        cut(recompute="some")


def test_weight_state_by_name_or_by_the_parameters_dtype() -> None:
    assert weight_state_for(gpt_bf16(), None) == MIXED_ADAMW  # bfloat16 parameters: a mixed-precision run
    model, batch = make_mlp(0)
    assert weight_state_for(trace(model, batch, decompose=True), None) == PLAIN  # float32: the masters
    assert weight_state_for(gpt_bf16(), "plain") == PLAIN and weight_state_for(gpt_bf16(), MIXED_ADAMW) == MIXED_ADAMW
    with pytest.raises(AutoparError, match="weight_state='fp8'"):
        weight_state_for(gpt_bf16(), "fp8")


def test_the_tensor_only_candidate_is_priced_with_the_weight_state_and_its_optimizer_step() -> None:
    # the 2-layer bf16 GPT holds 28032 parameter elements (the tied head once), 2 bytes each; the
    # plain count keeps 4 bytes per stored byte (weight, gradient, AdamW in bf16: 8 per element),
    # mixed precision keeps 18 per element: 9 per stored byte, 5 more (fp32 gradient: 2 per stored
    # byte; master and AdamW: 6); AdamW moves 30 per element
    state = StateBytes.of(gpt_bf16(), MIXED_ADAMW)
    elements = STAGE0 + STAGE1 - 2048
    assert state.stored == elements * 2
    assert state.extra == pytest.approx(18 / 2 - 4) and state.step == pytest.approx(30 / 2)
    assert state.ratios == StateRatios(grad=pytest.approx(2.0), optimizer=pytest.approx(6.0))
    assert state.ratios.total == pytest.approx(9.0)
    hw = load_hardware(HW)
    stored = state.stored / 8  # a plan that splits every parameter over 8 ranks
    # its search counted its memory with those ratios (`set_state_ratios`): taken as it is
    best = MeshCandidate((2, 4), ("x", "y"), comm_time=2e-3, compute_time=5e-3, memory=1e6, fits=True,
                         scheduled_time=6e-3, reduce_time=1e-3, param_bytes=stored)  # fmt: skip
    row = tensor_only_candidate(best, state, hw, limit=1e6, world_size=8)
    assert row.memory == pytest.approx(1e6) and row.fits
    assert row.step_time == pytest.approx(6e-3 + 15 * stored / hw.memory_bandwidth)
    assert not tensor_only_candidate(best, state, hw, limit=1e6 - 1, world_size=8).fits


def test_plans_are_counted_with_the_weight_state_recorded_on_their_graph() -> None:
    # the same plan of a copy of the graph, plainly and with mixed precision's ratios: params as
    # stored, gradient 2 and optimizer 6 bytes per stored byte instead of 1 and 2, same activations
    gm = gpt_bf16()
    mixed = graph_copy(gm)
    set_state_ratios(mixed, StateBytes.of(gm, MIXED_ADAMW).ratios)
    assert state_ratios(gm) == StateRatios()
    plan = choose_layouts(gm, Mesh.from_shape((2,), ("x",)), default_registry())
    plain, counted = plan_memory(gm, plan, (2,)), plan_memory(mixed, plan, (2,))
    assert counted.param_bytes == plain.param_bytes > 0
    assert counted.activation_bytes() == plain.activation_bytes()
    p = plain.param_bytes
    assert plain.breakdown().total == pytest.approx(4 * p + plain.activation_bytes() + plain.working_bytes)
    assert counted.breakdown().grads == pytest.approx(2 * p) and counted.breakdown().optimizer == pytest.approx(6 * p)
    assert weight_state_bytes(mixed) == pytest.approx(9 / 4 * weight_state_bytes(gm))


def test_the_stage_sub_mesh_is_ranked_with_its_gradient_reduction_once_per_step() -> None:
    # a data-parallel sub-mesh: 10 ms per microbatch with 8 ms of it its gradient reduction; a
    # tensor-parallel one: 6 ms with 1 ms of reduction. Per microbatch the second is faster; over
    # a step of 16 microbatches reducing once, the first: 16 x 2 + 8 = 40 ms < 16 x 5 + 1 = 81 ms
    data = MeshCandidate((8,), ("x",), comm_time=9e-3, compute_time=1e-3, memory=1.0, fits=True, reduce_time=8e-3)
    tensor = MeshCandidate((2, 4), ("x", "y"), comm_time=2e-3, compute_time=4e-3, memory=1.0, fits=True,
                           scheduled_time=6e-3, reduce_time=1e-3)  # fmt: skip
    choice = MeshChoice(8, HW, "search", 1e9, [tensor, data])  # the choice's own ranking: per microbatch
    assert per_microbatch(data) == pytest.approx(2e-3) and per_microbatch(tensor) == pytest.approx(5e-3)
    assert per_step_best(choice, 16) is data
    assert per_step_best(choice, 1) is tensor  # one microbatch: 2 + 8 = 10 ms against 5 + 1 = 6 ms


def test_the_search_fits_replicated_weights_with_the_weight_state_they_hold() -> None:
    # on (8,) the search stores the 2-layer GPT's weights replicated (DDP's pattern: 56 KB of
    # bf16, 224 KB counted plainly). Under mixed precision replicas hold 9 bytes per stored byte,
    # 504 KB: over a 400 KB limit a plain count fits under. The search of the graph with the
    # ratios recorded counts them, and stores the weights sharded instead (PTD-P 1.7B on 4x8 was
    # handed 95.8 GB of 80 by the plain count)
    mesh, limit = Mesh.from_shape((8,), ("x",)), 4e5
    cost = TimeCost("a100-calibrated", mesh.shape)
    plain = search_layouts(gpt_bf16(), mesh, default_registry(), cost=cost, memory_limit=limit)
    assert plain.storage == "replicated" and plain.memory is not None and plain.memory.total <= limit
    assert plain.memory.total + 5 * plain.memory.params > limit  # what the replicas would hold
    mixed = graph_copy(gpt_bf16())
    set_state_ratios(mixed, StateBytes.of(mixed, MIXED_ADAMW).ratios)
    counted = search_layouts(mixed, mesh, default_registry(), cost=cost, memory_limit=limit)
    assert counted.storage == "sharded" and counted.memory is not None
    assert counted.memory.total == pytest.approx(9 * counted.memory.params + counted.memory.activations + counted.memory.working)
    assert counted.memory.total <= limit
