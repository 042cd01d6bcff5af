"""Training in lockstep: a compiled model's ranks stepped by an optimizer against the serial model
(loss, every gradient, every parameter), for the tests of whole models."""

from __future__ import annotations

import torch
from pass_fixtures import lockstep_step
from torch import nn

from autopar.testing import assemble


def train_hf_in_lockstep(compiled: dict, model: nn.Module, kwargs: dict, shape: tuple[int, ...], steps: int) -> None:
    """`steps` steps of SGD with momentum: the ranks' programs from `parallel`'s weights, their
    gradients assembled and stepped by one optimizer; `model` stepped serially by another. Loss,
    every gradient and (after the steps) every parameter equal."""
    parallel = type(model)(model.config)  # type: ignore[operator]
    parallel.load_state_dict(model.state_dict())
    first = next(iter(compiled.values())).program
    assert not first.param_parts, "every parameter is one program input"
    params = dict(parallel.named_parameters())
    opt = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        fwd, bwd = lockstep_step(compiled, parallel, shape, (), kwargs)
        loss = assemble({c: fwd[c][0] for c in fwd}, first.output_layouts[0], shape)
        serial_opt.zero_grad()
        want = model(**kwargs).loss
        want.backward()
        torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-5, msg=f"loss, step {step}")
        opt.zero_grad()
        serial = dict(model.named_parameters())
        for i, (name, lay) in enumerate(zip(first.param_names, first.param_layouts)):
            if name not in params:  # a buffer (rotary frequencies)
                continue
            grad = assemble({c: bwd[c][i] for c in bwd}, lay, shape)
            torch.testing.assert_close(grad, serial[name].grad, atol=2e-5, rtol=1e-4, msg=f"{name}, step {step}")
            params[name].grad = grad
        opt.step()
        serial_opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p, atol=2e-5, rtol=1e-4, msg=name)
