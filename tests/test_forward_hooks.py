"""Forward hooks that cannot run at each call as in serial are said, not dropped silently: a hook
of the model that returns None runs once, at the trace (its side effects are not repeated), and a
hook registered on a submodule of the parallel module never runs (its program does not call it)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

from autopar import ForwardHookWarning
from autopar.passes.trace import trace
from autopar.runtime.source_watch import SourceWatch


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _trace(model: nn.Module) -> list[warnings.WarningMessage]:
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(model, (x,), decompose=True)
    return [w for w in caught if issubclass(w.category, ForwardHookWarning)]


def test_a_hook_that_keeps_features_is_named_at_the_trace() -> None:
    model = _net()
    kept: list[torch.Tensor] = []
    calls = {"pre": 0}

    def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        kept.append(out.detach())

    def count(module: nn.Module, args: Any) -> None:
        calls["pre"] += 1

    model[0].register_forward_hook(keep)
    model[2].register_forward_pre_hook(count)
    said = [str(w.message) for w in _trace(model)]
    assert len(said) == 2, said
    assert any("forward hook" in s and ".keep on 0 returned None" in s for s in said), said
    assert any("forward pre-hook" in s and ".count on 2 returned None" in s for s in said), said
    assert all("side effects" in s and "Hint:" in s for s in said)
    # the user's own hooks are left as they were (the trace wraps its copy's)
    assert list(model[0]._forward_hooks.values()) == [keep]


def test_a_hook_that_changes_the_output_is_traced_without_a_warning() -> None:
    model = _net()
    model[0].register_forward_hook(lambda module, args, out: out * 0.5)
    assert _trace(model) == []


def test_a_hook_on_a_submodule_of_the_parallel_module_is_said_at_the_next_call() -> None:
    source, containers = _net(), _net()
    watch = SourceWatch(source, [("2", containers[2])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch.check()
        assert caught == []
        containers[2].register_forward_hook(lambda module, args, out: None)
        watch.check()
        watch.check()  # once per change
    said = [str(w.message) for w in caught if issubclass(w.category, ForwardHookWarning)]
    assert len(said) == 1, said
    assert "pmodel.get_submodule('2')" in said[0] and "never runs" in said[0]


if __name__ == "__main__":
    pytest.main([__file__])
