"""Round 11 (user17): models we did not write, in the loop a user writes from README.md and
docs/api.md, against serial in the same loop (same seeds, same batches), 3 SGD-momentum steps, gloo.

torchrun --standalone --nproc_per_node=N probe/user17.py KIND FEATURE[,FEATURE...] [fp64]
MESH=2,2 for a 2-D mesh; PP=1 names the first axis "pp" (PipelineOptions(microbatches=2)).
KIND:
  bart        BartForConditionalGeneration fine-tuned as its docs show: input_ids, attention_mask,
              labels (-100 on padding) in, `.loss` out
  t5          T5ForConditionalGeneration, the same (labels in, loss inside)
  distilbert  DistilBertModel inside the user's module: masked mean pool, dropout, linear head;
              F.cross_entropy outside
  modernbert  ModernBertModel the same way
  mnv3        timm MobileNetV3 (BatchNorm, hard-swish, squeeze-excite), CE outside (timm's
              train script: `loss_fn(model(input), target)`)
  convnextv2  timm ConvNeXt-V2 (GRN), drop_path 0.1, CE outside
FEATURE:
  accum     2 micro-batches a step, (loss / 2).backward() (no `no_sync`: docs/api.md says none is needed)
  sched     torch.optim.lr_scheduler.LambdaLR warmup stepped each step
  autocast  both forwards under torch.amp.autocast("cpu", dtype=torch.bfloat16)
  switch    after every step model.eval(): the eval forward (with grad, then under no_grad)
            compared with serial's, model.train()
  freeze-bn every BatchNorm put in eval() before parallelize (the fine-tuning habit: frozen
            statistics), the rest training
  freeze-drop the user's head dropout (Pooled.drop) put in eval() before parallelize; with
            switch, the first model.train() unfreezes it again in both (nn.Module.train sets all)
  nodrop    (distilbert) the encoder's own dropouts at 0 (the head's nn.Dropout stays): under
            autocast its attention dropout is drawn per microbatch on a pipeline (warned)
  save      at the end full_state_dict() -> torch.save -> torch.load(weights_only=True) into a
            fresh serial model and into a fresh parallel one (load_state_dict); their next loss
            and parameters compared
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import Timer, finish, maxdiff, say
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar

if os.environ.get("TV_SHIM"):
    import tv_shim  # noqa: F401

kind = sys.argv[1]
features = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else set()
dtype = torch.float64 if "fp64" in sys.argv[3:] else torch.float32
pp = bool(os.environ.get("PP"))
dist.init_process_group("gloo")
shape = tuple(int(n) for n in os.environ.get("MESH", str(dist.get_world_size())).split(","))
names = (("pp",) if pp else ()) + ("x", "y", "z")
mesh = init_device_mesh("cpu", shape, mesh_dim_names=names[: len(shape)])
g = torch.Generator().manual_seed(1234)
B, T, V = 8, 10, 96


class Pooled(nn.Module):
    """The user's own classifier around an encoder: masked mean pool, dropout, linear head."""

    def __init__(self, encoder: nn.Module, hidden: int, classes: int = 5) -> None:
        super().__init__()
        self.encoder = encoder
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1)
        return self.head(self.drop(pooled))


def build(seed: int) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "bart":
        cfg = tf.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1)
        m = tf.BartForConditionalGeneration(cfg)
    elif kind == "t5":
        cfg = tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          decoder_start_token_id=0)
        m = tf.T5ForConditionalGeneration(cfg)
    elif kind == "distilbert":
        nodrop = {"dropout": 0.0, "attention_dropout": 0.0} if "nodrop" in features else {}
        cfg = tf.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=64, **nodrop)
        m = Pooled(tf.DistilBertModel(cfg), 32)
    elif kind == "modernbert":
        cfg = tf.ModernBertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                                  global_attn_every_n_layers=3, local_attention=8)
        m = Pooled(tf.ModernBertModel(cfg), 32)
    else:
        import timm

        if kind == "mnv3":
            m = timm.create_model("mobilenetv3_small_050", num_classes=10)
        else:
            m = timm.create_model("convnextv2_atto", num_classes=10, depths=(1, 1, 2, 1),
                                  dims=(8, 16, 24, 32), drop_path_rate=0.1)
    return m.to(dtype).train()


vision = kind in ("mnv3", "convnextv2")


def make(n: int) -> dict:
    if vision:
        return {"x": torch.randn(n, 3, 32, 32, generator=g, dtype=dtype),
                "y": torch.randint(0, 10, (n,), generator=g)}
    ids = torch.randint(3, V, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    mask[1, -3:] = 0
    ids = ids.masked_fill(mask == 0, 1 if kind == "bart" else 0)
    if kind in ("bart", "t5"):
        labels = torch.randint(3, V, (n, T - 2), generator=g)
        labels[2, -2:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask, "y": torch.randint(0, 5, (n,), generator=g)}


def model_kwargs(b: dict) -> dict:
    return {k: v for k, v in b.items() if k not in ("x", "y")}


def loss_of(m, b: dict) -> torch.Tensor:
    with torch.amp.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in features):
        if vision:
            return F.cross_entropy(m(b["x"]), b["y"])
        if kind in ("bart", "t5"):
            return m(**b).loss
        return F.cross_entropy(m(**model_kwargs(b)), b["y"])


def halves(b: dict) -> list[dict]:
    n = len(next(iter(b.values())))
    return [{k: v[: n // 2] for k, v in b.items()}, {k: v[n // 2 :] for k, v in b.items()}]


def parallel(m: nn.Module, example: dict) -> nn.Module:
    opts = {}
    if pp:
        opts["pipeline"] = autopar.PipelineOptions(microbatches=2)
    if vision:
        return autopar.parallelize(m, mesh, example_inputs=(example["x"],), **opts)
    return autopar.parallelize(m, mesh, example_kwargs=model_kwargs(example) if kind not in ("bart", "t5")
                               else example, **opts)


model = build(0)
if "freeze-bn" in features:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
if "freeze-drop" in features:
    model.drop.eval()
serial = copy.deepcopy(model)
data = [make(B) for _ in range(3)]
val = make(B)
example = halves(data[0])[0] if "accum" in features else data[0]
with Timer() as tm:
    pmodel = parallel(model, example)
say(f"{kind} {sorted(features)} {dtype} mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}: "
    f"parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
tol = 3e-2 if "autocast" in features else (1e-9 if dtype == torch.float64 else 2e-4)


def parts(m: nn.Module):
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)) if "sched" in features else None
    return opt, sch


(opt_s, sch_s), (opt_p, sch_p) = parts(serial), parts(pmodel)
sp_all, ppar = dict(serial.named_parameters()), dict(pmodel.named_parameters())
if pp:  # a pipeline rank holds its stages' parameters: compare those, the worst over the ranks
    assert set(ppar) <= set(sp_all), sorted(set(ppar) - set(sp_all))[:5]
    sp = {n: sp_all[n] for n in ppar}
    held = [set(ppar)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held[0])
    assert set().union(*everyone) == set(sp_all), sorted(set(sp_all) - set().union(*everyone))[:5]
else:
    assert set(sp_all) == set(ppar), sorted(set(sp_all) ^ set(ppar))[:5]
    sp = sp_all


def worst(pairs) -> tuple[float, str]:
    out, at = 0.0, "-"
    for name, a, b in pairs:
        if (a is None) != (b is None):
            out, at = float("inf"), f"{name}: grad None on one side"
            break
        if a is not None:
            d = maxdiff(a, b) / max(1.0, float(a.abs().max()))
            if d > out:
                out, at = d, name
    if pp:  # the worst over the ranks (each holds its own stages)
        t = torch.tensor([out], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if float(t) > out:
            at = "another rank's stage"
        out = float(t)
    return out, at


def buffers_diff(a: nn.Module, b: nn.Module) -> float:
    pb = dict(b.named_buffers())
    return max([maxdiff(t, pb[n]) for n, t in a.named_buffers() if n in pb and t.is_floating_point()] + [0.0])


summary = {"loss": 0.0, "grad": 0.0, "param": 0.0, "eval": 0.0}


def step(i: int, batch: dict) -> bool:
    losses = []
    for m in (serial, pmodel):
        torch.manual_seed(100 + i)
        micro = halves(batch) if "accum" in features else [batch]
        total = 0.0
        for mb in micro:
            loss = loss_of(m, mb) / len(micro)
            loss.backward()
            total += loss.detach()
        losses.append(total)
    gd, gat = worst((n, sp[n].grad, ppar[n].grad) for n in sp)
    ld = maxdiff(losses[0], losses[1])
    for opt, sch in ((opt_s, sch_s), (opt_p, sch_p)):
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sch is not None:
            sch.step()
    pd, pat = worst((n, sp[n].detach(), ppar[n].detach()) for n in sp)
    bd = buffers_diff(serial, pmodel)
    say(f"step {i}: loss {float(losses[0]):.5f} diff {ld:.2e}; grad diff {gd:.2e} ({gat}); "
        f"param diff {pd:.2e} ({pat}); buffers {bd:.2e}" + (f"; lr {sch_p.get_last_lr()[0]:.4f}" if sch_p else ""))
    summary["loss"] = max(summary["loss"], ld)
    summary["grad"] = max(summary["grad"], gd)
    summary["param"] = max(summary["param"], pd, bd)
    good = ld <= tol and gd <= tol and pd <= tol and bd <= tol
    if "switch" in features:
        for m in (serial, pmodel):
            m.eval()
        vd = maxdiff(loss_of(serial, val), loss_of(pmodel, val))
        with torch.no_grad():
            nd = maxdiff(loss_of(serial, val), loss_of(pmodel, val))
        bd2 = buffers_diff(serial, pmodel)
        for m in (serial, pmodel):
            m.train()
        say(f"  eval forward loss diff {vd:.2e}, under no_grad {nd:.2e}; buffers after eval {bd2:.2e}")
        summary["eval"] = max(summary["eval"], vd, nd)
        good &= vd <= tol and nd <= tol and bd2 <= tol
    return good


ok = True
for i, batch in enumerate(data):
    ok &= step(i, batch)
if "save" in features:
    sd = pmodel.full_state_dict()
    path = os.path.join(tempfile.gettempdir(), f"user17-{kind}-{os.getpid()}.pt")
    if dist.get_rank() == 0:
        torch.save(sd, path)
    obj = [path]
    dist.broadcast_object_list(obj, src=0)
    loaded = torch.load(obj[0], weights_only=True)
    fresh_s = build(1)
    fresh_s.load_state_dict(loaded)
    fresh_p = parallel(build(2), example)
    fresh_p.load_state_dict(loaded)
    fs, fp = dict(fresh_s.named_parameters()), dict(fresh_p.named_parameters())
    d1, _ = worst((n, sp[n].detach(), fs[n].detach()) for n in sp)
    d2, at2 = worst((n, sp[n].detach(), fp[n].detach()) for n in sp)
    b2 = buffers_diff(serial, fresh_p)
    torch.manual_seed(5)
    l0 = loss_of(serial, val)
    torch.manual_seed(5)
    l1 = loss_of(fresh_s, val)
    torch.manual_seed(5)
    l2 = loss_of(fresh_p, val)
    say(f"save: fresh serial params {d1:.2e}, fresh parallel params {d2:.2e} ({at2}), buffers {b2:.2e}; "
        f"next loss {float(l0.detach()):.5f}: fresh serial {maxdiff(l0, l1):.2e}, fresh parallel {maxdiff(l0, l2):.2e}")
    ok &= max(d1, d2, b2, maxdiff(l0, l1), maxdiff(l0, l2)) <= tol
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(obj[0])
say("SUMMARY " + " ".join(f"{k} {v:.1e}" for k, v in summary.items()))
finish(ok)
