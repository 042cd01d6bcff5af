"""Attention inputs for the property tests of sequence-split attention (all-gathered keys and values,
ring attention): q (B, H, T, E), k and v with H or fewer heads (GQA), causal or not, and a mask."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from autopar.core.strategy import Strategy
from autopar.rules.base import RuleRegistry
from autopar.testing import check_strategy
from autopar.testing.strategies import dim_sizes, random_tensor, seeds


def attention_case(
    data: st.DataObject, mesh: tuple[int, ...], seq: int
) -> tuple[tuple, dict, torch.Generator]:
    """Inputs of `scaled_dot_product_attention` at sequence `seq`: a mask of none, padding
    (B, 1, T, T) with -inf at padded keys, one broadcast along the queries (B, 1, 1, T), or random
    additive values (T, T); key 0 is never padded, so no row is empty."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    b = data.draw(dim_sizes(mesh, cap=4))
    kv_heads = data.draw(st.integers(1, 2))
    heads = kv_heads * data.draw(st.integers(1, 2))
    e = data.draw(st.integers(1, 4))
    causal = data.draw(st.booleans())
    q = random_tensor((b, heads, seq, e), generator=g)
    k = random_tensor((b, kv_heads, seq, e), generator=g)
    v = random_tensor((b, kv_heads, seq, e), generator=g)
    kwargs: dict = {"scale": data.draw(st.sampled_from([None, 0.3]))}
    kind = data.draw(st.sampled_from(["none", "padding", "broadcast", "additive"]))
    if kind == "additive":
        kwargs["attn_mask"] = random_tensor((seq, seq), generator=g)
    elif kind != "none":
        padded = data.draw(st.lists(st.integers(0, seq - 1), min_size=b, max_size=b))
        mask = torch.zeros(b, 1, 1 if kind == "broadcast" else seq, seq, dtype=q.dtype)
        for row, pad in enumerate(padded):  # keys 1..pad padded; key 0 stays, so no row is empty
            mask[row, ..., 1 : 1 + pad] = float("-inf")
        kwargs["attn_mask"] = mask
    return (q, k, v, 0.0, causal), kwargs, g


def check_some(
    data: st.DataObject,
    op: object,
    args: tuple,
    kwargs: dict,
    mesh: tuple[int, ...],
    options: list[Strategy],
    registry: RuleRegistry,
) -> None:
    """Up to 3 of `options` (the strategies under test) checked against the oracle, on one noise."""
    assert options, "no strategy to check: the caller's assume() should have skipped this example"
    seed = data.draw(seeds(), label="noise seed")
    for strategy in data.draw(st.lists(st.sampled_from(options), min_size=1, max_size=3, unique=True)):
        check_strategy(
            op, args, kwargs, strategy, mesh, registry, atol=1e-4, rtol=1e-4,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
