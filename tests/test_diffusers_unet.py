"""diffusers' UNet2DModel trained as diffusers trains it (noise prediction, MSE), on every rank in
lockstep against serial: the loss, every gradient and every parameter after two SGD-with-momentum
steps, on (2,), (4,) and 2x2x2 meshes (all four meshes in both dtypes when the fix was made).

Its attention block ends in a reshape of a transpose, so the serial activations after it are
channels-last; a rank's blocks of them arrive contiguous after a redistribution. group_norm's CPU
backward kernel reads its gradient in its input's memory format without checking it: before
`local_ops.group_norm_backward_block` this model's gradients were silently wrong on (2,) (82 of 144
by 0.3-1.5 relative) and the forward raised "Expected X.is_contiguous(memory_format)" on larger
meshes (a batch block of one sample of a channels-last tensor).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from pass_fixtures import compile_every_rank, lockstep_step
from torch import nn

from autopar.testing import assemble
from examples import diffusers_zoo

diffusers = pytest.importorskip("diffusers")

STEPS = 2
LR = 0.1


class NoisePrediction(nn.Module):
    """diffusers' training step, `F.mse_loss(unet(noisy, t).sample, noise)`, inside a module."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.unet(noisy, timesteps).sample, noise)


def _case(dtype: torch.dtype) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The examples' toy UNet2DModel (seeded by itself) and a batch per step."""
    unet = diffusers_zoo.toy_unet2d()
    model = NoisePrediction(unet).to(dtype)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        noise = torch.randn(4, 3, 8, 8, generator=gen, dtype=dtype)
        clean = torch.randn(4, 3, 8, 8, generator=gen, dtype=dtype)
        timesteps = torch.randint(0, 1000, (4,), generator=gen)
        batches.append((clean + noise, timesteps, noise))
    return model, batches


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    # float32: sums over other block orders round differently (relative to the tensor's scale)
    atol, rtol = (1e-10, 1e-8) if dtype == torch.float64 else (2e-5, 2e-4)
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, atol=max(atol, rtol * scale), rtol=rtol, msg=what)


# Each mesh ran in both dtypes when the fix was made (docs/debugging.md); kept here: the silent case
# ((2,), float64, where float32 noise cannot hide it) and two of the meshes whose forward raised.
CASES = [((2,), torch.float64), ((4,), torch.float32), ((2, 2, 2), torch.float64)]


@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=["2-float64", "4-float32", "2x2x2-float64"])
def test_unet2d_trains_equal_to_serial(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    model, batches = _case(dtype)
    serial = copy.deepcopy(model)
    compiled = compile_every_rank(model, shape, batches[0])
    program = next(iter(compiled.values())).program
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=LR, momentum=0.9)
    params = dict(model.named_parameters())
    for step, batch in enumerate(batches):
        fwd, bwd = lockstep_step(compiled, model, shape, batch, {})
        serial_opt.zero_grad()
        loss = serial(*batch)
        loss.backward()
        for coords, outs in fwd.items():
            _close(outs[0], loss.detach(), dtype, f"step {step} loss on {coords}")
        serial_grads = {name: p.grad for name, p in serial.named_parameters()}
        assert sorted(program.param_names) == sorted(params)  # every weight is a whole parameter here
        for i, (name, layout) in enumerate(zip(program.param_names, program.param_layouts)):
            grad = assemble({c: bwd[c][i] for c in bwd}, layout, shape, atol=1e-4, rtol=1e-4)
            _close(grad, serial_grads[name], dtype, f"step {step} gradient of {name}")
            params[name].grad = grad.to(dtype)
        opt.step()
        serial_opt.step()
    for name, p in serial.named_parameters():
        _close(params[name].detach(), p.detach(), dtype, f"{name} after {STEPS} steps")
