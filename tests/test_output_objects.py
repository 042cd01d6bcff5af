"""A model that returns its own dataclass (`Out(loss, logits)`, as Lightning-style code writes):
pytree sees no tensor in an unregistered one, so the program used to have no outputs at all and the
parallel module returned None in its place (a user probe: 0 outputs compiled, no error). It is
refused, named, with how to register it; registered, it trains like serial and comes back whole.
A dataclass batch gets the same hint from torch.export's refusal, and registered trains like serial."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pass_fixtures import assert_call_matches_serial, compile_every_rank, lockstep_step

from autopar.core.errors import TraceError
from autopar.core.meta import signature
from autopar.passes.trace import trace
from autopar.testing import assemble


@dataclass
class _Out:
    loss: torch.Tensor
    logits: torch.Tensor


@dataclass
class _RegisteredOut:
    loss: torch.Tensor
    logits: torch.Tensor
    note: str = "step"


torch.export.register_dataclass(_RegisteredOut)  # what the error's hint says to do


class _Net(nn.Module):
    def __init__(self, out: type) -> None:
        super().__init__()
        self.out = out
        self.l1, self.l2 = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> object:
        logits = self.l2(torch.relu(self.l1(x)))
        return self.out(loss=F.cross_entropy(logits, y), logits=logits)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 12, generator=g), torch.randint(3, (8,), generator=g)


def test_an_unregistered_dataclass_output_is_refused_with_how_to_register_it() -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError) as raised:
        trace(_Net(_Out), _batch())
    error = raised.value
    assert error.op == "return _Out" and "would return None" in error.message, error
    assert error.where and "test_output_objects.py" in error.where, error.where
    assert error.hint and "torch.export.register_dataclass(_Out)" in error.hint


def test_a_registered_dataclass_output_trains_like_serial_and_comes_back_whole() -> None:
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(_Net(_RegisteredOut), (2, 2), _batch())
    first = next(iter(compiled.values()))
    assert len(first.program.output_layouts) == 2  # the loss and the logits
    structure = signature(first.graph).outputs
    assert structure is not None
    rebuilt = structure.rebuild([torch.tensor(1.0), torch.zeros(8, 3)])
    assert isinstance(rebuilt, _RegisteredOut) and rebuilt.note == "step", rebuilt


@dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class _RegisteredBatch:
    x: torch.Tensor
    y: torch.Tensor


torch.export.register_dataclass(_RegisteredBatch)


class _BatchNet(_Net):
    def forward(self, batch: _Batch) -> object:  # type: ignore[override]
        return super().forward(batch.x, batch.y).loss


def test_a_dataclass_batch_gets_how_to_register_it_and_registered_trains_like_serial() -> None:
    """torch.export's own refusal of the batch's class came with the generic "make the forward
    traceable" hint; it now says to register the class, which then trains like serial."""
    torch.manual_seed(0)
    with pytest.raises(TraceError) as raised:
        trace(_BatchNet(_Out), (_Batch(*_batch()),))
    assert raised.value.hint and "torch.export.register_dataclass(_Batch)" in raised.value.hint, raised.value
    assert_call_matches_serial(_BatchNet(_Out), (2, 2), (_RegisteredBatch(*_batch()),))


class _TwoTowers(nn.Module):
    """CLIP's outputs in small: `logits_per_image` is a view (the transpose) of `logits_per_text`."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(6, 4), nn.Linear(5, 4)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> dict[str, torch.Tensor]:
        per_text = self.text(texts) @ self.image(images).t() * self.logit_scale.exp()
        return {"logits_per_image": per_text.t(), "logits_per_text": per_text}


def test_a_loss_on_an_output_that_views_another_output_trains_every_weight_like_serial() -> None:
    """A contrastive loss on `logits_per_image` alone (open_clip's loop over transformers' CLIP):
    the joint export gave the view no tangent of its own, so its gradient was dropped and the text
    tower and the logit scale got none (a user probe on CLIPModel, 4 gloo ranks)."""
    torch.manual_seed(0)
    model = _TwoTowers()
    g = torch.Generator().manual_seed(1)
    images, texts = torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)
    shape = (2, 2)
    compiled = compile_every_rank(model, shape, (images, texts))
    program = next(iter(compiled.values())).program
    assert program.tangent_outputs == [0, 1], program.tangent_outputs  # the view has its own
    _, grads = lockstep_step(compiled, model, shape, (images, texts), {})  # output 0's gradient: ones
    model(images, texts)["logits_per_image"].backward(torch.ones(8, 8))
    params = dict(model.named_parameters())
    for i, (name, layout) in enumerate(zip(program.param_names, program.param_layouts)):
        want = params[name].grad
        assert want is not None
        got = assemble({c: grads[c][i] for c in grads}, layout, shape)
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4, msg=name)
