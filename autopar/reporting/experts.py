"""Where a plan puts the experts of its mixture-of-experts layers, for `plan_summary()` and `explain`.

A plan that splits the experts (`autopar.rules.expert_parallel`: a grouped matmul's weight
Shard(0) on some mesh axes) holds E/ep of each layer's experts per rank. A user reading the plan
wants to know which axis that is, how many experts each rank holds, and why the planner chose it;
the reasons are the expert weights per rank, the bytes the expert layers send per step, and the
search's cheapest plan with and without the split (`SearchReport.experts_split_cost` and
`experts_whole_cost`, handed in by the driver), and its cheapest plan for each set of mesh axes it
tried for the experts (`experts_axes_costs`: over every axis, over each axis alone, none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.cost.dispatch import dispatch_cost
from autopar.cost.formulas import format_bytes
from autopar.cost.hardware import Link
from autopar.rules import expert_parallel, routed_experts


@dataclass(frozen=True)
class ExpertPlacement:
    """The expert split of a plan's MoE layers (one split for all of them: the axes of the first)."""

    axes: tuple[str, ...]  # mesh axis names holding the experts (none: every rank holds them all)
    sizes: tuple[int, ...]  # their sizes
    experts: int  # experts per layer
    layers: tuple[str, ...]  # module paths of the experts modules
    weight_bytes_local: float  # expert weights per rank, every layer
    weight_bytes_total: float
    comm_bytes: float  # sent per rank per step by the collectives of the expert modules
    split_cost: float | None = None  # the search's cheapest plan splitting the experts
    whole_cost: float | None = None  # ... keeping every expert on every rank
    cost_unit: str = "elements"
    # modeled bytes per rank per step of the token traffic, every layer: (all-gather dispatcher,
    # all-to-all dispatcher); None where the layers' token count could not be read
    dispatch_bytes: tuple[float, float] | None = None
    # which token dispatcher the plan runs where the experts are split: "all-gather" (insert_comm's
    # collectives) or "all-to-all" (inside `autopar::routed_experts`, PlanOptions.token_dispatch)
    dispatcher: str = "all-gather"
    # the search's cheapest plan with the experts split and each dispatcher (routed-experts ops)
    dispatcher_costs: tuple[tuple[str, float], ...] = ()
    # modeled bytes per rank per step the all-to-all dispatcher's exchanges inside the ops send
    # (not among the collectives' records: they run inside the op)
    inside_bytes: float = 0.0
    # the search's cheapest plan per placement of the experts it priced: (mesh axis names holding
    # them, none: whole on every rank; cost), cheapest first
    axes_costs: tuple[tuple[tuple[str, ...], float], ...] = ()

    @property
    def ranks(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        if not self.axes:
            return (
                f"experts not split: every rank holds all {self.experts} experts of {len(self.layers)} MoE "
                f"layers (split inside them or replicated); {self.reason()}"
            )
        axes = " and ".join(f"{a} ({g})" for a, g in zip(self.axes, self.sizes))
        per_rank = self.experts // self.ranks if self.experts % self.ranks == 0 else self.experts / self.ranks
        shown = ", ".join(self.layers[:3]) + (", ..." if len(self.layers) > 3 else "")
        line = (
            f"experts split over mesh {'axes' if len(self.axes) > 1 else 'axis'} {axes}: each rank holds {per_rank} of the {self.experts} "
            f"experts (E/{self.ranks}) of {len(self.layers)} MoE layers ({shown}), expert weights "
            f"{format_bytes(self.weight_bytes_local)} of {format_bytes(self.weight_bytes_total)} per rank; "
            f"the expert layers send {self.comm_bytes / 1e6:.3f} MB per rank per step"
        )
        if self.dispatch_bytes is not None:
            gather, to_all = self.dispatch_bytes
            line += (
                f"; token dispatch modeled with the tokens split over these ranks: all-gather "
                f"{gather / 1e6:.3f} MB, all-to-all {to_all / 1e6:.3f} MB per rank per step"
            )
        line += f"; the plan dispatches tokens by {self.dispatcher}"
        if self.inside_bytes:
            line += f" (its exchanges inside the ops send {self.inside_bytes / 1e6:.3f} MB per rank per step, modeled)"
        if len(self.dispatcher_costs) > 1:
            prices = ", ".join(f"{kind} {price:.4g} {self.cost_unit}" for kind, price in self.dispatcher_costs)
            line += f", the search's cheapest plan with each: {prices}"
        return f"{line}; {self.reason()}"

    def reason(self) -> str:
        """Why, in the search's numbers: with the split or without, then which axes."""
        because = self._split_or_whole()
        if len(self.axes_costs) < 2:
            return because
        shown = ", ".join(
            f"{' and '.join(axes) if axes else 'whole on every rank'} {cost:.4g}" for axes, cost in self.axes_costs
        )
        return f"{because}; by the mesh axes holding the experts, its cheapest plans cost: {shown}"

    def _split_or_whole(self) -> str:
        unit = self.cost_unit
        if not self.axes:
            if self.split_cost is None:
                return "the search found no plan with them split"
            return (
                f"chosen because the search's cheapest plan keeping every expert on every rank costs "
                f"{self.whole_cost:.4g} {unit} against {self.split_cost:.4g} for its cheapest with the split"
            )
        if self.split_cost is None:
            return "chosen by the planner (no search prices)"
        if self.whole_cost is None:
            return (
                f"chosen because the search found no plan keeping every expert on every rank "
                f"(its plan: {self.split_cost:.4g} {unit})"
            )
        saved = self.whole_cost - self.split_cost
        return (
            f"chosen because the search's cheapest plan with the split costs {self.split_cost:.4g} {unit} "
            f"against {self.whole_cost:.4g} for its cheapest keeping every expert on every rank "
            f"({saved:.4g} {unit} less)"
        )

    def names(self, node: fx.Node) -> bool:
        """Whether `node` belongs to one of the expert modules (for `explain`)."""
        path = info(node).module_path if has_info(node) else ""
        return bool(path) and any(path == p or path.startswith(p + ".") for p in self.layers)


def expert_placement(
    gm: fx.GraphModule,
    program: Any,
    mesh: Mesh,
    collectives: Sequence[Any],
    split_cost: float | None = None,
    whole_cost: float | None = None,
    cost_unit: str = "elements",
    dispatcher_costs: dict[str, float] | None = None,
    axes_costs: dict[tuple[int, ...], float] | None = None,
) -> ExpertPlacement | None:
    """The expert split of the plan laid out on `gm` (the joint graph after propagate); where no
    grouped matmul splits its experts, a placement on no axes if the search priced a split (why
    not), else None. `collectives`: the report's records (their module paths pick the expert
    layers' ones)."""
    grouped = []
    for n in gm.graph.nodes:
        strategy = info(n).strategy if n.op == "call_function" and has_info(n) else None
        name = getattr(n.target, "name", None)
        if strategy is not None and callable(name) and name() in expert_parallel.GROUPED_MM_OPS or strategy is not None and n.target in routed_experts.ROUTED_OPS:
            grouped.append((n, strategy))
    split = [(n, s) for n, s in grouped if s.inputs[_weight_index(n)].shard_axes(expert_parallel.EXPERT_DIM)]
    if not split and (not grouped or whole_cost is None):
        return None
    first, first_strategy = (split or grouped)[0]
    weight = first_strategy.inputs[_weight_index(first)]
    axes = weight.shard_axes(expert_parallel.EXPERT_DIM)
    layers = tuple(dict.fromkeys(info(n).module_path for n, _ in grouped if info(n).module_path))
    weights = {_parameter(n.args[_weight_index(n)]) for n, _ in grouped if len(n.args) > _weight_index(n)}
    if first.target in routed_experts.ROUTED_OPS:
        weights |= {_parameter(n.args[_weight_index(n) + 1]) for n, _ in grouped}
    to_all = any(routed_experts.all_to_all_axis(n.target, s) is not None for n, s in split)
    layouts = dict(zip(program.param_names, program.param_layouts))
    held = [layouts[name] for name in weights if name in layouts]
    comm = sum(
        c.bytes
        for c in collectives
        if any(c.module_path == p or c.module_path.startswith(p + ".") for p in layers)
    )
    return ExpertPlacement(
        axes=tuple(mesh.axis_names[a] for a in axes),
        sizes=tuple(mesh.shape[a] for a in axes),
        experts=weight.shape[expert_parallel.EXPERT_DIM],
        layers=layers,
        weight_bytes_local=float(sum(lay.local_bytes(mesh.shape) for lay in held)),
        weight_bytes_total=float(sum(lay.local_bytes([1] * mesh.ndim) for lay in held)),
        comm_bytes=float(comm),
        split_cost=split_cost,
        whole_cost=whole_cost,
        cost_unit=cost_unit,
        dispatch_bytes=_dispatch_bytes(split, math.prod(mesh.shape[a] for a in axes)) if split else None,
        dispatcher="all-to-all" if to_all else "all-gather",
        dispatcher_costs=tuple(sorted((dispatcher_costs or {}).items())),
        inside_bytes=_inside_bytes(split, mesh),
        axes_costs=tuple(
            (tuple(mesh.axis_names[a] for a in held), cost)
            for held, cost in sorted((axes_costs or {}).items(), key=lambda item: item[1])
        ),
    )


def _inside_bytes(split: Sequence[tuple[fx.Node, Any]], mesh: Mesh) -> float:
    """What the all-to-all dispatcher's exchanges inside the forward ops send per rank per step,
    forward and backward (`dispatch_cost(..., planned=True)`, routing spread evenly); over two or
    three mesh axes, the exchange along each (`token_dispatch.axes_exchange` moves every row across
    each axis at most once)."""
    total = 0.0
    link = Link(alpha=0.0, bandwidth=1.0)  # bytes do not depend on the link
    for node, strategy in split:
        if node.target is not routed_experts.ROUTED_EXPERTS:
            continue
        x, ids, gate_up = strategy.inputs[0], strategy.inputs[1], strategy.inputs[3]
        tokens = x.local_shape(mesh.shape, (0,) * mesh.ndim)[0]
        for axis in routed_experts.all_to_all_axes(node.target, strategy):
            total += dispatch_cost(
                "all_to_all", tokens, x.shape[1], ids.shape[1], gate_up.shape[0], mesh.shape[axis], link, x.dtype,
                planned=True,
            ).bytes_sent  # fmt: skip
    return total


def _weight_index(node: fx.Node) -> int:
    """Where a grouped matmul's (or a routed-experts op's gate_up) expert weight is among its inputs."""
    if node.target in routed_experts.ROUTED_OPS:
        return routed_experts.tokens_index(node.target) + 3
    return 1


def _dispatch_bytes(split: Sequence[tuple[fx.Node, Any]], ranks: int) -> tuple[float, float] | None:
    """Both dispatchers' modeled bytes per rank per step for the layers of these expert-split
    grouped matmuls (the first forward one of each layer): rows S = tokens x top-k and hidden K
    from its input, the tokens from the `index` that gathers the rows (through the collectives
    and copies a plan puts between them)."""
    per_layer: dict[str, tuple[float, float]] = {}
    for node, strategy in split:
        path = info(node).module_path
        if path in per_layer or "backward" in str(node.target):
            continue
        if node.target in routed_experts.ROUTED_OPS:  # (t, H) tokens, (t, k) routing, (E, ...) experts
            tokens, hidden = strategy.inputs[0].shape
            top_k, experts = strategy.inputs[1].shape[1], strategy.inputs[3].shape[0]
            if tokens % ranks:
                return None
        else:
            rows, hidden = strategy.inputs[0].shape
            found = _gathered_tokens(node.args[0])
            if found is None or found <= 0 or rows % found or found % ranks:
                return None
            tokens, top_k, experts = found, rows // found, strategy.inputs[1].shape[expert_parallel.EXPERT_DIM]
        link = Link(alpha=0.0, bandwidth=1.0)  # bytes do not depend on the link
        per_layer[path] = (
            dispatch_cost("all_gather", tokens // ranks, hidden, top_k, experts, ranks, link).bytes_sent,
            dispatch_cost("all_to_all", tokens // ranks, hidden, top_k, experts, ranks, link).bytes_sent,
        )
    if not per_layer:
        return None
    return sum(g for g, _ in per_layer.values()), sum(a for _, a in per_layer.values())


def _gathered_tokens(value: Any) -> int | None:
    """The number of tokens of the `index` op whose rows a grouped matmul reads."""
    node = value
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is torch.ops.aten.index.Tensor:
            source = node.args[0]
            shape = source.meta["val"].shape if isinstance(source, fx.Node) and "val" in source.meta else None
            return int(shape[0]) if shape else None
        node = node.args[0] if node.args else None
    return None


def _parameter(value: Any) -> str | None:
    """The parameter a grouped matmul's weight argument reads, through the views and relayouts
    between them: a relayout's collective and its glue can have several inputs (the chunks of one
    all-gathered tensor put back in order), all made from the one parameter; any path that reaches
    another placeholder, or none, names no parameter."""
    found: set[str | None] = set()
    seen: set[fx.Node] = set()
    stack = [value] if isinstance(value, fx.Node) else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.add(info(node).param_name if has_info(node) else None)
        elif node.all_input_nodes:
            stack.extend(node.all_input_nodes)
        else:
            found.add(None)  # made from nothing (a factory): not a parameter's value
        if len(found) > 1:
            return None
    return next(iter(found)) if found else None
