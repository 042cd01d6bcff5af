"""The zoo and transformers example models: deterministic, sane at init, every weight trained,
every dim splittable by 8, and traceable by autopar (forward + backward in one graph)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from examples import zoo

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _makers() -> dict[str, Callable[..., Any]]:
    makers: dict[str, Callable[..., Any]] = dict(zoo.MAKERS)
    if HAVE_TRANSFORMERS:
        from examples import hf_models

        makers.update(hf_models.MAKERS)
    return makers


NAMES = [*zoo.MAKERS, "hf_gpt2", "hf_llama"]
CLASSES = {"llama": 64, "bert": 64, "vit": 16, "mixer": 16, "hf_gpt2": 64, "hf_llama": 64}


def _make(name: str, seed: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    if name.startswith("hf_") and not HAVE_TRANSFORMERS:
        pytest.skip("transformers is not installed (pip install -e '.[test]')")
    return _makers()[name](seed)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_sane_and_fully_trained(name: str) -> None:
    model, batch = _make(name, 3)
    again, batch_again = _make(name, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(batch, batch_again))
    assert batch[0].shape[0] == zoo.BATCH
    loss = model(*batch)
    assert loss.shape == ()
    # small init: close to uniform predictions
    assert loss.item() == pytest.approx(math.log(CLASSES[name]), abs=0.25)
    loss.backward()
    for pname, p in model.named_parameters():
        assert all(s % 8 == 0 or s == 1 for s in p.shape), (pname, tuple(p.shape))  # 1: broadcast
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().max() > 1e-7, f"{pname} gets no gradient: it would train on rounding noise"


def test_bert_batch_masks_padding_and_predicts_masked_tokens_only() -> None:
    _, (idx, token_types, attention_mask, labels) = zoo.make_bert(0)
    cfg = zoo.BertConfig()
    assert ((idx == cfg.pad_token) == (attention_mask == 0)).all()
    assert (labels[attention_mask == 0] == -100).all()
    predicted = labels != -100
    assert (idx[predicted] == cfg.mask_token).all() and predicted[:, 0].all()
    assert set(token_types.unique().tolist()) == {0, 1}
    assert (attention_mask == 0).any(), "some sequences must be padded"


def test_vit_pools_and_token_counts() -> None:
    model, batch = zoo.make_vit(0, pool="mean")
    assert model.pos.shape[1] % 8 == 0  # patches + class token
    assert torch.isfinite(model(*batch))
