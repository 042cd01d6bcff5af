"""The lockstep harness names where a wrong program first departs from serial: a deliberately wrong
rule (softmax split along its own dim, each rank normalizing its block alone) must be reported at
the softmax node with its module path, not only as a mismatched loss."""

from __future__ import annotations

import pytest
import torch
from pass_fixtures import assert_call_matches_serial
from torch import nn

from autopar.core.layout import Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules.base import with_replicated
from autopar.rules.registry import default_registry

aten = torch.ops.aten


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.act = nn.Softmax(dim=-1)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x))).pow(2).mean()


def _softmax_split_anywhere(call: OpCall) -> list[AxisStrategy]:
    """Wrong on purpose: a block of a row normalized alone does not sum to 1 with the others."""
    ndim = call.inputs[0].ndim
    return with_replicated(call, [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(ndim)])


def test_a_wrong_rule_is_located_at_its_node() -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(8, 8)
    assert_call_matches_serial(model, (2,), (x,))  # the right rules pass
    registry = default_registry()
    registry.register(aten._softmax.default, _softmax_split_anywhere, family="wrong")
    with pytest.raises(AssertionError, match=r"first divergence at \w+ = aten\._softmax\.default \[act"):
        assert_call_matches_serial(model, (2,), (x,), registry=registry, planner="greedy")
