"""The fixed comparison plans compiled: each hand scheme of `autopar.planning.fixed`, planned on the
traced graph, compiled on its own mesh by the driver and priced like the chosen plan
(`autopar.plan(..., compare=True)`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
import torch.nn as nn

from autopar.compiler.driver import Compiled, compile_for_rank, graph_fingerprint
from autopar.compiler.pricing import Compared, price
from autopar.core.errors import AutoparError
from autopar.core.plan import Plan
from autopar.core.precision import AutocastState, MixedPrecision
from autopar.planning.fixed import SCHEMES, TITLES, FixedPlan, plan_fixed
from autopar.rules.base import RuleRegistry


def compile_fixed(
    model: nn.Module,
    example_inputs: Sequence[Any],
    fixed: FixedPlan,
    *,
    traced_fingerprint: str,
    registry: RuleRegistry,
    hardware: str | None = None,
    example_kwargs: dict[str, Any] | None = None,
    coords: Sequence[int] | None = None,
    split_fused: bool = False,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
) -> Compiled:
    """`compile_for_rank` on the scheme's mesh with the fixed plan, for `price`; the model is traced
    again and must give the graph the plan was made on (`graph_fingerprint`), so the plan fits it."""
    assert fixed.scheme is not None and fixed.plan is not None
    plan = fixed.plan

    def use_fixed(gm: fx.GraphModule, make_plan: Callable[[], Plan]) -> Plan:
        if graph_fingerprint(gm) != traced_fingerprint:
            raise AutoparError(
                "the model traced to another graph than the one the fixed plan was made on",
                hint="fixed plans need a deterministic trace (same model, inputs and mesh size)",
            )
        return plan

    return compile_for_rank(
        model,
        fixed.scheme.mesh(),
        tuple(example_inputs),
        coords=tuple(coords) if coords is not None else (0,) * len(fixed.scheme.mesh_shape),
        example_kwargs=example_kwargs,
        registry=registry,
        agree=use_fixed,
        hardware=hardware,
        split_fused=split_fused,
        autocast=autocast,
        mixed_precision=mixed_precision,
        priced=True,
    )


def compare_fixed(
    model: nn.Module,
    example_inputs: Sequence[Any],
    traced: fx.GraphModule,
    p: int,
    hardware: str,
    registry: RuleRegistry,
    *,
    example_kwargs: dict[str, Any] | None = None,
    schemes: Sequence[str] = SCHEMES,
    require_heads: bool = True,
    split_fused: bool = False,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
) -> list[Compared]:
    """Each fixed scheme planned on `traced` (the model's joint graph, as traced for p ranks, before
    planning), compiled on its own mesh of p ranks and priced like any plan."""
    fingerprint = graph_fingerprint(traced)
    out = []
    for key in schemes:
        fixed = plan_fixed(traced, key, p, registry, hardware, require_heads)
        if fixed.plan is None or fixed.scheme is None:
            out.append(Compared(TITLES[key], None, f"infeasible: {fixed.infeasible}", None))
            continue
        compiled = compile_fixed(
            model, example_inputs, fixed, traced_fingerprint=fingerprint, registry=registry,
            hardware=hardware, example_kwargs=example_kwargs, split_fused=split_fused, autocast=autocast,
            mixed_precision=mixed_precision,
        )
        result = price(compiled, fixed.scheme.mesh(), hardware, key)
        note = f"{fixed.scheme.describe()}; best of {fixed.variants} layouts"
        out.append(Compared(TITLES[key], fixed.scheme.mesh_shape, note, result))
    return out
