"""Ops of vision and speech models that earlier had no rule (issue 31 item 4): a segmentation
loss (`nll_loss2d`, cross entropy over (N, C, H, W) logits, Segformer's), weight normalization
(`_weight_norm_interface`, wav2vec2's positional convolution), and the refusals whose hints must
name the real cause (torch's causal-mask detection in `nn.Transformer`, `F.ctc_loss`'s alignment
table). Decompositions checked against torch's kernels; models in lockstep against serial."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from pass_fixtures import assert_call_matches_serial
from torch import nn

from autopar.compiler.driver import compile_for_rank
from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.rules.decompositions import sharding_decompositions

aten = torch.ops.aten
TABLE = sharding_decompositions()


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    last=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_weight_norm_forward_and_backward_equal_the_kernels(shape: list[int], last: bool, seed: int) -> None:
    """The fused kernels take the first or the last dim (torch's weight_norm calls them there)."""
    dim = len(shape) - 1 if last else 0
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    g_shape = [n if d == dim else 1 for d, n in enumerate(shape)]
    g = torch.randn(g_shape, generator=gen, dtype=torch.float64)
    w, norms = aten._weight_norm_interface.default(v, g, dim)
    dw, dn = TABLE[aten._weight_norm_interface.default](v, g, dim)
    torch.testing.assert_close(dw, w)
    torch.testing.assert_close(dn, norms)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    want = aten._weight_norm_interface_backward.default(grad, v, g, norms, dim)
    got = TABLE[aten._weight_norm_interface_backward.default](grad, v, g, norms, dim)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


class Segmenter(nn.Module):
    """A per-pixel classifier trained as segmentation models are: cross entropy over 4-D logits."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Conv2d(16, 5, 1)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.relu(self.stem(pixels))), labels, ignore_index=0)


class PositionalConv(nn.Module):
    """wav2vec2's positional convolution: a grouped Conv1d under weight_norm over the kernel dim."""

    def __init__(self) -> None:
        super().__init__()
        conv = nn.Conv1d(16, 16, 8, padding=4, groups=4)  # an even kernel, as wav2vec2's 128
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        self.proj = nn.Linear(16, 16)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.proj(features)
        x = x + F.gelu(self.conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2)  # wav2vec2's SamePad
        return x.pow(2).mean()


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)])
def test_segmentation_loss_matches_serial(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    pixels, labels = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4, 8, 8))
    assert_call_matches_serial(Segmenter(), shape, (pixels, labels))


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)])
def test_weight_normed_convolution_matches_serial(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    assert_call_matches_serial(PositionalConv(), shape, (torch.randn(4, 12, 16),))


class CausalTransformer(nn.Module):
    """torch's own recipe: nn.Transformer with generate_square_subsequent_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        return self.t(src, tgt, tgt_mask=mask).sum()


def test_transformer_causal_mask_detection_is_named_with_its_fix() -> None:
    with pytest.raises(AutoparError) as caught:
        compile_for_rank(CausalTransformer(), Mesh.from_shape((2,)), (torch.randn(4, 6, 16), torch.randn(4, 5, 16)))
    text = str(caught.value)
    assert "_detect_is_causal_mask" in text and "tgt_is_causal=True" in text, text


class CTCModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor, target_lengths: torch.Tensor) -> torch.Tensor:
        log_probs = self.proj(x).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(log_probs, targets, lengths, target_lengths)


def test_ctc_loss_refusal_names_its_cause_not_experts() -> None:
    batch = (torch.randn(4, 12, 8), torch.randint(1, 6, (4, 5)), torch.full((4,), 12), torch.tensor([5, 4, 3, 5]))
    with pytest.raises(AutoparError) as caught:
        compile_for_rank(CTCModel(), Mesh.from_shape((2,)), batch)
    text = str(caught.value)
    assert "ctc_loss" in text and "expert" not in text, text
