"""Context parallelism chosen by a memory limit (issue 36, item 3): the zoo's LLaMA (2 heads, batch
2) at a sequence of 256 on (2, 4) ranks. Neither the batch (2) nor the heads (2) can split the
4-rank axis, so without context parallelism attention runs whole on it and keeps its queries,
keys, values and output whole for backward; the search at no limit prefers that plan. Under a
limit that no plan without the sequence split meets, even recomputing every block (whose values
exist again while its backward runs, `planning.recompute`), the search splits attention's
queries along the sequence by itself, and the program trains equal to serial. The modeled
numbers are the H100 table's, as `autopar.plan` prices a CUDA mesh by default. The same for
transformers' LlamaForCausalLM, Qwen3ForCausalLM and MistralForCausalLM (sliding window) at their
defaults, called with a padding mask, at sequence 128 on (8,), (2, 4) and (2, 2, 2) ranks."""

from __future__ import annotations

import os

import pytest
import torch
from case_matrix import pairwise
from pass_fixtures import assert_call_matches_serial, compile_every_rank
from train_fixtures import train_hf_in_lockstep

import autopar
from autopar.core.errors import AutoparError, MemoryLimitError
from autopar.core.layout import BalancedShard
from autopar.core.meta import info
from autopar.rules.context_parallel import BACKWARD, FORWARD, without_sequence_split
from autopar.rules.registry import default_registry
from examples.hf_models import VOCAB, tiny_causal_lm
from examples.zoo import make_llama

SHAPE = (2, 4)
# bytes per rank: a plan with CP fits it (0.95 does not: its causal attention backward holds one
# kernel call's key gradients beside its own, `planning.working.causal_rows_scratch_bytes`), none without CP does
LIMIT = 1.05 * 2**20
TABLE = "h100-nvlink-ib"
SEQUENCE_SPLITS = (autopar.Shard(2), BalancedShard(2))


def _model() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return make_llama(0, batch_size=2, n_head=2, n_kv_head=2, seq_len=256, dim=64, hidden=128, vocab_size=128)


def _query_placements(graph: torch.fx.Graph) -> list[tuple]:
    return [
        info(n).strategy.inputs[1 if n.target is BACKWARD else 0].placements  # type: ignore[union-attr]
        for n in graph.nodes
        if n.target in (FORWARD, BACKWARD)
    ]


def test_memory_limit_makes_the_search_split_the_sequence() -> None:
    model, batch = _model()
    free = autopar.plan(model, SHAPE, batch)
    assert all(not any(p == autopar.Shard(2) for p in q) for q in _query_placements(free.compiled.graph.graph)), (
        "at no limit, attention is not split along the sequence here"
    )
    without = autopar.PlanOptions(registry=without_sequence_split(default_registry()))
    with pytest.raises(MemoryLimitError) as refused:
        autopar.plan(model, SHAPE, batch, memory_limit=LIMIT, planning=without)
    assert refused.value.memory > LIMIT
    limited = autopar.plan(model, SHAPE, batch, memory_limit=LIMIT)
    queries = _query_placements(limited.compiled.graph.graph)
    assert len(queries) >= 4 and all(q[1] == autopar.Shard(2) for q in queries), queries  # (with recomputed copies)
    report = limited.compiled.graph.meta["autopar_search"]
    assert report.memory <= LIMIT


def test_memory_limit_plan_trains_like_serial() -> None:
    """Every rank's program of the plan chosen under the limit, in lockstep: loss and every
    gradient equal serial's."""
    model, batch = _model()
    compiled = assert_call_matches_serial(model, SHAPE, batch, memory_limit=LIMIT, hardware=TABLE)
    first = next(iter(compiled.values()))
    assert all(q[1] == autopar.Shard(2) for q in _query_placements(first.graph.graph))


def test_auto_mesh_under_the_limit_splits_the_sequence() -> None:
    """`mesh_shape="auto"` over 8 ranks: the mesh chosen under the limit splits attention's
    queries along the sequence on one of its axes, with no axis named "cp"."""
    model, batch = _model()
    result = autopar.plan(model, "auto", batch, world_size=8, memory_limit=LIMIT)
    assert "cp" not in result.mesh.axis_names
    queries = _query_placements(result.compiled.graph.graph)
    assert queries and all(autopar.Shard(2) in q for q in queries), queries


def test_cp_axis_with_auto_mesh_is_refused() -> None:
    model, batch = _model()
    with pytest.raises(AutoparError, match='cannot keep a "cp" axis') as refused:
        autopar.plan(model, "auto", batch, world_size=8, mesh_names=("dp", "cp"))
    assert "mesh_names" in (refused.value.hint or "")


# bytes per rank, per (model, mesh): under it no plan without the sequence split fits, the leanest
# plan with it does (`autopar.plan` on the H100 table: the leanest plans' needs in the comments, MiB)
HF_LIMITS = {
    ("llama", (8,)): 0.4 * 2**20,  # without 0.50, with 0.32
    ("llama", (2, 4)): 0.3 * 2**20,  # without 0.35, with 0.26
    ("llama", (2, 2, 2)): 0.255 * 2**20,  # without 0.28, with 0.23
    ("qwen3", (8,)): 0.4 * 2**20,  # without 0.51, with 0.33
    ("qwen3", (2, 4)): 0.3 * 2**20,  # without 0.35, with 0.27
    ("qwen3", (2, 2, 2)): 0.27 * 2**20,  # without 0.29, with 0.25
    ("mistral", (8,)): 0.4 * 2**20,  # without 0.50, with 0.32
    ("mistral", (2, 4)): 0.3 * 2**20,  # without 0.35, with 0.26
    ("mistral", (2, 2, 2)): 0.255 * 2**20,  # without 0.28, with 0.23
}
HF_MODELS = {
    "llama": lambda: tiny_causal_lm("llama", n_layer=1, heads=2, kv_heads=2),
    "qwen3": lambda: _qwen3(),
    "mistral": lambda: tiny_causal_lm("mistral", n_layer=1, heads=2, kv_heads=2, sliding_window=32),
}


def _qwen3() -> torch.nn.Module:
    """Qwen3ForCausalLM at its defaults but its size (q/k norms; 2 query and 2 key/value heads)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def test_transformers_llama_at_no_limit_keeps_attention_whole() -> None:
    """LlamaForCausalLM at its defaults (1 layer, 2 query heads, 2 key/value heads), called as its
    docs call it with left padding in one sample (the causal and padding structure in a (B, 1, T, T)
    mask), batch 2, sequence 128, on (2, 4) ranks without a "cp" axis: at no limit the search keeps
    attention whole on the 4-rank axis (the other models and meshes under a limit:
    `test_memory_limit_chooses_the_sequence_split`)."""
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    model = HF_MODELS["llama"]()
    free = autopar.plan(model, SHAPE, (), example_kwargs=_padded(), planning=autopar.PlanOptions(hardware=TABLE))
    assert all(q[1] != autopar.Shard(2) for q in _query_placements(free.compiled.graph.graph))


def _padded() -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 128, dtype=torch.long)
    mask[0, :37] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


# each model and each mesh once (all 9 pairs with AUTOPAR_FULL_MATRIX=1: tests/case_matrix.py)
HF_CASES = pairwise(sorted(HF_MODELS), [(8,), (2, 4), (2, 2, 2)])


@pytest.mark.parametrize(("family", "shape"), HF_CASES, ids=[f"{f}-{'x'.join(map(str, s))}" for f, s in HF_CASES])
def test_memory_limit_chooses_the_sequence_split(family: str, shape: tuple[int, ...]) -> None:
    """Issue 36 item 4, the search's own choice under a memory limit: transformers' Llama, Qwen3 and
    Mistral (a sliding window of 32 keys in the mask) at their defaults (1 layer, 2 query and 2
    key/value heads, so the heads fill no 4- or 8-rank axis), called as their docs call them with
    37 tokens of left padding in one sample, batch 2, sequence 128, on (8,), (2, 4) and (2, 2, 2)
    ranks with no "cp" axis. Under the case's limit (`HF_LIMITS`) no plan without the sequence split
    fits (`MemoryLimitError`); the search's plan fits it, splits every attention call's queries
    along the sequence on some axis by itself, and two SGD-with-momentum steps of the ranks'
    programs in lockstep equal serial (loss, every gradient, every parameter)."""
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    limit = HF_LIMITS[(family, shape)]
    torch.manual_seed(0)
    model = HF_MODELS[family]()
    kwargs = _padded()
    without = autopar.PlanOptions(hardware=TABLE, registry=without_sequence_split(default_registry()))
    with pytest.raises(MemoryLimitError):
        autopar.plan(model, shape, (), example_kwargs=kwargs, memory_limit=limit, planning=without)
    compiled = compile_every_rank(model, shape, (), kwargs, memory_limit=limit, hardware=TABLE)
    graph = next(iter(compiled.values())).graph
    queries = _query_placements(graph.graph)
    assert len(queries) >= 2 and all(any(p in SEQUENCE_SPLITS for p in q) for q in queries), queries
    assert graph.meta["autopar_search"].memory <= limit
    train_hf_in_lockstep(compiled, model, kwargs, shape, steps=2)
