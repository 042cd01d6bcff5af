"""The check behind row-disjoint pending sums (`RowDisjoint`, "D"): values an op combines as D must
have the same row owners.

A D value holds each row on the one rank whose experts computed it. Which rank that is comes
from the grouped matmul that made it: the routing (`offs`, the rows per expert) and how its
weight splits the experts over the mesh. Rules see one op at a time, so they offer `x * y` with
both D, or a grouped matmul over split experts taking a D input, without knowing where the values
came from. Here every D value is traced to the grouped matmuls it comes from, and an op that
combines D values (or a grouped matmul whose D input must hold the rows of its own experts) must
find one owner map on every mesh axis. A plan that breaks this would compute wrong numbers, so it
is refused with an error, never run.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from autopar.core.errors import ShardingError
from autopar.core.layout import RowDisjoint
from autopar.core.meta import info
from autopar.rules import expert_parallel
from autopar.rules.calls import output_index, tensor_inputs

# Per mesh axis: (the offs node, the owning coordinate on that axis of each expert), or None
# where the value is not D on that axis.
Owners = tuple[tuple[str, tuple[int, ...]] | None, ...]


def check_row_owners(gm: fx.GraphModule, mesh_shape: Sequence[int]) -> None:
    """Raise `ShardingError` where an op combines row-disjoint values of different row owners, or
    a grouped matmul takes a D input whose rows are not those of its own experts."""
    owners: dict[tuple[fx.Node, int], Owners] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            parent = node.args[0]
            if isinstance(parent, fx.Node) and isinstance(node.args[1], int):
                found = owners.get((parent, output_index(node)))
                if found is not None:
                    owners[(node, 0)] = found
            continue
        strategy = info(node).strategy
        if strategy is None:
            continue
        layouts = (*strategy.inputs, *strategy.outputs)
        if not any(isinstance(p, RowDisjoint) for lay in layouts for p in lay.placements):
            continue
        owners.update(
            {(node, i): key for i, key in enumerate(_owners_of(node, strategy, owners, mesh_shape))}
        )


def _owners_of(
    node: fx.Node, strategy: Any, owners: dict[tuple[fx.Node, int], Owners], mesh_shape: Sequence[int]
) -> list[Owners]:
    inputs = tensor_inputs(node)
    grouped = expert_parallel.is_expert_split(node.target, strategy)
    per_axis: list[tuple[str, tuple[int, ...]] | None] = []
    for a in range(len(mesh_shape)):
        found: set[tuple[str, tuple[int, ...]]] = set()
        for x, lay in zip(inputs, strategy.inputs):
            if not isinstance(lay.placements[a], RowDisjoint):
                continue
            known = owners.get((x, 0))
            if known is None or known[a] is None:
                raise _error(
                    node,
                    f"its input {x.name} is row-disjoint (D) on mesh axis {a}, but no "
                    "grouped matmul over split experts made it",
                )
            found.add(known[a])  # type: ignore[arg-type]
        experts = expert_parallel.experts_layout(node.target, strategy) if grouped else None
        if experts is not None and a in experts.shard_axes(expert_parallel.EXPERT_DIM):  # not a split inside them
            offs = inputs[2].name
            found.add((offs, expert_parallel.expert_owners(experts, a, mesh_shape)))
        if len(found) > 1:
            raise _error(
                node,
                f"it combines row-disjoint (D) values whose rows belong to different ranks "
                f"on mesh axis {a} (different routings or expert splits)",
            )
        made = any(isinstance(lay.placements[a], RowDisjoint) for lay in strategy.outputs)
        if made and not found:
            raise _error(node, f"its output is row-disjoint (D) on mesh axis {a} with no D input")
        per_axis.append(found.pop() if made else None)
    return [tuple(per_axis)] * len(strategy.outputs)


def _error(node: fx.Node, why: str) -> ShardingError:
    return ShardingError(
        f"the plan's layouts of {node.name} would compute wrong numbers: {why}",
        op=str(node.target),
        where=info(node).where(),
        hint="use the same expert split (weight Shard(0) on the same mesh axes) for both grouped "
        "matmuls of an expert MLP, or give this op's rule no row-disjoint strategy",
    )
