"""parallelize(torch.compile(model)): the user compiled the model first. Dropout 0.3, the loss
outside, one backward against serial under the same seed, gloo.

torchrun --standalone --nproc_per_node=2 probe/compiled_first.py
"""

import copy
import warnings

import torch
import torch.nn.functional as F
from common import say, setup
from torch import nn

import autopar

warnings.filterwarnings("ignore")
mesh = setup()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
serial = copy.deepcopy(model)
x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
try:
    p = autopar.parallelize(torch.compile(model), mesh, example_inputs=(x,))
    names = [n for n, _ in p.named_parameters()]
    torch.manual_seed(3)
    F.cross_entropy(p(x), y).backward()
    torch.manual_seed(3)
    F.cross_entropy(serial(x), y).backward()
    sp = dict(serial.named_parameters())
    d = max(
        float(
            (
                (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad)
                - sp[n.replace("_orig_mod.", "")].grad
            )
            .abs()
            .max()
        )
        for n, q in p.named_parameters()
    )
    say("parallelize(torch.compile(model)) worked; names", names[:2], "grad diff", d)
except Exception as e:
    say("parallelize(torch.compile(model)):", type(e).__module__, type(e).__name__, str(e)[:500])
