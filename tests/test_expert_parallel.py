"""Expert parallelism end to end, every rank's program in lockstep in one process against serial:
transformers' MixtralForCausalLM (8 experts, top 2), Qwen3MoeForCausalLM (8 experts, top 8) and
DeepseekV3ForCausalLM (8 routed experts, top 2 within 2 of 4 groups, one shared expert, a dense
first layer, latent attention) at their default settings (experts through `transformers::grouped_mm_fallback`), trained two
steps of SGD with momentum. Loss, every gradient and the parameters after each step equal
serial's, with the experts split over the ranks (weights Shard(0): each rank holds E/ep experts)
and with the search's own plan (which splits them too), on (8,), (2, 4) and (2, 2, 2)."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.fx as fx
import transformers.integrations.moe  # noqa: F401  (registers transformers' grouped-matmul ops)
from case_matrix import pairwise
from pass_fixtures import compile_every_rank, lockstep_step

import autopar
from autopar.compiler.driver import Compiled, compile_for_rank
from autopar.core.errors import ShardingError
from autopar.core.layout import D, R, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, info, set_info
from autopar.core.strategy import AxisStrategy, OpCall, Strategy
from autopar.reporting.experts import _parameter
from autopar.rules import expert_parallel
from autopar.rules.base import Requirement
from autopar.rules.matmul import library_op
from autopar.rules.registry import default_registry
from autopar.testing import assemble

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH, STEPS = 64, 16, 2, 2
GROUPED_MM = library_op("transformers", "grouped_mm_fallback")
GROUPED_MM_BACKWARD = library_op("transformers", "grouped_mm_fallback_backward")


def _mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.MixtralForCausalLM(config)


def _qwen3_moe() -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_experts=8,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def _deepseek_v3(moe_intermediate_size: int = 16) -> torch.nn.Module:
    """DeepSeek-V3 at its defaults, small: multi-head latent attention (low-rank q and kv), a
    dense first layer (`first_k_dense_replace=1`) then an MoE layer of 8 routed experts, top 2 of
    them chosen within the best 2 of 4 expert groups by a sigmoid router with its score-correction
    bias, and one shared expert beside it. (One MoE layer: a second one ran the same ops again;
    two MoE layers are trained in Mixtral's and Qwen3-MoE's cases.)"""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        max_position_embeddings=64,
    )
    return transformers.DeepseekV3ForCausalLM(config)


def _deepseek_v3_wide_experts() -> torch.nn.Module:
    """The same with each routed expert's MLP 64 wide (as the dense layer's): on this toy the
    experts must outweigh the tokens they are sent for the split to pay, and at 16 the search keeps
    them whole (by 0.6 % on (8,), 13 % on (2, 4), 3.5 % on (2, 2, 2) in element counts)."""
    return _deepseek_v3(moe_intermediate_size=64)


def _experts_only_registry() -> Any:
    """The default rules, but the grouped matmuls offer only the expert split on every axis: the
    plan must place E/ep experts on each rank."""
    registry = default_registry()
    rules = (
        (GROUPED_MM, expert_parallel.expert_split_forward),
        (GROUPED_MM_BACKWARD, expert_parallel.expert_split_backward),
    )
    for op, strategies in rules:
        rule = registry.get(op)
        assert rule is not None

        def only(call: OpCall, strategies: Any = strategies) -> list[AxisStrategy]:
            return list(strategies(call))

        registry.register(
            op, only, family=rule.family, localize=rule.localize, anchor=True, uneven=rule.uneven
        )
    return registry


def _inside_experts_registry() -> Any:
    """The default rules, but the grouped matmuls never split their experts (only inside them)."""
    registry = default_registry()
    for op in (GROUPED_MM, GROUPED_MM_BACKWARD):
        rule = registry.get(op)
        assert rule is not None

        def inside(call: OpCall, strategies: Any = rule.strategies) -> list[AxisStrategy]:
            return [s for s in strategies(call) if s.inputs[1] != Shard(expert_parallel.EXPERT_DIM)]

        registry.register(
            op, inside, family=rule.family, localize=rule.localize, anchor=rule.anchor, uneven=rule.uneven
        )
    return registry


def _full_grads(compiled: dict, bwd: dict, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Every user parameter's gradient assembled from the ranks' blocks (a fused parameter's parts
    concatenated back along their cut dim)."""
    first = next(iter(compiled.values())).program
    parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    grads: dict[str, torch.Tensor] = {}
    for i, (name, layout) in enumerate(zip(first.param_names, first.param_layouts)):
        if name in first.constants or bwd[next(iter(bwd))][i] is None:  # a buffer or a constant
            continue
        full = assemble({c: bwd[c][i] for c in bwd}, layout, shape, atol=1e-4, rtol=1e-4)
        part = first.param_parts.get(name)
        if part is None:
            grads[name] = full
        else:
            parts.setdefault(part.source, []).append((part.index, part.dim, full))
    for source, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        grads[source] = torch.cat([p[2] for p in pieces], dim=pieces[0][1])
    return grads


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, atol=max(2e-5, 1e-4 * scale), rtol=1e-4, msg=what)


def _batch(seed: int, padded: bool) -> dict[str, torch.Tensor]:
    """input_ids and labels; with `padded`, an attention mask whose second sequence ends in padding
    (labels -100 there), as a user's batch of unequal lengths."""
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    if not padded:
        return {"input_ids": ids, "labels": ids}
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 5 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train_like_serial(make: Any, shape: tuple[int, ...], padded: bool = False, **options: Any) -> dict:
    """Compile for every rank of `shape`, then STEPS steps of SGD with momentum in lockstep against
    the serial model: loss (and the router's auxiliary loss where the model returns one), every
    gradient, every parameter after each step."""
    torch.manual_seed(0)
    model = make()
    serial = copy.deepcopy(model)
    compiled = compile_every_rank(model, shape, (), _batch(1, padded), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        step_kwargs = _batch(10 + step, padded)
        fwd, bwd = lockstep_step(compiled, model, shape, (), step_kwargs)
        torch.manual_seed(0)
        out = serial(**step_kwargs)
        want = out.loss
        want.backward()
        aux = getattr(out, "aux_loss", None)
        for c in fwd:
            _close(fwd[c][0], want.detach(), f"loss of step {step} on {c}")
            if aux is not None:  # the program's second output, as the model's output lists them
                _close(fwd[c][1], aux.detach(), f"router auxiliary loss of step {step} on {c}")
        grads = _full_grads(compiled, bwd, shape)
        for name, p in serial.named_parameters():
            assert p.grad is not None and name in grads, name
            _close(grads[name], p.grad, f"gradient of {name}, step {step}")
        for name, p in model.named_parameters():
            p.grad = grads[name]
        opt.step()
        serial_opt.step()
        opt.zero_grad(set_to_none=True)
        serial_opt.zero_grad(set_to_none=True)
        for (name, p), q in zip(model.named_parameters(), serial.parameters()):
            _close(p.detach(), q.detach(), f"{name} after step {step}")
    return compiled


def _expert_weight_layouts(compiled: dict) -> dict[str, str]:
    first: Compiled = next(iter(compiled.values()))
    program = first.program
    return {
        name: str(layout)
        for name, layout in zip(program.param_names, program.param_layouts)
        if ".mlp.experts." in name
    }


CASES = [
    (_mixtral, (8,)),
    (_mixtral, (2, 4)),
    (_qwen3_moe, (8,)),
    (_qwen3_moe, (2, 4)),
    (_deepseek_v3, (8,)),
    (_deepseek_v3, (2, 4)),
    (_mixtral, (2, 2, 2)),
    (_qwen3_moe, (2, 2, 2)),
    (_deepseek_v3, (2, 2, 2)),
]
IDS = [
    "mixtral-8",
    "mixtral-2x4",
    "qwen3moe-8",
    "qwen3moe-2x4",
    "deepseek-v3-8",
    "deepseek-v3-2x4",
    "mixtral-2x2x2",
    "qwen3moe-2x2x2",
    "deepseek-v3-2x2x2",
]


@pytest.mark.parametrize(("make", "shape"), CASES, ids=IDS)
def test_experts_split_over_the_ranks_train_like_serial(make: Any, shape: tuple[int, ...]) -> None:
    """Each rank holds one of the 8 experts of every layer (weights Shard(0) on every axis), every
    grouped matmul multiplies only its expert's rows, and the ranks' partial sums add up to serial."""
    compiled = _train_like_serial(make, shape, registry=_experts_only_registry())
    layouts = _expert_weight_layouts(compiled)
    assert layouts, "the model's experts are parameters of the program"
    placements = "[" + ", ".join(["S(0)"] * len(shape)) + "]"
    assert all(lay == placements for lay in layouts.values()), layouts
    graph = next(iter(compiled.values())).graph.graph
    mms = [n for n in graph.nodes if n.target in (GROUPED_MM, GROUPED_MM_BACKWARD)]
    config = make().config
    moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    assert moe_layers in (1, 2) and {name.split(".mlp.")[0] for name in layouts} == {
        f"model.layers.{i}" for i in range(config.num_hidden_layers - moe_layers, config.num_hidden_layers)
    }, layouts
    assert len(mms) == 4 * moe_layers, "two grouped matmuls per MoE layer, forward and backward"


def _with_router_loss(make: Any) -> Any:
    """The model with its router's load-balancing loss on (`output_router_logits`, as users train
    MoE models), weighted 0.02 as Mixtral was trained (transformers' default 0.001 would hide an
    error in it below the tolerance)."""

    def make_with_loss() -> torch.nn.Module:
        model = make()
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = 0.02
        return model

    return make_with_loss


@pytest.mark.parametrize(
    ("make", "shape", "forced", "padded"),
    [(_mixtral, (2, 2), False, True), (_qwen3_moe, (4,), True, False)],
    ids=["mixtral-2x2-search-padded", "qwen3moe-4-forced"],
)
def test_router_auxiliary_loss_trains_like_serial(
    make: Any, shape: tuple[int, ...], forced: bool, padded: bool
) -> None:
    """With `output_router_logits=True` the loss includes the router's load-balancing loss (the
    routing probabilities and top-k counts of every layer, over all tokens: a padded batch weighs
    them by its attention mask) and the model returns it as `aux_loss`. With the experts split
    (the search's own plan at the defaults, or forced) the loss, the auxiliary loss, every gradient
    (the routers' get the auxiliary loss's too) and the parameters after 2 steps equal serial's."""
    options = {"registry": _experts_only_registry()} if forced else {}
    compiled = _train_like_serial(_with_router_loss(make), shape, padded=padded, **options)
    program = next(iter(compiled.values())).program
    assert program.output_layouts[1].shape == (), "the auxiliary loss is the program's second output"
    placements = "[" + ", ".join(["S(0)"] * len(shape)) + "]"
    layouts = _expert_weight_layouts(compiled)
    assert layouts and all(lay == placements for lay in layouts.values()), layouts


# each model and each mesh once (all 9 pairs with AUTOPAR_FULL_MATRIX=1: tests/case_matrix.py)
SEARCH_MODELS = {"mixtral": _mixtral, "qwen3moe": _qwen3_moe, "deepseek-v3": _deepseek_v3_wide_experts}
SEARCH_PAIRS = pairwise(list(SEARCH_MODELS), [(8,), (2, 4), (2, 2, 2)])
SEARCH_CASES = [(SEARCH_MODELS[name], shape) for name, shape in SEARCH_PAIRS]
SEARCH_IDS = [f"{name}-{'x'.join(map(str, shape))}" for name, shape in SEARCH_PAIRS]


@pytest.mark.parametrize(("make", "shape"), SEARCH_CASES, ids=SEARCH_IDS)
def test_search_chooses_the_expert_split_and_trains_like_serial(make: Any, shape: tuple[int, ...]) -> None:
    """Issue 35 item 4: at the defaults (no registry, no dispatcher asked for), as a user who calls
    `parallelize` gets it, the search itself splits the experts over every axis of (8,), (2, 4) and
    (2, 2, 2) (element counts: its cheapest plan with them split below its cheapest keeping them
    whole, docs/expert-parallel.md), the summary names those axes first among the placements it
    priced, each rank holds 1 of the 8 experts, and the loss, every gradient and every parameter
    after 2 SGD-momentum steps equal serial's (8 to 21 CPU s each). DeepSeek-V3 (top 2 of 2
    groups, shared expert, its router's loss-free balancing) with its experts 64 wide."""
    compiled = _train_like_serial(make, shape)
    experts = next(iter(compiled.values())).report.experts
    axes = tuple("xyz"[: len(shape)])
    assert experts is not None and experts.axes == axes and experts.axes_costs[0][0] == axes, experts
    assert dict(experts.axes_costs)[()] > experts.axes_costs[0][1], "whole experts priced, and dearer"
    assert experts.weight_bytes_local * 8 == experts.weight_bytes_total
    layouts = _expert_weight_layouts(compiled)
    placements = "[" + ", ".join(["S(0)"] * len(shape)) + "]"
    assert layouts and all(lay == placements for lay in layouts.values()), layouts


def _compile_rank0(make: Any, shape: tuple[int, ...], **options: Any) -> Compiled:
    torch.manual_seed(0)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mesh = Mesh.from_shape(shape)
    return compile_for_rank(make(), mesh, (), example_kwargs={"input_ids": ids, "labels": ids}, **options)


def _between(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    """The nodes on some path from `first` to `last` (both excluded)."""
    after: set[fx.Node] = set()
    todo = list(first.users)
    while todo:
        n = todo.pop()
        if n not in after and n is not last:
            after.add(n)
            todo.extend(n.users)
    before: set[fx.Node] = set()
    todo = list(last.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in before and n is not first:
            before.add(n)
            todo.extend(n.all_input_nodes)
    return [n for n in last.graph.nodes if n in after and n in before]


LOCAL_CASES = [
    (_mixtral, (8,), True),
    (_qwen3_moe, (8,), True),
    (_mixtral, (2, 4), True),
    (_qwen3_moe, (2, 4), True),
    (_mixtral, (2, 4), False),
]


@pytest.mark.parametrize(
    ("make", "shape", "forced"),
    LOCAL_CASES,
    ids=["mixtral-8", "qwen3moe-8", "mixtral-2x4", "qwen3moe-2x4", "mixtral-2x4-search"],
)
def test_expert_split_keeps_each_rank_rows_local_through_the_expert_mlp(
    make: Any, shape: tuple[int, ...], forced: bool
) -> None:
    """Expert split (forced, or the search's own choice at the defaults on (2, 4)): the up
    projection's output is row-disjoint (D) on every axis, the gate runs on it, the down projection
    takes it as D, and no collective sits between the two grouped matmuls of a layer (forward).
    The only reduction left in the expert MLP is the down projection's output. (Before the greedy
    pass stopped charging a carried D as a new pending sum, the plan on (2, 4) reduce-scattered the
    up projection's rows over the second axis before the gate.)"""
    options = {"registry": _experts_only_registry()} if forced else {}
    compiled = _compile_rank0(make, shape, **options)
    placements = "[" + ", ".join(["S(0)"] * len(shape)) + "]"
    layouts = _expert_weight_layouts({0: compiled})
    assert layouts and all(lay == placements for lay in layouts.values()), layouts
    compiled = _compile_rank0(make, shape, registry=_experts_only_registry())
    graph = compiled.graph.graph
    forward = [n for n in graph.nodes if n.target == GROUPED_MM]
    assert len(forward) == 4, "two layers, two grouped matmuls each"
    disjoint = "[" + ", ".join(["D"] * len(shape)) + "]"
    for up, down in zip(forward[0::2], forward[1::2]):
        assert str(info(up).layouts[0]) == disjoint and str(info(down).strategy.inputs[0]) == disjoint
        path = _between(up, down)
        ops = {str(n.target) for n in path}
        assert any("silu" in op for op in ops), ops  # the gate runs between them
        assert not [n for n in path if "c10d" in str(n.target)], ops
    collectives = compiled.report.collectives
    assert collectives, "the down projection's output and the gradients are still reduced"


def test_row_disjoint_values_of_different_owners_are_refused() -> None:
    """A plan whose two grouped matmuls split the experts differently (up: over both axes, down:
    over the second only) would hand the down projection rows owned by other ranks on that axis:
    the owner check refuses it with an error naming the op, never runs it."""
    registry = default_registry()
    hidden = 32

    def admits(call: OpCall, strategy: Strategy) -> bool:
        weight = strategy.inputs[1].placements
        if call.inputs[1].shape[2] == hidden:  # the down projection: experts on axis 1 only, D rows there
            return weight == (R, Shard(0)) and strategy.inputs[0].placements[1] == D
        return weight == (Shard(0), Shard(0))

    registry.require(GROUPED_MM, Requirement(admits, "a test's mismatched expert splits"))
    with pytest.raises(ShardingError, match="wrong numbers") as caught:
        _compile_rank0(_mixtral, (2, 2), registry=registry)
    assert "grouped_mm_fallback" in str(caught.value)


def test_search_is_seeded_with_the_expert_split() -> None:
    """The search starts from an expert-split plan too (`search_seeds.expert_seeds`), with the
    down projection taking the gate's row-disjoint output: priced like the other seeds (no
    forbidden redistribution to D in it), and searched from."""
    compiled = _compile_rank0(_mixtral, (8,))
    report = compiled.graph.meta["autopar_search"]
    assert {"experts", "experts:R"} <= set(report.seeds), report.seeds
    best_role_seed = min(v for k, v in report.seeds.items() if ":" not in k and k not in ("experts",))
    assert report.seeds["experts"] < 2 * best_role_seed, report.seeds
    assert report.seeds["experts"] <= report.seeds["experts:R"], report.seeds


def test_plan_summary_names_the_expert_axes_and_why() -> None:
    """The search's plan on (2, 4) in element counts splits the experts over both axes: the
    summary says which mesh axes hold them, how many each rank holds, their bytes, and the search's
    prices with and without the split."""
    compiled = _compile_rank0(_mixtral, (2, 4))
    summary = str(compiled.report)
    line = next(text for text in summary.splitlines() if text.startswith("experts split"))
    assert line.startswith(
        "experts split over mesh axes x (2) and y (4): each rank holds 1 of the 8 experts (E/8) "
        "of 2 MoE layers (model.layers.0.mlp.experts, model.layers.1.mlp.experts)"
    ), line
    experts = compiled.report.experts
    assert experts is not None and experts.split_cost is not None and experts.whole_cost is not None
    assert experts.split_cost < experts.whole_cost, "the search keeps the cheaper plan"
    assert f"costs {experts.split_cost:.4g} elements against {experts.whole_cost:.4g}" in line, line
    assert experts.weight_bytes_local * 8 == experts.weight_bytes_total
    collectives = compiled.report.collectives
    assert experts.comm_bytes == sum(c.bytes for c in collectives if ".mlp.experts" in c.module_path)
    assert f"send {experts.comm_bytes / 1e6:.3f} MB per rank per step" in line
    # both token dispatchers priced for the same 2 layers, 32 tokens of 32 values, top 2, over the
    # 8 expert ranks (4 tokens each), fp32: the all-gather one gathers the routing (64 int64 ids)
    # and the tokens, reduce-scatters the output, and the same on the gradients; the all-to-all one
    # exchanges 8 counts, then only the 4 x 2 routed rows each way, twice
    gather = 2 * (7 / 8 * 64 * 8 + 4 * 7 / 8 * 32 * 32 * 4)
    to_all = 2 * (7 / 8 * 8 * 8 + 4 * 7 / 8 * 4 * 2 * 32 * 4)
    assert experts.dispatch_bytes == pytest.approx((gather, to_all))
    assert f"all-gather {gather / 1e6:.3f} MB, all-to-all {to_all / 1e6:.3f} MB per rank per step" in line


def test_plan_summary_prices_each_placement_of_the_experts() -> None:
    """The search starts from the experts split over every axis and from the cheapest split over
    one axis alone, beside the plans keeping them whole; the summary lists its cheapest plan for
    each placement it reached, cheapest first, and the plan holds the experts on the first. On
    (2, 2) in element counts Qwen3-MoE's experts go over both axes (x alone costs more than
    keeping them whole); on (2, 2, 2) over all three (5.414e4 elements against 6.531e4 whole,
    8.558e4 over x alone; the search reaches that plan since the loss's [sum, count] pair and
    the per-collective tie-breaker `search_cost.CALL_ELEMENTS` came in, before them whole won)."""
    for shape, chosen in (((2, 2), ("x", "y")), ((2, 2, 2), ("x", "y", "z"))):
        experts = _compile_rank0(_qwen3_moe, shape).report.experts
        assert experts is not None and experts.axes == chosen, experts
        costs = dict(experts.axes_costs)
        assert () in costs and tuple("xyz"[: len(shape)]) in costs, costs
        assert any(len(axes) == 1 for axes in costs), "a split over one axis alone was searched"
        assert experts.axes_costs[0][0] == chosen, experts.axes_costs
        assert [c for _, c in experts.axes_costs] == sorted(costs.values())
        shown = ", ".join(f"{' and '.join(a) if a else 'whole on every rank'} {c:.4g}" for a, c in experts.axes_costs)
        assert str(experts).endswith(f"by the mesh axes holding the experts, its cheapest plans cost: {shown}")


def test_explain_says_why_the_experts_are_not_split() -> None:
    """`autopar.plan` (H100 table) of the toy Mixtral with the grouped matmuls offered only splits
    inside the experts: the summary and `explain` of a grouped matmul say that every rank holds
    every expert, and why."""
    torch.manual_seed(0)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    result = autopar.plan(
        _mixtral(),
        (2, 4),
        (),
        example_kwargs={"input_ids": ids, "labels": ids},
        planning=autopar.PlanOptions(registry=_inside_experts_registry()),
    )
    experts = result.compiled.report.experts
    assert experts is not None and experts.axes == () and experts.split_cost is None
    line = str(experts)
    assert line.startswith("experts not split: every rank holds all 8 experts of 2 MoE layers"), line
    assert line.endswith("the search found no plan with them split"), line
    assert line in str(result).splitlines()
    grouped = next(n for n in result.compiled.graph.graph.nodes if n.target == GROUPED_MM)
    assert result.explain(grouped.name).splitlines()[-1] == f"  {line}"


def test_the_experts_line_finds_a_weight_read_through_a_relayout() -> None:
    """An expert weight stored in one split and used in another reaches the grouped matmul through
    its relayout: an all-gather's chunks put back in order by a `cat` of several inputs, all made
    from the one parameter (toy Mixtral, (2, 2, 2), token_dispatch="alltoall": stored
    [S(0), S(1), S(0)], used [S(0), R, S(0)]). The summary's expert weights were 0.000 MiB of
    0.000 MiB when the walk back to the parameter stopped at the `cat`; a value made from the
    weight and another placeholder names no parameter."""
    graph = fx.Graph()
    weight, other = graph.placeholder("w"), graph.placeholder("x")
    set_info(weight, NodeInfo(role="param", phase="forward", param_name="layers.0.experts.down_proj"))
    set_info(other, NodeInfo(role="input", phase="forward"))
    gathered = graph.call_function(torch.ops.aten.split.Tensor, (weight, 2, 1))
    chunks = [graph.call_function(getattr, (gathered, "__getitem__")) for _ in range(2)]
    whole = graph.call_function(torch.ops.aten.cat.default, (chunks, 1))
    mixed = graph.call_function(torch.ops.aten.mul.Tensor, (whole, other))
    assert _parameter(whole) == "layers.0.experts.down_proj"
    assert _parameter(graph.call_function(torch.ops.aten.view.default, (whole, [-1]))) == "layers.0.experts.down_proj"
    assert _parameter(mixed) is None
