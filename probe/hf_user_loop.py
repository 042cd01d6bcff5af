"""A user's whole loop around transformers models: PEFT adapters (only they train) and a model
wrapped in the user's own module with forward hooks and buffers it updates in forward.

torchrun --standalone --nproc_per_node=4 probe/hf_user_loop.py KIND [fp32|fp64]
KIND:
  peft-gpt2      GPT2LMHeadModel, LoRA on `c_attn` (a Conv1D: fan_in_fan_out), lora_dropout, loss inside
  peft-bert-cls  BertForSequenceClassification, LoraConfig(task_type="SEQ_CLS"): the classifier is a
                 `modules_to_save` copy (trained in full), padding mask, loss inside
  peft-dora      LlamaForCausalLM with DoRA (`use_dora=True`: a weight-norm magnitude per row)
  wrapped        Qwen2Model inside the user's module: a forward hook that keeps an EMA of the
                 hidden states' norm in a buffer (returns None), a step counter buffer updated in
                 forward, a linear head and `F.cross_entropy` outside
The loop (every KIND): 3 steps of 8, 8 and 7 rows (a data set's remainder: uneven), 2 micro-batches accumulated a step, `clip_grad_norm_` (its norm compared),
a warmup-cosine LR schedule, `zero_grad(set_to_none=True)`, then `full_state_dict()` saved with
torch.save, loaded into a fresh serial model, whose eval loss must equal the trained serial's.
Differences are printed separately for the loss, the gradients, the parameters and the buffers.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from common import Timer, finish, maxdiff, say, setup
from torch import nn

import autopar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
kind = sys.argv[1] if len(sys.argv) > 1 else "wrapped"
dtype = torch.float64 if len(sys.argv) > 2 and sys.argv[2] == "fp64" else torch.float32
mesh = setup()
B, T, V = 8, 12, 64
g = torch.Generator().manual_seed(1234)


class Wrapped(nn.Module):
    """The user's own module around a transformers backbone."""

    def __init__(self, backbone: nn.Module, classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, classes)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("norm_ema", torch.zeros(()))
        self.backbone.norm.register_forward_hook(self._keep_norm)

    def _keep_norm(self, module, args, output) -> None:
        self.norm_ema.mul_(0.9).add_(0.1 * output.detach().norm(dim=-1).mean().to(self.norm_ema.dtype))

    def forward(self, input_ids, attention_mask):
        if self.training:
            self.calls += 1
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(-1) - 1
        return self.head(h[torch.arange(h.shape[0]), last])


def build() -> nn.Module:
    import peft
    import transformers

    torch.manual_seed(0)
    if kind == "peft-gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1,
                               fan_in_fan_out=True)
        return peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), lora)
    if kind == "peft-bert-cls":
        cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=48, max_position_embeddings=32, num_labels=3)
        lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"])
        return peft.get_peft_model(transformers.BertForSequenceClassification(cfg), lora)
    if kind == "peft-dora":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
        return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)
    if kind == "wrapped":
        cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        return Wrapped(transformers.Qwen2Model(cfg), 5)
    raise SystemExit(kind)


def make(n: int = B) -> dict:
    ids = torch.randint(0, V, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    mask[1, -3:] = 0
    mask[5, -5:] = 0
    if kind == "peft-bert-cls":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (n,), generator=g)}
    if kind == "wrapped":
        return {"input_ids": ids, "attention_mask": mask, "y": torch.randint(0, 5, (n,), generator=g)}
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_of(m: nn.Module, batch: dict) -> torch.Tensor:
    if kind == "wrapped":
        b = dict(batch)
        y = b.pop("y")
        return F.cross_entropy(m(**b), y)
    return m(**batch).loss


def halves(batch: dict) -> list[dict]:
    n = len(batch["input_ids"])
    return [{k: v[: (n + 1) // 2] for k, v in batch.items()}, {k: v[(n + 1) // 2:] for k, v in batch.items()}]


model = build().to(dtype).train()
serial = copy.deepcopy(model)
steps = 3
data = [make(), make(), make(B - 1)]  # the last: a data set's remainder (micro-batches of 4 and 3)
example = {k: v for k, v in halves(data[0])[0].items() if k != "y"}
with Timer() as tm:
    pmodel = autopar.parallelize(model, mesh, example_kwargs=example)
say(f"{kind} {dtype} mesh {tuple(mesh.shape)}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")


def loop_parts(m: nn.Module):
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    return opt, get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=steps + 1)


(opt_s, sch_s), (opt_p, sch_p) = loop_parts(serial), loop_parts(pmodel)
sp, pp = dict(serial.named_parameters()), dict(pmodel.named_parameters())
assert set(sp) == set(pp), sorted(set(sp) ^ set(pp))[:6]
trainable = [n for n, p in sp.items() if p.requires_grad]
assert all(pp[n].requires_grad for n in trainable) and len(trainable) < len(sp) or kind == "wrapped"
tol = 2e-4 if dtype == torch.float32 else 1e-9


def worst(pairs) -> tuple[float, str]:
    """Max abs difference relative to max(1, the largest serial value), and where."""
    out, at = 0.0, "-"
    for name, a, b in pairs:
        d = maxdiff(a, b) / max(1.0, float(a.abs().max()) if a is not None and a.numel() else 1.0)
        if d > out:
            out, at = d, name
    return out, at


ok = True
for step, batch in enumerate(data):
    losses, norms = [], []
    for m in (serial, pmodel):
        torch.manual_seed(100 + step)
        total = 0.0
        for micro in halves(batch):
            loss = loss_of(m, micro) / 2
            loss.backward()
            total += loss.detach()
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 0.5))
    gd, gat = worst((n, sp[n].grad, pp[n].grad) for n in trainable)
    ok &= not [n for n, p in pp.items() if not p.requires_grad and p.grad is not None]
    for opt, sch in ((opt_s, sch_s), (opt_p, sch_p)):
        opt.step()
        sch.step()
        opt.zero_grad(set_to_none=True)
    ld, nd = maxdiff(losses[0], losses[1]), maxdiff(norms[0], norms[1])
    say(f"step {step}: loss {float(losses[0]):.6f} diff {ld:.2e}; clipped grad diff {gd:.2e} ({gat});"
        f" grad norm {float(norms[0]):.4f} diff {nd:.2e}; lr {sch_p.get_last_lr()[0]:.4f}")
    ok &= ld <= tol and gd <= tol and nd <= tol
    ok &= all(p.grad is None for p in pmodel.parameters())
pd, pat = worst((n, sp[n].detach(), pp[n].detach()) for n in sp)
pb = dict(pmodel.named_buffers())
bd, bat = worst((n, b, pb[n]) for n, b in serial.named_buffers())
say(f"after {steps} steps: param diff {pd:.2e} ({pat}); buffer diff {bd:.2e} ({bat});"
    f" buffers {[(n, float(b)) for n, b in pb.items() if b.dim() == 0]}")
ok &= pd <= tol and bd <= tol

full = pmodel.full_state_dict()
fresh = build().to(dtype)
if torch.distributed.get_rank() == 0:
    path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    torch.save(full, path)
    result = fresh.load_state_dict(torch.load(path, weights_only=True))
    same_keys = set(full) == set(serial.state_dict())
    rd = max(maxdiff(v, full[k]) for k, v in serial.state_dict().items())
    serial.eval()
    fresh.eval()
    with torch.no_grad():
        ev = maxdiff(loss_of(serial, data[0]), loss_of(fresh, data[0]))
    say(f"reload: keys equal {same_keys}, load {result}, max state diff {rd:.2e}, eval loss diff {ev:.2e}")
    ok &= same_keys and rd <= tol and ev <= tol
finish(ok)
