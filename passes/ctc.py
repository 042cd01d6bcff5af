"""Part of trace: `F.ctc_loss` (and `nn.CTCLoss`) exported as autopar's fixed-shape CTC op.

torch's own CTC op sizes an output by the longest target, a value fake tensors do not know, so
torch.export refuses it. While the model is exported (and in the recorded run that finds repeated
blocks, passes/repeats_find.py), `CTCRoute` catches `torch.ctc_loss` calls
whose targets are padded to (N, S) and computes them as torch's composite does (the unbatched
case as a batch of one, infinite losses zeroed under `zero_infinity`, then the reduction), with
`autopar::ctc_loss` in place of `aten._ctc_loss` (`autopar/rules/ctc.py`). Targets concatenated
into one 1-D tensor are left to torch: which sample owns which target is read from the lengths'
values, and the trace's refusal names that (`CTC_HINT` in passes/trace.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from autopar.rules.ctc import ctc_loss

_CTC_FUNCTIONS = (torch.ctc_loss, torch.nn.functional.ctc_loss)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


class CTCRoute(TorchFunctionMode):
    """Routes CTC losses with padded targets to `autopar::ctc_loss` while it is active."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _CTC_FUNCTIONS:
            routed = _route(func is torch.nn.functional.ctc_loss, tuple(args), kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)


def _route(functional: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """torch's composite ctc_loss over `autopar::ctc_loss`; None where it does not apply."""
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction", "zero_infinity")
    defaults: dict[str, Any] = {"blank": 0, "reduction": "mean" if functional else 1, "zero_infinity": False}
    bound = {**defaults, **dict(zip(names, args)), **kwargs}
    log_probs, targets = bound["log_probs"], bound["targets"]
    if not isinstance(log_probs, Tensor) or not isinstance(targets, Tensor):
        return None
    batched = log_probs.dim() == 3
    if targets.dim() != (2 if batched else 1):  # concatenated targets: owners read from values
        return None
    if not batched:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
    lengths = [_as_lengths(bound[k], log_probs) for k in ("input_lengths", "target_lengths")]
    reduction = bound["reduction"]
    reduction = _REDUCTIONS[reduction] if isinstance(reduction, str) else int(reduction)
    zero_infinity = bool(bound["zero_infinity"])
    nll, _ = ctc_loss(log_probs, targets, lengths[0], lengths[1], int(bound["blank"]), zero_infinity)
    if zero_infinity:
        nll = torch.where(nll == float("inf"), torch.zeros((), dtype=nll.dtype), nll)
    if reduction == 1:
        return (nll / lengths[1].clamp_min(1)).mean()
    if reduction == 2:
        return nll.sum()
    return nll if batched else nll.squeeze(0)


def _as_lengths(value: Any, log_probs: Tensor) -> Tensor:
    """Lengths given as a tensor, or as a list or tuple of ints (a constant of the program)."""
    if isinstance(value, Tensor):
        return value.reshape(-1).long()
    return torch.tensor(list(value), dtype=torch.long, device=log_probs.device).reshape(-1)
