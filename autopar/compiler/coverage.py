"""`python -m autopar coverage MODULE:FACTORY`: trace a model as `parallelize` would and list which
ops of its joint graph have sharding rules (`autopar.reporting.coverage` builds the rows).

It decomposes layer norm and losses when the mesh has several ranks, exactly as the compile does,
and needs no process group.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from autopar.core.errors import UsageError
from autopar.passes.trace import trace
from autopar.reporting.coverage import OpCoverage, format_rows, graph_coverage
from autopar.rules.base import RuleRegistry
from autopar.rules.registry import default_registry


def op_coverage(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    mesh_shape: Sequence[int] = (2, 2, 2),
    registry: RuleRegistry | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> list[OpCoverage]:
    """Rows for every op in the joint graph of `model`, missing ones first, then by count."""
    registry = registry if registry is not None else default_registry()
    decompose = math.prod(mesh_shape) > 1
    gm = trace(model, tuple(example_inputs), decompose=decompose, example_kwargs=example_kwargs)
    return graph_coverage(gm, registry, mesh_shape)


def load_factory(spec: str) -> Callable[[], tuple[nn.Module, Sequence[Any]]]:
    """`"package.module:function"` -> a zero-argument callable returning `(model, batch)`.

    Factories that take a `seed` (like `examples.models.make_gpt`) are called with seed 0. The
    module is looked up from the current directory too, as `python -m` does (the `autopar`
    console script would not see it otherwise).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FACTORY, got {spec!r}", hint="for example examples.zoo:make_llama")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"cannot import {module_name}: {exc}",
            hint="run from the directory that holds it, or install its package",
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{module_name} has no function {attr}", hint="name a function returning (model, batch)")
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
