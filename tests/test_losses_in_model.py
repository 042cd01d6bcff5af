"""Losses a model computes inside forward: BCE (with logits), smooth L1, Huber, KL divergence,
log-sigmoid, and spectral_norm's power iteration had no sharding rule on more than one rank (a
probe found BertForSequenceClassification(problem_type="multi_label_classification") failing at
modeling_bert.py). Every rank's program runs in lockstep against the serial call."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from pass_fixtures import assert_call_matches_serial
from torch import nn

aten = torch.ops.aten


class Losses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.normed = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        y = self.normed(self.lin(x))
        return (
            F.binary_cross_entropy_with_logits(y, t)
            + F.binary_cross_entropy(torch.sigmoid(y), t)
            + F.smooth_l1_loss(y, t)
            + F.huber_loss(y, t, delta=0.5)
            + F.kl_div(F.log_softmax(y, -1), F.softmax(t, -1), reduction="batchmean")
            + F.logsigmoid(y).mean()
        )


def test_losses_inside_forward_equal_serial() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(4, 8, generator=g), torch.rand(4, 8, generator=g)
    compiled = assert_call_matches_serial(Losses(), (2,), (x, t))
    targets = {n.target for n in next(iter(compiled.values())).graph.graph.nodes}
    fused = {aten.binary_cross_entropy_with_logits.default, aten.huber_loss.default, aten.xlogy.Tensor}
    assert not targets & fused, "the fused losses are decomposed on more than one rank"


def test_bert_multi_label_classification_at_defaults_equals_serial() -> None:
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, problem_type="multi_label_classification",
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(64, (4, 8), generator=g)
    labels = torch.randint(0, 2, (4, 3), generator=g).float()
    assert_call_matches_serial(model, (2,), (), {"input_ids": ids, "labels": labels})


class TokenLoss(nn.Module):
    """A language model's head and its mean cross entropy over the tokens not ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.emb(ids)))
        return F.cross_entropy(logits.view(-1, 16), labels.view(-1))


def test_a_token_mean_reduces_its_sum_and_count_in_one_all_reduce() -> None:
    """With the tokens split, the loss's sum and its count of targets not ignored are one pending
    sum of 2 numbers, all-reduced once in forward (were: the per-token losses and the ignore mask
    all-gathered, two collectives); loss and gradients equal serial's."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(16, (8, 16), generator=g), torch.randint(16, (8, 16), generator=g)
    labels[:, :3] = -100
    compiled = assert_call_matches_serial(TokenLoss(), (2,), (ids, labels))
    for rank in compiled.values():
        at_loss = [
            info.comm
            for n in rank.graph.graph.nodes
            if (info := n.meta.get("autopar")) is not None and info.comm is not None and info.module_path == "<root>"
        ]
        assert [(c.kind, c.before.shape) for c in at_loss] == [("all_reduce", (2,))]
