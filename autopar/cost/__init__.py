"""Cost model for plan search: hardware tables, per-rank time and memory, closed-form volumes.

Typical use from a search::

    cost = MeshCost.build(load_hardware("h100-nvlink-ib"), mesh_shape)   # once per mesh
    t = cost.redistribute(src, dst)                # per candidate edge (s)
    t += cost.compute(flops, bytes_moved, dtype)   # per op, from its local shapes (s)
"""

from autopar.cost.formulas import (
    ADAMW_STATE_FACTOR,
    SGD_MOMENTUM_STATE_FACTOR,
    MemoryBreakdown,
    MeshCost,
    collective_time,
    compute_time,
    latency_steps,
    memory_per_rank,
    redistribute_time,
    step_time,
)
from autopar.cost.hardware import (
    Hardware,
    Link,
    available_hardware,
    axis_intra_node,
    axis_links,
    hardware_from_dict,
    load_hardware,
    span_link,
)

__all__ = [
    "ADAMW_STATE_FACTOR",
    "SGD_MOMENTUM_STATE_FACTOR",
    "Hardware",
    "Link",
    "MemoryBreakdown",
    "MeshCost",
    "available_hardware",
    "axis_intra_node",
    "axis_links",
    "span_link",
    "collective_time",
    "compute_time",
    "hardware_from_dict",
    "latency_steps",
    "load_hardware",
    "memory_per_rank",
    "redistribute_time",
    "step_time",
]
