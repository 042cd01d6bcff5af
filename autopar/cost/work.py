"""The work of an op: flops (or elements produced) of the full op, and the ranks it is divided over.

The simulated timeline and every planner price compute from these two numbers.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Literal

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from autopar.core.errors import AutoparError
from autopar.core.layout import Replicate
from autopar.core.strategy import Strategy
from autopar.cost.hardware import Attention, Elementwise, Rate
from autopar.rules.device_attention import CPU_BACKWARD as BACKWARD
from autopar.rules.device_attention import CPU_FORWARD as FORWARD

AttentionKernel = Literal["flash", "full"]
ATTENTION_KERNELS: tuple[AttentionKernel, ...] = ("flash", "full")
PLANNED_ATTENTION: AttentionKernel = "flash"
"""How a causal attention call (`is_causal=True`) is priced, a property of the run priced:

- "flash": the kernel skips the key blocks above the diagonal, so the call costs its lower
  triangle (`causal_fraction`) and a contiguous sequence split leaves the last rank the most work
  (`planning.ring_cost.causal_imbalance_cost`). FlashAttention 2/3, the memory-efficient and cuDNN
  kernels torch's SDPA picks for a causal call on GPUs, and torch's CPU flash kernel (the op the
  trace records) all do; so do Megatron-Core with Transformer Engine's fused attention, torchtitan
  and NeMo.
- "full": the kernel computes all s x s scores and masks them (Megatron-LM of 2021: `baddbmm` of
  the whole scores, then an upper-triangular masked softmax; no flash attention); the causal call
  costs what the same call without the mask does, on every rank alike.

Every planner prices a plan with PLANNED_ATTENTION, which is what autopar runs: torch's SDPA with
`is_causal=True` on the flash / efficient kernels. The step model takes the run's own
(`planning.step_model.StepConfig.attention`); benchmarks/published.py sets it per published row."""


def work_split(strategy: Strategy, mesh_shape: Sequence[int]) -> int:
    """Ranks an op's work is divided over: every axis on which some output is not replicated."""
    return math.prod(
        mesh_shape[a]
        for a in range(len(mesh_shape))
        if not all(isinstance(out.placements[a], Replicate) for out in strategy.outputs)
    )


_VIEWS = {torch.ops.aten._unsafe_view.default, operator.getitem}


def is_view(node: fx.Node) -> bool:
    """Whether the op only makes a view (no memory traffic): its schema returns aliases."""
    if node.target in _VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def compute_rate(node: fx.Node, attention: AttentionKernel = PLANNED_ATTENTION) -> Rate:
    """How an op is priced (`autopar.cost.formulas.compute_time`): matmuls (grouped ones too) by
    their flops at their dtype's rate; a fused attention call under flash kernels (`attention`,
    see PLANNED_ATTENTION) as `Attention`, at its kernel's rate for its head dimension, sequence,
    pass and mask; under "full" (all the scores by batched matmuls) at the matmul rate; every
    other op as `Elementwise`, by the bytes it moves. The dtype is the op's first floating-point
    result's (under autocast a matmul's result is bfloat16, a cast's the dtype it casts to);
    float32 otherwise."""
    dtype = torch.float32
    for value in pytree.tree_leaves(node.meta.get("val")):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            dtype = value.dtype
            break
    name = str(node.target)
    if getattr(node.target, "overloadpacket", None) in flop_registry:
        return dtype
    if "scaled_dot_product" in name and attention == "flash":
        q = node.args[0]
        if isinstance(q, fx.Node) and isinstance(q.meta.get("val"), torch.Tensor) and q.meta["val"].dim() == 4:
            _, _, seq, head_dim = q.meta["val"].shape
            return Attention(dtype, int(head_dim), int(seq), "backward" in name, is_causal_attention(node))
    if "scaled_dot_product" in name or "grouped_mm" in name or "routed_experts" in name:
        return dtype
    return Elementwise(dtype, runs=not is_view(node))


def global_work(node: fx.Node, attention: AttentionKernel = PLANNED_ATTENTION) -> float:
    """Flops of the full op (matmuls, attention) or elements produced (everything else). A causal
    attention call costs its lower triangle where the run's kernel skips the masked blocks
    (`attention`, see PLANNED_ATTENTION)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    out = node.meta.get("val")
    if packet in flop_registry:
        args = pytree.tree_map(lambda x: x.meta["val"] if isinstance(x, fx.Node) else x, node.args)
        kwargs = pytree.tree_map(lambda x: x.meta["val"] if isinstance(x, fx.Node) else x, node.kwargs)
        try:
            return float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take this overload's arguments
            pass
    name = str(target)
    if "scaled_dot_product" in name:
        q = node.args[0]
        if isinstance(q, fx.Node):
            b, h, s, d = q.meta["val"].shape
            full = 4.0 * b * h * s * s * d * (2.5 if "backward" in name else 1.0)
            return full * causal_fraction(s) if causal_skipped(node, attention) else full
    if "grouped_mm" in name:
        return _grouped_mm_flops(node, backward="backward" in name)
    if "routed_experts" in name:
        return _routed_experts_flops(node, backward="backward" in name)
    numel = sum(v.numel() for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor))
    return float(numel)


def _routed_experts_flops(node: fx.Node, backward: bool) -> float:
    """One MoE layer's routed experts as one op (`autopar::routed_experts`: x (t, H), ids (t, k),
    weights, gate_up (E, 2I, H), down (E, H, I)): each of the t·k pairs runs its expert's gated MLP,
    2·H·2I + 2·I·H = 6·H·I flops forward; the backward op recomputes that and takes both matmuls'
    two gradients, 18·H·I, whatever the routing."""
    at = 1 if backward else 0
    ids, down = node.args[at + 1], node.args[at + 4]
    if not isinstance(ids, fx.Node) or not isinstance(down, fx.Node):
        return 0.0
    tokens, top_k = ids.meta["val"].shape
    _, hidden, inner = down.meta["val"].shape
    return (18.0 if backward else 6.0) * tokens * top_k * hidden * inner


def is_causal_attention(node: fx.Node) -> bool:
    """Whether a node is the CPU attention pair (what the trace records) with its `is_causal` flag:
    torch's causal mask, which the kernels skip rather than compute."""
    if node.target not in (FORWARD, BACKWARD):
        return False
    at = 7 if node.target == BACKWARD else 4
    flag = node.args[at] if len(node.args) > at else node.kwargs.get("is_causal", False)
    return bool(flag)


def causal_skipped(node: fx.Node, attention: AttentionKernel = PLANNED_ATTENTION) -> bool:
    """Whether `node` is a causal attention call whose masked blocks the run's kernel skips: what
    prices it at its triangle and a contiguous sequence split of it at its busiest rank."""
    if attention not in ATTENTION_KERNELS:
        raise AutoparError(
            f"attention kernel {attention!r} is not one the cost model knows",
            op=str(node.target),
            hint=f"use one of {ATTENTION_KERNELS} (cost.work.PLANNED_ATTENTION says what each prices)",
        )
    return attention == "flash" and is_causal_attention(node)


def causal_fraction(seq: int) -> float:
    """The share of the (seq, seq) scores a causal kernel computes: the lower triangle with its
    diagonal, (seq + 1) / (2 seq). The flash kernels skip the tiles above the diagonal, so a causal
    call costs about half of the same call without the mask."""
    return (seq + 1) / (2 * seq)


def _grouped_mm_flops(node: fx.Node, backward: bool) -> float:
    """A grouped matmul of mixture-of-experts layers (transformers' `grouped_mm_fallback` and its
    backward; input (S, K), weight (E, K, N)): every row meets one expert's (K, N) matrix, so
    2 S K N flops forward, twice that backward (the input's and the weight's gradients), whatever
    the routing. `torch._grouped_mm`'s other forms cost the same per element of the first operand
    times N: (K, S) x (S, N) -> (E, K, N) sums each of the S rows once (2 K S N), and the batched
    (E, M, K) x (E, K, N) is 2 E M K N."""
    first, weight = node.args[0], node.args[1]
    if not isinstance(first, fx.Node) or not isinstance(weight, fx.Node):
        return 0.0
    n = weight.meta["val"].shape[-1]
    return 2.0 * first.meta["val"].numel() * n * (2.0 if backward else 1.0)
