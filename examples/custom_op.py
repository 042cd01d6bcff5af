"""Your own op, its sharding rules, and parallelize(..., planning=PlanOptions(registry=...)).

    torchrun --nproc-per-node 8 examples/custom_op.py   # parallelize on (2, 2, 2), train beside serial
    python examples/custom_op.py                          # no launcher: op coverage and the plan, in process

Two ops defined with torch.library, each with a fake kernel (so torch.export traces it) and an
autograd formula (so the joint forward+backward graph has its backward):

- `mylib::rms_scale(x, weight, eps)`: RMS normalization of the last dim times a weight, whose
  backward is a second custom op, `mylib::rms_scale_backward`. Both appear in the joint graph, so
  both need a rule.
- `mylib::rope(x, offset, inverse)`: rotary position embedding, positions along dim -2 starting at
  `offset`. Its backward is the inverse rotation, the same op. A rank that holds a block of positions
  must rotate it by its own positions: the rule's `localize` passes that rank's offset.

A rule is written for one mesh axis: the (input placements, output placements) it accepts.
autopar takes the product over the mesh axes. `tests/test_custom_op.py` tests these rules against the
in-process oracle with hypothesis, the way your own rules should be tested.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler.coverage import op_coverage
from autopar.core.layout import P, R, Shard
from autopar.reporting.coverage import format_rows
from autopar.rules.base import AxisStrategy, LocalCall, LocalContext, OpCall, RuleRegistry, with_replicated
from autopar.rules.registry import default_registry

# ---------------------------------------------------------------- the ops (plain torch.library)


@torch.library.custom_op("mylib::rms_scale", mutates_args=())
def rms_scale(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.library.custom_op("mylib::rms_scale_backward", mutates_args=())
def rms_scale_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n, grad_n = x * r, grad * weight
    grad_x = r * (grad_n - n * (grad_n * n).mean(-1, keepdim=True))
    return grad_x, (grad * n).reshape(-1, x.shape[-1]).sum(0)


@rms_scale.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@rms_scale_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_scale_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, ctx.eps = inputs
    ctx.save_for_backward(x, weight)


def _rms_scale_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = rms_scale_backward(grad, x, weight, ctx.eps)
    return grad_x, grad_weight, None


rms_scale.register_autograd(_rms_scale_grad, setup_context=_rms_scale_setup)


@torch.library.custom_op("mylib::rope", mutates_args=())
def rope(x: Tensor, offset: int = 0, inverse: bool = False) -> Tensor:
    t, half = x.shape[-2], x.shape[-1] // 2
    pos = torch.arange(offset, offset + t, dtype=x.dtype, device=x.device)
    freq = 10000.0 ** (-torch.arange(half, dtype=x.dtype, device=x.device) / half)
    angle = pos[:, None] * freq
    cos, sin = angle.cos(), angle.sin() * (-1.0 if inverse else 1.0)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@rope.register_fake
def _(x: Tensor, offset: int = 0, inverse: bool = False) -> Tensor:
    return torch.empty_like(x)


def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, ctx.offset, ctx.inverse = inputs


def _rope_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    return rope(grad, ctx.offset, not ctx.inverse), None, None  # a rotation's inverse is its transpose


rope.register_autograd(_rope_grad, setup_context=_rope_setup)

# ---------------------------------------------------------------- their sharding rules

RMS_SCALE = torch.ops.mylib.rms_scale.default
RMS_SCALE_BACKWARD = torch.ops.mylib.rms_scale_backward.default
ROPE = torch.ops.mylib.rope.default


def rms_scale_rule(call: OpCall) -> list[AxisStrategy]:
    """(x, weight) -> y. Rows are independent: split any leading dim of x, weight whole. The last dim
    is never split (its mean needs all of it). y is linear in weight: Partial weight, Partial y."""
    x = call.inputs[0]
    rows = [AxisStrategy((Shard(d), R), (Shard(d),)) for d in range(x.ndim - 1)]
    return with_replicated(call, [*rows, AxisStrategy((R, P), (P,))])


def rms_scale_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """(grad, x, weight) -> (grad_x, grad_weight). With rows split, grad_weight (a sum over rows) is a
    Partial summand on each rank. Both outputs are linear in grad."""
    x = call.inputs[1]
    rows = [AxisStrategy((Shard(d), Shard(d), R), (Shard(d), P)) for d in range(x.ndim - 1)]
    return with_replicated(call, [*rows, AxisStrategy((P, R, R), (P, P))])


def rope_rule(call: OpCall) -> list[AxisStrategy]:
    """x -> y: any dim but the last (it holds the rotated pairs) may be split; linear in x."""
    x = call.inputs[0]
    split = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(x.ndim - 1)]
    return with_replicated(call, [*split, AxisStrategy((P,), (P,))])


def localize_rope(ctx: LocalContext) -> LocalCall:
    """A rank holding positions [start, start + t) of a split dim -2 rotates them as those positions."""
    layout = ctx.strategy.inputs[0]
    start = layout.local_offsets(ctx.mesh_shape, ctx.coords)[len(layout.shape) - 2]
    offset = int(ctx.call.arg(1, "offset", 0)) + start
    return LocalCall(ctx.call.op, (ctx.args[0], offset, bool(ctx.call.arg(2, "inverse", False))), {})


def custom_registry() -> RuleRegistry:
    """autopar's rules plus ours; pass it as `registry=` to parallelize, compile_for_rank or plan."""
    registry = default_registry()
    registry.register(RMS_SCALE, rms_scale_rule, family="mylib")
    registry.register(RMS_SCALE_BACKWARD, rms_scale_backward_rule, family="mylib")
    registry.register(ROPE, rope_rule, family="mylib", localize=localize_rope)
    return registry


# ---------------------------------------------------------------- a model that uses them


class RopeBlock(nn.Module):
    """Plain PyTorch apart from calling the two custom ops."""

    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        h = rope(self.inp(x))  # (batch, positions, dim)
        h = h + self.out(F.gelu(self.fc(rms_scale(h, self.norm_weight, 1e-6))))
        return F.mse_loss(h, target)


def make_model(
    seed: int, batch: int = 4, seq: int = 8, dim: int = 32
) -> tuple[RopeBlock, tuple[Tensor, Tensor]]:
    """The model and one batch (x, target), identical for identical arguments."""
    torch.manual_seed(seed)
    model = RopeBlock(dim)
    with torch.no_grad():
        model.norm_weight.uniform_(0.5, 1.5)
    gen = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, seq, dim, generator=gen), torch.randn(batch, seq, dim, generator=gen))


# ---------------------------------------------------------------- using it


def train(steps: int = 3) -> None:
    """On every rank (torchrun): parallelize with our registry and train beside a serial copy."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("x", "y", "z"))
    model, batch = make_model(0)
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=batch, planning=autopar.PlanOptions(registry=custom_registry())
    )
    opt, serial_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pmodel, serial))
    for step in range(steps):
        losses = []
        for m, o in ((pmodel, opt), (serial, serial_opt)):
            o.zero_grad()
            loss = m(*batch)
            loss.backward()
            o.step()
            losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step}: parallel loss {losses[0]:.6f}  serial loss {losses[1]:.6f}")
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-6)
    if dist.get_rank() == 0:
        print(pmodel.plan_summary())


def main() -> int:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        try:
            train()
        finally:
            dist.destroy_process_group()
        return 0
    model, batch = make_model(0)
    registry = custom_registry()
    rows = op_coverage(model, batch, mesh_shape=(2, 2, 2), registry=registry)
    print(format_rows(rows))
    planning = autopar.PlanOptions(hardware="cpu-gloo", planner="greedy", registry=registry)
    print(autopar.plan(model, (2, 2, 2), batch, planning=planning))
    return 1 if any(r.missing for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
