"""Context parallelism end to end, in lockstep against serial: models whose batch and heads cannot
fill the mesh, where the search (at its defaults) splits attention's queries along the sequence
and gathers keys and values (autopar/rules/context_parallel.py). Loss and every gradient equal
serial's: transformers' LlamaForCausalLM and MistralForCausalLM (a sliding window) called with a
padding `attention_mask` (the causal, window and padding structure is in the (B, 1, T, T) mask,
split on its query dim) and the zoo's LLaMA (`is_causal=True`: each rank's query block attends up
to its own offset), all with grouped-query attention."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from pass_fixtures import assert_call_matches_serial

from autopar.compiler.driver import Compiled
from autopar.core.layout import Partial, Shard
from autopar.core.meta import info
from autopar.rules.context_parallel import BACKWARD, FORWARD
from examples.hf_models import SEQ, VOCAB, tiny_causal_lm
from examples.zoo import make_llama

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH = 2


def _attention_is_split_along_the_sequence(compiled: dict, axis: int = 0) -> None:
    """Every attention call, forward and backward, has its queries split along the sequence on
    `axis`, keys and values whole there, and (backward) the keys' and values' gradients pending
    sums, which the program reduces."""
    first: Compiled = next(iter(compiled.values()))
    calls = [n for n in first.graph.graph.nodes if n.target in (FORWARD, BACKWARD)]
    assert len(calls) == 4, "two layers, forward and backward"
    for node in calls:
        strategy = info(node).strategy
        assert strategy is not None
        query = strategy.inputs[1 if node.target is BACKWARD else 0]
        key = strategy.inputs[2 if node.target is BACKWARD else 1]
        assert query.placements[axis] == Shard(2), (node.name, strategy)
        assert not key.shard_axes(2), (node.name, strategy)
        if node.target is BACKWARD:
            assert [out.placements[axis] for out in strategy.outputs] == [Shard(2), Partial(), Partial()]


def _hf_mistral() -> torch.nn.Module:
    """A sliding window of 4 keys inside a sequence of 16: the window lives in the mask."""
    return tiny_causal_lm("mistral", heads=2, kv_heads=1, sliding_window=4)


@pytest.mark.parametrize(
    "make",
    [functools.partial(tiny_causal_lm, heads=2, kv_heads=1), _hf_mistral],
    ids=["llama", "mistral_sliding_window"],
)
def test_hf_causal_lm_with_padding_splits_attention_along_the_sequence(make: object) -> None:
    """2 query heads, 1 key/value head, batch 2 on 4 ranks: only the sequence fills the mesh."""
    torch.manual_seed(0)
    model = make()  # type: ignore[operator]
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :5] = 0  # left padding in the first sample
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    compiled = assert_call_matches_serial(model, (4,), (), kwargs)
    _attention_is_split_along_the_sequence(compiled)
    graph = next(iter(compiled.values())).graph.graph
    masks = [n.kwargs["attn_mask"] for n in graph.nodes if n.target is FORWARD]
    assert all(info(m).layouts[0].placements == (Shard(2),) for m in masks), "the mask follows the queries"


def test_zoo_llama_causal_splits_attention_along_the_sequence() -> None:
    """`F.scaled_dot_product_attention(..., is_causal=True)`: the ranks' query blocks start at
    offsets 0, 4, 8, 12 and must each attend the keys up to their own positions."""
    model, batch = make_llama(0, batch_size=BATCH, n_head=2, n_kv_head=1, seq_len=SEQ)
    compiled = assert_call_matches_serial(model, (4,), batch)
    _attention_is_split_along_the_sequence(compiled)
    assert all(
        n.args[4] is True for n in next(iter(compiled.values())).graph.graph.nodes if n.target is FORWARD
    )


def test_zoo_llama_on_two_axes_splits_batch_and_sequence() -> None:
    """On (2, 4) the batch of 2 fills the first axis and the sequence the second: each rank's
    causal query block is a quarter of one sample's sequence."""
    model, batch = make_llama(0, batch_size=BATCH, n_head=2, n_kv_head=1, seq_len=SEQ)
    compiled = assert_call_matches_serial(model, (2, 4), batch)
    _attention_is_split_along_the_sequence(compiled, axis=1)
    first = next(iter(compiled.values()))
    for node in first.graph.graph.nodes:
        if node.target in (FORWARD, BACKWARD):
            strategy = info(node).strategy
            assert strategy is not None and all(lay.placements[0] == Shard(0) for lay in strategy.inputs)
