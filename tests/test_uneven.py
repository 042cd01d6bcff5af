"""Uneven sizes: dims the mesh does not divide are split in `torch.chunk` blocks (GPT-2's 50257).

Layout arithmetic, which strategies are admissible, the rules on uneven blocks against the oracle,
storage of weights that no axis divides, and whole models compiled for every rank and run in step
against the serial model. (Transformers' GPT-2 at its real vocabulary on 8 ranks: `hf_gpt2_vocab` in
test_zoo_multirank.py.)
"""

from __future__ import annotations

import pytest
import torch
from pass_fixtures import model_case, propagated, rank_programs, simulate_step

from autopar.core.layout import Layout, Partial, R, Shard, chunks_nonempty
from autopar.core.meta import has_info, info
from autopar.planning.storage import storage_layout
from autopar.rules.base import Strategy, admissible
from autopar.rules.registry import default_registry
from autopar.testing import assemble, check_strategy
from autopar.testing.strategies import candidate_strategies

aten = torch.ops.aten
REGISTRY = default_registry()


def test_gpt2_vocabulary_splits_like_torch_chunk() -> None:
    layout = Layout((Shard(0),), (50257, 768))
    sizes = [layout.local_shape((8,), (r,))[0] for r in range(8)]
    assert sizes == [6283] * 7 + [6276]
    assert sizes == [len(c) for c in torch.arange(50257).chunk(8)]
    assert [layout.local_offsets((8,), (r,))[0] for r in range(8)] == [6283 * r for r in range(8)]
    assert layout.local_shape((8,)) == (6283, 768)  # no coordinates: the largest block (pricing)
    assert layout.fits((8,)) and not layout.is_even((8,)) and layout.uneven_dims((8,)) == [0]


def test_fits_refuses_empty_blocks_and_nested_uneven_splits() -> None:
    assert not chunks_nonempty(9, 8)  # torch.chunk(9 rows, 8) gives 5 blocks of 2 and ... nothing
    assert len(torch.arange(9).chunk(8)) == 5
    assert not Layout((Shard(0),), (9,)).fits((8,))
    assert not Layout((Shard(0), Shard(0)), (9,)).fits((2, 2))  # two axes on one uneven dim
    assert Layout((Shard(0), Shard(1)), (9, 7)).fits((2, 2))
    assert Layout((Shard(0), Shard(0)), (8,)).fits((2, 2))  # even nesting is always fine


def test_admissible_needs_the_same_size_wherever_the_axis_splits() -> None:
    mesh = (2,)
    # x @ w with the contraction (67) split on both operands: each rank sums its block -> Partial
    mm = Strategy(
        (Layout((Shard(1),), (8, 67)), Layout((Shard(0),), (67, 5))), (Layout((Partial(),), (8, 5)),)
    )
    assert admissible(mm, mesh, uneven=True) and not admissible(mm, mesh, uneven=False)
    # a view merging the uneven dim into a longer one: blocks of 67 are not blocks of 268
    merged = Strategy((Layout((Shard(0),), (67, 4)),), (Layout((Shard(0),), (268,)),))
    assert not admissible(merged, mesh, uneven=True)
    # a view keeping the uneven dim whole: (b, s, 67) -> (b*s, 67)
    kept = Strategy((Layout((Shard(2),), (2, 3, 67)),), (Layout((Shard(1),), (6, 67)),))
    assert admissible(kept, mesh, uneven=True)


def _uneven_cases() -> list[tuple[str, object, tuple, dict, tuple[int, ...]]]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(11, (3, 5), generator=gen)
    grad = torch.randn(3, 5, 6, generator=gen)
    return [
        (
            "mm",
            aten.mm.default,
            (torch.randn(10, 7, generator=gen), torch.randn(7, 5, generator=gen)),
            {},
            (3,),
        ),
        ("addmm", aten.addmm.default, (torch.randn(5), torch.randn(10, 7), torch.randn(7, 5)), {}, (2, 3)),
        ("embedding", aten.embedding.default, (torch.randn(11, 6, generator=gen), idx), {}, (4,)),
        ("embedding_backward", aten.embedding_dense_backward.default, (grad, idx, 11, -1, False), {}, (4,)),
        ("log_softmax", aten._log_softmax.default, (torch.randn(7, 5, generator=gen), 1, False), {}, (3,)),
        ("sum", aten.sum.dim_IntList, (torch.randn(7, 5, generator=gen), [0]), {}, (3,)),
        ("view", aten.view.default, (torch.randn(2, 3, 7, generator=gen), [6, 7]), {}, (3,)),
        (
            "add",
            aten.add.Tensor,
            (torch.randn(7, 5, generator=gen), torch.randn(7, 5, generator=gen)),
            {},
            (2, 3),
        ),
    ]


@pytest.mark.parametrize("case", _uneven_cases(), ids=lambda c: c[0])
def test_rules_on_uneven_blocks_match_the_full_op(case: tuple) -> None:
    _, op, args, kwargs, mesh = case
    options = candidate_strategies(op, args, kwargs, mesh, REGISTRY)
    uneven = [s for s in options if not all(lay.is_even(mesh) for lay in (*s.inputs, *s.outputs))]
    assert uneven, f"{op}: no uneven strategy offered on {mesh}"
    for strategy in uneven:
        check_strategy(op, args, kwargs, strategy, mesh, REGISTRY, generator=torch.Generator().manual_seed(1))


def test_weights_no_axis_divides_are_stored_in_chunk_blocks_and_even_dims_win() -> None:
    assert storage_layout(Layout((R,), (50257, 36)), (8,)) == Layout((Shard(0),), (50257, 36))
    assert storage_layout(Layout((R,), (50257, 32)), (8,)) == Layout((Shard(1),), (50257, 32))
    assert storage_layout(Layout((R,), (67,)), (8,)) == Layout((R,), (67,))  # vectors may replicate
    assert storage_layout(Layout((R,), (5, 3)), (8,)) == Layout((R,), (5, 3))  # too small for 8 blocks


def test_plans_split_unevenly_only_the_dims_the_mesh_does_not_divide() -> None:
    mesh = (2, 2, 2)
    gm = propagated("gpt1_vocab67", mesh)
    layouts = [lay for n in gm.graph.nodes if has_info(n) for lay in info(n).layouts]
    uneven_sizes = {lay.shape[d] for lay in layouts for d in lay.uneven_dims(mesh)}
    assert uneven_sizes == {67}  # the vocabulary; every other dim of the GPT divides by 2


def _grad_errors(key: str, shape: tuple[int, ...]) -> tuple[float, float, float, int]:
    fwd, bwd = simulate_step(key, shape)
    model, inputs = model_case(key)
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    programs = {c: p for c, (_, p) in rank_programs(key, shape).items()}
    first = next(iter(programs.values()))
    params = dict(model.named_parameters())
    worst = 0.0
    uneven = 0
    grads = {name: p.grad for name, p in params.items()}
    for i, (name, layout) in enumerate(zip(first.param_names, first.param_layouts)):
        uneven += not layout.is_even(shape)
        got = assemble({c: bwd[c][i] for c in programs}, layout, shape)
        want = first.param_value(name, grads)
        assert want is not None
        worst = max(worst, float((got - want).abs().max() / (want.abs().max() + 1e-4)))
    losses = {float(out[0]) for out in fwd.values()}
    return max(losses), min(losses), worst, uneven


@pytest.mark.parametrize(("key", "shape"), [("mlp_uneven", (8,)), ("gpt1_vocab67", (2, 2, 2))])
def test_uneven_models_equal_serial_on_every_rank(key: str, shape: tuple[int, ...]) -> None:
    model, inputs = model_case(key)
    serial = float(model(*inputs).detach())
    high, low, grad_err, uneven_params = _grad_errors(key, shape)
    assert high == pytest.approx(serial, rel=1e-5) and low == pytest.approx(serial, rel=1e-5)
    assert grad_err < 1e-4
    assert uneven_params >= 1  # the test means something only if some weight lives in uneven blocks
