"""Seeds of the plan search from the fixed schemes: 1-D Megatron, 2-D SUMMA and the 3-D cube.

The search starts from the cheapest of its seeds and only improves on it, so a fixed scheme that
lays out on the search's own mesh is a seed too: its plan (`autopar.planning.fixed`: the paired
linears forced to the scheme, the rest laid out by the greedy pass) is priced like the greedy plans
of the axis roles. Only schemes whose mesh is the search's mesh (unit axes aside: (1, 8, 8) takes
the 8x8 grids of 2-D) can seed it; a graph without paired linears has none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.planning.fixed import SCHEMES, find_linears, forced_strategies, pair_linears, variants_on
from autopar.planning.greedy import greedy_plan
from autopar.planning.greedy_scores import GreedyMemo
from autopar.rules.base import RuleRegistry

PREFIX = "fixed:"


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
    for key in SCHEMES:
        try:
            variants = variants_on(key, mesh.shape, gm)
        except AutoparError:
            continue
        for scheme in variants:
            name = PREFIX + scheme.describe()
            try:
                forced = forced_strategies(gm, scheme, pairs, registry, forcing)
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
