"""The all-to-all token dispatcher in compiled plans (`autopar.rules.routed_experts`): each experts
module traced as one `autopar::routed_experts` op whose local call exchanges the routed rows.

- the op's four per-axis strategies against the serial layer on thread ranks, random routings
  (hot and cold experts included), float64;
- transformers' MixtralForCausalLM at its defaults (8 experts, top 2) with
  `token_dispatch="alltoall"` on (4,) and (2, 2): loss, every gradient and every parameter after 2
  SGD-momentum steps equal serial, and the plan holds the op with its experts and tokens split
  on one axis, and no collective on the tokens it takes;
- `token_dispatch="auto"` prices both dispatchers and picks the all-to-all one where it sends less.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.fx as fx
from test_expert_parallel import (
    _compile_rank0,
    _deepseek_v3,
    _expert_weight_layouts,
    _experts_only_registry,
    _mixtral,
    _qwen3_moe,
    _train_like_serial,
)

from autopar.compiler.driver import compile_for_rank
from autopar.compiler.pricing import price
from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.core.strategy import OpCall, Strategy
from autopar.cost.dispatch import LOSS_FREE_ROUTING_IMBALANCE, ROUTING_IMBALANCE, routing_imbalance
from autopar.planning.search_cost import ElementCost
from autopar.rules import routed_experts
from autopar.rules.base import Requirement, RuleRegistry
from autopar.rules.registry import default_registry
from examples.models import make_mlp

c10d = torch.ops._c10d_functional
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_an_activation_the_op_lacks_is_refused_by_name() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(AutoparError, match="activation 'tanh'"):
        routed_experts.experts_forward(
            x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), torch.zeros(2, 4, 3), torch.zeros(2, 3, 2),
            "tanh", 0, routed_experts.SingleExchange(),
        )


def _routed_nodes(compiled) -> list:  # type: ignore[no-untyped-def]
    graph = next(iter(compiled.values())).graph.graph if isinstance(compiled, dict) else compiled.graph.graph
    return [n for n in graph.nodes if n.op == "call_function" and n.target in routed_experts.ROUTED_OPS]


def _assert_all_to_all_plan(compiled, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    nodes = _routed_nodes(compiled)
    assert len(nodes) == 4, "two MoE layers, one forward and one backward op each"
    graph = next(iter(compiled.values())).graph.graph
    assert not [n for n in graph.nodes if "grouped_mm" in str(n.target)], "no traced grouped matmul is left"
    for node in nodes:
        strategy = info(node).strategy
        assert strategy is not None
        axis = routed_experts.all_to_all_axis(node.target, strategy)
        assert axis is not None, f"{node.name} uses the all-to-all dispatcher: {strategy}"
        tokens = node.args[1] if node.target is routed_experts.ROUTED_EXPERTS_BACKWARD else node.args[0]
        # the tokens reach the op split over the experts' axis: no all-gather of them there
        assert not _gathered(tokens, axis), f"{node.name} takes tokens gathered over the experts' axis"


def _gathered(node: fx.Node, axis: int) -> bool:
    """Whether an all-gather over mesh axis `axis` feeds `node` through the nodes insert_comm
    added before it."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.target is c10d.all_gather_into_tensor.default:
            step = info(n).comm
            if step is not None and step.axis == axis:
                return True
        if has_info(n) and info(n).role == "comm":
            todo.extend(n.all_input_nodes)
    return False


# layer 0's router logits are COLD * (u . h) for one direction u: a token picks experts 0 and 1
# (u . h > 0) or 6 and 5 (u . h < 0), so experts 2, 3, 4 and 7 get no row, and on 4 ranks rank 1
# (experts 2 and 3) receives nothing while ranks 0 and 3 receive every row
COLD = torch.tensor([5.0, 4.0, -1.0, -2.0, -3.0, -4.0, -5.0, 0.0])


def _mixtral_with_cold_experts() -> torch.nn.Module:
    model = _mixtral()
    with torch.no_grad():
        router = model.model.layers[0].mlp.gate.weight
        direction = torch.randn(router.shape[1], generator=torch.Generator().manual_seed(3))
        router.copy_(torch.outer(COLD, direction))
    return model


def _mixtral_with_a_hot_expert() -> torch.nn.Module:
    """Every token's first choice in layer 0 is expert 0: the embeddings share one direction v
    (as large as their own parts) and the router's row for expert 0 is 5 v, far above the others'
    logits. The second choices spread over a few experts; experts 1 to 4 get (nearly) none."""
    model = _mixtral()
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        direction = torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(4))
        direction /= direction.norm()
        embeddings.add_(embeddings.norm(dim=1).mean() * direction)
        model.model.layers[0].mlp.gate.weight[0] = 5.0 * direction
    return model


def _routed_ids(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Layer 0's top-k expert indices of the model's forward on `batch`."""
    seen: list[torch.Tensor] = []
    hook = model.model.layers[0].mlp.experts.register_forward_hook(lambda m, a, out: seen.append(a[1]))
    try:
        with torch.no_grad():
            model(input_ids=batch)
    finally:
        hook.remove()
    return seen[0]


def test_the_steered_router_leaves_experts_without_tokens() -> None:
    """(What the cold-experts case below trains on: its first step's batch.)"""
    torch.manual_seed(0)
    ids = _routed_ids(_mixtral_with_cold_experts(), torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(10)))
    assert set(ids.unique().tolist()) == {0, 1, 5, 6}, ids.unique()


@pytest.mark.parametrize(
    ("make", "shape"), [(_mixtral_with_cold_experts, (4,)), (_mixtral, (2, 2))], ids=["4-cold-experts", "2x2"]
)
def test_mixtral_with_the_all_to_all_dispatcher_trains_like_serial(make: Any, shape: tuple[int, ...]) -> None:
    """MixtralForCausalLM at its defaults (8 experts, top 2), token_dispatch="alltoall": two steps
    of SGD with momentum equal serial, and the plan exchanges tokens inside the op. On (4,) layer
    0's router is steered so that half the experts get no token (one rank receives no row, two
    receive all); on (2, 2) the tiny batch routes unevenly by itself."""
    compiled = _train_like_serial(make, shape, token_dispatch="alltoall")
    _assert_all_to_all_plan(compiled, shape)


@pytest.mark.parametrize("all_to_all", [True, False], ids=["alltoall", "allgather"])
def test_a_hot_expert_trains_like_serial_with_each_dispatcher(all_to_all: bool) -> None:
    """Issue 35 item 2's imbalance, one expert getting most tokens: layer 0 routes every token to
    expert 0 first (on (4,) rank 0 receives at least half of the 64 (token, choice) rows of each batch,
    rank 1 none). Dropless with each dispatcher: the all-to-all one inside the routed-experts op,
    and the all-gather one over the traced grouped matmuls with the experts forced split (2 of the
    8 per rank). Loss, every gradient and every parameter after 2 SGD-momentum steps equal serial."""
    for seed in (1, 10, 11):  # the compile's batch and the two steps' (test_expert_parallel._batch)
        torch.manual_seed(0)  # the model _train_like_serial makes
        ids = _routed_ids(_mixtral_with_a_hot_expert(), torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(seed)))
        per_rank = torch.bincount(ids.flatten() // 2, minlength=4).tolist()
        assert (ids[:, 0] == 0).all() and per_rank[0] >= 32 and per_rank[1] == 0, per_rank
    if all_to_all:
        compiled = _train_like_serial(_mixtral_with_a_hot_expert, (4,), token_dispatch="alltoall")
        _assert_all_to_all_plan(compiled, (4,))
    else:
        compiled = _train_like_serial(_mixtral_with_a_hot_expert, (4,), registry=_experts_only_registry())
        layouts = _expert_weight_layouts(compiled)
        assert layouts and set(layouts.values()) == {"[S(0)]"}, layouts


def test_all_to_all_forced_on_a_model_without_experts_is_refused() -> None:
    model, inputs = make_mlp(0)
    with pytest.raises(AutoparError, match="no experts module"):
        compile_for_rank(model, Mesh.from_shape((2,)), inputs, token_dispatch="alltoall")


@pytest.mark.parametrize(
    ("shape", "imbalance", "wanted"),
    [((4,), 1.0, "all-gather"), ((4,), ROUTING_IMBALANCE, "all-gather"), ((2,), 1.0, "all-gather")],
    ids=["4-balanced", "4-published-imbalance", "2-balanced"],
)
def test_auto_prices_both_dispatchers_and_picks_the_cheaper(
    shape: tuple[int, ...], imbalance: float, wanted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """token_dispatch="auto" on the toy Mixtral (top 2), element counts: the search prices the
    cheapest whole plan with each dispatcher and keeps the cheaper. On 2 ranks the all-to-all
    moves as many rows as the all-gather in forward and more in backward; at the published
    imbalance (`cost.dispatch.ROUTING_IMBALANCE`, the planners' default: the busiest rank receives
    1.52 times the mean rows) its rows grow by that factor. With routing spread evenly on 4 ranks
    the all-to-all moves k/ep = 1/2 of the all-gather's rows (0.012 against 0.025 MB per rank per
    step), but the plans around them differ: the search from the 1-D Megatron seed ends at
    31570.7 elements dispatching by all-gather, the cheapest plan dispatching by all-to-all
    (searched from the tensor-role seed) at 31677.5, so the all-gather wins there too. The
    experts line says which and the search's price of each."""
    monkeypatch.setattr(ElementCost, "routing_imbalance", imbalance)
    compiled = _compile_rank0(_mixtral, shape, token_dispatch="auto")
    nodes = _routed_nodes(compiled)
    assert len(nodes) == 4
    axes = {routed_experts.all_to_all_axis(n.target, info(n).strategy) for n in nodes}
    assert axes == ({0} if wanted == "all-to-all" else {None}), axes
    experts = compiled.report.experts
    assert experts is not None and experts.dispatcher == wanted
    costs = dict(experts.dispatcher_costs)
    assert set(costs) == {"all-to-all", "all-gather"}, costs
    assert min(costs, key=costs.__getitem__) == wanted, costs
    assert f"the plan dispatches tokens by {wanted}" in str(experts)


def test_the_routing_imbalance_follows_the_router() -> None:
    """DeepSeek-V3's router balances by a score-correction bias (no auxiliary loss), whose busiest
    expert measures 1.04 times the mean, Mixtral's and Qwen3-MoE's by an auxiliary loss (1.52):
    `cost.dispatch.routing_imbalance`. The trace records the model's figure on every routed-experts
    node, the compiled program's nodes keep it, and the lowered plan's pricing charges it: the
    same program priced with the auxiliary-loss figure on its nodes costs more compute (the toy
    layer's experts are a sliver of its step, so by little)."""
    assert routing_imbalance(_deepseek_v3()) == LOSS_FREE_ROUTING_IMBALANCE
    assert routing_imbalance(_mixtral()) == routing_imbalance(_qwen3_moe()) == ROUTING_IMBALANCE
    compiled = _compile_rank0(_deepseek_v3, (4,), token_dispatch="alltoall", priced=True)
    assert [routed_experts.node_routing_imbalance(n) for n in _routed_nodes(compiled)] == [1.04] * 2  # one MoE layer
    program = [
        n
        for gm in (compiled.program.forward, compiled.program.backward)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in routed_experts.ROUTED_OPS
    ]
    assert [routed_experts.node_routing_imbalance(n) for n in program] == [1.04] * 2
    mesh = Mesh.from_shape((4,))
    loss_free = price(compiled, mesh, "h100-nvlink-ib", "search").compute_time
    for node in _routed_nodes(compiled):  # the lowered graph, which the pricing reads
        node.meta[routed_experts.IMBALANCE_META] = ROUTING_IMBALANCE
    assert price(compiled, mesh, "h100-nvlink-ib", "search").compute_time > loss_free


def experts_placed(axes: tuple[int, ...], all_to_all: bool | None = None) -> RuleRegistry:
    """The default rules with every routed-experts op's experts over exactly `axes` (none: whole)
    and, where `all_to_all` says, the tokens exchanged inside the op over them (or gathered)."""
    registry = default_registry().copy()

    def admits(call: OpCall, s: Strategy) -> bool:
        exchanged = bool(routed_experts.all_to_all_axes(call.op, s))
        return routed_experts.expert_axes(call.op, s) == axes and all_to_all in (None, exchanged)

    for op in routed_experts.ROUTED_OPS:
        registry.require(op, Requirement(admits, f"experts over mesh axes {axes}"))
    return registry


@pytest.mark.parametrize(
    ("make", "shape", "all_to_all"),
    [
        (_mixtral_with_cold_experts, (2, 2), True),
        (_mixtral, (2, 2), False),
        (_mixtral_with_cold_experts, (2, 2, 2), True),
        (_mixtral_with_cold_experts, (2, 2, 2), False),
    ],
    ids=["2x2-alltoall-cold", "2x2-allgather", "2x2x2-alltoall-cold", "2x2x2-allgather-cold"],
)
def test_experts_over_several_mesh_axes_train_like_serial(make: Any, shape: tuple[int, ...], all_to_all: bool) -> None:
    """Issue 35: Mixtral's experts split over every axis of (2, 2) (each rank holding 2 of the 8,
    rank (i, j) block 2i + j) and of (2, 2, 2) (one expert per rank, rank (i, j, l) expert
    4i + 2j + l), trained in lockstep against serial (loss, every gradient, every parameter after 2
    SGD-momentum steps), with each dispatcher: the all-to-all exchanging the tokens over the axes'
    groups as one inside the op (`token_dispatch.axes_exchange`), and the all-gather (the tokens
    whole on every axis, the outputs summed over all). Layer 0's router steered so that experts 2,
    3, 4 and 7 get no token: on (2, 2) rank (0, 1) receives no row, on (2, 2, 2) four ranks hold an
    expert without tokens. The experts line names every axis."""
    axes = tuple(range(len(shape)))
    compiled = _train_like_serial(
        make, shape, registry=experts_placed(axes, all_to_all), token_dispatch="auto" if not all_to_all else "alltoall"
    )
    nodes = _routed_nodes(compiled)
    assert len(nodes) == 4, "two MoE layers, one forward and one backward op each"
    for node in nodes:
        strategy = info(node).strategy
        assert strategy is not None and routed_experts.expert_axes(node.target, strategy) == axes
        assert routed_experts.all_to_all_axes(node.target, strategy) == (axes if all_to_all else ())
    program = next(iter(compiled.values())).program
    local = [n for gm in (program.forward, program.backward) for n in gm.graph.nodes if n.target in routed_experts.ROUTED_OPS]
    assert [routed_experts.exchange_axes(n.args) for n in local] == [axes if all_to_all else ()] * 4
    layouts = {name: str(lay) for name, lay in zip(program.param_names, program.param_layouts) if ".experts." in name}
    assert layouts and set(layouts.values()) == {"[" + ", ".join(["S(0)"] * len(shape)) + "]"}, layouts
    line = next(iter(compiled.values())).report.experts
    assert line is not None and line.axes == ("x", "y", "z")[: len(shape)], line
    assert f"the plan dispatches tokens by {'all-to-all' if all_to_all else 'all-gather'}" in str(line)


def test_the_search_puts_the_experts_over_three_axes_and_trains_like_serial() -> None:
    """On (2, 2, 2) with token_dispatch="auto" (element counts, the published routing imbalance)
    the search's own plan holds one of Mixtral's 8 experts per rank, over x, y and z, with the
    all-gather dispatcher (its cheapest plan 2.48e4 elements against 5.746e4 with the all-to-all;
    with the experts over at most two axes it was 4.25e4, over x and z), trains like serial in
    lockstep, and `plan_summary()`'s experts line says so."""
    compiled = _train_like_serial(_mixtral, (2, 2, 2), token_dispatch="auto")
    for node in _routed_nodes(compiled):
        assert routed_experts.expert_axes(node.target, info(node).strategy) == (0, 1, 2), node.name
    report = next(iter(compiled.values())).report
    line = report.experts
    assert line is not None and line.axes == ("x", "y", "z") and line.ranks == 8, line
    assert dict(line.dispatcher_costs)[line.dispatcher] == min(dict(line.dispatcher_costs).values()), line
    summary = str(report)
    assert "experts split over mesh axes x (2) and y (2) and z (2): each rank holds 1 of the 8 experts" in summary
