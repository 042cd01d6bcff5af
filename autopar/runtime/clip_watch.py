"""The pipeline's clipping slip: `torch.nn.utils.clip_grad_norm_(pmodel.parameters(), c)` on a
pipelined module, README's loop habit on a tensor-only module.

A rank of a pipeline holds only its stages' gradients, so torch's function, which sees no other
rank, takes the norm of those stages alone and scales them by `c / stage_norm`: every stage whose
own norm passes `c` is clipped by its own factor, the others not at all, and the step differs from
serial's without an error (a timm ViT on pp=2 trained 4.5e-4 away from serial in 3 steps).
`PipelinedModule.clip_grad_norm_` is the serial clip.

torch's function cannot be seen while it runs (it reads plain tensors on a 1-D pp mesh); what it
leaves can. After each backward the watch keeps a few elements of every gradient this rank holds
(the first 8 of each local block, gathered into one float64 vector by one `cat` and one
conversion: no pass over the gradients, no collective); at the next step of an optimizer over
those parameters it compares. When every kept element changed by one common
factor below 1 that is not a power of two, some code scaled all of this rank's gradients alike,
and not the module's own clip (which records what it leaves): that is a norm clip taken on this
rank, and the step warns (`PipelineClipWarning`). Changes it leaves alone: none, an elementwise
clip (`clip_grad_value_`: no common factor), part of the gradients scaled, GradScaler's unscale
(a power of two, exactly). What it cannot see: a step where no stage's own norm passed `c` while
the whole model's did (torch's clip then changes nothing, serial's would).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

from autopar.core.errors import PipelineClipWarning

# Elements kept of each gradient's local block: enough that a common factor is not a coincidence.
KEPT = 8
# How far the kept elements' factors may spread and still be one factor (float32 rounding: ~1e-7).
SPREAD = 1e-5


def _slices(params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `KEPT` elements of each held gradient's local block, as views (no copy yet)."""
    out = []
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        if local.numel():
            out.append((p, local.detach().reshape(-1)[:KEPT]))
    return out


def _gathered(slices: Sequence[torch.Tensor]) -> torch.Tensor:
    """The slices as one float64 vector: one `cat` (which promotes mixed float dtypes exactly) and
    one conversion, not a copy per parameter (a model has hundreds of gradients)."""
    return torch.cat(list(slices)).to(torch.float64, copy=True)


class ClipWatch:
    """What this rank's gradients held after the last backward (or the module's own clip), to
    tell at the next optimizer step whether a norm clip of this rank alone scaled them."""

    def __init__(self) -> None:
        # The parameters whose gradients were kept, each slice's length, and the slices in one
        # float64 vector.
        self._kept: tuple[list[torch.Tensor], list[int], torch.Tensor] | None = None

    def after_backward(self, params: Sequence[torch.Tensor]) -> None:
        """Called inside a backward: records `params`' gradients once the backward has accumulated
        every `.grad`."""
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.record(params))  # type: ignore[attr-defined]

    def record(self, params: Sequence[torch.Tensor]) -> None:
        kept = _slices(params)
        if not kept:
            self._kept = None
            return
        self._kept = ([p for p, _ in kept], [len(v) for _, v in kept], _gathered([v for _, v in kept]))

    def check(self, optimizer: Optimizer) -> None:
        kept, self._kept = self._kept, None
        if kept is None:
            return
        params, lengths, before_all = kept
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not any(id(p) in mine for p in params):
            self._kept = kept  # another optimizer's step: keep for this module's own
            return
        now = _slices(params)
        if [id(p) for p, _ in now] != [id(p) for p in params] or [len(v) for _, v in now] != lengths:
            return  # a gradient set to None or resized since the backward: not a clip
        both = torch.stack([before_all, _gathered([v for _, v in now])]).cpu()  # one copy from the device
        before_all, now_all = both[0], both[1]
        nonzero = before_all != 0
        if bool((now_all[~nonzero] != 0).any()) or not bool(nonzero.any()):
            return
        found = now_all[nonzero] / before_all[nonzero]
        factor = float(found.mean())
        if float((found - factor).abs().max()) > SPREAD * abs(factor) or not 0.0 < factor < 1.0 - SPREAD:
            return
        if abs(math.log2(factor) - round(math.log2(factor))) < 1e-9:
            return  # GradScaler's unscale, a halving: the same on every rank
        warnings.warn(
            f"every gradient this pipeline rank holds was scaled by {factor:.6g} after the backward, "
            "as torch.nn.utils.clip_grad_norm_(pmodel.parameters(), max_norm) does: on a pipelined "
            "module it takes the norm of this rank's stages only, so each stage is clipped by its own "
            "norm and the step differs from serial's. Call pmodel.clip_grad_norm_(max_norm) instead: "
            "the whole model's norm, the serial clip (docs/pipeline.md#what-differs-from-a-tensor-parallel-module)",
            PipelineClipWarning,
            stacklevel=4,  # the user's optimizer.step() line (through torch's step wrapper and the hook)
        )


def watch_clipping(module: Any) -> ClipWatch:
    """A `ClipWatch` checked at every optimizer step while `module` lives; the module calls
    `after_backward` in its backwards and `record` after its own clip. Holds the module weakly."""
    watch = ClipWatch()
    alive = weakref.ref(module)

    def before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if alive() is not None:
            watch.check(optimizer)

    handle = register_optimizer_step_pre_hook(before_step)
    weakref.finalize(module, handle.remove)
    return watch
