"""Training in lockstep: a compiled model's ranks stepped by an optimizer against the serial model
(loss, every gradient, every parameter), for the tests of whole models."""

from __future__ import annotations

import torch
from pass_fixtures import lockstep_step, run_lockstep
from torch import nn

from autopar.runtime.program import local_value
from autopar.testing import assemble


def hf_step_in_lockstep(
    compiled: dict, parallel: nn.Module, model: nn.Module, kwargs: dict, shape: tuple[int, ...], what: str
) -> None:
    """One training call `model(**kwargs)`: every rank's programs in lockstep from `parallel`'s
    weights against the serial call, backward from the loss. The loss, every other tensor the call
    returns (the logits) and every gradient, assembled from the ranks' blocks, equal serial; the
    gradients are left on `parallel` (the runtime's DTensor parameters' `.grad`) and on `model`,
    for the caller's optimizers. Both sides draw from seed 0 (dropout takes the same masks)."""
    first = next(iter(compiled.values())).program
    assert not first.param_parts, "every parameter is one program input"
    fwd, bwd = lockstep_step(compiled, parallel, shape, (), kwargs)
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)  # the ranks' seed (lockstep_step)
    out = model(**kwargs)
    out.loss.backward()
    wanted = [t.detach() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    for i, (want, lay) in enumerate(zip(wanted, first.output_layouts)):
        got = assemble({c: fwd[c][i] for c in fwd}, lay, shape)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"output {i}, {what}")
    params, serial = dict(parallel.named_parameters()), dict(model.named_parameters())
    for i, (name, lay) in enumerate(zip(first.param_names, first.param_layouts)):
        if name not in params:  # a buffer (rotary frequencies)
            continue
        grad = assemble({c: bwd[c][i] for c in bwd}, lay, shape)
        torch.testing.assert_close(grad, serial[name].grad, atol=2e-5, rtol=1e-4, msg=f"{name}, {what}")
        params[name].grad = grad


def forward_in_lockstep(compiled: dict, parallel: nn.Module, kwargs: dict, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The outputs of forward-only programs (`forward_only=True`), run in lockstep from `parallel`'s
    weights and assembled from the ranks' blocks."""
    programs = {c: comp.program for c, comp in compiled.items()}
    state = {**dict(parallel.named_parameters()), **dict(parallel.named_buffers())}
    inputs = [x for x in torch.utils._pytree.tree_leaves(kwargs) if isinstance(x, torch.Tensor)]
    args = {
        c: [local_value(p.param_value(n, state).detach(), lay, shape, c) for n, lay in zip(p.param_names, p.param_layouts)]
        + [local_value(x, lay, shape, c) for x, lay in zip(inputs, p.input_layouts)]
        for c, p in programs.items()
    }
    torch.manual_seed(0)
    out = run_lockstep({c: p.forward for c, p in programs.items()}, args, shape)
    layouts = next(iter(programs.values())).output_layouts
    return [assemble({c: out[c][i] for c in out}, lay, shape) for i, lay in enumerate(layouts)]


def train_hf_in_lockstep(compiled: dict, model: nn.Module, kwargs: dict, shape: tuple[int, ...], steps: int) -> None:
    """`steps` steps of SGD with momentum: the ranks' programs from `parallel`'s weights, their
    gradients assembled and stepped by one optimizer; `model` stepped serially by another. Loss,
    every gradient and (after the steps) every parameter equal."""
    parallel = type(model)(model.config)  # type: ignore[operator]
    parallel.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        hf_step_in_lockstep(compiled, parallel, model, kwargs, shape, f"step {step}")
        opt.step()
        serial_opt.step()
        opt.zero_grad()
    params = dict(parallel.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p, atol=2e-5, rtol=1e-4, msg=name)
