"""Stage 2, propagate: give every value of the joint graph a Layout and every op a Strategy.

The plan choice (`autopar.planning`) decides; the driver hands the `Plan` here, and this stage
records it in node metadata, where the later stages read it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from autopar.core.errors import ShardingError
from autopar.core.meta import info, update_info
from autopar.core.plan import Plan
from autopar.passes.row_owners import check_row_owners


def propagate(gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int]) -> fx.GraphModule:
    """Record the plan's layouts in node metadata; the output node gets the layouts it requires.
    Then check that the values the plan combines as row-disjoint sums have the same row owners
    (`row_owners`): rules cannot see that, and a plan that breaks it is refused."""
    for node in gm.graph.nodes:
        if node.op == "output":
            layouts = plan.output_layouts
            if any(lay is None for lay in layouts):
                raise ShardingError(
                    "every model output must be a tensor",
                    hint="return tensors (or a loss) from forward; other values are not supported",
                )
            update_info(node, layouts=tuple(lay for lay in layouts if lay is not None))
            continue
        if node.name not in plan.layouts:
            raise ShardingError(f"planner left {node.name} without a layout", where=info(node).where())
        update_info(
            node,
            layouts=plan.layouts[node.name],
            strategy=plan.strategies.get(node.name),
            note=plan.notes.get(node.name, ""),
        )
    gm.meta["autopar_roles"] = plan.roles
    check_row_owners(gm, mesh_shape)
    return gm
