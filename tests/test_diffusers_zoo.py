"""The diffusers sweep's models (`examples/diffusers_zoo.py`) build at toy size and train serially
with their loss outside the model, so that `benchmarks/diffusers_sweep.py` never rots unnoticed
(a diffusers release renaming an argument or an output field fails here, in seconds)."""

from __future__ import annotations

import pytest
import torch

from examples import diffusers_zoo

pytest.importorskip("diffusers")


@pytest.mark.parametrize("case", diffusers_zoo.CASES, ids=lambda c: c.name)
def test_builds_and_returns_a_loss_serially(case: diffusers_zoo.Case) -> None:
    model, batch = case.build(torch.float32)
    args, kwargs = case.inputs(batch)
    torch.manual_seed(0)  # DiT drops class labels at random in training mode
    loss = case.loss(model(*args, **kwargs), batch)
    assert loss.dim() == 0 and torch.isfinite(loss), loss
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    inside = diffusers_zoo.LossInside(model, case)  # the lockstep harness's form: the same loss
    torch.manual_seed(0)
    torch.testing.assert_close(inside(*batch), loss.detach(), atol=0, rtol=0)
