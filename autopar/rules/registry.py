"""The default rule library, built fresh on every call (no shared mutable registry)."""

from __future__ import annotations

from autopar.rules import (
    autograd_function,
    ctc,
    expert_parallel,
    factory,
    matmul,
    nn,
    pointwise,
    pooling,
    random,
    reduction,
    routed_experts,
    views,
)
from autopar.rules.base import RuleRegistry

# expert_parallel last: it adds row-disjoint strategies to rules the others registered
FAMILIES = (autograd_function, matmul, pointwise, reduction, views, nn, ctc, pooling, factory, random, routed_experts, expert_parallel)


def default_registry() -> RuleRegistry:
    """A new registry with every family's rules; callers may add or override rules on it."""
    registry = RuleRegistry()
    for family in FAMILIES:
        family.register(registry)
    return registry
