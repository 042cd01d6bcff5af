"""Property tests: attention with the queries split along the sequence (context parallelism), its
backward, causal offsets, padding masks and grouped-query attention, against the oracle."""

from __future__ import annotations

import math

import torch
from attention_cases import attention_case, check_some
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.core.strategy import Strategy
from autopar.rules import nn as nn_rules
from autopar.rules.base import make_call
from autopar.rules.context_parallel import BACKWARD, FORWARD, SEQ, sequence_split_refusal, sequence_strategies
from autopar.rules.registry import default_registry
from autopar.testing import check_strategy
from autopar.testing.strategies import candidate_strategies, mesh_shapes, random_tensor

REGISTRY = default_registry()
SETTINGS = settings(max_examples=30, deadline=None)


def _sequence_split(options: list[Strategy], query: int) -> list[Strategy]:
    return [s for s in options if s.inputs[query].shard_axes(SEQ)]


def _case(data: st.DataObject, mesh: tuple[int, ...]) -> tuple[tuple, dict, torch.Generator]:
    """q (B, H, T, E), k and v with H or fewer heads (GQA), T from 2 to 13 (uneven on most meshes),
    causal or not, and a mask: none, padding (B, 1, T, T) with -inf at padded keys, one broadcast
    along the queries (B, 1, 1, T), or random additive values (T, T)."""
    seq = data.draw(st.sampled_from([math.prod(mesh), math.prod(mesh) + 1, *range(2, 14)]))
    return attention_case(data, mesh, seq)


def _check_some(
    data: st.DataObject, op: object, args: tuple, kwargs: dict, mesh: tuple[int, ...], query: int
) -> None:
    options = _sequence_split(candidate_strategies(op, args, kwargs, mesh, REGISTRY), query)
    assume(options)  # a mesh of size-1 axes, or one whose axes leave a rank no queries
    check_some(data, op, args, kwargs, mesh, options, REGISTRY)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(max_axes=3, max_size=3))
def test_sequence_split_forward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    args, kwargs, _ = _case(data, mesh)
    _check_some(data, FORWARD, args, kwargs, mesh, query=0)


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(max_axes=3, max_size=3))
def test_sequence_split_backward(data: st.DataObject, mesh: tuple[int, ...]) -> None:
    """dq split like q, dk and dv partial sums over the ranks' query blocks."""
    (q, k, v, dropout, causal), kwargs, g = _case(data, mesh)
    out, lse = FORWARD(q, k, v, dropout, causal, **kwargs)
    grad = random_tensor(out.shape, generator=g)
    _check_some(data, BACKWARD, (grad, q, k, v, out, lse, dropout, causal), kwargs, mesh, query=1)


def test_the_sequence_strategy_gathers_keys_and_reduces_their_gradients() -> None:
    """What the plan inserts around it: k and v whole (all-gathered from a sequence split), dk and
    dv partial sums (reduce-scattered); the mask follows the queries on its query dim."""
    q = torch.randn(2, 4, 8, 4)
    mask = torch.zeros(2, 1, 8, 8)
    out, lse = FORWARD(q, q, q, 0.0, False, attn_mask=mask)
    forward = sequence_strategies(make_call(FORWARD, (q, q, q, 0.0, False), {"attn_mask": mask}, (out, lse)))
    gathered, ring = nn_rules.Shard(2), nn_rules.Shard(2)
    assert [(s.inputs, s.outputs) for s in forward] == [
        ((gathered, nn_rules.R, nn_rules.R, nn_rules.Shard(2)), (gathered, nn_rules.Shard(2))),
        ((ring, ring, ring, nn_rules.Shard(2)), (ring, ring)),  # ring attention: k and v split too
    ]
    args = (out, q, q, q, out, lse, 0.0, False)
    grads = BACKWARD(*args, attn_mask=mask)
    backward = sequence_strategies(make_call(BACKWARD, args, {"attn_mask": mask}, grads))
    assert [s.outputs for s in backward] == [
        (nn_rules.Shard(2), nn_rules.P, nn_rules.P),
        (nn_rules.Shard(2), nn_rules.Shard(2), nn_rules.Shard(2)),
    ]


def test_causal_block_without_its_offset_is_wrong() -> None:
    """The kernel's own causal flag on a later block of queries (top-left aligned on its local
    scores) gives wrong rows: the rule without its localize fails the oracle."""
    registry = default_registry()
    registry.register(FORWARD, nn_rules.sdpa_rule, family="nn", uneven=True)  # no localize
    q, k, v = (torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    args = (q, k, v, 0.0, True)
    options = _sequence_split(candidate_strategies(FORWARD, args, {}, (2,), registry), 0)
    (strategy,) = [s for s in options if not s.inputs[1].shard_axes(SEQ)]  # keys gathered
    try:
        check_strategy(FORWARD, args, {}, strategy, (2,), registry)
    except AssertionError:
        pass
    else:
        raise AssertionError("a later block's causal rows must differ without the offset mask")
    check_strategy(FORWARD, args, {}, strategy, (2,), REGISTRY)  # with it: right


def test_dropout_inside_attention_is_refused_with_its_reason() -> None:
    """The CPU kernel is never traced with dropout, but a call that had it must not be split along
    the sequence: each rank would draw another mask."""
    q = torch.randn(2, 2, 8, 4)
    out, lse = FORWARD(q, q, q, 0.0, False)
    call = make_call(FORWARD, (q, q, q, 0.1, False), {}, (out, lse))
    reason = sequence_split_refusal(call)
    assert reason is not None and "dropout_p=0.1" in reason and "_cpu" in reason
    assert sequence_strategies(call) == []
    options = nn_rules.sdpa_rule(call)
    assert options and not any(s.inputs[0] == nn_rules.Shard(SEQ) for s in options)  # batch, heads remain
    assert sequence_split_refusal(make_call(FORWARD, (q, q, q, 0.0, True), {}, (out, lse))) is None
