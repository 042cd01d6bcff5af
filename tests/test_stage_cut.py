"""Stage cutting by cost (autopar.planning.stage_units, autopar.planning.stage_cut; issue 19 item 2),
on small models traced on fake tensors: the units and boundaries found, the exact dynamic program
against brute force, balance with the embedding and head priced, forced cuts, the memory limit,
and a report whose numbers add up."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.errors import AutoparError, MemoryLimitError
from autopar.core.meta import has_info, info
from autopar.core.pipeline_schedule import schedule_by_name
from autopar.core.pipeline_simulate import simulate
from autopar.cost.formulas import compute_time
from autopar.cost.hardware import load_hardware
from autopar.cost.work import compute_rate, global_work
from autopar.passes.trace import trace
from autopar.planning.stage_cut import (
    Schedules,
    StageCut,
    StageCutError,
    StageMemoryError,
    balance,
    cut_graph,
    cut_stages,
    in_flight,
    node_stages,
    peak_activations,
)
from autopar.planning.stage_units import StageGraph, compact, stage_graph, unit_names
from examples.models import make_gpt
from examples.zoo import make_bert, make_llama

HW = "h100-nvlink-ib"


@functools.cache
def gpt_graph(n_layer: int, vocab_size: int = 64) -> fx.GraphModule:
    model, batch = make_gpt(0, n_layer=n_layer, vocab_size=vocab_size)
    return trace(model, batch, decompose=True)


@functools.cache
def llama_graph() -> fx.GraphModule:
    model, batch = make_llama(0, n_layer=3)
    return trace(model, batch, decompose=True)


@functools.cache
def analysed(n_layer: int, vocab_size: int = 64, tensor_size: int = 1) -> StageGraph:
    return stage_graph(gpt_graph(n_layer, vocab_size), HW, tensor_size)


# ------------------------------------------------------------------------------------ units


def test_unit_names_follow_blocks_and_top_level_modules() -> None:
    paths = [
        "wte",
        "blocks.0.attn.qkv",
        "blocks.0",
        "blocks.11.mlp",
        "ln_f",
        "model.embed_tokens",
        "model.layers.3.self_attn",
        "model.norm",
        "lm_head",
        "0",
        "1.linear",
    ]
    assert unit_names(paths) == {
        "wte": "wte",
        "blocks.0.attn.qkv": "blocks.0",
        "blocks.0": "blocks.0",
        "blocks.11.mlp": "blocks.11",
        "ln_f": "ln_f",
        "model.embed_tokens": "model.embed_tokens",
        "model.layers.3.self_attn": "model.layers.3",
        "model.norm": "model.norm",
        "lm_head": "lm_head",
        "0": "0",
        "1.linear": "1",
    }
    # a container's own ops around its blocks (a transformers *ForCausalLM's logits slice and
    # loss, LlamaModel's causal mask) are glue, placed like the root module's: no unit
    hf = unit_names(["model", "model.model", "model.model.layers.0.mlp", "model.lm_head"])
    assert hf == {"model": "", "model.model": "", "model.model.layers.0.mlp": "model.model.layers.0",
                  "model.lm_head": "model.lm_head"}  # fmt: skip
    assert compact(["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "ln_f", "blocks.4"]) == (
        "wte, wpe, blocks.0-2, ln_f, blocks.4"
    )


def test_gpt_boundaries_are_the_module_boundaries() -> None:
    g = analysed(7)
    blocks = tuple(f"blocks.{i}" for i in range(7))
    assert g.names == ("wte", "wpe", *blocks, "ln_f", "lm_head")
    assert g.candidates() == tuple(range(1, 11))
    # one activation crosses each cut: the residual stream (wte's output before wpe)
    for k in g.candidates():
        (tensor,) = g.crossing[k]
        assert tensor.shape == (8, 16, 32) and tensor.per_batch and tensor.bytes == 8 * 16 * 32 * 4
    # parameters go to their first use; the tied embedding / head weight is read by both ends
    assert g.used_by["wte.weight"] == (0, 10) and g.aliases["wte.weight"] == ("lm_head.weight",)
    assert g.units[10].reads == ("wte.weight",) and "wte.weight" in g.units[0].params
    assert all(g.used_by[f"blocks.{i}.attn.qkv.weight"] == (2 + i,) for i in range(7))


def test_backward_ops_go_to_the_unit_of_the_op_they_differentiate() -> None:
    gm, g = gpt_graph(7), analysed(7)
    hw = load_hardware(HW)
    # the trace gives backward ops the forward op's module path: lm_head's weight-gradient matmul
    paths = {info(n).module_path for n in gm.graph.nodes if has_info(n) and info(n).phase == "backward"}
    assert {"lm_head", "blocks.2.mlp.fc", "blocks.0.attn.qkv", "wte"} <= paths
    # every backward op with a block's path is priced in that block's unit
    for i in range(7):
        mine = [
            n
            for n in gm.graph.nodes
            if n.op == "call_function"
            and info(n).phase == "backward"
            and info(n).module_path.startswith(f"blocks.{i}.")
        ]
        priced = sum(compute_time(global_work(n), 0.0, compute_rate(n), hw) for n in mine)
        unit = g.units[2 + i]
        assert unit.backward >= priced > 0
        assert 1.5 < unit.backward / unit.forward < 2.5  # backward ~ 2x forward, from the ops
        assert 0 < unit.backward_input < unit.backward  # dI on the gradient path, dW the rest
    assert g.units[0].backward_input == 0  # the embedding's backward is its weight gradient only
    # the root's ops are priced with their forward op's unit, so identical blocks cost the same
    assert all(u.time == pytest.approx(g.units[2].time, rel=1e-9) for u in g.units[2:9])


def test_llama_rotary_tables_are_recomputed_not_sent() -> None:
    g = stage_graph(llama_graph(), HW)
    assert g.names == ("embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head")
    assert g.candidates() == (1, 2, 3, 4, 5)
    # cos / sin come from a buffer and the sequence length only: each stage makes its own
    for k in g.candidates():
        assert [t.shape for t in g.crossing[k]] == [(8, 16, 32)]
    assert set(g.used_by["inv_freq"]) == {1, 2, 3}


def test_bert_attention_mask_is_recomputed_not_sent() -> None:
    model, batch = make_bert(0)
    g = stage_graph(trace(model, batch, decompose=True), HW)
    assert g.names[:4] == ("word", "position", "token_type", "ln_embed") and g.names[-1] == "mlm_head"
    # the float mask the first layer's attention makes from the input mask: no parameter, so the
    # second layer's stage makes it too instead of receiving it
    assert [t.shape for t in g.crossing[g.names.index("layers.1")]] == [(8, 16, 32)]


def test_tensor_ranks_divide_work_and_memory() -> None:
    one, four = analysed(7), analysed(7, tensor_size=4)
    assert four.total_time == pytest.approx(one.total_time / 4)
    a = cut_graph(one, pp=2, microbatches=4)
    b = cut_graph(four, pp=2, microbatches=4)
    assert a.boundaries == b.boundaries
    for x, y in zip(a.stages, b.stages, strict=True):
        assert y.memory == pytest.approx(x.memory / 4) and y.send_bytes == pytest.approx(x.send_bytes / 4)


# ------------------------------------------------------------------------ the dynamic program


def brute_force(times, sizes, stages, allowed, fits):  # type: ignore[no-untyped-def]
    n = len(times)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        if not all(allowed[k] for k in cuts):
            continue
        edges = (0, *cuts, n)
        if not all(fits(edges[s], edges[s + 1], s) for s in range(stages)):
            continue
        key = (max(sum(times[edges[s] : edges[s + 1]]) for s in range(stages)), sum(sizes[k] for k in cuts))
        best = key if best is None or key < best else best
    return best


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_balance_is_exact_against_brute_force(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 8))
    stages = data.draw(st.integers(1, n))
    times = data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    sizes = data.draw(st.lists(st.integers(0, 6), min_size=n + 1, max_size=n + 1))
    allowed = data.draw(st.lists(st.booleans(), min_size=n + 1, max_size=n + 1))
    limit = data.draw(st.integers(0, 40))
    weight = data.draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))

    def fits(i: int, j: int, s: int) -> bool:  # a memory-like constraint that depends on the stage
        return sum(weight[i:j]) * (stages - s) <= limit

    expected = brute_force(times, sizes, stages, allowed, fits)
    got = balance([float(t) for t in times], [float(b) for b in sizes], stages, allowed=allowed, fits=fits)
    if expected is None:
        assert got is None
        return
    assert got is not None and len(got) == stages - 1
    edges = (0, *got, n)
    assert all(allowed[k] for k in got) and all(fits(edges[s], edges[s + 1], s) for s in range(stages))
    key = (max(sum(times[edges[s] : edges[s + 1]]) for s in range(stages)), sum(sizes[k] for k in got))
    assert key == expected


def test_balance_ties_prefer_small_boundaries() -> None:
    # stages of 2 + 2 either way; the cut before unit 2 sends less
    assert balance([1.0, 1.0, 1.0, 1.0], [0, 5, 1, 5, 0], 2) == (2,)
    assert balance([1.0, 1.0, 2.0], [0, 3, 1, 0], 2) == (2,)
    assert balance([1.0], [0, 0], 2) is None


# --------------------------------------------------------------------------- balance on models


def blocks_per_stage(cut: StageCut) -> list[int]:
    return [sum(u.startswith("blocks.") for u in s.units) for s in cut.stages]


def test_uneven_depth_is_balanced_by_time_with_embedding_and_head_priced() -> None:
    small, huge = analysed(7), analysed(7, vocab_size=2048)
    for g in (small, huge):
        cut = cut_graph(g, pp=3, microbatches=6)
        # never worse than counting layers: 7 blocks as 3 / 2 / 2 or 2 / 3 / 2 or 2 / 2 / 3
        for counts in ((3, 2, 2), (2, 3, 2), (2, 2, 3)):
            starts = [f"blocks.{counts[0]}", f"blocks.{counts[0] + counts[1]}"]
            layered = cut_graph(g, pp=3, microbatches=6, stage_boundaries=starts)
            assert cut.max_stage_time <= layered.max_stage_time * (1 + 1e-9)
    # the head of a 2048-word vocabulary costs blocks' worth of time: the last stage gets fewer blocks
    huge_cut = cut_graph(huge, pp=3, microbatches=6)
    small_cut = cut_graph(small, pp=3, microbatches=6)
    assert blocks_per_stage(huge_cut)[-1] < blocks_per_stage(huge_cut)[0]
    assert blocks_per_stage(huge_cut)[-1] < blocks_per_stage(small_cut)[-1]
    head = huge.units[-1]
    assert head.name == "lm_head" and head.time > 1.5 * huge.units[2].time
    # balanced: the longest stage is within one unit of the mean
    assert huge_cut.max_stage_time - huge.total_time / 3 <= max(u.time for u in huge.units)


def test_report_adds_up() -> None:
    g = analysed(7, vocab_size=2048)
    gm = gpt_graph(7, 2048)
    hw = load_hardware(HW)
    priced = sum(
        compute_time(global_work(n), 0.0, compute_rate(n), hw)
        for n in gm.graph.nodes
        if n.op == "call_function"
    )
    for pp, v, schedule in (
        (4, 1, "1f1b"),
        (2, 2, "interleaved-1f1b"),
        (2, 2, "zero-bubble"),
        (2, 1, "gpipe"),
    ):
        cut = cut_graph(g, pp=pp, v=v, microbatches=4, schedule=schedule)
        assert len(cut.stages) == pp * v
        assert sum(s.time for s in cut.stages) == pytest.approx(cut.total_time) == pytest.approx(priced)
        assert [u for s in cut.stages for u in s.units] == list(g.names)
        assert cut.boundaries == tuple(s.units[0] for s in cut.stages[1:])
        plan = schedule_by_name(schedule, pp, v, 4)
        assert [s.in_flight for s in cut.stages] == list(in_flight(plan))
        assert [s.rank for s in cut.stages] == [plan.placement.rank_of(i) for i in range(pp * v)]
        for s in cut.stages:
            assert s.memory == pytest.approx(
                s.state_bytes + s.in_flight * s.activation_bytes + s.fixed_activation_bytes
            )
            # weights + gradients + two fp32 AdamW states (4x) for the trainable part
            assert s.param_bytes * 3.9 < s.state_bytes <= s.param_bytes * 4
        if v == 1:
            assert list(cut.rank_memory) == pytest.approx([s.memory for s in cut.stages])
        else:  # a rank's peak is at most the sum of its stages' own peaks
            for r in range(pp):
                assert cut.rank_memory[r] <= sum(s.memory for s in cut.stages if s.rank == r) * (1 + 1e-9)
        # the simulated step: at least the longest stage, at most everything in a row
        assert cut.max_stage_time <= cut.makespan <= cut.total_time * 1.01 + 1e-3
        assert 0.0 <= cut.bubble < 1.0
        text = str(cut)
        assert "blocks." in text and "lm_head" in text and "(p-1)/(v*m)" in text
    # every compute node has a stage, and the nodes of a module call are in that call's stage
    cut = cut_graph(g, pp=4, microbatches=4)
    where = node_stages(g, cut)
    computes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert set(where) == {n.name for n in computes}
    for n in computes:
        path = info(n).module_path
        if path.startswith("blocks."):
            unit = ".".join(path.split(".")[:2])
            assert unit in cut.stages[where[n.name]].units
    # the tied weight is reported where it is shared
    cut = cut_graph(g, pp=2, microbatches=4)
    assert cut.stages[0].shared == ("wte.weight",) == cut.stages[-1].shared
    # one microbatch's boundary: the residual stream of 8 / 4 sequences
    assert cut.stages[0].send_bytes == 2 * 16 * 32 * 4


def test_in_flight_is_the_simulators_peak() -> None:
    for name, pp, v, m in (
        ("1f1b", 4, 1, 8),
        ("gpipe", 3, 1, 5),
        ("zero-bubble", 4, 1, 8),
        ("1f1b", 4, 1, 2),
    ):
        plan = schedule_by_name(name, pp, v, m)
        assert in_flight(plan) == simulate(plan).peak_in_flight
    plan = schedule_by_name("interleaved-1f1b", 2, 2, 4)
    per_stage = in_flight(plan)
    peaks = peak_activations(plan, [1.0] * 4)
    assert peaks == tuple(float(p) for p in simulate(plan).peak_in_flight)
    assert all(peaks[r] <= per_stage[r] + per_stage[r + 2] for r in range(2))


# ------------------------------------------------------------------------------- forced cuts


def test_forced_cut_is_kept_and_checked() -> None:
    g = analysed(7)
    cut = cut_graph(g, pp=3, microbatches=3, stage_boundaries=["blocks.1", "blocks.5"])
    assert cut.forced and cut.boundaries == ("blocks.1", "blocks.5")
    assert [s.modules for s in cut.stages] == [
        "wte, wpe, blocks.0",
        "blocks.1-4",
        "blocks.5-6, ln_f, lm_head",
    ]
    assert cut_stages(gpt_graph(7), pp=3, microbatches=3, stage_boundaries=["wpe", "lm_head"]).stages[
        0
    ].units == ("wte",)
    with pytest.raises(StageCutError, match="'blocks.1.attn' is not a module a stage can start with") as e:
        cut_graph(g, pp=3, microbatches=3, stage_boundaries=["blocks.1.attn", "blocks.5"])
    assert e.value.hint is not None and "wpe, blocks.0-6, ln_f, lm_head" in e.value.hint
    with pytest.raises(StageCutError, match="names 1 modules, but 3 stages need 2"):
        cut_graph(g, pp=3, microbatches=3, stage_boundaries=["blocks.1"])
    with pytest.raises(StageCutError, match="not in the model's forward order"):
        cut_graph(g, pp=3, microbatches=3, stage_boundaries=["blocks.5", "blocks.1"])
    with pytest.raises(StageCutError, match="cannot start a stage"):
        cut_graph(g, pp=2, microbatches=3, stage_boundaries=["wte"])
    assert isinstance(e.value, AutoparError) and isinstance(e.value, ValueError)
    with pytest.raises(StageCutError, match="only 11 units"):
        cut_graph(g, pp=12, microbatches=12)


def test_shared_schedules_give_the_same_cuts_and_too_deep_builds_none() -> None:
    """A pipeline choice cuts every depth under every recomputation mode with one `Schedules`:
    each schedule is built once, the cuts are those of fresh schedules, and a depth with more
    stages than units is refused before its schedule is built (ZB-V's took seconds at 1536 ranks)."""
    g = analysed(5)
    shared = Schedules()
    for name, v in (("1f1b", 1), ("zero-bubble", 2), ("interleaved-1f1b", 2)):
        for mode in ("none", "selective", "full"):
            fresh = cut_graph(g, pp=2, microbatches=4, v=v, schedule=name, recompute=mode)
            again = cut_graph(g, pp=2, microbatches=4, v=v, schedule=name, recompute=mode, schedules=shared)
            assert str(again) == str(fresh) and again.step_time == fresh.step_time
            assert again.rank_memory == fresh.rank_memory
    assert len(shared._built) == 3
    too_deep = Schedules()
    with pytest.raises(StageCutError, match="only 9 units"):
        cut_graph(g, pp=5, microbatches=8, v=2, schedule="zero-bubble", schedules=too_deep)
    assert not too_deep._built
    # argument errors come first, as before
    with pytest.raises(AutoparError, match="unknown pipeline schedule"):
        cut_graph(g, pp=50, microbatches=8, schedule="nope", schedules=too_deep)


# ------------------------------------------------------------------------------ memory limit


def test_memory_limit_moves_the_cut_or_raises() -> None:
    g = analysed(7, vocab_size=2048)
    free = cut_graph(g, pp=3, microbatches=6, memory_limit=math.inf)
    heaviest = max(range(3), key=lambda r: free.rank_memory[r])
    limit = free.rank_memory[heaviest] * 0.98
    tight = cut_graph(g, pp=3, microbatches=6, memory_limit=limit)
    assert tight.boundaries != free.boundaries
    assert max(tight.rank_memory) <= limit
    assert tight.max_stage_time >= free.max_stage_time  # memory is bought with time
    assert free.fits and tight.fits
    forced = cut_graph(g, pp=3, microbatches=6, memory_limit=limit, stage_boundaries=free.boundaries)
    assert not forced.fits and "OVER IT" in str(forced)  # a forced cut is reported, not refused
    # the default limit is 90 % of the table's device memory
    assert cut_graph(g, pp=3, microbatches=6).memory_limit == pytest.approx(
        0.9 * load_hardware(HW).memory_capacity
    )
    with pytest.raises(StageMemoryError, match="no cut into 3 stages fits") as e:
        cut_graph(g, pp=3, microbatches=6, memory_limit=limit / 10)
    assert isinstance(e.value, MemoryLimitError) and e.value.memory > e.value.limit == limit / 10
    assert e.value.hint is not None and "recomputation" in e.value.hint


def test_interleaved_memory_is_shared_by_a_ranks_stages() -> None:
    g = analysed(7, vocab_size=2048)
    free = cut_graph(g, pp=2, v=2, microbatches=4, schedule="interleaved-1f1b", memory_limit=math.inf)
    limit = max(free.rank_memory) * 1.5
    cut = cut_graph(g, pp=2, v=2, microbatches=4, schedule="interleaved-1f1b", memory_limit=limit)
    assert all(s.memory <= limit / 2 for s in cut.stages) and max(cut.rank_memory) <= limit


def test_unsplit_batch_dimension_assumption_scales_activations() -> None:
    g = analysed(7)
    two, four = cut_graph(g, pp=2, microbatches=2), cut_graph(g, pp=2, microbatches=4)
    for a, b in zip(two.stages, four.stages, strict=True):
        assert b.activation_bytes == pytest.approx(a.activation_bytes / 2)
        assert b.time == pytest.approx(a.time)  # per step: all microbatches


def test_slowed_cut_spreads_extra_time_by_compute_and_simulates_again() -> None:
    """A stage sub-mesh's extra time per step (`StageCut.slowed`, what the mesh choice with pipeline
    depths adds for the sub-mesh's collectives): spread over the stages in proportion to their
    compute, I/W parts alike, the step simulated again; no extra time leaves the cut as it is."""
    for schedule, v in (("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2)):
        cut = cut_graph(analysed(7, vocab_size=2048), pp=2, v=v, microbatches=4, schedule=schedule)
        assert cut.slowed(0.0) is cut
        extra = cut.total_time  # the sub-mesh doubles every stage's work
        slow = cut.slowed(extra)
        assert slow.total_time == pytest.approx(2 * cut.total_time)
        for before, after in zip(cut.stages, slow.stages, strict=True):
            assert (after.forward, after.backward, after.backward_input) == pytest.approx(
                (2 * before.forward, 2 * before.backward, 2 * before.backward_input)
            )
            assert (after.units, after.memory) == (before.units, before.memory)
        assert slow.boundaries == cut.boundaries and slow.rank_memory == cut.rank_memory
        # twice the compute, the same transfers: longer, but at most twice as long
        assert cut.makespan < slow.makespan <= 2 * cut.makespan * (1 + 1e-9)
