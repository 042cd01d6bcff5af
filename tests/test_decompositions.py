"""The multi-rank decompositions (`autopar.rules.decompositions`) compute what the fused ops do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.decompositions import LOSS_DECOMPOSED, sharding_decompositions

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


def _loss_cases(g: torch.Generator, shape: list[int]) -> list[tuple[object, tuple[object, ...]]]:
    """(op, args) for each fused loss `LOSS_DECOMPOSED` names, on float64 inputs of `shape`."""
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    t = torch.rand(shape, generator=g, dtype=torch.float64)
    p = torch.sigmoid(x)
    w = torch.rand(shape, generator=g, dtype=torch.float64)
    grad = torch.rand((), generator=g, dtype=torch.float64)
    t[..., 0] = 0.0  # xlogy's zero: 0 * log(0) is 0
    mean, total, none = 1, 2, 0
    flat, other = x.flatten(), t.flatten()
    return [
        (aten.binary_cross_entropy_with_logits.default, (x, t, w, w[..., :1].clone(), mean)),
        (aten.binary_cross_entropy_with_logits.default, (x, t, None, None, total)),
        (aten.binary_cross_entropy.default, (p, t, w, mean)),
        (aten.binary_cross_entropy.default, (p, t, None, none)),
        (aten.binary_cross_entropy_backward.default, (grad, p, t, w, mean)),
        (aten.smooth_l1_loss.default, (x, t, mean, 0.5)),
        (aten.smooth_l1_loss_backward.default, (grad, x, t, total, 0.5)),
        (aten.huber_loss.default, (x, t, mean, 0.7)),
        (aten.huber_loss_backward.default, (grad, x, t, total, 0.7)),
        (aten.xlogy.Tensor, (t, p)),
        (aten.log_sigmoid_forward.default, (x,)),
        (aten.log_sigmoid_backward.default, (w, x, aten.log_sigmoid_forward.default(x)[1])),
        (aten.vdot.default, (flat, other)),
    ]


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_loss_decompositions_equal_the_fused_kernels(shape: list[int], seed: int) -> None:
    """BCE (with logits), smooth L1, Huber, xlogy (kl_div), log-sigmoid, vdot (spectral_norm):
    torch's decompositions the multi-rank trace applies compute what the kernels do."""
    for op, args in _loss_cases(torch.Generator().manual_seed(seed), shape):
        want, got = op(*args), TABLE[op](*args)
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9, msg=str(op))
        else:
            _close(got, want)


def test_every_decomposed_loss_is_checked() -> None:
    g = torch.Generator().manual_seed(0)
    assert {op for op, _ in _loss_cases(g, [2, 3])} == set(LOSS_DECOMPOSED)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 6),
    classes=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    reduction=st.integers(0, 2),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_nll_loss_equals_the_kernel_with_its_sums_stacked(
    rows: int, classes: int, dtype: torch.dtype, reduction: int, weighted: bool, seed: int
) -> None:
    """nll_loss as the multi-rank trace writes it (a mean's two sums stacked into one tensor for
    float32/64, torch's decomposition otherwise) gives the kernel's loss and total weight, ignored
    targets included; an all-ignored batch divides 0 by 0 as the kernel does (nan)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, classes, generator=g).to(dtype)
    target = torch.randint(0, classes, (rows,), generator=g)
    target[torch.rand(rows, generator=g) < 0.3] = -100
    weight = torch.rand(classes, generator=g).to(dtype) if weighted else None
    op = aten.nll_loss_forward.default
    want, got = op(x, target, weight, reduction, -100), TABLE[op](x, target, weight, reduction, -100)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, atol=tol, rtol=tol, equal_nan=True)
