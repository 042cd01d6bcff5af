"""How far float64 itself drifts on user17.py's MobileNetV3 loop (one process, serial only): the
same model twice, the second with every weight moved by one part in 1e15 (a summation order's
worth), trained on the same batches (2 accumulated halves of 8 rows, LambdaLR warmup, SGD momentum
0.9 at lr 0.05), then the eval loss. The growth per step is what a parallel run's differences of
the same size grow by: compare user17.py mnv3's numbers with these.

TV_SHIM=1 PYTHONPATH=$PWD/probe:TIMMDIR python probe/drift17.py
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

if os.environ.get("TV_SHIM"):
    import tv_shim  # noqa: F401
import timm

torch.manual_seed(0)
a = timm.create_model("mobilenetv3_small_050", num_classes=10).double().train()
b = copy.deepcopy(a)
with torch.no_grad():
    for p in b.parameters():
        p.mul_(1 + 1e-15 * torch.randn_like(p))
g = torch.Generator().manual_seed(1234)
data = [(torch.randn(8, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
        for _ in range(4)]
opts = []
for m in (a, b):
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    opts.append((o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3))))
for step, (x, y) in enumerate(data[:3]):
    for m in (a, b):
        for h in (slice(0, 4), slice(4, 8)):
            (F.cross_entropy(m(x[h]), y[h]) / 2).backward()
    gd = max(float((p.grad - q.grad).abs().max()) / max(1.0, float(p.grad.abs().max()))
             for p, q in zip(a.parameters(), b.parameters()))
    for o, s in opts:
        o.step()
        o.zero_grad()
        s.step()
    pd = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    for m in (a, b):
        m.eval()
    with torch.no_grad():
        ed = float((F.cross_entropy(a(data[3][0]), data[3][1]) - F.cross_entropy(b(data[3][0]), data[3][1])).abs())
    for m in (a, b):
        m.train()
    print(f"step {step}: grads {gd:.2e}, params {pd:.2e}, eval loss {ed:.2e}")
