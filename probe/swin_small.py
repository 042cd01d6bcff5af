"""A small timm Swin (shifted windows: aten.roll), loss outside, against serial.

torchrun --standalone --nproc_per_node=2 probe/swin_small.py
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
import tv_preload  # noqa: F401
from common import compare, finish, maxdiff, say, setup
from timm.models.swin_transformer import SwinTransformer

import autopar

mesh = setup()
torch.manual_seed(0)
model = SwinTransformer(img_size=16, patch_size=2, window_size=4, embed_dim=16, depths=(2,), num_heads=(2,),
                        num_classes=10)
inside = "inside" in sys.argv


class WithLoss(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.m(x), y)


if inside:
    model = WithLoss(model)
serial = copy.deepcopy(model)
g = torch.Generator().manual_seed(1234)
data = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]
pmodel = autopar.parallelize(model, mesh, example_inputs=data[0] if inside else (data[0][0],))
sb, pb = dict(serial.named_buffers()), dict(pmodel.named_buffers())
say("buffers serial only:", sorted(set(sb) - set(pb)), "parallel only:", sorted(set(pb) - set(sb)))
for n in sorted(set(sb) & set(pb)):
    say(f"  buffer {n}: diff {maxdiff(sb[n], pb[n]):.2e}")
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
ok = True
for step, (x, y) in enumerate(data):
    opt_s.zero_grad()
    opt_p.zero_grad()
    rng = torch.get_rng_state()  # drop_path (timm's default 0.1): both draw the same numbers
    ls = serial(x, y) if inside else F.cross_entropy(serial(x), y)
    torch.set_rng_state(rng)
    lp = pmodel(x, y) if inside else F.cross_entropy(pmodel(x), y)
    ls.backward()
    lp.backward()
    say(f"step {step}: loss serial {ls.item():.6f} par {lp.item():.6f} diff {maxdiff(ls, lp):.2e}")
    ok &= maxdiff(ls, lp) <= 1e-5
    ok &= compare(serial, pmodel, f"grads step {step}", 2e-5) <= 2e-5
    opt_s.step()
    opt_p.step()
ok &= compare(serial, pmodel, "params after 3 steps", 2e-5, grads=False) <= 2e-5
finish(ok)
