"""A forward that draws from numpy's or Python's global random generator is refused, naming the
line: the draw ran once, in the trace, and its numbers became a constant of the program, the same
at every call where serial draws new ones. Found as a user: transformers' Wav2Vec2ForCTC (its
SpecAugment time mask is drawn with `np.random.choice` in training) trained on (2, 2) with the CTC
loss outside the model gave a loss off serial's at the first step and gradients off by 0.6, with
no error. The same mask drawn with torch trains like serial."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pass_fixtures import train_in_lockstep

from autopar.compiler.pipeline_export import export_loss
from autopar.core.errors import TraceError
from autopar.passes.trace import trace


class _TimeMasked(torch.nn.Module):
    """SpecAugment's pattern: in training, zero random time steps of the features, then classify
    every step. `draw`: where the mask comes from ("numpy", "python", or "torch")."""

    def __init__(self, draw: str) -> None:
        super().__init__()
        self.draw = draw
        self.proj = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) / np.sqrt(16.0)  # numpy, but no draw: traced as before
        if self.training:
            if self.draw == "numpy":
                keep = torch.from_numpy(np.random.rand(*h.shape[:2]) >= 0.3)
            elif self.draw == "python":
                keep = torch.full(h.shape[:2], random.random() >= 0.3)
            else:
                keep = torch.rand(h.shape[:2]) >= 0.3
            h = h * keep[..., None]
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 6, 8, generator=g), torch.randint(5, (4, 6), generator=g)


@pytest.mark.parametrize(("draw", "op"), [("numpy", "numpy.random.rand"), ("python", "random.random")])
def test_a_host_random_draw_in_forward_is_refused_with_its_line(draw: str, op: str) -> None:
    torch.manual_seed(0)
    np.random.seed(3)
    random.seed(3)
    before = (np.random.get_state()[1].copy(), random.getstate())
    with pytest.raises(TraceError) as raised:
        trace(_TimeMasked(draw), _batch(0))
    error = raised.value
    assert error.op == op, error
    assert error.where and "test_host_random.py" in error.where and "in forward" in error.where, error.where
    assert error.hint is not None and "torch.rand" in error.hint and "mask_time_prob" in error.hint
    # the refused trace leaves both generators where they were (the user's next draw is serial's)
    assert np.array_equal(np.random.get_state()[1], before[0]) and random.getstate() == before[1]


def test_the_mask_drawn_with_torch_trains_like_serial() -> None:
    """The hint's recipe: the same mask from torch.rand is drawn by the program at every call."""
    torch.manual_seed(0)
    model = _TimeMasked("torch")
    batches = [_batch(seed) for seed in range(2)]
    r = train_in_lockstep(model, (2, 2), batches, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["param_err"] < 1e-5, r


def test_wav2vec2_spec_augment_is_refused_naming_its_mask() -> None:
    """Wav2Vec2ForCTC in training with its default SpecAugment (mask_time_prob=0.05, at least two
    masked spans), called on audio alone (the loss outside): refused at the library's draw."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        conv_dim=(32, 32), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_length=4,
    )  # fmt: skip
    with pytest.raises(TraceError) as raised:
        trace(Wav2Vec2ForCTC(config), (), example_kwargs={"input_values": torch.randn(2, 400)})
    error = raised.value
    assert error.op == "numpy.random.rand", error  # its spans' random rounding
    assert error.where and "modeling_wav2vec2.py" in error.where and "in _compute_mask_indices" in error.where, error.where


def test_the_pipeline_export_refuses_it_too() -> None:
    """A pipeline exports the model apart (`export_loss`): the same draw, the same error."""
    torch.manual_seed(0)
    with pytest.raises(TraceError) as raised:
        export_loss(_TimeMasked("numpy"), _batch(0), None)
    assert raised.value.op == "numpy.random.rand", raised.value
    assert raised.value.where and "test_host_random.py" in raised.value.where, raised.value.where


class _DrawsButSkipsNothing(torch.nn.Module):
    """MusicGen's LayerDrop pattern at layerdrop 0: `random.uniform(0, 1)` drawn at every layer,
    compared with 0, never skipping one: the program does not depend on the draw."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layerdrop = layerdrop
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            p = random.uniform(0, 1)
            if self.training and p < self.layerdrop:
                continue
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def test_a_draw_the_program_does_not_depend_on_is_traced() -> None:
    """Refused at layerdrop 0.5 (the skipped layers are fixed by the trace's draws); at 0 the draw
    reaches nothing, the trace goes on, and the generator is left where it was."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    random.seed(1)
    with pytest.raises(TraceError) as raised:
        trace(_DrawsButSkipsNothing(0.5), (x,))
    assert raised.value.op == "random.uniform", raised.value
    random.seed(1)
    before = random.getstate()
    trace(_DrawsButSkipsNothing(0.0), (x,))
    assert random.getstate() == before
