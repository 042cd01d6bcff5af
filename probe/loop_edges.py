"""The training loop's edges, one feature per run.

torchrun --standalone --nproc_per_node=4 probe/loop_edges.py FEATURE
FEATURE: autocast_step | onecycle | cosine_warmup | add_param_group | resume | permuted | transposed |
         channels_last | load_bin | load_bad_safetensors
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import compare, finish, maxdiff, rank, say, setup
from torch import nn

import autopar

feature = sys.argv[1]
mesh = setup()
B = 8


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, stride=2)
        self.fc = nn.Linear(16, 10)
        self.proj = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv1(x)))
        h = F.relu(self.conv2(h)).mean((2, 3))
        return self.proj(self.fc(h))


torch.manual_seed(0)
dtype = torch.float64 if feature in ("onecycle", "cosine_warmup", "add_param_group", "resume") else torch.float32
model = ConvNet().to(dtype)
serial = copy.deepcopy(model)
g = torch.Generator().manual_seed(1234)
data = [(torch.randn(B, 3, 8, 8, generator=g, dtype=dtype), torch.randint(0, 10, (B,), generator=g))
        for _ in range(4)]


def prep(x: torch.Tensor) -> torch.Tensor:
    if feature == "permuted":  # a batch stored NHWC, handed over as a permuted NCHW view
        return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    if feature == "transposed":  # H and W swapped in storage
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    if feature == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    return x


if feature == "channels_last":
    model = model.to(memory_format=torch.channels_last)
    serial = serial.to(memory_format=torch.channels_last)

ok = True
if feature == "load_bin":
    pmodel = autopar.parallelize(model, mesh, example_inputs=(data[0][0],))
    d = tempfile.mkdtemp(prefix="p6bin") if rank() == 0 else None
    lst = [d]
    dist.broadcast_object_list(lst)
    d = lst[0]
    if rank() == 0:
        torch.save(serial.state_dict(), os.path.join(d, "pytorch_model.bin"))
    dist.barrier()
    for path in (d, os.path.join(d, "pytorch_model.bin")):
        try:
            autopar.load_checkpoint(pmodel, path)
            say(f"load_checkpoint({path}) LOADED (pickle!)")
            ok = False
        except Exception as e:  # noqa: BLE001
            say(f"load_checkpoint({os.path.basename(path)}): {type(e).__name__}: {e}")
            ok &= isinstance(e, autopar.AutoparError)
    finish(ok)

if feature == "load_bad_safetensors":
    from safetensors.torch import save_file
    pmodel = autopar.parallelize(model, mesh, example_inputs=(data[0][0],))
    lst = [tempfile.mkdtemp(prefix="p6st") if rank() == 0 else None]
    dist.broadcast_object_list(lst)
    base = lst[0]
    sd = {k: v.contiguous() for k, v in serial.state_dict().items()}
    cases = {
        "wrong_shape": {**sd, "fc.weight": torch.zeros(10, 17, dtype=dtype)},
        "missing": {k: v for k, v in sd.items() if k != "proj.bias"},
        "extra": {**sd, "unused.weight": torch.zeros(3)},
        "bn_int_as_float": {**sd, "bn.num_batches_tracked": torch.zeros((), dtype=torch.float32)},
    }
    for name, sdict in cases.items():
        d = os.path.join(base, name)
        if rank() == 0:
            os.makedirs(d)
            save_file(sdict, os.path.join(d, "model.safetensors"))
        dist.barrier()
        try:
            autopar.load_checkpoint(pmodel, d)
            say(f"{name}: loaded without error")
        except Exception as e:  # noqa: BLE001
            say(f"{name}: {type(e).__name__}: {e}")
            ok &= isinstance(e, autopar.AutoparError)
    finish(ok)

x0 = prep(data[0][0])
pmodel = autopar.parallelize(model, mesh, example_inputs=(x0,))
opt_s = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
if feature == "add_param_group":  # start with the convs only, then add the head (fine-tuning recipe)
    head = ("fc.", "proj.")
    opt_s = torch.optim.SGD([p for n, p in serial.named_parameters() if not n.startswith(head)], lr=0.05, momentum=0.9)
    opt_p = torch.optim.SGD([p for n, p in pmodel.named_parameters() if not n.startswith(head)], lr=0.05, momentum=0.9)
sch_s = sch_p = None
if feature == "onecycle":
    sch_s = torch.optim.lr_scheduler.OneCycleLR(opt_s, max_lr=0.1, total_steps=4)
    sch_p = torch.optim.lr_scheduler.OneCycleLR(opt_p, max_lr=0.1, total_steps=4)
if feature == "cosine_warmup":
    from transformers import get_cosine_schedule_with_warmup
    sch_s = get_cosine_schedule_with_warmup(opt_s, 1, 4)
    sch_p = get_cosine_schedule_with_warmup(opt_p, 1, 4)
tol = 2e-5 if dtype == torch.float32 else 1e-10
for step, (x, y) in enumerate(data):
    if feature == "add_param_group" and step == 2:
        opt_s.add_param_group({"params": [p for n, p in serial.named_parameters() if n.startswith(head)], "lr": 0.01})
        opt_p.add_param_group({"params": [p for n, p in pmodel.named_parameters() if n.startswith(head)], "lr": 0.01})
    if feature == "resume" and step == 2:  # save model + optimizer, rebuild both, load, continue
        osd_s = copy.deepcopy(opt_s.state_dict())
        full = pmodel.full_state_dict()
        osd_p = opt_p.state_dict()
        lst = [tempfile.mkdtemp(prefix="p6res") if rank() == 0 else None]
        dist.broadcast_object_list(lst)
        autopar.save_checkpoint(pmodel, lst[0])
        torch.manual_seed(99)
        fresh = ConvNet().to(dtype)
        pmodel = autopar.parallelize(fresh, mesh, example_inputs=(x0,))
        autopar.load_checkpoint(pmodel, lst[0])
        opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
        try:
            opt_p.load_state_dict(osd_p)
        except Exception as e:  # noqa: BLE001
            say(f"opt.load_state_dict(old optimizer state) raised {type(e).__name__}: {e}")
            ok = False
        ok &= compare(serial, pmodel, "after resume", tol, grads=False) <= tol
    opt_s.zero_grad()
    opt_p.zero_grad()
    xp = prep(x)
    if feature == "autocast_step":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ls = F.cross_entropy(serial(x), y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = F.cross_entropy(pmodel(xp), y)
    else:
        ls = F.cross_entropy(serial(x), y)
        lp = F.cross_entropy(pmodel(xp), y)
    ls.backward()
    lp.backward()
    say(f"step {step}: loss serial {ls.item():.6f} par {lp.item():.6f} diff {maxdiff(ls, lp):.2e}")
    ltol = 2e-2 if feature == "autocast_step" else tol
    ok &= maxdiff(ls, lp) <= ltol
    ok &= compare(serial, pmodel, f"grads step {step}", ltol) <= ltol
    opt_s.step()
    opt_p.step()
    if sch_s is not None:
        sch_s.step()
        sch_p.step()
        say(f"  lr serial {sch_s.get_last_lr()} par {sch_p.get_last_lr()}")
ok &= compare(serial, pmodel, "params after steps", ltol, grads=False) <= ltol
finish(ok)
