"""Which ops of a model's joint graph have sharding rules: `python -m autopar coverage MODULE:FACTORY`.

A model with an op that has no rule fails at compile time with `MissingRuleError` on the first
such op. This lists all of them at once, with how often each occurs and which rule family covers
it, so that a user (or a rule author) sees the whole gap before writing rules. It traces exactly as
`parallelize` does for the given mesh (decomposing layer norm and losses when it has several ranks)
and needs no process group.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.rules.base import RuleRegistry, expand, make_call
from autopar.rules.registry import default_registry

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


def op_coverage(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    mesh_shape: Sequence[int] = (2, 2, 2),
    registry: RuleRegistry | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> list[OpCoverage]:
    """Rows for every op in the joint graph of `model`, missing ones first, then by count."""
    from autopar.passes.trace import trace

    registry = registry if registry is not None else default_registry()
    decompose = math.prod(mesh_shape) > 1
    gm = trace(model, tuple(example_inputs), decompose=decompose, example_kwargs=example_kwargs)
    return graph_coverage(gm, registry, mesh_shape)


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


def load_factory(spec: str) -> Callable[[], tuple[nn.Module, Sequence[Any]]]:
    """`"package.module:function"` -> a zero-argument callable returning `(model, batch)`.

    Factories that take a `seed` (like `examples.models.make_gpt`) are called with seed 0.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    params = inspect.signature(factory).parameters
    required = [
        p
        for p in params.values()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required and required[0].name == "seed" and len(required) == 1:
        return lambda: factory(0)
    return factory  # type: ignore[no-any-return]


def model_coverage(
    spec: str, mesh_shape: Sequence[int] = (2, 2, 2), registry: RuleRegistry | None = None
) -> list[OpCoverage]:
    """Rows for the model that the factory `MODULE:FACTORY` builds."""
    model, batch = load_factory(spec)()
    inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    return op_coverage(model, inputs, mesh_shape=mesh_shape, registry=registry)


def load_registry(spec: str) -> RuleRegistry:
    """`"package.module:function"` -> the RuleRegistry that function returns (your own rules)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION, got {spec!r}")
    registry = getattr(importlib.import_module(module_name), attr)()
    if not isinstance(registry, RuleRegistry):
        raise TypeError(f"{spec} returned {type(registry).__name__}, not a RuleRegistry")
    return registry


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


def parse_mesh(text: str) -> tuple[int, ...]:
    """`"2,2,2"` -> (2, 2, 2)."""
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError as exc:
        raise ValueError(f"--mesh takes comma-separated sizes like 2,2,2, got {text!r}") from exc
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"--mesh sizes must be positive, got {text!r}")
    return shape


def run(spec: str, mesh: str = "2,2,2", registry: str | None = None) -> int:
    """The `coverage` subcommand: print the table; 1 if any op is missing a rule, else 0."""
    rows = model_coverage(spec, parse_mesh(mesh), load_registry(registry) if registry else None)
    print(format_rows(rows))
    return 1 if any(r.missing for r in rows) else 0
