"""Random ops: sharded dropout draws exactly the serial model's numbers, whatever the layout."""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.layout import Layout
from autopar.rules.base import LocalContext, make_call
from autopar.rules.registry import default_registry
from autopar.testing import all_coords, assemble, shard_tensor
from autopar.testing.strategies import (
    candidate_strategies,
    check_random_strategies,
    mesh_shapes,
    tensor_shapes,
)

aten = torch.ops.aten
COVERED_OPS = [
    aten.native_dropout.default,
    aten.native_dropout_backward.default,
    aten.rand.default,
    aten.randn.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.bernoulli.p,
    aten.exponential.default,
    aten.uniform.default,
]
REGISTRY = default_registry()


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_dropout_blocks_reassemble_the_serial_draw(data: st.DataObject) -> None:
    mesh = data.draw(mesh_shapes())
    shape = data.draw(tensor_shapes(mesh, max_dims=3))
    p = data.draw(st.sampled_from([0.1, 0.5, 0.0]))
    train = data.draw(st.sampled_from([True, False]))
    seed = data.draw(st.integers(0, 1000))
    # laid out in any memory order (a transposed view in nn.MultiheadAttention): the serial op
    # fills its mask in that order
    order = data.draw(st.permutations(range(len(shape))))
    x = torch.randn([shape[d] for d in order], dtype=torch.float64).permute([order.index(d) for d in range(len(shape))])
    torch.manual_seed(seed)
    want_out, want_mask = aten.native_dropout.default(x, p, train)
    call = make_call(aten.native_dropout.default, (x, p, train), {}, (want_out, want_mask))
    strategy = data.draw(
        st.sampled_from(candidate_strategies(aten.native_dropout.default, (x, p, train), {}, mesh, REGISTRY))
    )
    rule = REGISTRY.get(aten.native_dropout.default)
    assert rule is not None and rule.localize is not None
    pieces = shard_tensor(x, strategy.inputs[0], mesh)
    outs, masks = {}, {}
    for coords in all_coords(mesh):
        torch.manual_seed(seed)  # every rank starts from the serial generator state
        ctx = LocalContext(call, strategy, tuple(mesh), coords, (pieces[coords], p, train), {}, tuple(x.dim_order()))
        local = rule.localize(ctx)
        outs[coords], masks[coords] = local.target(*local.args, **local.kwargs)
    got_out = assemble(outs, strategy.outputs[0], mesh)
    got_mask = assemble(
        {c: m.to(torch.float64) for c, m in masks.items()}, _as_float(strategy.outputs[1]), mesh
    )
    torch.testing.assert_close(got_out, want_out)
    assert torch.equal(got_mask.to(torch.bool), want_mask)


def _as_float(layout: Layout) -> Layout:
    return Layout(layout.placements, layout.shape, torch.float64)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_dropout_backward(data: st.DataObject) -> None:
    mesh = data.draw(mesh_shapes())
    shape = data.draw(tensor_shapes(mesh, max_dims=3))
    grad = torch.randn(shape, dtype=torch.float64)
    mask = torch.rand(shape) > 0.3
    check_random_strategies(
        data, aten.native_dropout_backward.default, (grad, mask, 1.25), {}, mesh, REGISTRY
    )


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_factories_reassemble_the_serial_draw(data: st.DataObject) -> None:
    """`torch.rand(shape)` (stochastic depth) and `randn_like(x)` of a view in any memory order:
    every rank's block, cut from the draw it makes from the serial generator state, reassembles
    the serial tensor."""
    mesh = data.draw(mesh_shapes())
    shape = data.draw(tensor_shapes(mesh, max_dims=3))
    op = data.draw(st.sampled_from(COVERED_OPS[2:]))
    seed = data.draw(st.integers(0, 1000))
    order = data.draw(st.permutations(range(len(shape))))
    p = data.draw(st.sampled_from([0.0, 0.3, 0.9]))
    _check_random_factory(op, mesh, shape, order, seed, p, lambda s: data.draw(st.sampled_from(s)))


def test_bernoulli_of_a_transposed_view_draws_in_contiguous_order() -> None:
    """bernoulli(x, p) fills a contiguous tensor whatever x's strides, unlike randn_like(x)."""
    for index in range(5):
        pick = functools.partial(_nth, index)
        _check_random_factory(aten.bernoulli.p, (2,), (2, 2, 2), [1, 0, 2], 1, 0.3, pick)


def _nth(index: int, strategies: list) -> object:
    return strategies[index % len(strategies)]


def _check_random_factory(op, mesh, shape, order, seed, p, pick) -> None:  # type: ignore[no-untyped-def]
    like = op in (aten.rand_like.default, aten.randn_like.default, aten.bernoulli.p, aten.exponential.default, aten.uniform.default)
    x = torch.empty([shape[d] for d in order], dtype=torch.float64).permute([order.index(d) for d in range(len(shape))])
    args: tuple = (x,) if like else (list(shape),)
    if op == aten.bernoulli.p:
        args = (x, p)
    if op == aten.exponential.default:
        args = (x, 1.0 + p)  # a rate, > 0
    if op == aten.uniform.default:
        args = (x, -p, 2.0)
    kwargs = {} if like else {"dtype": torch.float64}
    torch.manual_seed(seed)
    want = op(*args, **kwargs)
    call = make_call(op, args, kwargs, want)
    strategy = pick(candidate_strategies(op, args, kwargs, mesh, REGISTRY))
    rule = REGISTRY.get(op)
    assert rule is not None and rule.localize is not None
    pieces = shard_tensor(x, strategy.inputs[0], mesh) if like else None
    blocks = {}
    for coords in all_coords(mesh):
        torch.manual_seed(seed)
        local_args = (pieces[coords],) if pieces is not None else args
        order_known = tuple(x.dim_order()) if like else None
        ctx = LocalContext(call, strategy, tuple(mesh), coords, local_args, dict(kwargs), order_known)
        local = rule.localize(ctx)
        blocks[coords] = local.target(*local.args, **local.kwargs)
        assert blocks[coords].shape == strategy.outputs[0].local_shape(mesh, coords)
    assert torch.equal(assemble(blocks, strategy.outputs[0], mesh), want)
