"""Stage 2, propagate: give every value of the joint graph a Layout and every op a Strategy.

The plan choice (`autopar.planning`) decides; the driver hands the `Plan` here, and this stage
records it in node metadata, where the later stages read it.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.core.errors import ShardingError
from autopar.core.meta import info, update_info
from autopar.core.plan import Plan


def propagate(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Record the plan's layouts in node metadata; the output node gets the layouts it requires."""
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
    return gm
