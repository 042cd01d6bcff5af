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
from examples.zoo import make_llama

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


def _priced(seq: int, table: str = "h100-nvlink-ib", op: object = FORWARD) -> dict[str, tuple[float, float]]:
    """(compute, exchanges) of the forward (or backward) attention's all-gather and ring candidates
    on a (4,) mesh of a hardware table, modeled seconds."""
    q = torch.empty(1, 8, seq, 64, device="meta")
    out, lse = FORWARD(q, q, q, 0.0, True)[:2]
    if op == BACKWARD:
        args, outs = (q, q, q, q, out, lse, 0.0, True), (q, q, q)
    else:
        args, outs = (q, q, q, 0.0, True), (out, lse)
    call = make_call(op, args, {}, outs)
    work = 4 * seq * seq * 64 * 8  # the two matmuls of the scores and the output
    cost = TimeCost(table, (4,))
    found = {}
    rule = default_registry().get(op)
    assert rule is not None
    at = 1 if op == BACKWARD else 0
    for strategy in expand(call, rule.strategies(call), (4,), rule.uneven):
        name = "ring" if ring_axis(op, strategy) is not None else "allgather"
        if strategy.inputs[at].shard_axes(2):
            compute = cost.compute(work, work_split(strategy, (4,)), torch.float32)
            found[name] = (compute, ring_exchange_cost(op, strategy, work, torch.float32, cost))
    return found


def test_the_ring_is_priced_by_what_its_blocks_do_not_hide() -> None:
    """Short sequence: a block's compute is shorter than passing it on, so the exchanges show;
    long: the blocks hide them. The all-gather candidate has none (its gathers are edges)."""
    short, long = _priced(256), _priced(16384)
    assert short["allgather"][1] == long["allgather"][1] == 0.0
    assert short["ring"][1] > 0.0
    assert long["ring"][1] == 0.0 and long["ring"][0] == long["allgather"][0]


def test_on_gloo_every_exchange_costs_its_rank_its_call() -> None:
    """On cpu-gloo a collective costs its own rank 1 ms (`Link.call`: gloo's copies and queueing on
    the rank's cores), which no compute hides: even where the blocks hide the wire time, the ring
    pays it p-1 times in forward and p+1 in backward (4 ranks: 3 and 5 ms)."""
    call = TimeCost("cpu-gloo", (4,)).mesh.links[0].call
    assert call > 0
    forward, backward = _priced(16384, "cpu-gloo")["ring"], _priced(16384, "cpu-gloo", BACKWARD)["ring"]
    assert forward[1] == pytest.approx(3 * call)
    assert backward[1] >= 5 * call


def test_a_cp_axis_at_its_defaults_gathers_the_keys_where_the_ring_costs_more() -> None:
    """The zoo's LLaMA (1 layer, width 256, 4 heads, 1 key/value head, sequence 1024, batch 1) on a
    (4,) ("cp",) CPU mesh at the defaults (layouts planned by element counts): the ring's exchanges
    send more than gathering the keys and values does (p-1 blocks forward, 2p-1 backward with the
    gradient accumulators, against p-1 each way), and element counts hide none of them behind
    compute, as none of any other collective. The plan takes no ring, where the ring's exchanges
    counted as hidden behind its blocks' flops made it take the ring, which ran slower on 8 gloo
    ranks (docs/long-context.md). It splits attention's queries along the sequence with the keys
    gathered, or (since the load-balanced layout's conversions are priced as the two collectives
    insert_comm emits, zoo17) the heads, Ulysses' way: both without ring exchanges."""
    model, batch = make_llama(0, batch_size=1, vocab_size=256, seq_len=1024, dim=256, n_layer=1, n_head=4,
                              n_kv_head=1, hidden=688)  # fmt: skip
    result = autopar.plan(model, (4,), batch, mesh_names=("cp",), device_type="cpu")
    attention = [n for n in result.compiled.graph.graph.nodes if n.target in (FORWARD, BACKWARD)]
    assert attention
    for node in attention:
        chosen = info(node).strategy
        assert chosen is not None and ring_axis(node.target, chosen) is None, chosen
        queries = chosen.inputs[1 if node.target is BACKWARD else 0]
        assert (0,) in (queries.shard_axes(2), queries.shard_axes(1)), chosen
