"""transformers models with their loss inside, at tiny default-like configs (dropout on), trained as
docs/api.md's loop writes it: `loss = pmodel(**batch).loss`. One wrapped in the user's own module
with an extra head and the loss outside (`wrapped`).

torchrun --standalone --nproc_per_node=4 probe/hf_models.py whisper|vit|t5|bert-mlm|wrapped [fp32|fp64]
bert-mlm-frozen: BERT MLM with the word embeddings (tied to the decoder) frozen, transformers'
gradient_checkpointing_enable(), and batches padded each to its own longest sentence.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from common import Timer, compare, finish, maxdiff, say, setup
from torch import nn

import autopar

kind = sys.argv[1] if len(sys.argv) > 1 else "vit"
dtype = getattr(torch, {"fp32": "float32", "fp64": "float64"}[sys.argv[2] if len(sys.argv) > 2 else "fp32"])
mesh = setup()
torch.manual_seed(0)
B = 4
g = torch.Generator().manual_seed(1234)


class Wrapped(nn.Module):
    """The user's own module: a BERT backbone, a pooled classification head, the loss outside."""

    def __init__(self, backbone: nn.Module, classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(backbone.config.hidden_size, classes))

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(h[:, 0])


if kind == "whisper":
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=100, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, d_model=32,
                        encoder_ffn_dim=37, decoder_ffn_dim=37, max_source_positions=16,
                        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)
    model = WhisperForConditionalGeneration(cfg)

    def make():
        labels = torch.randint(4, 100, (B, 8), generator=g)
        labels[0, -2:] = -100
        return {"input_features": torch.randn(B, 16, 32, generator=g, dtype=dtype), "labels": labels}
elif kind == "vit":
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                    image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=0.1,
                    attention_probs_dropout_prob=0.1)
    model = ViTForImageClassification(cfg)

    def make():
        return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g, dtype=dtype),
                "labels": torch.randint(0, 5, (B,), generator=g)}
elif kind == "t5":
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg)

    def make():
        labels = torch.randint(2, 100, (B, 8), generator=g)
        labels[1, -3:] = -100
        mask = torch.ones(B, 12, dtype=torch.long)
        mask[2, -4:] = 0
        return {"input_ids": torch.randint(2, 100, (B, 12), generator=g), "attention_mask": mask,
                "labels": labels}
elif kind in ("bert-mlm", "wrapped", "bert-mlm-frozen"):
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertModel,
        BertTokenizer,
        DataCollatorForLanguageModeling,
    )

    words = [f"w{i}" for i in range(90)]
    vocab = os.path.join(tempfile.mkdtemp(), "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = BertTokenizer(vocab)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=37, max_position_embeddings=32)
    model = Wrapped(BertModel(cfg), 3) if kind == "wrapped" else BertForMaskedLM(cfg)
    if kind == "bert-mlm-frozen":
        model.bert.embeddings.word_embeddings.requires_grad_(False)
        model.gradient_checkpointing_enable()
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.3)

    def make():
        # sentences of varying length, padded by the collator to the longest (fixed at 12 here)
        texts = []
        lengths = [int(n) for n in torch.randint(5, 11, (B,), generator=g)]
        for i in range(B):
            n = lengths[i] if kind == "bert-mlm-frozen" else (10 if i else 8)
            texts.append(" ".join(words[j] for j in torch.randint(0, 90, (n,), generator=g).tolist()))
        enc = [tok(t) for t in texts]
        if kind == "wrapped":
            batch = tok.pad(enc, return_tensors="pt")
            return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                    "y": torch.randint(0, 3, (B,), generator=g)}
        return dict(collator(enc))
else:
    raise SystemExit(kind)

model = model.to(dtype).train()
serial = copy.deepcopy(model)
data = [make() for _ in range(3)]
for b in data:
    say(f"{kind}: batch " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in b.items()))


def loss_of(m, batch):
    if kind == "wrapped":
        b = dict(batch)
        y = b.pop("y")
        return F.cross_entropy(m(**b), y)
    return m(**batch).loss


ex = {k: v for k, v in data[0].items() if k != "y"}
with Timer() as tm:
    pmodel = autopar.parallelize(model, mesh, example_kwargs=ex)
say(f"{kind} {dtype}: parallelize cpu {tm.cpu:.1f}s wall {tm.wall:.1f}s")
say(pmodel.plan_summary())
opt_s = torch.optim.SGD([p for p in serial.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
opt_p = torch.optim.SGD([p for p in pmodel.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
tol = 2e-4 if dtype == torch.float32 else 1e-9
ok = True
for step, batch in enumerate(data):
    opt_s.zero_grad()
    opt_p.zero_grad()
    rng = torch.get_rng_state()
    ls = loss_of(serial, batch)
    ls.backward()
    torch.set_rng_state(rng)
    with Timer() as tm:
        lp = loss_of(pmodel, batch)
        lp.backward()
    say(f"step {step}: loss serial {ls.item():.6f} par {lp.item():.6f} diff {maxdiff(ls, lp):.2e}"
        f" step cpu {tm.cpu:.2f}s")
    ok &= maxdiff(ls, lp) <= tol
    ok &= compare(serial, pmodel, f"grads step {step}", tol) <= tol
    opt_s.step()
    opt_p.step()
ok &= compare(serial, pmodel, "params after 3 steps", tol, grads=False) <= tol
# evaluation as a user writes it: eval(), no_grad, the loss and logits
serial.eval()
pmodel.eval()
with torch.no_grad():
    es = loss_of(serial, data[0])
    ep = loss_of(pmodel, data[0])
say(f"eval loss serial {es.item():.6f} par {ep.item():.6f} diff {maxdiff(es, ep):.2e}")
ok &= maxdiff(es, ep) <= tol
finish(ok)
