"""What a pipelined training step costs beyond its stages' forward and backward (issue 29): the
weight state a rank keeps, the data axis's gradient reduction, the optimizer step, and full
activation recomputation. `autopar.planning.stage_cut` prices a cut with them.

- *Weight state* (`WeightState`): bytes per trainable parameter element. `PLAIN` is what
  `parallelize` runs, with or without `mp_policy`: the stored parameter in the traced dtype, its
  gradient in the same dtype, AdamW's two states in it too (torch allocates `exp_avg` and
  `exp_avg_sq` like the parameter). Under `mp_policy` the stored parameters are float32 masters
  (the bfloat16 copies are casts on read, saved for backward as activations), so the traced
  graph's float32 parameters give 4 + 4 + 8 = 16 bytes. `MIXED_ADAMW` is for a graph traced
  with bfloat16 weights standing in for a mixed-precision run (the PTD-P benchmark): bfloat16
  weight 2 + float32 gradient 4 (gradients accumulate and reduce in float32, Megatron's default
  for bfloat16) + float32 master 4 + AdamW 8 = 18 bytes, the "float16 param, fp32 grads: 18" row
  of https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html.
- *Gradient reduction*: gradients accumulate locally over the microbatches and the data axis
  reduces them once per step. Each rank reduces its stages' gradients in one bucket per unit as
  its last backward finishes them (DDP's and Megatron's overlapped reduction): what is exposed is
  what runs past that backward, and at least the last unit's bucket, which is ready only when the
  backward ends (`exposed_reduction`).
- *Optimizer step*: one memory-bound pass over the states after the reduction: the gradient is
  read, the master (or the weight) and the AdamW states read and written, and a master's new
  value written back to the weight (`WeightState.step_bytes`), at the memory bandwidth a pass of
  that size reaches (`optimizer_seconds`).
- *A rank's step* (`rank_step_end`): its schedule's end, then the exposed part of its
  reduction, then its optimizer step. `StageCut.step_time` (the planner) and
  `autopar.planning.step_model` (the calibrated model held against published runs) both end a
  step with it.
- *Recomputation* of the numbered blocks (`is_recomputed`; `RECOMPUTE_MODES`): "full"
  (Megatron's `--recompute-granularity full`, per layer): a block's forward runs again in its
  backward; in flight it keeps only its input, and while its backward runs one microbatch of its
  activations exists again. "selective" (torch's selective checkpointing that keeps matmul and
  attention outputs): a block's element-wise forward ops run again in its backward; in flight it
  keeps its input and the saved values that matmuls and attention made, and the element-wise ones
  exist again for one microbatch while its backward runs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.meta import has_info, info, signature
from autopar.core.pipeline_schedule import ActionKind
from autopar.core.pipeline_simulate import TimedAction
from autopar.core.plan import Plan
from autopar.cost.formulas import MeshCost
from autopar.cost.hardware import Hardware

_BLOCK = re.compile(r"\.\d+$")  # a unit that is one block of a repeated container: "blocks.3"


@dataclass(frozen=True)
class WeightState:
    """Bytes per trainable parameter element, by kind; None: the traced parameter's own itemsize
    (`optimizer` None: two states of that itemsize, AdamW's `exp_avg` and `exp_avg_sq`)."""

    weight: float | None = None
    grad: float | None = None
    master: float = 0.0  # a float32 copy the optimizer updates, under mixed precision
    optimizer: float | None = None

    def kinds(self, itemsize: int) -> tuple[float, float, float, float]:
        """(weight, gradient, master, optimizer) bytes of one element of a parameter whose traced
        dtype has `itemsize` bytes."""
        weight = float(itemsize) if self.weight is None else self.weight
        grad = weight if self.grad is None else self.grad
        optimizer = 2.0 * itemsize if self.optimizer is None else self.optimizer
        return weight, grad, self.master, optimizer

    def bytes(self, itemsize: int) -> float:
        """All bytes a rank keeps per element it holds."""
        return sum(self.kinds(itemsize))

    def grad_bytes(self, itemsize: int) -> float:
        """Bytes per element of the gradient the data axis reduces."""
        return self.kinds(itemsize)[1]

    def step_bytes(self, itemsize: int) -> float:
        """Bytes the optimizer step moves per element: the gradient read, the master (or the
        weight) and the optimizer states read and written, the weight written from the master."""
        weight, grad, master, optimizer = self.kinds(itemsize)
        updated = master if master > 0 else weight
        return grad + 2 * updated + 2 * optimizer + (weight if master > 0 else 0.0)


PLAIN = WeightState()
MIXED_ADAMW = WeightState(weight=2.0, grad=4.0, master=4.0, optimizer=8.0)
WEIGHT_STATES = {"plain": PLAIN, "mixed": MIXED_ADAMW}  # `PlanOptions.weight_state`'s names
_HALF = (torch.bfloat16, torch.float16)


def weight_state_for(gm: fx.GraphModule, chosen: WeightState | str | None) -> WeightState:
    """The weight state a plan of the traced `gm` is priced with: `chosen` by name
    (`WEIGHT_STATES`) or as given; None by the trainable parameters' traced dtype, what a user
    training with mixed-precision AdamW keeps: 16-bit parameters stand for a mixed-precision run
    (`MIXED_ADAMW`: float32 gradients, masters and AdamW states beside them), float32 ones are
    the masters themselves (`PLAIN`: 16 bytes, what `parallelize` with `mp_policy` keeps)."""
    if isinstance(chosen, WeightState):
        return chosen
    if chosen is not None:
        if chosen not in WEIGHT_STATES:
            raise AutoparError(
                f"weight_state={chosen!r} is not a weight state the planner prices",
                hint=f"one of {', '.join(map(repr, WEIGHT_STATES))}, or None for the parameters' dtype",
            )
        return WEIGHT_STATES[chosen]
    sig = signature(gm)
    dtypes = {
        n.meta["val"].dtype
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and has_info(n)
        and info(n).role == "param"
        and sig.requires_grad.get(info(n).param_name or n.name, True)
        and isinstance(n.meta.get("val"), torch.Tensor)
    }
    return MIXED_ADAMW if dtypes and dtypes <= set(_HALF) else PLAIN


RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_mode(recompute: bool | str) -> str:
    """`recompute` as one of `RECOMPUTE_MODES` (True: "full", False: "none")."""
    mode = {True: "full", False: "none"}.get(recompute, recompute) if isinstance(recompute, bool) else recompute
    if mode not in RECOMPUTE_MODES:
        raise AutoparError(
            f"recompute={recompute!r} is not a recomputation the step accounting prices",
            hint=f"one of {', '.join(map(repr, RECOMPUTE_MODES))}",
        )
    return mode


def is_recomputed(unit_name: str) -> bool:
    """Whether full recomputation runs this unit's forward again: one block of a repeated
    container (a transformer layer), as Megatron's full recomputation does; embeddings, the
    final norm and the head keep their activations."""
    return _BLOCK.search(unit_name) is not None


def exposed_reduction(seconds: float, last_backward: float, buckets: int) -> float:
    """The part of a rank's once-per-step gradient reduction (`seconds` in all) that runs past its
    last backward (`last_backward` seconds, the rank's final backward action). Its `buckets` (one
    per unit it holds, equal) become ready evenly through that backward, bucket i at i * B / k,
    and reduce one after another, each in R / k: the last finishes at max over i of
    i B / k + (k - i + 1) R / k, at i = 1 or i = k, so max(R - B + B / k, R / k) after the end."""
    if seconds <= 0:
        return 0.0
    k = max(1, buckets)
    return max(seconds - last_backward + last_backward / k, seconds / k)


BACKWARD_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


def optimizer_seconds(nbytes: float, hw: Hardware) -> float:
    """The optimizer step's one pass over `nbytes` of state, at the fraction of the memory
    bandwidth a pass of that size reaches (the whole bandwidth on a table without kernel rates)."""
    if nbytes <= 0:
        return 0.0
    fraction = hw.kernels.memory_fraction(nbytes) if hw.kernels is not None else 1.0
    return nbytes / (hw.memory_bandwidth * fraction)


def rank_step_end(actions: Sequence[TimedAction], reduce: float, buckets: int, optimizer: float) -> float:
    """When a rank's step ends: its last scheduled action, then what runs past its last backward
    of its `reduce` seconds of gradient reduction in `buckets` buckets (`exposed_reduction`), then
    its `optimizer` seconds."""
    end = actions[-1].end if actions else 0.0
    last = next((a.end - a.start for a in reversed(actions) if a.action.kind in BACKWARD_KINDS), 0.0)
    return end + exposed_reduction(reduce, last, buckets) + optimizer


def gradient_reduction_time(
    gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int], hardware: Hardware
) -> float:
    """Seconds one rank spends reducing the gradients under `plan` on a mesh of `mesh_shape`: the
    redistributions of the joint graph's gradient outputs from the layout backward leaves them in
    (partial over a data axis) to the one the plan stores them in (an all-reduce, or a
    reduce-scatter for sharded weights), each priced alone, as `plan_cost_parts` prices outputs.
    A pipeline runs them once per step, not once per microbatch."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    cost = MeshCost.build(hardware, mesh_shape)
    seconds = 0.0
    for i in range(signature(gm).num_user_outputs, len(outputs)):
        src = outputs[i]
        wanted = plan.output_layouts[i] if i < len(plan.output_layouts) else None
        if isinstance(src, fx.Node) and wanted is not None and src.name in plan.layouts:
            seconds += cost.redistribute(plan.layouts[src.name][0], wanted)
    return seconds
