"""Property test of `autopar::routed_experts` and its backward (`autopar.rules.routed_experts`):
every strategy the op's rule offers (the all-to-all over thread ranks, the all-gather blocks, the
op whole) against the serial experts loop, with random routings (hot and cold experts, ranks
without tokens), in float64."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.core.errors import AutoparError
from autopar.rules import routed_experts
from autopar.rules.base import LocalContext, make_call
from autopar.rules.registry import default_registry
from autopar.testing.oracle import all_coords, assemble, shard_tensor
from autopar.testing.strategies import candidate_strategies
from autopar.testing.threads import run_routed_calls, run_threads

COVERED_OPS = list(routed_experts.ROUTED_OPS)


def _serial_layer(x, ids, weights, gate_up, down):  # type: ignore[no-untyped-def]
    """The experts loop as transformers' eager experts compute it (one token and choice at a time)."""
    out = x * 0.0  # (in the autograd graph even without tokens)
    for t in range(ids.shape[0]):
        for c in range(ids.shape[1]):
            e = int(ids[t, c])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] = out[t] + weights[t, c] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@st.composite
def _layers(draw):  # type: ignore[no-untyped-def]
    ranks = draw(st.sampled_from([2, 4]))
    local = draw(st.sampled_from([1, 2]))
    experts = ranks * local
    top_k = draw(st.sampled_from([1, 2]))
    per_rank = draw(st.integers(0, 5))
    tokens = ranks * per_rank
    kind = draw(st.sampled_from(["uniform", "hot", "cold"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    pool = list(range(experts - 1 if kind == "cold" and experts - 1 >= top_k else experts))
    rows = []
    for _ in range(tokens):
        chosen = [pool[int(i)] for i in torch.randperm(len(pool), generator=g)[:top_k]]
        if kind == "hot" and float(torch.rand((), generator=g)) < 0.9:  # nine in ten choose expert 0 first
            chosen = [0, *[e for e in chosen if e != 0]][:top_k]
        rows.append(chosen)
    ids = torch.tensor(rows, dtype=torch.long).reshape(tokens, top_k)
    hidden, inner = 3, 2
    tensors = [
        torch.randn(tokens, hidden, generator=g, dtype=torch.float64),
        torch.rand(tokens, top_k, generator=g, dtype=torch.float64),
        torch.randn(experts, 2 * inner, hidden, generator=g, dtype=torch.float64),
        torch.randn(experts, hidden, inner, generator=g, dtype=torch.float64),
        torch.randn(tokens, hidden, generator=g, dtype=torch.float64),
    ]
    return ranks, ids, tensors


@settings(max_examples=25, deadline=None)
@given(_layers())
def test_every_strategy_of_the_op_equals_the_serial_layer(layer) -> None:  # type: ignore[no-untyped-def]
    """All-to-all over thread ranks (tokens and experts split), all-gather blocks (tokens whole,
    each rank's experts, outputs summed), and the serial op: output and the gradients of the
    tokens, the router weights and both expert weights, against the serial loop's autograd."""
    ranks, ids, (x, weights, gate_up, down, grad) = layer
    leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    want = _serial_layer(leaves[0], ids, *leaves[1:])
    wants = [want, *torch.autograd.grad(want, leaves, grad, allow_unused=True)]
    wants = [w if w is not None else torch.zeros_like(t) for w, t in zip(wants, [want, *leaves])]

    def close(got: list[torch.Tensor], what: str) -> None:
        for g, w, name in zip(got, wants, ("output", "grad x", "grad weights", "grad gate_up", "grad down")):
            torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10, msg=f"{what}: {name}")

    # the serial op and its registered backward
    leaves2 = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    out = routed_experts.routed_experts(leaves2[0], ids, leaves2[1], leaves2[2], leaves2[3], "silu")
    got = torch.autograd.grad(out, leaves2, grad) if out.requires_grad and out.numel() else (None,) * 4
    close([out.detach(), *[g if g is not None else torch.zeros_like(t) for g, t in zip(got, leaves2)]], "serial op")

    tokens, local = x.shape[0] // ranks, gate_up.shape[0] // ranks

    def rank_call(r: int, exchange: routed_experts.Exchange) -> list[torch.Tensor]:
        rows, experts = slice(r * tokens, (r + 1) * tokens), slice(r * local, (r + 1) * local)
        args = (x[rows], ids[rows], weights[rows], gate_up[experts], down[experts], "silu", 0, exchange)
        fwd = routed_experts.experts_forward(*args)
        return [fwd, *routed_experts.experts_backward(grad[rows], *args)]

    shards = run_threads(ranks, rank_call)
    close([torch.cat([s[i] for s in shards]) for i in range(5)], "all-to-all")

    single = routed_experts.SingleExchange()
    blocks = []
    for r in range(ranks):
        experts = slice(r * local, (r + 1) * local)
        args = (x, ids, weights, gate_up[experts], down[experts], "silu", r * local, single)
        blocks.append([routed_experts.experts_forward(*args), *routed_experts.experts_backward(grad, *args)])
    summed = [sum(b[i] for b in blocks) for i in (0, 1, 2)]  # P: output, grad x, grad weights
    stacked = [torch.cat([b[i] for b in blocks]) for i in (3, 4)]  # S(0): the experts' gradients
    close([*summed, *stacked], "all-gather blocks")  # type: ignore[list-item]


@st.composite
def _layers_on_several_axes(draw, meshes):  # type: ignore[no-untyped-def]
    """A layer for a mesh of `meshes`: experts and tokens that every split over all its axes
    divides, routed uniformly, "hot" (nine tokens in ten choose expert 0 first) or "cold" (the last
    expert never)."""
    mesh = draw(st.sampled_from(meshes))
    ranks = math.prod(mesh)
    experts = ranks * draw(st.sampled_from([1, 2]))
    top_k = draw(st.sampled_from([1, 2]))
    tokens = ranks * draw(st.integers(0, 3))
    kind = draw(st.sampled_from(["uniform", "hot", "cold"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pool = list(range(experts - 1 if kind == "cold" else experts))
    rows = []
    for _ in range(tokens):
        chosen = [pool[int(i)] for i in torch.randperm(len(pool), generator=g)[:top_k]]
        if kind == "hot" and float(torch.rand((), generator=g)) < 0.9:
            chosen = [0, *[e for e in chosen if e != 0]][:top_k]
        rows.append(chosen)
    ids = torch.tensor(rows, dtype=torch.long).reshape(tokens, top_k)
    hidden, inner = 3, 2
    x, grad = (torch.randn(tokens, hidden, generator=g, dtype=torch.float64) for _ in range(2))
    weights = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=g, dtype=torch.float64)
    down = torch.randn(experts, hidden, inner, generator=g, dtype=torch.float64)
    return mesh, (grad, x, ids, weights, gate_up, down)


def _run_strategy(op, args, strategy, mesh):  # type: ignore[no-untyped-def]
    """The op sharded by `strategy` on every rank of `mesh` through the rule's own `localize` (each
    axis's group named), the ranks exchanging as processes would (`run_routed_calls`), assembled."""
    registry = default_registry()
    call = make_call(op, args, {}, op(*args))
    pieces = [shard_tensor(t, lay, mesh) for t, lay in zip(args[:-1], strategy.inputs)]
    calls = {}
    for c in all_coords(mesh):
        groups = tuple("xyzw"[: len(mesh)])
        ctx = LocalContext(call, strategy, mesh, c, (*(p[c] for p in pieces), args[-1]), {}, groups=groups)
        local = registry.get(op).localize(ctx)
        assert local.target is op
        calls[c] = local.args
    outputs = run_routed_calls(calls, mesh)
    results = [outputs[c] if isinstance(outputs[c], tuple) else (outputs[c],) for c in all_coords(mesh)]
    return [
        assemble(dict(zip(all_coords(mesh), (r[i] for r in results))), lay, mesh, atol=1e-10, rtol=1e-10)
        for i, lay in enumerate(strategy.outputs)
    ]


@settings(max_examples=12, deadline=None)
@given(_layers_on_several_axes([(2, 2), (2, 3)]))
def test_experts_over_two_mesh_axes_equal_the_serial_op(layer) -> None:  # type: ignore[no-untyped-def]
    """The rule written for one axis, expanded over a 2-D mesh: every strategy it admits, forward
    and backward, run on the oracle's pieces through its own local calls and assembled by its
    output layouts, equals the serial op. Among them the experts split over both axes (each rank
    one block, the earlier axis outer) with the all-to-all exchanging over both axes' groups at
    once (`TwoAxisExchange`) and with the all-gather; a mix of the two dispatchers is not offered."""
    mesh, (grad, *inputs) = layer
    forward = (*inputs, "silu")
    backward = (grad, *inputs, "silu")
    for op, args in ((routed_experts.ROUTED_EXPERTS, forward), (routed_experts.ROUTED_EXPERTS_BACKWARD, backward)):
        options = candidate_strategies(op, args, {}, mesh, default_registry())
        kinds = {
            (routed_experts.expert_axes(op, s), routed_experts.all_to_all_axes(op, s)) for s in options
        }
        assert ((0, 1), (0, 1)) in kinds and ((0, 1), ()) in kinds, kinds
        assert all(a2a in ((), axes) for axes, a2a in kinds), kinds
        _check_every_strategy(op, args, options, mesh)


def _check_every_strategy(op, args, options, mesh) -> None:  # type: ignore[no-untyped-def]
    want = op(*args)
    wants = want if isinstance(want, tuple) else (want,)
    for strategy in options:
        for got, expected in zip(_run_strategy(op, args, strategy, mesh), wants):
            torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10, msg=f"{op} {strategy}")


@settings(max_examples=6, deadline=None)
@given(_layers_on_several_axes([(2, 2, 2)]), st.integers(0, 2))
def test_experts_over_three_mesh_axes_equal_the_serial_op(layer, third: int) -> None:  # type: ignore[no-untyped-def]
    """The rule expanded over (2, 2, 2): the experts over all three axes (rank (i, j, l) expert
    block 4i + 2j + l), with the all-to-all exchanging over the three axes' groups as one
    (`token_dispatch.axes_exchange`: along x, then y, then z) and with the all-gather, among every
    candidate it admits, forward and backward, each equal to the serial op on random routings (hot
    and cold experts, ranks receiving no row). The all-to-all over three axes and over each pair
    are checked on every example; of the other candidates (the all-gather, one axis, data) a third
    drawn by the example (46 candidates per op in all)."""
    mesh, (grad, *inputs) = layer
    forward = (*inputs, "silu")
    backward = (grad, *inputs, "silu")
    for op, args in ((routed_experts.ROUTED_EXPERTS, forward), (routed_experts.ROUTED_EXPERTS_BACKWARD, backward)):
        options = candidate_strategies(op, args, {}, mesh, default_registry())
        kinds = {(routed_experts.expert_axes(op, s), routed_experts.all_to_all_axes(op, s)) for s in options}
        assert ((0, 1, 2), (0, 1, 2)) in kinds and ((0, 1, 2), ()) in kinds, kinds
        assert all(a2a in ((), axes) for axes, a2a in kinds), kinds
        wide = [s for s in options if len(routed_experts.all_to_all_axes(op, s)) > 1]
        rest = [s for s in options if len(routed_experts.all_to_all_axes(op, s)) <= 1]
        _check_every_strategy(op, args, wide + rest[third::3], mesh)


@settings(max_examples=3, deadline=None)
@given(_layers_on_several_axes([(2, 2, 2, 2)]))
def test_the_op_exchanges_over_four_mesh_axes_like_the_serial_op(layer) -> None:  # type: ignore[no-untyped-def]
    """Any number of expert axes takes the same op: on (2, 2, 2, 2) (16 or 32 experts, rank
    (i, j, l, n) holding token and expert block ((i * 2 + j) * 2 + l) * 2 + n), each rank's local
    call names the four axes' groups in its one `exchange` argument and the 16 ranks exchange over
    them as one (`run_routed_calls`, as processes do), forward and backward equal to the serial op
    on random routings. (The plan splits the experts over at most `MAX_EXPERT_AXES` = 3 axes: a
    planning choice, the op's call is not the limit.)"""
    mesh, (grad, x, ids, weights, gate_up, down) = layer
    spec = routed_experts.encode_exchange([(name, a) for a, name in enumerate("xyzw")])
    coords = all_coords(mesh)
    tokens, local = x.shape[0] // len(coords), gate_up.shape[0] // len(coords)
    for backward in (False, True):
        calls = {}
        for r, c in enumerate(coords):  # (all_coords: the earlier axis outer, as the blocks nest)
            rows, experts = slice(r * tokens, (r + 1) * tokens), slice(r * local, (r + 1) * local)
            head = (grad[rows],) if backward else ()
            calls[c] = (*head, x[rows], ids[rows], weights[rows], gate_up[experts], down[experts], "silu", 0, spec)
        got = run_routed_calls(calls, mesh)
        op = routed_experts.ROUTED_EXPERTS_BACKWARD if backward else routed_experts.ROUTED_EXPERTS
        want = op(*((grad,) if backward else ()), x, ids, weights, gate_up, down, "silu")
        wants = want if backward else (want,)
        for i, w in enumerate(wants):
            pieces = [got[c][i] if backward else got[c] for c in coords]
            torch.testing.assert_close(torch.cat(pieces), w, atol=1e-10, rtol=1e-10, msg=f"{op} output {i}")


def _local_exchange(op, args, strategy, mesh) -> set[str]:  # type: ignore[no-untyped-def]
    """The `exchange` argument of every rank's local call of `strategy` (`localize`)."""
    call = make_call(op, args, {}, op(*args))
    pieces = [shard_tensor(t, lay, mesh) for t, lay in zip(args[:-1], strategy.inputs)]
    groups = tuple(f"group {name}" for name in "xyzw"[: len(mesh)])
    out = set()
    for c in all_coords(mesh):
        ctx = LocalContext(call, strategy, mesh, c, (*(p[c] for p in pieces), args[-1]), {}, groups=groups)
        out.add(default_registry().get(op).localize(ctx).args[-1])
    return out


def test_the_local_call_names_its_exchange_in_one_argument() -> None:
    """`localize` encodes the exchange's (group, axis) pairs in mesh-axis order as one string,
    the same on every rank; an all-gather split or a whole op exchanges nothing ("")."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g)
    ids = torch.arange(8).remainder(4).reshape(8, 1)
    args = (x, ids, torch.rand(8, 1, generator=g), torch.randn(4, 4, 3, generator=g), torch.randn(4, 3, 2, generator=g), "silu")
    op = routed_experts.ROUTED_EXPERTS
    mesh = (2, 2)
    options = candidate_strategies(op, args, {}, mesh, default_registry())
    by_kind = {(routed_experts.expert_axes(op, s), routed_experts.all_to_all_axes(op, s)): s for s in options}
    assert _local_exchange(op, args, by_kind[((0, 1), (0, 1))], mesh) == {"group x:0;group y:1"}
    assert _local_exchange(op, args, by_kind[((1,), (1,))], mesh) == {"group y:1"}
    assert _local_exchange(op, args, by_kind[((0, 1), ())], mesh) == {""}
    assert _local_exchange(op, args, by_kind[((), ())], mesh) == {""}


@given(st.lists(st.tuples(st.text(min_size=1).filter(lambda s: ";" not in s), st.integers(0, 7)), max_size=5))
def test_an_encoded_exchange_reads_back(pairs: list[tuple[str, int]]) -> None:
    """`decode_exchange(encode_exchange(pairs)) == pairs` for any group names without the separator
    (a ":" in a name included: the axis is read after the last one) and any number of axes."""
    spec = routed_experts.encode_exchange(pairs)
    assert routed_experts.decode_exchange(spec) == tuple(pairs)
    assert routed_experts.exchange_axes(("x", "silu", 0, spec)) == tuple(a for _, a in pairs)


def test_an_exchange_that_cannot_be_encoded_is_refused() -> None:
    with pytest.raises(AutoparError, match="process group 'a;b'"):
        routed_experts.encode_exchange([("a;b", 0)])
    with pytest.raises(AutoparError, match="process group ''"):
        routed_experts.encode_exchange([("", 0)])
    with pytest.raises(AutoparError, match="malformed token exchange 'g:x'"):
        routed_experts.decode_exchange("g:x")
