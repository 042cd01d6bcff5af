"""Which ops of a traced joint graph have sharding rules (`python -m autopar coverage`).

A model with an op that has no rule fails at compile time with `MissingRuleError` on the first
such op. This lists all of them at once, with how often each occurs and which rule family covers
it, so that a user (or a rule author) sees the whole gap before writing rules. The graph comes
from the trace stage (`autopar.compiler.coverage` runs it on a model).
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.rules.base import RuleRegistry, expand, make_call

MISSING = "missing"


@dataclass(frozen=True)
class OpCoverage:
    """One op overload of the joint graph: how many nodes call it and what covers it."""

    op: str
    count: int
    family: str  # the rule's family, or MISSING
    splittable: int  # calls whose rule offers a non-replicated layout on some mesh axis

    @property
    def missing(self) -> bool:
        return self.family == MISSING


def graph_coverage(gm: fx.GraphModule, registry: RuleRegistry, mesh_shape: Sequence[int]) -> list[OpCoverage]:
    """Coverage rows of an already traced joint graph."""
    counts: collections.Counter[Any] = collections.Counter()
    splittable: collections.Counter[Any] = collections.Counter()
    axis_sizes = sorted({s for s in mesh_shape if s > 1})
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        counts[node.target] += 1
        rule = registry.get(node.target)
        if rule is not None and _can_split(node, rule.strategies, axis_sizes, rule.uneven):
            splittable[node.target] += 1
    rows = [
        OpCoverage(str(op), n, rule.family if (rule := registry.get(op)) else MISSING, splittable[op])
        for op, n in counts.items()
    ]
    return sorted(rows, key=lambda r: (not r.missing, -r.count, r.op))


def _can_split(
    node: fx.Node, strategies: Callable[..., Any], axis_sizes: Sequence[int], uneven: bool = False
) -> bool:
    """Whether the rule offers an even layout other than all-replicated on one of the axis sizes."""

    def val(x: Any) -> Any:
        return x.meta.get("val") if isinstance(x, fx.Node) else x

    args = pytree.tree_map(val, node.args)
    kwargs = pytree.tree_map(val, node.kwargs)
    call = make_call(node.target, tuple(args), dict(kwargs), node.meta.get("val"))
    options = strategies(call)
    for size in axis_sizes:
        for strategy in expand(call, options, (size,), uneven):
            if not all(lay.is_replicated for lay in (*strategy.inputs, *strategy.outputs)):
                return True
    return False


def format_rows(rows: Sequence[OpCoverage]) -> str:
    """A table: op, count, family (or missing), calls that can be split; then a one-line total."""
    width = max([len(r.op) for r in rows] + [2])
    lines = [f"{'op':<{width}}  {'count':>5}  {'family':<10}  splittable"]
    for r in rows:
        lines.append(f"{r.op:<{width}}  {r.count:>5}  {r.family:<10}  {r.splittable}/{r.count}")
    missing = [r for r in rows if r.missing]
    nodes = sum(r.count for r in rows)
    lines.append(
        f"{len(rows)} ops ({nodes} nodes): {len(rows) - len(missing)} with rules, {len(missing)} missing"
    )
    return "\n".join(lines)


