"""Module surgery and hooks a user adds, one feature per run.

torchrun --standalone --nproc_per_node=4 probe/surgery.py FEATURE
FEATURE: weight_norm | spectral_norm | parametrize | orthogonal | training_branch | val_every |
         grad_clamp | pre_hook | old_weight_norm
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from common import compare, finish, maxdiff, say, setup
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import autopar

feature = sys.argv[1]
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
mesh = setup()
B, D = 8, 16


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 32)
        self.fc2 = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(32, 4)
        self.noise_scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.training:  # a branch on the mode: scale in training only (like a stochastic-depth net)
            h = h * self.noise_scale
        h = self.drop(F.gelu(self.fc2(h)))
        return self.head(h)


torch.manual_seed(0)
model = Net().to(dtype)
if feature == "weight_norm":
    weight_norm(model.fc1)
    weight_norm(model.fc2, dim=1)
elif feature == "old_weight_norm":
    nn.utils.weight_norm(model.fc1)
elif feature == "spectral_norm":
    spectral_norm(model.fc2)
elif feature == "parametrize":
    parametrize.register_parametrization(model.fc2, "weight", Symmetric())
elif feature == "orthogonal":
    orthogonal(model.fc2)
elif feature == "pre_hook":
    model.fc2.register_forward_pre_hook(lambda mod, args: (args[0] * 2.0,))
if feature not in ("training_branch", "val_every"):
    model.drop.p = 0.0
serial = copy.deepcopy(model)

g = torch.Generator().manual_seed(1234)
data = [(torch.randn(B, D, generator=g, dtype=dtype), torch.randint(0, 4, (B,), generator=g))
        for _ in range(4)]
pmodel = autopar.parallelize(model, mesh, example_inputs=(data[0][0],))
if feature == "grad_clamp":
    for m in (serial, pmodel):
        for p in m.parameters():
            p.register_hook(lambda grad: grad.clamp(-0.01, 0.01))
opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
tol = 2e-5 if dtype == torch.float32 else 1e-10
ok = True
torch.manual_seed(7)
for step, (x, y) in enumerate(data):
    opt_s.zero_grad()
    opt_p.zero_grad()
    state = torch.get_rng_state()
    ls = F.cross_entropy(serial(x), y)
    ls.backward()
    torch.set_rng_state(state)
    lp = F.cross_entropy(pmodel(x), y)
    lp.backward()
    say(f"step {step}: loss serial {ls.item():.6f} par {lp.item():.6f} diff {maxdiff(ls, lp):.2e}")
    ok &= maxdiff(ls, lp) <= tol
    ok &= compare(serial, pmodel, f"grads step {step}", tol) <= tol
    opt_s.step()
    opt_p.step()
    if feature == "val_every" and step % 2 == 1:
        serial.eval()
        pmodel.eval()
        with torch.no_grad():
            vs, vp = serial(data[0][0]), pmodel(data[0][0])
        say(f"  validation logits diff {maxdiff(vs, vp):.2e}")
        ok &= maxdiff(vs, vp) <= tol
        serial.train()
        pmodel.train()
ok &= compare(serial, pmodel, "params after steps", tol, grads=False) <= tol
finish(ok)
