"""Ops of vision and speech models that earlier had no rule (issue 31 item 4): a segmentation
loss (`nll_loss2d`, cross entropy over (N, C, H, W) logits, Segformer's), weight normalization
(`_weight_norm_interface`, wav2vec2's positional convolution), and the refusals whose hints must
name the real cause (torch's causal-mask detection in `nn.Transformer`, `F.ctc_loss`'s alignment
table with concatenated targets; padded targets train). Decompositions checked against torch's kernels; models in lockstep against serial."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from pass_fixtures import assert_call_matches_serial, train_in_lockstep
from torch import nn

from autopar.compiler.driver import compile_for_rank
from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.passes.repeats import REPEATS_KEY, RepeatedBlocks
from autopar.passes.trace import trace
from autopar.rules.ctc import CTC_LOSS
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


class WeightNormedMLP(nn.Module):
    """torch's `parametrizations.weight_norm` at its default dim 0 on a Linear (and dim 1 on
    another): the trace leaves the defaulted dim out of the call, which the decomposition must take
    (it was "TypeError: _weight_norm() missing 1 required positional argument: 'dim'")."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.utils.parametrizations.weight_norm(nn.Linear(16, 32))
        self.fc2 = nn.utils.parametrizations.weight_norm(nn.Linear(32, 32), dim=1)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(F.gelu(self.fc2(F.gelu(self.fc1(x))))), labels)


def test_default_weight_norm_trains_equal_to_serial() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    result = train_in_lockstep(
        WeightNormedMLP(), (2, 2), batches, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    )
    assert result["loss_err"] < 1e-5 and result["grad_err"] < 1e-4 and result["param_err"] < 1e-5, result


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


class Acoustic(nn.Module):
    """A toy acoustic model trained with CTC: conv1d over frames, a linear to characters, log_softmax,
    then F.ctc_loss over (T, N, C) log probabilities with targets padded to (N, S)."""

    def __init__(self, reduction: str = "mean", zero_infinity: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.out = nn.Linear(16, 6)
        self.reduction, self.zero_infinity = reduction, zero_infinity

    def forward(self, x: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor, target_lengths: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)  # (N, T, 16)
        log_probs = self.out(h).log_softmax(-1).transpose(0, 1)  # (T, N, C)
        return F.ctc_loss(log_probs, targets, lengths, target_lengths, reduction=self.reduction, zero_infinity=self.zero_infinity)


def _speech_batch() -> tuple[torch.Tensor, ...]:
    """4 utterances of 12 frames (two shorter), targets of up to 5 characters padded with noise."""
    torch.manual_seed(0)
    return torch.randn(4, 12, 8), torch.randint(1, 6, (4, 5)), torch.tensor([12, 10, 12, 9]), torch.tensor([5, 4, 3, 5])


@pytest.mark.parametrize(("shape", "reduction", "zero_infinity"), [((2, 2), "mean", False), ((2, 2, 2), "sum", True)])
def test_ctc_acoustic_model_matches_serial(shape: tuple[int, ...], reduction: str, zero_infinity: bool) -> None:
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(Acoustic(reduction, zero_infinity), shape, _speech_batch())
    ctc = [n for n in next(iter(compiled.values())).graph.graph.nodes if n.target == CTC_LOSS]
    assert len(ctc) == 1


def test_ctc_loss_splits_the_batch_where_the_plan_splits_it() -> None:
    """On a (2,) mesh the batch split is the plan: each rank computes CTC over its 2 utterances."""
    compiled = compile_for_rank(Acoustic(), Mesh.from_shape((2,)), _speech_batch())
    forward = compiled.program.forward
    ctc = [n for n in forward.graph.nodes if n.target == CTC_LOSS]
    assert [tuple(n.args[0].meta["val"].shape) for n in ctc] == [(12, 2, 6)]


class ListLengths(nn.Module):
    """nn.CTCLoss without reduction, lengths as Python lists (constants of the program)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 6)
        self.ctc = nn.CTCLoss(reduction="none")

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_probs = self.out(x).log_softmax(-1).transpose(0, 1)
        return self.ctc(log_probs, targets, [12, 10, 12, 9], [5, 4, 3, 5]).mean()


def test_ctc_loss_module_with_list_lengths_matches_serial() -> None:
    x, targets, _, _ = _speech_batch()
    assert_call_matches_serial(ListLengths(), (2,), (x, targets))


class DeepAcoustic(nn.Module):
    """Eight identical blocks under a CTC loss: traced once and copied, like any repeated stack."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(8)])
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor, target_lengths: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.ctc_loss(self.out(h).log_softmax(-1).transpose(0, 1), targets, lengths, target_lengths)


def test_repeated_blocks_under_a_ctc_loss_are_found() -> None:
    """The recorded forward run that finds repeated blocks runs F.ctc_loss on fake tensors too."""
    gm = trace(DeepAcoustic(), _speech_batch())
    assert gm.meta.get(REPEATS_KEY) == (RepeatedBlocks("blocks", 8),)


def test_ctc_loss_with_concatenated_targets_is_refused_with_padding_named() -> None:
    x, targets, lengths, target_lengths = _speech_batch()
    flat = torch.cat([t[:n] for t, n in zip(targets, target_lengths)])  # which sample owns which: values
    with pytest.raises(AutoparError) as caught:
        compile_for_rank(Acoustic(), Mesh.from_shape((2,)), (x, flat, lengths, target_lengths))
    text = str(caught.value)
    assert "ctc_loss" in text and "pad the targets" in text and "expert" not in text, text
