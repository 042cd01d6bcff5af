"""Training-loop habits around a parallel module, each against the serial model in the same loop.

torchrun --standalone --nproc_per_node=4 probe/loop_habits.py FEATURE[,FEATURE...] [fp32|fp64]

FEATURE:
  accum        gradient accumulation: 2 micro-steps of half the batch, `(loss / 2).backward()`
  clip         torch.nn.utils.clip_grad_norm_(params, 0.05) before every step (clipping active)
  ema          an EMA copy of the weights: `torch._foreach_lerp_(ema, params, 0.1)` after each step
  ckpt         torch.utils.checkpoint(block, x, use_reentrant=False) in the model's own forward
  switch       model.eval() for a validation loss under no_grad after every step, then train();
               step 1 trains in eval() mode (dropout off)
  frozen       emb.requires_grad_(False) before parallelize
  freeze-late  emb.requires_grad_(False) on both models after step 1
  keep-grads   zero_grad(set_to_none=False)
  adamw        AdamW instead of SGD with momentum
  scaler       float16 autocast with torch.amp.GradScaler("cpu"): scale, unscale_, step, update
  clip-inf     clip_grad_norm_ with norm_type=inf (with clip)
  reentrant    torch.utils.checkpoint(..., use_reentrant=True) (with ckpt)
  tied         the head's weight is the embedding's (tied), so `frozen` freezes both
  auto         parallelize(model, world_size, mesh_shape="auto") instead of the given mesh
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from common import Timer, compare, finish, full, maxdiff, say, setup
from torch import nn

import autopar

features = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else {"accum"}
dtype = torch.float64 if len(sys.argv) > 2 and sys.argv[2] == "fp64" else torch.float32
mesh = setup()
V, D, T, B = 64, 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, dropout=0.1, batch_first=True)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, checkpointed: bool, reentrant: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.checkpointed = checkpointed
        self.reentrant = reentrant

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(idx) + self.pos[: idx.shape[1]])
        for blk in self.blocks:
            x = cp.checkpoint(blk, x, use_reentrant=self.reentrant) if self.checkpointed else blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


torch.manual_seed(0)
model = LM("ckpt" in features, "reentrant" in features).to(dtype)
if "tied" in features:
    model.head.weight = model.emb.weight
if "frozen" in features:
    model.emb.requires_grad_(False)
serial = copy.deepcopy(model)
g = torch.Generator().manual_seed(1234)
steps = 4
data = [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
        for _ in range(steps)]
micro = 2 if "accum" in features else 1
example = tuple(t[: B // micro] for t in data[0])
with Timer() as tm:
    if "auto" in features:
        pmodel = autopar.parallelize(model, mesh.size(), example_inputs=example, mesh_shape="auto")
    else:
        pmodel = autopar.parallelize(model, mesh, example_inputs=example)
say(f"{sorted(features)} {dtype}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
say(pmodel.plan_summary().splitlines()[:3])


def make_opt(m: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in m.parameters() if p.requires_grad]
    if "adamw" in features:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


opt_s, opt_p = make_opt(serial), make_opt(pmodel)
ema_s = [p.detach().clone() for p in serial.parameters()]
ema_p = [p.detach().clone() for p in pmodel.parameters()]
tol = 2e-4 if dtype == torch.float32 else 1e-9
if "scaler" in features:
    tol = 2e-2  # float16 matmuls
ok = True
set_to_none = "keep-grads" not in features
norm_type = float("inf") if "clip-inf" in features else 2.0
scaler_s = torch.amp.GradScaler("cpu", enabled="scaler" in features)
scaler_p = torch.amp.GradScaler("cpu", enabled="scaler" in features)


def ctx():
    return torch.autocast("cpu", dtype=torch.float16, enabled="scaler" in features)


for step, (idx, tgt) in enumerate(data):
    if "freeze-late" in features and step == 2:
        serial.emb.requires_grad_(False)
        pmodel.emb.requires_grad_(False)
        say("frozen emb on both models")
    if "switch" in features and step == 1:
        serial.eval()
        pmodel.eval()
    opt_s.zero_grad(set_to_none=set_to_none)
    opt_p.zero_grad(set_to_none=set_to_none)
    ls_total = lp_total = 0.0
    with Timer() as tm:
        for m in range(micro):
            sl = slice(m * B // micro, (m + 1) * B // micro)
            rng = torch.get_rng_state()
            with ctx():
                ls = serial(idx[sl], tgt[sl]) / micro
            scaler_s.scale(ls).backward()
            torch.set_rng_state(rng)
            with ctx():
                lp = pmodel(idx[sl], tgt[sl]) / micro
            scaler_p.scale(lp).backward()
            ls_total += ls.item()
            lp_total += lp.item()
    say(f"step {step}: loss serial {ls_total:.6f} par {lp_total:.6f} diff {abs(ls_total - lp_total):.2e}"
        f" cpu {tm.cpu:.2f}s")
    ok &= abs(ls_total - lp_total) <= tol
    scaler_s.unscale_(opt_s)
    scaler_p.unscale_(opt_p)
    if "clip" in features:
        ns = torch.nn.utils.clip_grad_norm_([p for p in serial.parameters() if p.grad is not None], 0.05,
                                            norm_type=norm_type)
        npar = torch.nn.utils.clip_grad_norm_([p for p in pmodel.parameters() if p.grad is not None], 0.05,
                                              norm_type=norm_type)
        say(f"  clip_grad_norm_: serial {float(ns):.6f} par {float(full(npar)):.6f}")
        ok &= maxdiff(ns, npar) <= tol
    ok &= compare(serial, pmodel, f"grads step {step}", tol) <= tol
    scaler_s.step(opt_s)
    scaler_p.step(opt_p)
    scaler_s.update()
    scaler_p.update()
    if "ema" in features:
        with torch.no_grad():
            torch._foreach_lerp_(ema_s, list(serial.parameters()), 0.1)
            torch._foreach_lerp_(ema_p, list(pmodel.parameters()), 0.1)
        worst = max(maxdiff(a, b) for a, b in zip(ema_s, ema_p))
        say(f"  ema diff {worst:.2e}")
        ok &= worst <= tol
    if "switch" in features:
        if step == 1:
            serial.train()
            pmodel.train()
        serial.eval()
        pmodel.eval()
        with torch.no_grad():
            vs = serial(data[0][0][: B // micro], data[0][1][: B // micro])
            vp = pmodel(data[0][0][: B // micro], data[0][1][: B // micro])
        say(f"  validation loss serial {vs.item():.6f} par {vp.item():.6f} diff {maxdiff(vs, vp):.2e}")
        ok &= maxdiff(vs, vp) <= tol
        serial.train()
        pmodel.train()
ok &= compare(serial, pmodel, f"params after {steps} steps", tol, grads=False) <= tol
say("programs:", len(pmodel.programs))
finish(ok)
