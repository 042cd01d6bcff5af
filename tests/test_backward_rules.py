"""Every rule's backward is proven too: the joint graph of each forward op family contains only ops
that are registered AND property-tested (the COVERED_OPS of tests/test_rules_*.py).

Each module below is one op family as users write it; tracing it the way `parallelize` does
(forward + backward, decompositions for a multi-rank mesh) lists the backward ops its rule implies.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.compiler.coverage import op_coverage
from autopar.rules.registry import default_registry

HERE = Path(__file__).parent


class Apply(nn.Module):
    """`fn(layer(x)).sum()`-style scalar loss around one op family."""

    def __init__(self, layer: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.layer = layer
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.layer(x)).square().mean()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


class Classify(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(idx)).flatten(0, 1), idx.flatten())


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _lin(fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A linear (so gradients flow back through `fn`) followed by the family's op."""
    torch.manual_seed(0)
    return Apply(nn.Linear(8, 8), fn), (_x(4, 8),)


def _rms(y: torch.Tensor) -> torch.Tensor:
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


class CTC(nn.Module):
    """Frame logits -> CTC loss over targets padded to (N, S), summed."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor, target_lengths: torch.Tensor) -> torch.Tensor:
        log_probs = self.out(x).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(log_probs, targets, lengths, target_lengths, reduction="sum")


def _ctc() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    targets = torch.randint(1, 6, (4, 3), generator=torch.Generator().manual_seed(0))
    return CTC(), (_x(4, 10, 8), targets, torch.tensor([10, 9, 10, 8]), torch.tensor([3, 2, 3, 1]))


# family -> (model factory, backward ops its joint graph must contain)
FAMILIES: dict[str, tuple[Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]], set[str]]] = {
    "gelu": (lambda: _lin(F.gelu), {"aten.gelu_backward.default", "aten.mm.default"}),
    "relu/tanh/silu": (
        lambda: _lin(lambda y: F.silu(torch.tanh(F.relu(y)))),
        {"aten.threshold_backward.default", "aten.tanh_backward.default", "aten.silu_backward.default"},
    ),
    "layer_norm": (lambda: _lin(nn.LayerNorm(8)), {"aten.rsqrt.default", "aten.sum.dim_IntList"}),
    "rms_norm": (lambda: _lin(_rms), {"aten.pow.Tensor_Scalar", "aten.sum.dim_IntList"}),
    "softmax": (
        lambda: _lin(lambda y: F.softmax(y, -1) + F.log_softmax(y, 0)),
        {"aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default"},
    ),
    "attention": (
        lambda: (Attention(), (_x(2, 4, 8),)),
        {"aten._scaled_dot_product_flash_attention_for_cpu_backward.default", "aten.stack.default"},
    ),
    "embedding+cross_entropy": (
        lambda: (Classify(), (torch.randint(16, (2, 4), generator=torch.Generator().manual_seed(0)),)),
        {
            "aten.embedding_dense_backward.default",
            "aten.scatter.value",
            "aten._log_softmax_backward_data.default",
        },
    ),
    "conv2d": (
        lambda: (Apply(nn.Conv2d(4, 8, 2, stride=2), torch.flatten), (_x(2, 4, 4, 4),)),
        {"aten.convolution_backward.default"},
    ),
    "dropout": (lambda: _lin(nn.Dropout(0.25)), {"aten.native_dropout_backward.default"}),
    "mse": (
        lambda: _lin(lambda y: F.mse_loss(y, torch.zeros_like(y))),
        {"aten.sub.Tensor", "aten.mm.default"},
    ),
    "ctc": (_ctc, {"aten._ctc_loss_backward.Tensor", "autopar.ctc_loss.default"}),
    "cumsum+where": (
        lambda: _lin(lambda y: torch.where(y > 0, y.cumsum(-1), -y)),
        {"aten.cumsum.default", "aten.where.self", "aten.neg.default"},
    ),
}


def _property_tested() -> set[str]:
    ops: set[str] = set()
    for path in sorted(HERE.glob("test_rules_*.py")):
        spec = importlib.util.spec_from_file_location(f"_backward_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ops |= {str(op) for op in getattr(module, "COVERED_OPS", [])}
    return ops


@pytest.fixture(scope="module")
def property_tested() -> set[str]:
    return _property_tested()


@pytest.mark.parametrize("family", FAMILIES)
def test_backward_ops_have_property_tested_rules(family: str, property_tested: set[str]) -> None:
    make, backward_ops = FAMILIES[family]
    model, inputs = make()
    rows = op_coverage(model, inputs, mesh_shape=(2, 2), registry=default_registry())
    ops = {r.op for r in rows}
    assert backward_ops <= ops, f"{family}: expected backward ops missing from the joint graph"
    assert not [r.op for r in rows if r.missing], f"{family}: ops without a rule"
    assert ops <= property_tested, f"{family}: rules without a property test: {sorted(ops - property_tested)}"
