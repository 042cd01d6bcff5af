"""timm image classifier, loss outside the model, as timm's train.py writes it.

torchrun --standalone --nproc_per_node=4 probe/timm_cls.py resnet18 ce float32
losses: ce (F.cross_entropy), smooth (label_smoothing=0.1), soft (mixup-style soft targets)
"""

from __future__ import annotations

import copy
import sys

import timm
import torch
import torch.nn.functional as F
import tv_preload  # noqa: F401  (before timm: lets PyPI's torchvision import beside CPU torch)
from common import Timer, compare, finish, maxdiff, say, setup

import autopar

name = sys.argv[1] if len(sys.argv) > 1 else "resnet18"
lossk = sys.argv[2] if len(sys.argv) > 2 else "ce"
dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "float32")
kwargs = {k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
mesh = setup()
B, S = 8, 32

torch.manual_seed(0)
model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).to(dtype)
serial = copy.deepcopy(model)


def make(g: torch.Generator):
    x = torch.randn(B, 3, S, S, generator=g, dtype=dtype)
    y = torch.randint(0, 10, (B,), generator=g)
    lam = 0.7
    perm = torch.arange(B).flip(0)
    soft = lam * F.one_hot(y, 10).to(dtype) + (1 - lam) * F.one_hot(y[perm], 10).to(dtype)
    return x, y, soft


def loss_fn(logits, y, soft):
    if lossk == "ce":
        return F.cross_entropy(logits, y)
    if lossk == "smooth":
        return F.cross_entropy(logits, y, label_smoothing=0.1)
    if lossk == "soft":
        return torch.sum(-soft * F.log_softmax(logits, dim=-1), dim=-1).mean()
    raise SystemExit(lossk)


g = torch.Generator().manual_seed(1234)
data = [make(g) for _ in range(3)]
with Timer() as t:
    pmodel = autopar.parallelize(model, mesh, example_inputs=(data[0][0],))
say(f"{name} {lossk} {dtype}: parallelize cpu {t.cpu:.1f}s wall {t.wall:.1f}s")
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
tol = 2e-4 if dtype == torch.float32 else 1e-9
ok = True
for step, (x, y, soft) in enumerate(data):
    opt_s.zero_grad()
    opt_p.zero_grad()
    rng = torch.get_rng_state()  # stochastic depth / dropout: both draw the same numbers
    ls = loss_fn(serial(x), y, soft)
    ls.backward()
    torch.set_rng_state(rng)
    with Timer() as t:
        logits = pmodel(x)
        lp = loss_fn(logits, y, soft)
        lp.backward()
    acc = (logits.argmax(-1) == y).float().mean().item()
    say(f"step {step}: loss serial {ls.item():.6f} par {lp.item():.6f} diff {maxdiff(ls, lp):.2e}"
        f" acc {acc:.3f} step cpu {t.cpu:.2f}s wall {t.wall:.2f}s")
    ok &= maxdiff(ls, lp) <= tol
    ok &= compare(serial, pmodel, f"grads step {step}", tol) <= tol
    opt_s.step()
    opt_p.step()
ok &= compare(serial, pmodel, "params after 3 steps", tol, grads=False) <= tol
finish(ok)
