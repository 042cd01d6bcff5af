"""Hooks and state as a user writes them around a transformers model (GPT2LMHeadModel, dropout 0.1 at
its default, loss inside through labels), against serial, 3 SGD-momentum steps with clip_grad_norm_:

- forward pre-hooks / forward hooks registered on submodules before `parallelize` (one with kwargs,
  one changing the input, one changing the output), a hook on the parallel module's submodule and one
  on the original model after it (both should be said by a warning, not run silently);
- `register_full_backward_hook` on a submodule (should be refused as an AutoparError with a module
  path, a line and a hint);
- `full_state_dict()` through `safetensors.torch.save_file` / `load_file` into a fresh serial model
  and into a fresh parallel module; `save_checkpoint(format="safetensors")` / `load_checkpoint`;
- a checkpoint directory crafted to run code (a pickled `pytorch_model.bin`, a pickled `.metadata`)
  handed to `load_checkpoint`: refused, its payload never runs.

torchrun --standalone --nproc_per_node=2 probe/hooks_state.py      (MESH=2,2 with 4 ranks)
"""

from __future__ import annotations

import copy
import os
import pickle
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from common import finish, maxdiff, rank, say, setup
from hooks_state_hooks import attach
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

import autopar

mesh = setup()
tol = 2e-4
ok = True
cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
torch.manual_seed(0)
model = GPT2LMHeadModel(cfg).train()


attach(model)
serial = copy.deepcopy(model)
fresh = GPT2LMHeadModel(cfg)  # other weights: loaded from the checkpoints below
g = torch.Generator().manual_seed(1234)
data = [torch.randint(0, 64, (4, 12), generator=g) for _ in range(3)]

pmodel = autopar.parallelize(model, mesh, example_kwargs={"input_ids": data[0], "labels": data[0]})
opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
sp, pp = dict(serial.named_parameters()), dict(pmodel.named_parameters())
for step, ids in enumerate(data):
    for opt in (opt_s, opt_p):
        opt.zero_grad()
    torch.manual_seed(100 + step)
    ls = serial(input_ids=ids, labels=ids).loss
    ls.backward()
    torch.manual_seed(100 + step)
    lp = pmodel(input_ids=ids, labels=ids).loss
    lp.backward()
    ns = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.5)
    np_ = torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 0.5)
    gd = max(maxdiff(sp[n].grad, pp[n].grad) for n in sp)
    say(f"step {step}: loss {ls.item():.6f} diff {maxdiff(ls, lp):.2e}; clipped grad diff {gd:.2e}; "
        f"norm {ns.item():.5f} diff {maxdiff(ns, np_):.2e}")
    ok &= maxdiff(ls, lp) <= tol and gd <= tol and maxdiff(ns, np_) <= tol
    opt_s.step()
    opt_p.step()
pd = max(maxdiff(sp[n].detach(), pp[n].detach()) for n in sp)
say(f"after 3 steps: param diff {pd:.2e}")
ok &= pd <= tol

# Hooks after parallelize: on the parallel module's submodule, and on the original model.
calls = []
h1 = pmodel.get_submodule("transformer.h.1.mlp").register_forward_hook(lambda m, a, o: calls.append(1))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    pmodel(input_ids=data[0], labels=data[0]).loss.backward()
h1.remove()
said = [f"{w.category.__name__}: {str(w.message)[:90]}" for w in seen]
say(f"hook on pmodel's submodule after parallelize: ran {len(calls)} times; warned {said}")
ok &= any("ForwardHook" in s for s in said)
h2 = model.transformer.h[1].register_forward_hook(lambda m, a, o: o * 2)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    pmodel(input_ids=data[0], labels=data[0])
h2.remove()
said = [f"{w.category.__name__}: {str(w.message)[:90]}" for w in seen]
say(f"hook on the original model after parallelize: warned {said}")
ok &= any("OriginalModel" in s for s in said)
for opt in (opt_s, opt_p):
    opt.zero_grad()

# A module backward hook: refused, as an AutoparError with module path, line and hint.
bad = GPT2LMHeadModel(cfg)
bad.transformer.h[1].register_full_backward_hook(lambda m, gi, go: None)
try:
    autopar.parallelize(bad, mesh, example_kwargs={"input_ids": data[0], "labels": data[0]})
    say("register_full_backward_hook: NOT refused")
    ok = False
except autopar.AutoparError as e:
    text = str(e)
    say(f"register_full_backward_hook refused: {type(e).__name__}: {text[:300]!r} hint: {e.hint!r}")
    ok &= "transformer.h.1" in text and bool(e.hint)
except Exception as e:  # noqa: BLE001 - a raw error is what this probe looks for
    say(f"register_full_backward_hook: RAW {type(e).__name__}: {e}")
    ok = False

# State through safetensors.
shared = Path(tempfile.gettempdir()) / f"hooks_state_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}"
full = pmodel.full_state_dict()
if rank() == 0:
    shared.mkdir(exist_ok=True)
    plain = {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"}  # tied: saved once
    save_file(plain, str(shared / "user.safetensors"))
dist.barrier()
loaded = load_file(str(shared / "user.safetensors"))
reload_serial = copy.deepcopy(fresh)
missing = reload_serial.load_state_dict(loaded, strict=False)
rd = max(maxdiff(p, serial.get_parameter(n)) for n, p in reload_serial.named_parameters())
say(f"safetensors -> fresh serial: missing {missing.missing_keys}, param diff {rd:.2e}")
ok &= rd <= tol
attach(fresh)
p2 = autopar.parallelize(copy.deepcopy(fresh), mesh, example_kwargs={"input_ids": data[0], "labels": data[0]})
try:
    r = p2.load_state_dict(loaded, strict=False)
    d2 = max(maxdiff(p, serial.get_parameter(n)) for n, p in p2.named_parameters())
    say(f"safetensors -> fresh pmodel.load_state_dict: {r}, param diff {d2:.2e}")
    torch.manual_seed(7)
    l2 = p2(input_ids=data[1], labels=data[1]).loss
    torch.manual_seed(7)
    l1 = serial(input_ids=data[1], labels=data[1]).loss
    say(f"  loss after load {maxdiff(l1, l2):.2e}")
    ok &= d2 <= tol and maxdiff(l1, l2) <= tol
except Exception as e:  # noqa: BLE001
    say(f"pmodel.load_state_dict(safetensors) failed: {type(e).__name__}: {e}")
    ok = False
ck = shared / "ckpt"
autopar.save_checkpoint(pmodel, ck, format="safetensors")
p3 = autopar.parallelize(copy.deepcopy(fresh), mesh, example_kwargs={"input_ids": data[0], "labels": data[0]})
res = autopar.load_checkpoint(p3, ck)
d3 = max(maxdiff(p, serial.get_parameter(n)) for n, p in p3.named_parameters())
say(f"save_checkpoint(safetensors) -> load_checkpoint: {res}, param diff {d3:.2e}")
ok &= d3 <= tol


class RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


marker = shared / "ran"
crafted = shared / "crafted"
if rank() == 0:
    crafted.mkdir(exist_ok=True)
    with open(crafted / "pytorch_model.bin", "wb") as f:
        pickle.dump({"transformer.wte.weight": RunsACommand(marker)}, f)
    (shared / "dcp").mkdir(exist_ok=True)
    with open(shared / "dcp" / ".metadata", "wb") as f:
        pickle.dump(RunsACommand(marker), f)
dist.barrier()
for d in (crafted, shared / "dcp"):
    try:
        autopar.load_checkpoint(p3, d)
        say(f"crafted {d.name}: NOT refused")
        ok = False
    except autopar.AutoparError as e:
        say(f"crafted {d.name}: refused {type(e).__name__}: {str(e)[:120]!r}; hint {bool(e.hint)}")
    except Exception as e:  # noqa: BLE001
        say(f"crafted {d.name}: RAW {type(e).__name__}: {e}")
        ok = False
dist.barrier()
say(f"payload ran: {marker.exists()}")
ok &= not marker.exists()
finish(ok)
