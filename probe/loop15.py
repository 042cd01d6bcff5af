"""Round 9 (user15): the training loop people write around a transformers model, against serial in
the same loop (same seeds, same batches), 3 SGD-momentum steps, gloo.

torchrun --standalone --nproc_per_node=2 probe/loop15.py FEATURE[,FEATURE...]   (MESH=2,2 for 2-D)
GPT2LMHeadModel (toy, its default dropout 0.1), padded batches, labels inside. FEATURE:
  autocast  both forwards under torch.autocast("cpu", dtype=torch.bfloat16)
  clip      torch.nn.utils.clip_grad_norm_(params, 0.5) (the norms compared)
  accum     2 micro-batches a step, (loss / 2).backward()
  sched     torch.optim.lr_scheduler.OneCycleLR stepped each step
  reload    after step 1 copy.deepcopy(model/optimizer/scheduler state_dict()); after step 2 load
            them back (a rewind) and step 2 again on another batch
  load-full after step 0 the serial model's state_dict() (whole plain tensors) is copied; after
            step 2 both models load it (pmodel.load_state_dict of whole tensors, as from a file
            the serial model wrote)
  switch    model.eval(), a validation loss under torch.no_grad() after every step, model.train()
  compile   torch.compile(pmodel) called instead of pmodel
  second    a second parallelize of the same model; trained one step at the end against its own
            serial copy (the first parallel module must not disturb it)
  last      the last batch has 5 rows instead of 8
  nodrop    dropout 0 (resid, embd, attn): compiled and eager then draw nothing to differ by
  generate  after training, pmodel.generate(ids, max_new_tokens=3) (greedy) against serial's
"""

from __future__ import annotations

import copy
import sys

import torch
from common import Timer, finish, maxdiff, say, setup
from torch import nn

import autopar

features = set(sys.argv[1].split(","))
mesh = setup()
B, T, V = 8, 12, 64
g = torch.Generator().manual_seed(1234)


def build() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    drop = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if "nodrop" in features else {}
    cfg = tf.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, **drop)
    return tf.GPT2LMHeadModel(cfg).train()


def make(n: int) -> dict:
    ids = torch.randint(0, V, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    mask[1, -int(torch.randint(1, 6, (), generator=g)) :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def halves(b: dict) -> list[dict]:
    n = len(b["input_ids"])
    return [{k: v[: (n + 1) // 2] for k, v in b.items()}, {k: v[(n + 1) // 2 :] for k, v in b.items()}]


def forward(m, batch: dict) -> torch.Tensor:
    if "autocast" in features:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(**batch).loss
    return m(**batch).loss


model = build()
serial = copy.deepcopy(model)
data = [make(B), make(B), make(B), make(5 if "last" in features else B)]
val = make(B)
example = halves(data[0])[0] if "accum" in features else data[0]
with Timer() as tm:
    pmodel = autopar.parallelize(model, mesh, example_kwargs=example)
say(f"{sorted(features)} mesh {tuple(mesh.shape)}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
if "second" in features:
    serial2 = copy.deepcopy(model)
    pmodel2 = autopar.parallelize(model, mesh, example_kwargs=example)
call = torch.compile(pmodel) if "compile" in features else pmodel
tol = 3e-2 if "autocast" in features else 2e-4


def parts(m: nn.Module):
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sch = (
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10) if "sched" in features else None
    )
    return opt, sch


(opt_s, sch_s), (opt_p, sch_p) = parts(serial), parts(pmodel)
sp, pp = dict(serial.named_parameters()), dict(pmodel.named_parameters())


def worst(pairs) -> tuple[float, str]:
    out, at = 0.0, "-"
    for name, a, b in pairs:
        if (a is None) != (b is None):
            return float("inf"), f"{name}: grad None on one side"
        if a is not None:
            d = maxdiff(a, b) / max(1.0, float(a.abs().max()))
            if d > out:
                out, at = d, name
    return out, at


def train_step(step: int, batch: dict) -> bool:
    losses, norms = [], []
    for m, fn in ((serial, serial), (pmodel, call)):
        torch.manual_seed(100 + step)
        micro = halves(batch) if "accum" in features else [batch]
        total = 0.0
        for mb in micro:
            loss = forward(fn, mb) / len(micro)
            loss.backward()
            total += loss.detach()
        losses.append(total)
        if "clip" in features:
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    gd, gat = worst((n, sp[n].grad, pp[n].grad) for n in sp)
    ld = maxdiff(losses[0], losses[1])
    nd = maxdiff(norms[0], norms[1]) if norms else 0.0
    for opt, sch in ((opt_s, sch_s), (opt_p, sch_p)):
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sch is not None:
            sch.step()
    msg = f"step {step} ({len(batch['input_ids'])} rows): loss {float(losses[0]):.5f} diff {ld:.2e}; grad diff {gd:.2e} ({gat})"
    say(
        msg
        + (f"; norm diff {nd:.2e}" if norms else "")
        + (f"; lr {sch_p.get_last_lr()[0]:.4f}" if sch_p else "")
    )
    good = ld <= tol and gd <= tol and nd <= tol
    if "switch" in features:
        for m in (serial, pmodel):
            m.eval()
        with torch.no_grad():
            vd = maxdiff(forward(serial, val), forward(call, val))
        for m in (serial, pmodel):
            m.train()
        say(f"  validation (eval, no_grad) loss diff {vd:.2e}")
        good &= vd <= tol
    return good


ok = True
saved = None
for step, batch in enumerate(data[:3]):
    ok &= train_step(step, batch)
    if "load-full" in features and step == 0:
        snapshot = copy.deepcopy(serial.state_dict())
    if "load-full" in features and step == 2:
        serial.load_state_dict(snapshot)
        try:
            pmodel.load_state_dict(snapshot)
        except autopar.AutoparError as e:
            say(f"pmodel.load_state_dict(whole tensors) refused: {type(e).__name__}: {str(e)[:500]}")
            ok = False
        pd, pat = worst((n, sp[n].detach(), pp[n].detach()) for n in sp)
        say(f"loaded the serial step-0 state_dict into both: param diff {pd:.2e} ({pat})")
        ok &= pd <= tol
    if "reload" in features and step == 1:
        saved = [
            copy.deepcopy((m.state_dict(), o.state_dict(), s.state_dict() if s else None))
            for m, o, s in ((serial, opt_s, sch_s), (pmodel, opt_p, sch_p))
        ]
if saved is not None:
    for (msd, osd, ssd), (m, o, s) in zip(saved, ((serial, opt_s, sch_s), (pmodel, opt_p, sch_p))):
        m.load_state_dict(msd)
        o.load_state_dict(osd)
        if s is not None:
            s.load_state_dict(ssd)
    pd, pat = worst((n, sp[n].detach(), pp[n].detach()) for n in sp)
    say(f"reloaded the step-1 state: param diff {pd:.2e} ({pat})")
    ok &= pd <= tol
ok &= train_step(3, data[3])
pd, pat = worst((n, sp[n].detach(), pp[n].detach()) for n in sp)
say(f"after the steps: param diff {pd:.2e} ({pat})")
ok &= pd <= tol
if "second" in features:
    opt2, opt2s = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pmodel2, serial2))
    losses = []
    for m in (serial2, pmodel2):
        torch.manual_seed(7)
        loss = forward(m, data[1])
        loss.backward()
        losses.append(loss.detach())
    s2, p2 = dict(serial2.named_parameters()), dict(pmodel2.named_parameters())
    gd, gat = worst((n, s2[n].grad, p2[n].grad) for n in s2)
    opt2.step()
    opt2s.step()
    pd2, _ = worst((n, s2[n].detach(), p2[n].detach()) for n in s2)
    say(
        f"second parallelize: loss diff {maxdiff(*losses):.2e}, grad diff {gd:.2e} ({gat}), param diff {pd2:.2e}"
    )
    ok &= maxdiff(*losses) <= tol and gd <= tol and pd2 <= tol
if "generate" in features:
    ids = data[0]["input_ids"][:2, :6]
    for m in (serial, pmodel):
        m.eval()
    want = serial.generate(ids, max_new_tokens=3, do_sample=False)
    try:
        got = pmodel.generate(ids, max_new_tokens=3, do_sample=False)
        say(f"generate: serial {want.tolist()} parallel {got.tolist()}")
        ok &= torch.equal(want, got)
    except autopar.AutoparError as e:  # a clear refusal with a hint is the documented answer
        say(f"generate refused: {type(e).__name__}: {str(e)[:600]}")
    except Exception as e:  # noqa: BLE001 - anything else reaching the user is a bug
        say(f"generate raised {type(e).__module__}.{type(e).__name__}: {str(e)[:600]}")
        ok = False
finish(ok)
