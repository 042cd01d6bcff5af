"""Part of the trace stage: transformers' experts modules traced as one `autopar::routed_experts`
op each, so that the plan can place the all-to-all token dispatcher (`autopar.rules.routed_experts`).

transformers' MoE layers (Mixtral, Qwen3-MoE, OLMoE, ...) keep their experts in one module whose
`forward(hidden (t, H), top_k_index (t, k), top_k_weights (t, k))` sorts the (token, expert) pairs
and runs grouped matmuls; traced as they are, those ops tie rows to experts through data (`offs`)
and the only dispatcher a plan can make of them is the all-gather one. While tracing with
`PlanOptions(token_dispatch="alltoall" or "auto")`, each such module's forward is replaced (on the
instance, put back afterwards) by the one op with the same result, whose backward is its own op.

Only the layout the op computes is replaced: concatenated gate/up weights (E, 2I, H), down (E, H, I),
no bias, no transposed weights, no post-expert norm, an activation of `routed_experts.ACTIVATIONS`.
Other experts modules keep their traced ops (all-gather dispatcher); asked for "alltoall" with none
replaced, compiling raises (`autopar.compiler.driver`).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from autopar.cost.dispatch import routing_imbalance
from autopar.rules.routed_experts import ACTIVATIONS, IMBALANCE_META, ROUTED_OPS, routed_experts


def activation_name(module: nn.Module) -> str | None:
    """The experts' activation by its config name, if the op supports it."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    return act if isinstance(act, str) and act in ACTIVATIONS else None


def replaceable(module: nn.Module) -> bool:
    """A transformers experts module whose forward the op computes exactly."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.ndim == 3
        and down.ndim == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
        and getattr(module, "has_gate", False) is True
        and getattr(module, "is_concatenated", False) is True
        and getattr(module, "is_transposed", True) is False
        and getattr(module, "has_bias", True) is False
        and getattr(module, "has_post_expert_norm", True) is False
        and activation_name(module) is not None
    )


def _forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
    gate_up, down = self.gate_up_proj, self.down_proj
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)  # (`replaceable` checked)
    return routed_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, activation_name(self) or "")


@contextmanager
def routed_experts_traced(model: nn.Module, enabled: bool) -> Iterator[list[str]]:
    """While open (when `enabled`), every replaceable experts module of `model` computes with the
    one op; yields the module paths replaced."""
    replaced: list[tuple[nn.Module, bool, Any]] = []
    paths: list[str] = []
    if enabled:
        for path, module in model.named_modules():
            if replaceable(module):
                replaced.append((module, "forward" in vars(module), vars(module).get("forward")))
                module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
                paths.append(path)
    try:
        yield paths
    finally:
        for module, had, old in replaced:
            if had:
                module.forward = old  # type: ignore[method-assign]
            else:
                del module.forward


def mark_routing_imbalance(gm: fx.GraphModule, model: nn.Module) -> int:
    """Record on every routed-experts node of `gm` the routing imbalance of the model it was traced
    from (`cost.dispatch.routing_imbalance`: bias-balanced routers like DeepSeek-V3's measure far
    nearer the mean than auxiliary-loss ones), which the planners charge its expert splits
    (`planning.ring_cost.routed_exchange_cost`). Returns how many nodes were marked."""
    factor = routing_imbalance(model)
    marked = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ROUTED_OPS:
            node.meta[IMBALANCE_META] = factor
            marked += 1
    return marked
