"""Issue 36 item 4's models with each context-parallel strategy forced: transformers'
Qwen3ForCausalLM (q/k norms) and MistralForCausalLM (a sliding window of 4 keys, which transformers
writes into the mask) at their defaults, 4 query heads and 2 key/value heads, called with a padding
`attention_mask` (left padding in one sample), with `"allgather"`, `"ring"` and `"ulysses"` asked for
on a (4,) ("cp",) mesh and a (2, 2, 2) ("dp", "tp", "cp") mesh. Every attention call, forward and
backward, takes the layout asked for on "cp" (which cases run on which mesh: `CASES`); in lockstep, two SGD-with-momentum steps on the
gradients the ranks' programs computed give serial's loss, every gradient and every parameter."""

from __future__ import annotations

import os

import pytest
import torch
from pass_fixtures import compile_every_rank
from train_fixtures import train_hf_in_lockstep

from autopar.compiler.driver import trace_for
from autopar.core.layout import BalancedShard, R, Replicate, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.rules.calls import op_call
from autopar.rules.context_parallel import BACKWARD, EMBEDDING, FORWARD, require_context_parallel
from autopar.rules.registry import default_registry
from examples.hf_models import VOCAB, tiny_causal_lm

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEQ, BATCH, STEPS = 16, 2, 2
# the (query, key) placements on "cp" each strategy asks for
ASKED = {"allgather": (Shard(2), R), "ring": (Shard(2), Shard(2)), "ulysses": (Shard(1), Shard(1))}
MESHES = {"cp4": ((4,), ("cp",)), "dp2xtp2xcp2": ((2, 2, 2), ("dp", "tp", "cp"))}


def _qwen3() -> torch.nn.Module:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def _mistral() -> torch.nn.Module:
    """A window of 4 keys in a sequence of 16: rows see at most their 4 latest keys."""
    return tiny_causal_lm("mistral", n_layer=1, heads=4, kv_heads=2, sliding_window=4)


MODELS = {"qwen3": _qwen3, "mistral_sliding_window": _mistral}
# Each model with each strategy on (4,); on (2, 2, 2) (8 lockstep ranks, minutes of CPU each on
# the shared machine) Mistral's window with the ring, the strategy with the most exchanges
# (test_context_parallel_axis runs the all-gather and Ulysses on (2, 4)).
CASES = [(family, strategy, "cp4") for family in sorted(MODELS) for strategy in sorted(ASKED)] + [
    ("mistral_sliding_window", "ring", "dp2xtp2xcp2")
]


@pytest.mark.parametrize(("family", "strategy", "mesh"), CASES, ids=["-".join(case) for case in CASES])
def test_forced_strategy_trains_like_serial(family: str, strategy: str, mesh: str) -> None:
    shape, names = MESHES[mesh]
    cp = names.index("cp")
    torch.manual_seed(0)
    model = MODELS[family]()
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    registry = require_context_parallel(default_registry(), cp, strategy)
    compiled = compile_every_rank(model, shape, (), kwargs, names=names, registry=registry)
    graph = next(iter(compiled.values())).graph.graph
    calls = [n for n in graph.nodes if n.target in (FORWARD, BACKWARD)]
    assert len(calls) == 2, "one layer, forward and backward"
    for node in calls:
        chosen = info(node).strategy
        assert chosen is not None
        at = 1 if node.target is BACKWARD else 0
        query, key = chosen.inputs[at], chosen.inputs[at + 1]
        assert (query.placements[cp], key.placements[cp]) == ASKED[strategy], (node.name, chosen)
    embeddings = [n for n in graph.nodes if n.target is EMBEDDING]
    assert embeddings and all(info(n).layouts[0].placements[cp] == Shard(1) for n in embeddings)
    train_hf_in_lockstep(compiled, model, kwargs, shape, STEPS)


AT_128 = {  # the model, the strategy forced, the mesh and its "cp" axis, the (query, key) layouts on "cp"
    "mistral-balanced-dp2xcp4": (
        lambda: tiny_causal_lm("mistral", n_layer=1, heads=8, kv_heads=2, sliding_window=32),
        "balanced", (2, 4), ("dp", "cp"), (BalancedShard(2), R),
    ),
    "llama-ring-dp2xtp2xcp2": (
        lambda: tiny_causal_lm("llama", n_layer=1, heads=8, kv_heads=2),
        "ring", (2, 2, 2), ("dp", "tp", "cp"), ASKED["ring"],
    ),
}  # fmt: skip


def _padded_at(seq: int) -> dict[str, torch.Tensor]:
    """The batch of the sequence-128 cases: 37 tokens of left padding in the first sample."""
    ids = torch.randint(VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[0, :37] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.parametrize("case", sorted(AT_128))
def test_forced_strategy_at_sequence_128(case: str) -> None:
    """Issue 36 item 4 at its sequence: 8 query heads, 2 key/value heads, 37 tokens of left
    padding in one sample, sequence 128. Mistral (a window of 32 keys in the mask) with the
    load-balanced layout forced on a (2, 4) ("dp", "cp") mesh; Llama with the ring forced on
    (2, 2, 2) ("dp", "tp", "cp"), where the search nests the ring's sequence split inside another
    axis's split of the sequence (each rank's blocks at their nested offsets). Every attention
    call's queries and keys take the layout asked for on "cp", and two SGD-with-momentum steps in
    lockstep equal serial (loss, every gradient, every parameter)."""
    build, strategy, shape, names, asked = AT_128[case]
    cp, seq = names.index("cp"), 128
    torch.manual_seed(0)
    model = build()
    kwargs = _padded_at(seq)
    registry = require_context_parallel(default_registry(), cp, strategy)
    compiled = compile_every_rank(model, shape, (), kwargs, names=names, registry=registry)
    graph = next(iter(compiled.values())).graph.graph
    calls = [n for n in graph.nodes if n.target in (FORWARD, BACKWARD)]
    assert len(calls) == 2
    for node in calls:
        chosen = info(node).strategy
        assert chosen is not None
        at = 1 if node.target is BACKWARD else 0
        assert (chosen.inputs[at].placements[cp], chosen.inputs[at + 1].placements[cp]) == asked, (node.name, chosen)
    train_hf_in_lockstep(compiled, model, kwargs, shape, STEPS)


def test_pure_ulysses_keeps_every_weight_whole_on_cp() -> None:
    """`"ulysses"` forced is DeepSpeed-Ulysses: on "cp" every op reads its weights whole and its
    tokens split (data parallel over the sequence), attention splits the heads, and the tokens
    reach it and leave it by all-to-alls on "cp", forward and backward. Llama with 37 tokens of
    left padding in one sample, sequence 128, on (2, 2, 2) ("dp", "tp", "cp"): two
    SGD-with-momentum steps in lockstep equal serial (loss, every gradient, every parameter)."""
    shape, names = (2, 2, 2), ("dp", "tp", "cp")
    cp, seq = names.index("cp"), 128
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", n_layer=1, heads=8, kv_heads=2)
    kwargs = _padded_at(seq)
    registry = require_context_parallel(default_registry(), cp, "ulysses")
    compiled = compile_every_rank(model, shape, (), kwargs, names=names, registry=registry)
    calls = {n.name: op_call(n) for n in trace_for(model, Mesh.from_shape(shape, names), (), kwargs).graph.nodes}
    graph = next(iter(compiled.values())).graph.graph
    reads = 0
    for node in graph.nodes:
        chosen = info(node).strategy if has_info(node) else None
        call = calls.get(node.name)
        if chosen is None or call is None or not any(call.weights):
            continue
        for weight, layout in zip(call.weights, chosen.inputs):
            placement = layout.placements[cp]
            if weight:
                reads += 1
                assert isinstance(placement, Replicate), (node.name, chosen)
            elif layout.shape:
                assert isinstance(placement, Shard), (node.name, chosen)
    assert reads >= 9, "q, k, v, o, gate, up, down, lm_head and the norms read weights"
    for node in graph.nodes:
        if node.target in (FORWARD, BACKWARD):
            at = 1 if node.target is BACKWARD else 0
            assert info(node).strategy.inputs[at].placements[cp] == Shard(1), node.name  # type: ignore[union-attr]
    exchanges = {
        phase: [n for n in graph.nodes if has_info(n) and info(n).phase == phase and _all_to_all_on(n, cp)]
        for phase in ("forward", "backward")
    }
    assert exchanges["forward"] and exchanges["backward"]
    train_hf_in_lockstep(compiled, model, kwargs, shape, STEPS)


def _all_to_all_on(node: torch.fx.Node, axis: int) -> bool:
    step = info(node).comm
    return step is not None and step.kind == "all_to_all" and step.axis == axis
