"""Ring attention asked for (`PlanOptions(context_parallel="ring")`, a "cp" mesh axis): transformers'
LlamaForCausalLM at its defaults (4 query heads, 2 key/value heads), called with a padding
`attention_mask`, on (4,) ("cp",) and (2, 2) ("dp", "cp"): every attention call splits its
queries, keys and values along the sequence on "cp"; the emitted programs pass key/value blocks
to the next rank (p-1 exchanges in forward, p+1 in backward, per layer) instead of gathering
them; in lockstep, two SGD-with-momentum steps give serial's loss, every gradient and every
parameter."""

from __future__ import annotations

import os

import pytest
import torch
from pass_fixtures import compile_every_rank
from train_fixtures import train_hf_in_lockstep

import autopar
from autopar.core.layout import Shard
from autopar.core.meta import info
from autopar.cost.work import work_split
from autopar.planning.ring_cost import ring_exchange_cost
from autopar.planning.search_cost import TimeCost
from autopar.rules.base import expand, make_call
from autopar.rules.context_parallel import BACKWARD, EMBEDDING, FORWARD, require_context_parallel
from autopar.rules.registry import default_registry
from autopar.rules.ring_attention import ring_axis

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH, LAYERS = 64, 16, 2, 2
A2A = torch.ops._c10d_functional.all_to_all_single.default
GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _batch() -> dict:
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :5] = 0  # left padding: the first block of keys is hidden from every row of sample 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _ring_exchanges(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is A2A and info(n).comm is not None and info(n).comm.kind == "ring_shift"]  # type: ignore[union-attr]


@pytest.mark.parametrize(("shape", "names"), [((4,), ("cp",)), ((2, 2), ("dp", "cp"))], ids=["cp4", "dp2xcp2"])
def test_llama_with_ring_attention_trains_like_serial(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    model = _llama()
    kwargs = _batch()
    cp = names.index("cp")
    registry = require_context_parallel(default_registry(), cp, "ring")
    compiled = compile_every_rank(model, shape, (), kwargs, names=names, registry=registry)
    first = next(iter(compiled.values()))
    calls = [n for n in first.graph.graph.nodes if n.target in (FORWARD, BACKWARD)]
    assert len(calls) == 2 * LAYERS
    for node in calls:
        strategy = info(node).strategy
        assert strategy is not None
        q, k, v = strategy.inputs[1:4] if node.target is BACKWARD else strategy.inputs[:3]
        assert q.placements[cp] == k.placements[cp] == v.placements[cp] == Shard(2), (node.name, strategy)
        assert all(out.placements[cp] == Shard(2) for out in strategy.outputs), "no pending sums: dk, dv split"
    assert all(info(n).layouts[0].placements[cp] == Shard(1) for n in first.graph.graph.nodes if n.target is EMBEDDING)
    p = shape[cp]
    for coords, each in compiled.items():
        forward, backward = each.program.forward.graph, each.program.backward.graph
        assert len(_ring_exchanges(forward)) == LAYERS * (p - 1), coords
        assert len(_ring_exchanges(backward)) == LAYERS * (p + 1), coords
        gathered = [n for n in forward.nodes if n.target is GATHER and info(n).comm is not None and info(n).comm.axis == cp]  # type: ignore[union-attr]
        assert not [n for n in gathered if len(n.meta["val"].shape) == 4], "keys and values are not gathered"
    train_hf_in_lockstep(compiled, model, kwargs, shape, steps=2)


def test_plan_options_ask_for_the_ring() -> None:
    """The public spelling: `autopar.plan` with `PlanOptions(context_parallel="ring")`."""
    torch.manual_seed(0)
    result = autopar.plan(
        _llama(), (2, 2), (), example_kwargs=_batch(), mesh_names=("dp", "cp"), device_type="cpu",
        planning=autopar.PlanOptions(context_parallel="ring"),
    )  # fmt: skip
    forward = [n for n in result.compiled.graph.graph.nodes if n.target is FORWARD]
    assert forward
    for node in forward:
        chosen = info(node).strategy
        assert chosen is not None and chosen.inputs[1].placements[1] == Shard(2), chosen


def _priced(seq: int) -> dict[str, tuple[float, float]]:
    """(compute, exchanges) of the forward attention's all-gather and ring candidates on a (4,)
    mesh of the h100-nvlink-ib table, modeled seconds."""
    q = torch.empty(1, 8, seq, 64, device="meta")
    out, lse = FORWARD(q, q, q, 0.0, True)[:2]
    call = make_call(FORWARD, (q, q, q, 0.0, True), {}, (out, lse))
    work = 4 * seq * seq * 64 * 8  # the two matmuls of the scores and the output
    cost = TimeCost("h100-nvlink-ib", (4,))
    found = {}
    rule = default_registry().get(FORWARD)
    assert rule is not None
    for strategy in expand(call, rule.strategies(call), (4,), rule.uneven):
        name = "ring" if ring_axis(FORWARD, strategy) is not None else "allgather"
        if strategy.inputs[0].shard_axes(2):
            compute = cost.compute(work, work_split(strategy, (4,)), torch.float32)
            found[name] = (compute, ring_exchange_cost(FORWARD, strategy, work, torch.float32, cost))
    return found


def test_the_ring_is_priced_by_what_its_blocks_do_not_hide() -> None:
    """Short sequence: a block's compute is shorter than passing it on, so the exchanges show;
    long: the blocks hide them. The all-gather candidate has none (its gathers are edges)."""
    short, long = _priced(256), _priced(16384)
    assert short["allgather"][1] == long["allgather"][1] == 0.0
    assert short["ring"][1] > 0.0
    assert long["ring"][1] == 0.0 and long["ring"][0] == long["allgather"][0]
