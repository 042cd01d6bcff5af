"""The multi-rank decompositions (`autopar.rules.decompositions`) compute what the fused ops do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.decompositions import sharding_decompositions

aten = torch.ops.aten
TABLE = sharding_decompositions()


def _close(got: object, want: object) -> None:
    for g, w in zip(got, want):  # type: ignore[call-overload]
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4).filter(lambda s: s[0] * (s[2] if len(s) > 2 else 1) > 1),
    affine=st.booleans(),
    seed=st.integers(0, 2**16),
    train=st.booleans(),
)
def test_batch_norm_forward_and_backward(shape: list[int], affine: bool, seed: int, train: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    c = shape[1]
    weight = torch.randn(c, generator=g, dtype=torch.float64) if affine else None
    bias = torch.randn(c, generator=g, dtype=torch.float64) if affine else None
    mean = torch.randn(c, generator=g, dtype=torch.float64)
    var = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    functional = aten._native_batch_norm_legit_functional.default
    args = (x, weight, bias, mean, var, train, 0.1, 1e-5)
    _close(TABLE[functional](*args), functional(*args))
    inference = aten._native_batch_norm_legit_no_training.default
    out, *_ = TABLE[inference](x, weight, bias, mean, var, 0.1, 1e-5)
    torch.testing.assert_close(out, inference(x, weight, bias, mean, var, 0.1, 1e-5)[0], atol=1e-9, rtol=1e-9)
    no_stats = aten._native_batch_norm_legit.no_stats
    _close(TABLE[no_stats](x, weight, bias, True, 0.1, 1e-5), no_stats(x, weight, bias, True, 0.1, 1e-5))
    _, save_mean, save_rstd, _, _ = functional(x, weight, bias, mean, var, True, 0.1, 1e-5)
    grad = torch.randn(shape, generator=g, dtype=torch.float64)
    backward = aten.native_batch_norm_backward.default
    bargs = (grad, x, weight, mean, var, save_mean, save_rstd, train, 1e-5, [True, affine, affine])
    _close(TABLE[backward](*bargs), backward(*bargs))


@pytest.mark.parametrize("with_weight", [True, False])
def test_layer_norm_forward_and_backward(with_weight: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(6, generator=g, dtype=torch.float64) if with_weight else None
    bias = torch.randn(6, generator=g, dtype=torch.float64) if with_weight else None
    forward = aten.native_layer_norm.default
    want = forward(x, [6], weight, bias, 1e-5)
    _close(TABLE[forward](x, [6], weight, bias, 1e-5), want)
    grad = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)
    backward = aten.native_layer_norm_backward.default
    mask = [True, with_weight, with_weight]
    args = (grad, x, [6], want[1], want[2], weight, bias, mask)
    _close(TABLE[backward](*args), backward(*args))
