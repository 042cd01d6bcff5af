"""Property-testing sharding rules: the in-process oracle (`autopar.testing.oracle`, re-exported
here) and hypothesis strategies for meshes, shapes and layouts (`autopar.testing.strategies`,
imported on its own: hypothesis is a test dependency)."""

from autopar.testing.oracle import (
    MEMORY_LAYOUTS,
    all_coords,
    assemble,
    check_strategy,
    in_memory_layout,
    local_block,
    mesh_size,
    placements_on_axis,
    run_local,
    shard_tensor,
    simulate_steps,
)

__all__ = [
    "MEMORY_LAYOUTS",
    "all_coords",
    "assemble",
    "check_strategy",
    "in_memory_layout",
    "local_block",
    "mesh_size",
    "placements_on_axis",
    "run_local",
    "shard_tensor",
    "simulate_steps",
]
