"""CTC loss (speech recognition): the fixed-shape op autopar traces `F.ctc_loss` to, and its rules.

torch's `aten._ctc_loss` returns, beside each sample's negative log likelihood, the table of forward
variables `log_alpha` of shape (N, T, 2 * max(target_lengths) + 1): a size read from the lengths'
values, which fake tensors cannot know, so torch.export refuses the op. With targets padded to
(N, S), no target is longer than S, and a table of 2 * S + 1 positions holds every sample's; the
entries past a sample's 2 * length + 1 are never read (`_ctc_loss_backward` stops there). So
`autopar::ctc_loss` runs torch's kernel and pads the table to that static size with -inf; its
backward is torch's own `aten._ctc_loss_backward`, which is traceable. `passes/ctc.py` routes
`torch.ctc_loss` calls to it while the model is exported.

Samples are independent: the batch dim is split on every tensor alike (dim 1 of log_probs, which
is (T, N, C)); time and classes are never split (the recursion runs over time, each step mixes the
classes of the sample's target).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from autopar.core.layout import P, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall
from autopar.rules.base import RuleRegistry, with_replicated
from autopar.rules.pointwise import partial_ok

aten = torch.ops.aten

FAMILY = "nn"


@torch.library.custom_op("autopar::ctc_loss", mutates_args=())
def ctc_loss(
    log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor, blank: int, zero_infinity: bool
) -> tuple[Tensor, Tensor]:
    """(T, N, C) log probabilities, (N, S) padded targets, (N,) lengths -> ((N,) negative log
    likelihood, (N, T, 2 * S + 1) log_alpha padded with -inf)."""
    nll, log_alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    n, t, width = log_alpha.shape[0], log_alpha.shape[1], 2 * targets.shape[1] + 1
    padded = log_alpha.new_full((n, t, width), float("-inf"))
    padded[..., : log_alpha.shape[2]] = log_alpha
    # torch's kernel leaves the entries past each sample's frames and positions unwritten (its
    # backward never reads them): -inf there makes the table a function of the inputs alone.
    frames = torch.arange(t, device=padded.device)[None, :, None] < input_lengths.reshape(n, 1, 1)
    positions = torch.arange(width, device=padded.device)[None, None, :] < 2 * target_lengths.reshape(n, 1, 1) + 1
    return nll, padded.masked_fill(~(frames & positions), float("-inf"))


@ctc_loss.register_fake
def _(
    log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor, blank: int, zero_infinity: bool
) -> tuple[Tensor, Tensor]:
    t, n = log_probs.shape[0], log_probs.shape[1]
    return log_probs.new_empty((n,)), log_probs.new_empty((n, t, 2 * targets.shape[1] + 1))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths, *output)
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx: Any, grad: Tensor, _grad_alpha: Tensor) -> tuple[Tensor | None, ...]:
    """torch's derivative of `_ctc_loss`: only the likelihood's gradient flows (log_alpha is an
    intermediate the backward kernel reads)."""
    log_probs, targets, input_lengths, target_lengths, nll, log_alpha = ctx.saved_tensors
    grad_log_probs = aten._ctc_loss_backward.Tensor(
        grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, ctx.blank, ctx.zero_infinity
    )
    return grad_log_probs, None, None, None, None, None


ctc_loss.register_autograd(_backward, setup_context=_setup)

CTC_LOSS = torch.ops.autopar.ctc_loss.default
CTC_LOSS_BACKWARD = aten._ctc_loss_backward.Tensor


def ctc_loss_rule(call: OpCall) -> list[AxisStrategy]:
    """(log_probs (T, N, C), targets (N, S), input_lengths, target_lengths) -> (nll, log_alpha):
    split the batch on all of them."""
    batch = AxisStrategy((Shard(1), Shard(0), Shard(0), Shard(0)), (Shard(0), Shard(0)))
    return with_replicated(call, [batch])


def ctc_loss_backward_rule(call: OpCall) -> list[AxisStrategy]:
    """(grad (N,), log_probs, targets, input_lengths, target_lengths, nll, log_alpha) -> grad of
    log_probs: split the batch on all of them; the gradient is linear in `grad` (each sample's
    gradient is its log_probs' softmax minus the alignment posteriors, times that sample's grad)."""
    batch = AxisStrategy((Shard(0), Shard(1), *(Shard(0),) * 5), (Shard(1),))
    strategies = [batch]
    if partial_ok([call.inputs[0]], call.outputs):
        strategies.append(AxisStrategy((P, *(R,) * 6), (P,)))
    return with_replicated(call, strategies)


def register(registry: RuleRegistry) -> None:
    rules = registry.family(FAMILY, uneven=True)
    rules.register(CTC_LOSS, ctc_loss_rule)
    rules.register(CTC_LOSS_BACKWARD, ctc_loss_backward_rule)
