"""Seeds of the plan search from the fixed schemes: 1-D Megatron, 2-D SUMMA, the 3-D cube and its
letters on three unequal axes (the 3-D grid of AxoNN / Tensor3D), and from the expert split of mixture-of-experts layers (`expert_seeds`).

The search starts from the cheapest of its seeds and only improves on it, so a fixed scheme that
lays out on the search's own mesh is a seed too: its plan (`autopar.planning.fixed`: the paired
linears forced to the scheme, the rest laid out by the greedy pass) is priced like the greedy plans
of the axis roles. Only schemes whose mesh is the search's mesh (unit axes aside: (1, 8, 8) takes
the 8x8 grids of 2-D) can seed it; a graph without paired linears has none. Each order of the
3-D cube and grid seeds twice: its linears alone, and with attention and the residual stream laid
out as the scheme's closed form has them (`_grid_attention_seed`).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError, ShardingError
from autopar.core.layout import Partial, Placement, R, RowDisjoint, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.planning.fixed import (
    GRID_3D,
    SEED_SCHEMES,
    Linear,
    Scheme,
    find_linears,
    forced_strategies,
    pair_linears,
    variants_on,
)
from autopar.planning.greedy import greedy_plan
from autopar.planning.greedy_roles import axis_roles
from autopar.planning.greedy_scores import GreedyMemo
from autopar.rules import expert_parallel, routed_experts
from autopar.rules.base import RuleRegistry
from autopar.rules.calls import expand_cached, op_call, tensor_inputs
from autopar.rules.context_parallel import BACKWARD, FORWARD, SEQ

PREFIX = "fixed:"
EXPERTS = "experts"
ORDER = "order:"  # seeds from a narrower registry (`order_seeds`)
DATA = ":data"  # a dispatcher start laid out with every mesh axis a data axis (`dispatcher_seeds`)
ATTENTION = " + attention, residual stream"  # a 3-D scheme's seed with those forced too (`_grid_attention_seed`)
GRID_SCHEMES = ("cube_3d", GRID_3D)
HEADS = (Shard(1), Shard(1))  # (query, key and value) of attention split by heads


def fixed_seeds(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    memo: GreedyMemo | None = None,
) -> Iterator[tuple[str, Plan | AutoparError]]:
    """(name, plan) for every variant of every fixed scheme on `mesh`, or (name, why it failed);
    the greedy passes share the search's `expand_cache` and `memo` (`greedy.greedy_plan`)."""
    if mesh.size == 1:
        return
    pairs = pair_linears(gm, find_linears(gm))
    if not pairs:
        return
    forcing: dict[Any, Strategy] = {}
    for key in SEED_SCHEMES:
        try:
            variants = variants_on(key, mesh.shape, gm)
        except AutoparError:
            continue
        for scheme in variants:
            name = PREFIX + scheme.describe()
            try:
                forced = forced_strategies(gm, scheme, pairs, registry, forcing)
                _check_required(gm, registry, forced, name)
                plan = greedy_plan(
                    gm,
                    mesh,
                    registry,
                    roles=scheme.roles,
                    forced=forced,
                    expand_cache=expand_cache,
                    memo=memo,
                )
            except AutoparError as exc:
                yield name, exc
                continue
            yield name, plan
            if scheme.key in GRID_SCHEMES:
                yield from _grid_attention_seed(gm, mesh, registry, expand_cache, memo, scheme, forced, name, pairs)


def _grid_attention_seed(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    memo: GreedyMemo | None,
    scheme: Scheme,
    forced: dict[str, Strategy],
    name: str,
    pairs: Sequence[tuple[tuple[Linear, ...], Linear]],
) -> Iterator[tuple[str, Plan | AutoparError]]:
    """The 3-D scheme `scheme` (cube or grid) with attention and the residual stream forced beside
    its linears, as the scheme's closed form lays them out (`cost.symbolic.axonn`): the greedy pass
    around the linears alone does not (on the GPT of `benchmarks/plan_quality.py` at 2x4x8 its
    plan of the grid's first order sends 151 M elements per rank per layer, this one 106 M).

    - Attention (`_attention_forced`): the batch split on the token axis, the heads on the first
      linear's n axis, and on its k axis (where the first linear's output is a pending sum) the
      heads again where that axis nests inside the n axis, else the query sequence (keys and
      values whole, their gradients partial sums). Either moves what the closed form's all-reduce
      moves (reduce-scatter, then the output gathered) without running attention again on every
      rank of the k axis. No start where a call offers no such strategy (heads or sequence not
      divisible, a split refused).
    - The residual stream (`_stream_forced`): every value of the hidden shape outside the
      linears' own modules (layer norms, residual adds, their gradients) split as the first
      linear's input, tokens on the token axis and features on the k axis. Left to itself the
      greedy pass reshapes it at each layer norm (an all-to-all onto the sequence and back)."""
    attention = _attention_forced(gm, mesh, registry, expand_cache, scheme)
    if not attention:
        return
    forced = {**forced, **attention}
    forced.update(_stream_forced(gm, mesh, registry, expand_cache, scheme, pairs, forced))
    seeded = name + ATTENTION
    try:
        _check_required(gm, registry, forced, seeded)
        yield seeded, greedy_plan(
            gm, mesh, registry, roles=scheme.roles, forced=forced, expand_cache=expand_cache, memo=memo
        )
    except AutoparError as exc:
        yield seeded, exc


def _attention_forced(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    scheme: Scheme,
) -> dict[str, Strategy]:
    """Every attention call's strategy under `scheme` (`_grid_attention_seed`), or {} where one
    has no such candidate."""
    # a later mesh axis nests inside an earlier one: heads split on n and then on k stay in place
    k_axis = HEADS if scheme.first.index("k") > scheme.first.index("n") else (Shard(SEQ), R)
    letters = {"T": (Shard(0), Shard(0)), "n": HEADS, "k": k_axis}
    want = [letters.get(letter, (R, R)) for letter in scheme.first]
    query, keys = tuple(q for q, _ in want), tuple(k for _, k in want)
    out: dict[str, Strategy] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (FORWARD, BACKWARD):
            continue
        q = 1 if node.target == BACKWARD else 0  # (after grad_out in backward)
        choice = _first_candidate(
            node,
            mesh,
            registry,
            expand_cache,
            functools.partial(_splits_attention, q, query, keys),
        )
        if choice is None:
            return {}
        out[node.name] = choice
    return out


def _stream_forced(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    scheme: Scheme,
    pairs: Sequence[tuple[tuple[Linear, ...], Linear]],
    forced: dict[str, Strategy],
) -> dict[str, Strategy]:
    """The residual stream's strategies under `scheme` (`_grid_attention_seed`): each op outside
    the paired linears' modules and not in `forced` whose output has the first linears' input
    shape (tokens x k, as (T, k) or (b, s, k)) takes its first candidate with that output split
    as their input (tokens on the token axis, k on the k axis, whole on the n axis) and no pending
    sum among its inputs; an op with no such candidate is left to the greedy pass."""
    hidden = {(lin.tokens, lin.k) for firsts, _ in pairs for lin in firsts}
    inside = tuple({lin.module.rpartition(".")[0] + "." for firsts, second in pairs for lin in (*firsts, second)})
    out: dict[str, Strategy] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or node.name in forced or not isinstance(val, torch.Tensor) or val.dim() < 2:
            continue
        if (val.shape[:-1].numel(), val.shape[-1]) not in hidden or not has_info(node):
            continue
        if (info(node).module_path + ".").startswith(inside):
            continue
        tokens = 1 if val.dim() > 2 and val.shape[0] == 1 else 0  # the batch dim, or the sequence's at batch 1
        split = {"T": Shard(tokens), "k": Shard(val.dim() - 1)}
        want = tuple(split.get(letter, R) for letter in scheme.first)
        choice = _first_candidate(
            node,
            mesh,
            registry,
            expand_cache,
            functools.partial(_lays_out, want),
        )
        if choice is not None:
            out[node.name] = choice
    return out


def _splits_attention(q: int, query: tuple[Placement, ...], keys: tuple[Placement, ...], s: Strategy) -> bool:
    """Whether an attention candidate takes its query (input `q`) as `query`, keys and values as `keys`."""
    return s.inputs[q].placements == query and s.inputs[q + 1].placements == s.inputs[q + 2].placements == keys


def _lays_out(want: tuple[Placement, ...], s: Strategy) -> bool:
    """Whether a candidate's first output is laid out as `want` with no pending sum among its inputs."""
    return bool(s.outputs) and s.outputs[0].placements == want and not any(
        isinstance(p, Partial) for lay in s.inputs for p in lay.placements
    )


def _first_candidate(
    node: fx.Node,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    accept: Callable[[Strategy], bool],
) -> Strategy | None:
    """The first of `node`'s candidates on `mesh` that `accept` takes (None: none, or no rule)."""
    rule = registry.get(node.target)
    if rule is None:
        return None
    return next((s for s in expand_cached(node, rule, op_call(node), mesh.shape, expand_cache) if accept(s)), None)


def order_seeds(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    roles: list[tuple[str, ...]],
    expand_cache: dict[Any, list[Strategy]],
) -> Iterator[tuple[str, Plan | AutoparError]]:
    """("order:<name>:<roles>", plan) for every registry `registry` seeds from
    (`RuleRegistry.seed_from`) and every assignment of axis roles, or (name, why it failed).

    Such a registry is a narrower copy of `registry` ("cp" axes: the balanced causal order asked
    for, the linears' (batch, sequence) merge included), whose greedy plans lie where the chain
    moves from `registry`'s own seeds do not go: those list the contiguous strategies first, the
    balanced copies tie with them op by op, and the balanced order pays off only once the whole
    residual stream takes it. Each registry's passes get a memo of their own (its answers depend
    on the registry's lists; the expand cache is keyed by rule and may be shared). A seed that
    breaks one of `registry`'s requirements is refused (`_check_required`)."""
    for order, seeding in registry.seed_orders():
        memo = GreedyMemo()
        for assignment in roles:
            name = f"{ORDER}{order}:{'/'.join(assignment)}"
            try:
                plan = greedy_plan(gm, mesh, seeding, roles=assignment, expand_cache=expand_cache, memo=memo)
                _check_required(gm, registry, plan.strategies, name)
            except AutoparError as exc:
                yield name, exc
                continue
            yield name, plan


def _check_required(gm: fx.GraphModule, registry: RuleRegistry, forced: dict[str, Strategy], name: str) -> None:
    """A scheme's forced strategies must meet what the mesh asks of their ops (`OpRule.requirement`:
    weights whole on a "cp" axis with `context_parallel="ulysses"`): the search adds a seed's
    strategy to its op's candidates, so a seed that broke a requirement would bring it into the
    plan. Raises for the first that does not (the scheme is then no seed)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for node_name, strategy in forced.items():
        node = nodes[node_name]
        rule = registry.get(node.target)
        if rule is not None and rule.requirement is not None and not rule.requirement.admits(op_call(node), strategy):
            raise ShardingError(
                f"{name} splits {node.target} as the mesh does not allow",
                op=str(node.target),
                hint=rule.requirement.hint,
            )


def expert_seeds(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    memo: GreedyMemo | None = None,
) -> Iterator[tuple[str, Plan | AutoparError]]:
    """(name, plan) with every grouped matmul of the graph's MoE layers splitting its experts over
    every mesh axis, the rest laid out by the greedy pass; none without grouped matmuls.

    The expert split pays off only as a whole: the up projection's row-disjoint output (D) must
    run through the gate to a down projection that takes D, forward and backward, and the weights
    must be split on E everywhere. A search that moves one chain at a time from a plan splitting
    inside the experts does not reach it, so it gets a seed of its own, priced like the others.
    "experts" takes D inputs wherever a grouped matmul offers them; "experts:R" takes R inputs (the
    greedy pass then decides where the pending sums are reduced)."""
    if mesh.size == 1:
        return
    yield from dispatcher_seeds(gm, mesh, registry, expand_cache, memo)
    grouped = _grouped_mms(gm)
    if not grouped:
        return
    every_axis = tuple(a for a, size in enumerate(mesh.shape) if size > 1)
    disjoint = _may_be_disjoint(gm)
    # the experts over every axis (E/p per rank), with D or R inputs; then, on a mesh of several
    # axes, over each one alone (the others free to split inside the experts or the batch)
    variants = [(EXPERTS, every_axis, True), (EXPERTS + ":R", every_axis, False)]
    if len(every_axis) > 1:
        variants += [(f"{EXPERTS}@{mesh.axis_names[a]}", (a,), True) for a in every_axis]
    for name, split_axes, prefer_disjoint in variants:

        def pick(
            node: fx.Node,
            candidates: list[Strategy],
            split_axes: tuple[int, ...] = split_axes,
            prefer_disjoint: bool = prefer_disjoint,
        ) -> Strategy | None:
            options = [
                s
                for s in candidates
                if (experts := expert_parallel.experts_layout(node.target, s)) is not None
                and experts.shard_axes(expert_parallel.EXPERT_DIM) == split_axes
            ]
            want = [prefer_disjoint and x in disjoint for x in tensor_inputs(node)]
            return max(options, key=lambda s: _agreement(s, want)) if options else None

        yield from _forced_seed(gm, mesh, registry, expand_cache, memo, name, grouped, pick)


def dispatcher_seeds(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    memo: GreedyMemo | None = None,
    suffixes: tuple[str, ...] = ("", DATA),
    widest: int = routed_experts.MAX_EXPERT_AXES,
) -> Iterator[tuple[str, Plan | AutoparError]]:
    """For MoE layers traced as `autopar::routed_experts` ops: every op's experts over one mesh
    axis with each dispatcher its rule offers there ("experts:alltoall:<axis>", the tokens
    exchanged inside the op; "experts:allgather:<axis>", the tokens gathered), and over each pair
    and each triple of axes (up to `widest` axes) with the all-to-all
    ("experts:alltoall:<axis>+<axis>+<axis>": one expert per rank of a (2, 2, 2) mesh with 8
    experts), the rest laid out by the greedy pass. The greedy pass cannot price the exchanges inside the op, so each dispatcher
    gets a start of its own and the search's objective (which does) compares them.

    Each such start is laid out twice where the mesh's default roles are not all data: with those
    roles, and with every axis a data ("token") axis ("...:data"), the experts sharing the data
    axis as DeepSeek-V3 and torchtitan train (expert and data parallelism, no tensor split). The
    greedy pass splits weights on every tensor axis it is given, and on an auto mesh's unnamed
    axes (x, y: tensor by default) the first layout would split attention over every rank: the
    screen, which ranks meshes by their cheapest start, would rank a mesh whose best plan is
    expert plus data parallelism by that layout's price (DeepSeek-V3's published (2, 64) stage
    mesh: 8.2 s against 0.64 s searched). `suffixes`: only the starts of these layouts ("" the
    default roles, `DATA` every axis a data axis; the screen asks for them apart, `mesh_screen`)."""
    routed = _routed(gm)
    default = axis_roles(mesh)
    data = ("token",) * mesh.ndim
    layouts: list[tuple[str, tuple[str, ...] | None]] = [("", None)]
    if default != data:
        layouts.append((DATA, data))
    layouts = [(suffix, roles) for suffix, roles in layouts if suffix in suffixes]
    split = [a for a, size in enumerate(mesh.shape) if size > 1] if routed else []
    # each axis alone with either dispatcher; each pair (triple) of axes with the all-to-all (an expert
    # group spanning several axes, Megatron-Core's EP over its data and tensor groups)
    starts: list[tuple[tuple[int, ...], tuple[str, tuple[str, ...] | None], str]] = [((a,), layout, kind) for a in split for layout, kind in itertools.product(layouts, ("alltoall", "allgather"))]
    starts += [
        (axes, layout, "alltoall")
        for width in range(2, widest + 1)
        for axes in itertools.combinations(split, width)
        for layout in layouts
    ]
    for axes, (suffix, roles), kind in starts:

        def pick(
            node: fx.Node,
            candidates: list[Strategy],
            axes: tuple[int, ...] = axes,
            kind: str = kind,
            roles: tuple[str, ...] = roles or default,
        ) -> Strategy | None:
            options = (
                s
                for s in candidates
                if routed_experts.expert_axes(node.target, s) == axes
                and bool(routed_experts.all_to_all_axes(node.target, s)) == (kind == "alltoall")
            )
            return min(options, key=lambda s: _off_role(node, s, axes, roles), default=None)

        name = f"{EXPERTS}:{kind}:{'+'.join(mesh.axis_names[a] for a in axes)}{suffix}"
        yield from _forced_seed(gm, mesh, registry, expand_cache, memo, name, routed, pick, roles)


def _off_role(node: fx.Node, strategy: Strategy, axes: tuple[int, ...], roles: tuple[str, ...]) -> int:
    """How many axes besides the experts' `axes` a routed-experts candidate lays out against the
    seed's roles: a token axis that does not split the tokens, whose ranks would each gather them
    and run their experts' rows again. The first candidate of the rule's list keeps the tokens
    whole there: on (4, 2) with every axis a data axis ("experts:alltoall:x:data"), twice the
    experts' work and an all-gather of the tokens over y (the toy Mixtral of
    `tests/test_mesh_bound.py`: 0.358 ms modeled against 0.351 ms with the tokens split)."""
    tokens = strategy.inputs[routed_experts.tokens_index(node.target)]
    return sum(role == "token" and a not in axes and a not in tokens.shard_axes(0) for a, role in enumerate(roles))


def _forced_seed(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    expand_cache: dict[Any, list[Strategy]],
    memo: GreedyMemo | None,
    name: str,
    nodes: list[fx.Node],
    pick: Callable[[fx.Node, list[Strategy]], Strategy | None],
    roles: tuple[str, ...] | None = None,
) -> Iterator[tuple[str, Plan | AutoparError]]:
    """One start named `name`: each of `nodes` forced to the strategy `pick` chooses among its
    rule's candidates, the rest laid out by the greedy pass (with `roles`, default: the mesh's);
    no start where a node has no rule or `pick` finds nothing."""
    forced: dict[str, Strategy] = {}
    for node in nodes:
        rule = registry.get(node.target)
        choice = pick(node, expand_cached(node, rule, op_call(node), mesh.shape, expand_cache)) if rule else None
        if choice is None:
            return
        forced[node.name] = choice
    try:
        yield name, greedy_plan(gm, mesh, registry, roles=roles, forced=forced, expand_cache=expand_cache, memo=memo)
    except AutoparError as exc:
        yield name, exc


def _routed(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in routed_experts.ROUTED_OPS]


def has_routed_experts(gm: fx.GraphModule) -> bool:
    """Whether the graph's MoE layers are traced as routed-experts ops (PlanOptions.token_dispatch)."""
    return bool(_routed(gm))


def uses_all_to_all(gm: fx.GraphModule, plan: Plan) -> bool:
    """Whether `plan` exchanges some MoE layer's tokens inside its op (the all-to-all dispatcher)."""
    return any(
        routed_experts.all_to_all_axis(n.target, plan.strategies[n.name]) is not None
        for n in _routed(gm)
        if n.name in plan.strategies
    )


def _grouped_mms(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and callable(getattr(n.target, "name", None))
        and n.target.name() in expert_parallel.GROUPED_MM_OPS
    ]


def has_grouped_mm(gm: fx.GraphModule) -> bool:
    """Whether the graph has an MoE layer's grouped matmul or routed-experts op (an expert dim a
    plan could split)."""
    return bool(_grouped_mms(gm) or _routed(gm))


def splits_experts(gm: fx.GraphModule, plan: Plan) -> bool:
    """Whether `plan` splits some grouped matmul's (or routed-experts op's) experts over a mesh axis."""
    return bool(expert_axes(gm, plan))


def expert_axes(gm: fx.GraphModule, plan: Plan) -> tuple[int, ...]:
    """The mesh axes over which `plan` splits the experts of its first grouped matmul (or
    routed-experts op) that splits them; () where none does."""
    for n in _grouped_mms(gm):
        strategy = plan.strategies.get(n.name)
        layout = expert_parallel.experts_layout(n.target, strategy) if strategy is not None else None
        if layout is not None and layout.shard_axes(expert_parallel.EXPERT_DIM):
            return layout.shard_axes(expert_parallel.EXPERT_DIM)
    for n in _routed(gm):
        strategy = plan.strategies.get(n.name)
        axes = routed_experts.expert_axes(n.target, strategy) if strategy is not None else ()
        if axes:
            return tuple(axes)
    return ()


def _may_be_disjoint(gm: fx.GraphModule) -> set[fx.Node]:
    """Values that can be row-disjoint: a grouped matmul's outputs and what the ops with row-disjoint
    strategies (`expert_parallel.DISJOINT_RULES`) make of them."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "name", None)
        if (
            callable(name)
            and name() in expert_parallel.GROUPED_MM_OPS
            or node.target is operator.getitem
            and node.args[0] in found
            or node.target in expert_parallel.DISJOINT_RULES
            and any(x in found for x in tensor_inputs(node))
        ):
            found.add(node)
    return found


def _agreement(strategy: Strategy, want: list[bool]) -> int:
    """How many tensor inputs are row-disjoint exactly where `want` says."""
    return sum(
        any(isinstance(p, RowDisjoint) for p in lay.placements) == wanted
        for lay, wanted in zip(strategy.inputs, want)
    )


def note_cheapest(costs: dict[tuple[int, ...], float], axes: tuple[int, ...], value: float) -> None:
    """Keeps in `costs` the cheapest price seen for a plan holding the experts on `axes`."""
    known = costs.get(axes)
    if known is None or value < known:
        costs[axes] = value
