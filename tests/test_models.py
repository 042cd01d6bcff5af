"""The example models: deterministic from a seed, trainable serially, and traceable by torch.export."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from examples.models import GPT, MLP, make_gpt, make_mlp


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_make_gpt_is_deterministic_in_the_seed() -> None:
    m1, (idx1, tgt1) = make_gpt(3)
    m2, (idx2, tgt2) = make_gpt(3)
    m3, (idx3, _) = make_gpt(4)
    assert _same_state(m1, m2) and torch.equal(idx1, idx2) and torch.equal(tgt1, tgt2)
    assert not _same_state(m1, m3) and not torch.equal(idx1, idx3)


def test_gpt_shapes_and_tied_head() -> None:
    model, (idx, targets) = make_gpt(0, batch_size=8, n_layer=3)
    cfg = model.cfg
    assert isinstance(model, GPT) and len(model.blocks) == 3
    assert idx.shape == targets.shape == (8, cfg.block_size)
    assert int(idx.max()) < cfg.vocab_size
    assert model.lm_head.weight is model.wte.weight
    # The tied weight is one parameter, listed once under its first name.
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    for _, p in model.named_parameters():
        assert all(s % 8 == 0 for s in p.shape), "every dim must split over a 2x2x2 mesh"


def test_gpt_forward_backward_gives_the_loss_and_every_gradient() -> None:
    model, (idx, targets) = make_gpt(0)
    loss = model(idx, targets)
    assert loss.shape == ()
    # Small init: the untrained model predicts nearly uniformly.
    assert loss.item() == pytest.approx(math.log(model.cfg.vocab_size), abs=0.1)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_gpt_is_causal() -> None:
    model, (idx, targets) = make_gpt(0, batch_size=1)
    cfg = model.cfg
    # Changing the last token must not change the loss on the earlier positions.
    later = idx.clone()
    later[0, -1] = (later[0, -1] + 1) % cfg.vocab_size
    masked = targets.clone()
    masked[0, -1] = -100  # cross_entropy's ignore_index
    assert torch.equal(model(idx, masked), model(later, masked))


def test_gpt_exports_and_the_export_computes_the_same_loss() -> None:
    model, (idx, targets) = make_gpt(0)
    ep = torch.export.export(model, (idx, targets))
    targets_in_graph = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "aten.scaled_dot_product_attention.default" in targets_in_graph
    torch.testing.assert_close(ep.module()(idx, targets), model(idx, targets))


def test_mlp_trains_and_exports() -> None:
    model, (x, y) = make_mlp(0)
    assert isinstance(model, MLP) and x.shape == (8, 32) and y.shape == (8,)
    for p in model.parameters():
        assert all(s % 8 == 0 for s in p.shape)
    model2, _ = make_mlp(0)
    assert _same_state(model, model2)
    loss = model(x, y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    ep = torch.export.export(model, (x, y))
    torch.testing.assert_close(ep.module()(x, y), loss.detach())
