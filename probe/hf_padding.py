"""Round 9 (user15): transformers models we did not write, called as their docs call them, against
serial: loss, every gradient, parameters after 3 SGD-momentum steps, gloo.

torchrun --standalone --nproc_per_node=2 probe/hf_padding.py KIND [fp32|fp64]   (MESH=2,2 for 2-D)
KIND:
  mistral   MistralForCausalLM, sliding_window 4 < sequence 12, labels inside
  gemma2    Gemma2ForCausalLM (attention and final logit soft-capping, alternating sliding layers)
  gemma3    Gemma3ForCausalLM (text), sliding layers, query-key norms
  t5-out    T5ForConditionalGeneration, loss OUTSIDE: F.cross_entropy(out.logits.flatten(0, 1), labels)
  enc-head  a user module: BertModel encoder + mean pooling over the attention mask + MLP head,
            F.cross_entropy outside
Batches: the example (first) batch has NO padding; the later ones pad right (and left for the
decoders) by different amounts, so a program that baked "no padding" in would differ from serial.
The third batch has 6 rows instead of 8 (a data set's remainder: a new program).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from common import Timer, finish, maxdiff, say, setup
from torch import nn

import autopar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
kind = sys.argv[1]
dtype = torch.float64 if len(sys.argv) > 2 and sys.argv[2] == "fp64" else torch.float32
mesh = setup()
B, T, V = 8, 12, 64
g = torch.Generator().manual_seed(1234)
size = {
    "vocab_size": V,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class EncoderHead(nn.Module):
    """The user's classifier around a transformers encoder: masked mean pooling and an MLP head."""

    def __init__(self, encoder: nn.Module, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        hidden = encoder.config.hidden_size
        self.head = nn.Sequential(
            nn.Linear(hidden, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, classes)
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def build() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**size, sliding_window=4))
    if kind == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**size, head_dim=8, sliding_window=4))
    if kind == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**size, head_dim=8, sliding_window=4))
    if kind == "t5-out":
        return tf.T5ForConditionalGeneration(
            tf.T5Config(
                vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
            )
        )
    if kind == "enc-head":
        return EncoderHead(
            tf.BertModel(
                tf.BertConfig(
                    vocab_size=V,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=48,
                    max_position_embeddings=32,
                )
            ),
            3,
        )
    raise SystemExit(kind)


def make(n: int, pad: bool) -> dict:
    ids = torch.randint(1, V, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    if pad:
        mask[1, -3:] = 0
        mask[n - 2, -int(torch.randint(1, 6, (), generator=g)) :] = 0
        if kind in ("mistral", "gemma2", "gemma3"):
            mask[3, :4] = 0  # left padding too (generation-style batches)
    ids = ids.masked_fill(mask == 0, 0)
    if kind == "t5-out":
        labels = torch.randint(1, V, (n, 7), generator=g)
        labels[2, -2:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if kind == "enc-head":
        return {"input_ids": ids, "attention_mask": mask, "y": torch.randint(0, 3, (n,), generator=g)}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_of(m: nn.Module, batch: dict) -> torch.Tensor:
    b = dict(batch)
    if kind == "enc-head":
        y = b.pop("y")
        return F.cross_entropy(m(**b), y)
    if (
        kind == "t5-out"
    ):  # the labels go in (transformers shifts them into decoder_input_ids), the loss is ours
        labels = b["labels"]
        logits = m(**b).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return m(**b).loss


model = build().to(dtype).train()
serial = copy.deepcopy(model)
data = [make(B, False), make(B, True), make(6, True)]
example = {k: v for k, v in data[0].items() if k != "y"}
with Timer() as tm:
    pmodel = autopar.parallelize(model, mesh, example_kwargs=example)
say(f"{kind} {dtype} mesh {tuple(mesh.shape)}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
sp, pp = dict(serial.named_parameters()), dict(pmodel.named_parameters())
assert set(sp) == set(pp), sorted(set(sp) ^ set(pp))[:6]
tol = 2e-4 if dtype == torch.float32 else 1e-9


def worst(pairs) -> tuple[float, str]:
    """Max abs difference relative to max(1, the largest serial value), and where."""
    out, at = 0.0, "-"
    for name, a, b in pairs:
        if (a is None) != (b is None):
            return float("inf"), f"{name} grad None on one side"
        if a is None:
            continue
        d = maxdiff(a, b) / max(1.0, float(a.abs().max()) if a.numel() else 1.0)
        if d > out:
            out, at = d, name
    return out, at


ok = True
for step, batch in enumerate(data):
    losses = []
    for m in (serial, pmodel):
        torch.manual_seed(100 + step)
        loss = loss_of(m, batch)
        loss.backward()
        losses.append(loss.detach())
    gd, gat = worst((n, sp[n].grad, pp[n].grad) for n in sp)
    ld = maxdiff(losses[0], losses[1])
    say(
        f"step {step} ({len(batch['input_ids'])} rows, pad {step > 0}): loss {float(losses[0]):.6f} diff {ld:.2e};"
        f" grad diff {gd:.2e} ({gat})"
    )
    ok &= ld <= tol and gd <= tol
    for opt in (opt_s, opt_p):
        opt.step()
        opt.zero_grad(set_to_none=True)
pd, pat = worst((n, sp[n].detach(), pp[n].detach()) for n in sp)
say(f"after 3 steps: param diff {pd:.2e} ({pat})")
ok &= pd <= tol
serial.eval()
pmodel.eval()
with torch.no_grad():
    ev = maxdiff(loss_of(serial, data[1]), loss_of(pmodel, data[1]))
say(f"eval (no_grad) loss diff {ev:.2e}")
ok &= ev <= tol
if kind in ("mistral", "gemma2", "gemma3"):  # other arguments than the example's: new programs
    serial.train()
    pmodel.train()
    for tag, kw in (
        ("no attention_mask", {"attention_mask": None}),
        ("return_dict=False", {"return_dict": False}),
    ):
        b = {**data[1], **kw}
        if b["attention_mask"] is None:
            del b["attention_mask"]
        losses = []
        for m in (serial, pmodel):
            torch.manual_seed(9)
            out = m(**b)
            loss = out[0] if isinstance(out, tuple) else out.loss
            loss.backward()
            losses.append(loss.detach())
        gd, gat = worst((n, sp[n].grad, pp[n].grad) for n in sp)
        say(f"{tag}: loss diff {maxdiff(*losses):.2e}, grad diff {gd:.2e} ({gat})")
        ok &= maxdiff(*losses) <= tol and gd <= tol
        for m in (serial, pmodel):
            m.zero_grad(set_to_none=True)
finish(ok)
