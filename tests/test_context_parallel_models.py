"""Issue 36 item 4's models with each context-parallel strategy forced, as users call them:
transformers' LlamaForCausalLM, Qwen3ForCausalLM (q/k norms) and MistralForCausalLM (a sliding window
of 32 keys, which transformers writes into the mask) at their defaults, 1 layer, 8 query heads and 2
key/value heads, called with a padding `attention_mask` (37 tokens of left padding in one sample) at
sequence 128, with `"allgather"`, `"ring"` and `"ulysses"` asked for on each of the (8,) ("cp",),
(2, 4) ("dp", "cp") and (2, 2, 2) ("dp", "tp", "cp") meshes (27 cases with AUTOPAR_FULL_MATRIX=1;
by default the 9 of a Latin square, every pair of model, strategy and mesh once: tests/case_matrix.py),
and Mistral's window with the load-balanced layout on (2, 4). Every attention call, forward and backward, takes the query and key
layouts asked for on "cp", the embedding splits the sequence there, and two SGD-with-momentum steps
of the ranks' programs in lockstep give serial's loss, every gradient and every parameter
(`train_hf_in_lockstep`). Under `"ulysses"` the plan is DeepSpeed-Ulysses: every op reads its
weights whole on "cp", and all-to-alls on "cp" take the tokens to attention's heads split and back.

The search's own choice under a memory limit, for the same models and meshes, is in
test_context_parallel_memory.py; the same forced strategies on real gloo ranks in
test_context_parallel_multirank.py (the balanced layouts) and test_context_parallel_ring.py.
CPU cost: 4 to 9 s a case on the shared machine (compile every rank, two lockstep steps)."""

from __future__ import annotations

import os

import pytest
import torch
from case_matrix import pairwise
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

SEQ, BATCH, STEPS, PADDING = 128, 2, 2, 37
# the (query, key) placements on "cp" each strategy asks for
ASKED: dict[str, tuple[object, object]] = {
    "allgather": (Shard(2), R), "ring": (Shard(2), Shard(2)), "ulysses": (Shard(1), Shard(1)),
    "balanced": (BalancedShard(2), R),
}  # fmt: skip
MESHES = {"8": ((8,), ("cp",)), "2x4": ((2, 4), ("dp", "cp")), "2x2x2": ((2, 2, 2), ("dp", "tp", "cp"))}


def _qwen3() -> torch.nn.Module:
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


MODELS = {
    "llama": lambda: tiny_causal_lm("llama", n_layer=1, heads=8, kv_heads=2),
    "qwen3": _qwen3,
    # rows see at most their 32 latest keys: the window is in the mask
    "mistral": lambda: tiny_causal_lm("mistral", n_layer=1, heads=8, kv_heads=2, sliding_window=32),
}
# every (model, strategy), (model, mesh) and (strategy, mesh) pair once; all 27 with AUTOPAR_FULL_MATRIX=1
CASES = [
    *pairwise(sorted(MODELS), ("allgather", "ring", "ulysses"), list(MESHES)),
    ("mistral", "balanced", "2x4"),
]


def padded_batch() -> dict[str, torch.Tensor]:
    """Item 4's call: `labels` for the loss, left padding in the first sample's mask."""
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :PADDING] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.parametrize(("family", "strategy", "mesh"), CASES, ids=["-".join(case) for case in CASES])
def test_forced_strategy_trains_like_serial(family: str, strategy: str, mesh: str) -> None:
    shape, names = MESHES[mesh]
    cp = names.index("cp")
    torch.manual_seed(0)
    model = MODELS[family]()
    kwargs = padded_batch()
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
    split = BalancedShard(1) if strategy == "balanced" else Shard(1)
    assert embeddings and all(info(n).layouts[0].placements[cp] == split for n in embeddings)
    if strategy == "ulysses":
        _assert_pure_ulysses(model, shape, names, kwargs, graph)
    train_hf_in_lockstep(compiled, model, kwargs, shape, STEPS)


def _assert_pure_ulysses(
    model: torch.nn.Module, shape: tuple[int, ...], names: tuple[str, ...], kwargs: dict, graph: torch.fx.Graph
) -> None:
    """`"ulysses"` forced is DeepSpeed-Ulysses: on "cp" every op reads its weights whole and its
    other tensors split (data parallel over the sequence), and the tokens reach attention and leave
    it by all-to-alls on "cp", forward and backward."""
    cp = names.index("cp")
    calls = {n.name: op_call(n) for n in trace_for(model, Mesh.from_shape(shape, names), (), kwargs).graph.nodes}
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
    assert reads >= 8, "q, k, v, o, gate, up, down, lm_head and the norms read weights"
    exchanges = {
        phase: [n for n in graph.nodes if has_info(n) and info(n).phase == phase and _all_to_all_on(n, cp)]
        for phase in ("forward", "backward")
    }
    assert exchanges["forward"] and exchanges["backward"]


def _all_to_all_on(node: torch.fx.Node, axis: int) -> bool:
    step = info(node).comm
    return step is not None and step.kind == "all_to_all" and step.axis == axis

