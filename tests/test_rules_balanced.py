"""Property tests: every rule that offers the load-balanced sequence split (`BalancedShard`) on a
"cp" axis, against the oracle: attention (gathered keys, causal rows per chunk, masks, GQA), its
backward, arange, and the order-indifferent ops around them (pointwise with broadcasting,
row-wise norms and softmax, reductions over other dims and over the split one, views, matmuls,
embedding and its backward). And what is never offered it."""

from __future__ import annotations

import functools

import torch
from attention_cases import attention_case, check_some
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.core.layout import Layout, is_balanced_sequence
from autopar.core.strategy import Strategy
from autopar.rules.base import RuleRegistry
from autopar.rules.context_parallel import BACKWARD, FORWARD, require_context_parallel
from autopar.rules.registry import default_registry
from autopar.testing.strategies import candidate_strategies, random_tensor, seeds

aten = torch.ops.aten
SETTINGS = settings(max_examples=25, deadline=None)
MESHES = st.sampled_from([(2,), (3,), (4,), (2, 2), (3, 2), (2, 3)])


@functools.cache
def _registry(axis: int) -> RuleRegistry:
    """The rules a mesh whose axis `axis` is "cp" asks for the balanced layout with."""
    return require_context_parallel(default_registry(), axis, "balanced")


def _balanced(op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...]) -> list[Strategy]:
    options = candidate_strategies(op, args, kwargs, mesh, _registry(len(mesh) - 1))
    return [s for s in options if any(is_balanced_sequence(lay) for lay in (*s.inputs, *s.outputs))]


def _check(
    data: st.DataObject, op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...]
) -> list[Strategy]:
    options = _balanced(op, args, kwargs, mesh)
    assume(options)
    check_some(data, op, args, kwargs, mesh, options, _registry(len(mesh) - 1))
    return options


def _seq(data: st.DataObject, mesh: tuple[int, ...]) -> int:
    """A sequence the cp axis (the last) cuts into 2p equal chunks."""
    return 2 * mesh[-1] * data.draw(st.integers(1, 2))


@SETTINGS
@given(data=st.data(), mesh=MESHES)
def test_balanced_attention_forward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    args, kwargs, _ = attention_case(data, mesh, _seq(data, mesh))
    _check(data, FORWARD, args, kwargs, mesh)


@SETTINGS
@given(data=st.data(), mesh=MESHES)
def test_balanced_attention_backward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """dq split balanced like q, dk and dv the sums of every chunk's shares."""
    (q, k, v, dropout, causal), kwargs, g = attention_case(data, mesh, _seq(data, mesh))
    out, lse = FORWARD(q, k, v, dropout, causal, **kwargs)
    grad = random_tensor(out.shape, generator=g)
    _check(data, BACKWARD, (grad, q, k, v, out, lse, dropout, causal), kwargs, mesh)


def _op_case(name: str, t: int, g: torch.Generator) -> tuple[object, tuple, dict]:
    """One op over (batch 2, sequence t, width 4) activations."""
    x = random_tensor((2, t, 4), generator=g)
    y = random_tensor((2, t, 4), generator=g)
    ids = torch.randint(0, 5, (2, t), generator=g)
    cases = {
        "add_broadcast": (aten.add.Tensor, (x, random_tensor((t, 1), generator=g)), {}),
        "mul": (aten.mul.Tensor, (x, y), {}),
        "softmax": (aten._softmax.default, (x, -1, False), {}),
        "layer_norm": (aten.native_layer_norm.default, (x, [4], None, None, 1e-5), {}),
        "sum_width": (aten.sum.dim_IntList, (x, [2]), {}),
        "sum_sequence": (aten.sum.dim_IntList, (x, [1]), {}),
        "mean_all": (aten.mean.default, (x,), {}),
        "view_heads": (aten.view.default, (x, [2, t, 2, 2]), {}),
        "transpose": (aten.transpose.int, (x, 1, 2), {}),
        "mm": (aten.mm.default, (x[0], random_tensor((4, 3), generator=g)), {}),
        "mm_contract_sequence": (aten.mm.default, (x[0].t().contiguous(), y[0]), {}),
        "bmm": (aten.bmm.default, (x, random_tensor((2, 4, t), generator=g)), {}),
        "embedding": (aten.embedding.default, (random_tensor((5, 4), generator=g), ids), {}),
        "embedding_backward": (aten.embedding_dense_backward.default, (x, ids, 5, -1, False), {}),
        "where": (aten.where.self, (ids.unsqueeze(-1) > 2, x, y), {}),
        "arange": (aten.arange.default, (t,), {"dtype": torch.float64}),
        "arange_start_step": (aten.arange.start_step, (3, 3 + 2 * t, 2), {"dtype": torch.int64}),
    }
    return cases[name]


OPS = [
    "add_broadcast", "mul", "softmax", "layer_norm", "sum_width", "sum_sequence", "mean_all", "view_heads",
    "transpose", "mm", "mm_contract_sequence", "bmm", "embedding", "embedding_backward", "where", "arange",
    "arange_start_step",
]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(data=st.data(), mesh=MESHES, name=st.sampled_from(OPS))
def test_order_indifferent_ops_offer_it(data: st.DataObject, mesh: tuple[int, ...], name: str) -> None:
    g = torch.Generator().manual_seed(data.draw(seeds()))
    op, args, kwargs = _op_case(name, _seq(data, mesh), g)
    _check(data, op, args, kwargs, mesh)


def test_every_op_of_the_list_offers_it() -> None:
    """On (4,): each op of the property test has balanced strategies, only on the cp axis."""
    g = torch.Generator().manual_seed(0)
    for name in OPS:
        op, args, kwargs = _op_case(name, 16, g)
        assert _balanced(op, args, kwargs, (4,)), name
    op, args, kwargs = _op_case("mul", 16, g)
    on_two = candidate_strategies(op, args, kwargs, (2, 2), _registry(1))
    assert any(lay.balanced_dims() == ((1, 1),) for s in on_two for lay in s.inputs)
    assert not any(a == 0 for s in on_two for lay in (*s.inputs, *s.outputs) for _, a in lay.balanced_dims())


def _offered(op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...] = (4,)) -> list[Layout]:
    return [lay for s in _balanced(op, args, kwargs, mesh) for lay in (*s.inputs, *s.outputs)]


def test_what_reads_offsets_is_not_offered_it() -> None:
    """Random draws (a rank's numbers come from its block's offsets), eye, the embedding's
    vocabulary-row split, and the ring (its blocks' offsets) never take a balanced split."""
    x = torch.randn(2, 16, 4)
    assert not _offered(aten.native_dropout.default, (x, 0.5, True), {})
    assert not _offered(aten.eye.default, (16,), {})
    weight, ids = torch.randn(16, 4), torch.randint(0, 16, (2, 3))
    assert not [lay for lay in _offered(aten.embedding.default, (weight, ids), {}) if lay.shape == (16, 4)]
    grad = torch.randn(2, 3, 4)
    assert not [lay for lay in _offered(aten.embedding_dense_backward.default, (grad, ids, 16, -1, False), {})
                if lay.shape == (16, 4)]  # fmt: skip
    q = torch.randn(1, 2, 16, 4)
    for s in _balanced(FORWARD, (q, q, q, 0.0, True), {}, (4,)):
        assert s.inputs[1].is_replicated and s.inputs[2].is_replicated, s  # keys gathered: no ring


def _tokens_balanced(options: list[Strategy]) -> list[Strategy]:
    """The strategies whose (batch * sequence) tokens are split balanced."""
    return [
        s
        for s in options
        if any(len(lay.shape) == 2 and d == 0 for lay in (*s.inputs, *s.outputs) for d, _ in lay.balanced_dims())
    ]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), cp=st.sampled_from([2, 3, 4]), merging=st.booleans())
def test_flattened_tokens_keep_the_balanced_sequence(data: st.DataObject, cp: int, merging: bool) -> None:
    """(batch, sequence, width) <-> (batch * sequence, width), as the linears flatten, on a
    ("dp", "cp") mesh with one sample per "dp" rank: `[S(0), Sb(1)]` <-> `[S(0), Sb(0)]` is
    offered, and every offered strategy with the tokens balanced computes what the oracle says."""
    mesh = (2, cp)
    t = _seq(data, mesh)
    g = torch.Generator().manual_seed(data.draw(seeds()))
    x = random_tensor((2, t, 4), generator=g) if merging else random_tensor((2 * t, 4), generator=g)
    args = (x, [2 * t, 4] if merging else [2, t, 4])
    options = _tokens_balanced(_balanced(aten.view.default, args, {}, mesh))
    nested = [str(s) for s in options]
    want = "([S(0), Sb(1)]) -> ([S(0), Sb(0)])" if merging else "([S(0), Sb(0)]) -> ([S(0), Sb(1)])"
    assert want in nested, nested
    check_some(data, aten.view.default, args, {}, mesh, options, _registry(len(mesh) - 1))


def test_flattened_tokens_of_several_samples_are_not_balanced() -> None:
    """Where a rank's block of tokens holds two samples (batch 2 on a (4,) "cp" mesh, batch 4 on
    (2, 2)), a balanced split of the tokens would not be each sample's sequence balanced: the
    merge carries no balanced sequence split (and the contiguous layout after the cut,
    `[S(0), S(0)]`, splits the batch outside the sequence as before)."""
    for mesh, batch in (((4,), 2), ((2, 2), 4), ((2, 4), 4)):
        x = torch.randn(batch, 16, 4)
        assert not _tokens_balanced(_balanced(aten.view.default, (x, [batch * 16, 4]), {}, mesh)), mesh
        flat = torch.randn(batch * 16, 4)
        assert not _tokens_balanced(_balanced(aten._unsafe_view.default, (flat, [batch, 16, 4]), {}, mesh)), mesh
