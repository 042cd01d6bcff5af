"""Context parallelism asked for: a mesh axis named "cp" splits the sequence over it, with attention
by the all-gather strategy or Ulysses' heads split (`PlanOptions.context_parallel`,
`rules.context_parallel.require_context_parallel`). In lockstep against serial (loss, every
gradient): the all-to-all that Ulysses is, in the emitted programs of a model whose activations
are split along the sequence by its embedding; the "cp" axis at its defaults; the refusals. The
forced strategies on transformers' Llama, Qwen3 and Mistral with padding, on (8,), (2, 4) and
(2, 2, 2) meshes, trained against serial: test_context_parallel_models.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from pass_fixtures import assert_call_matches_serial, compile_every_rank
from torch import nn

import autopar
from autopar.core.errors import UsageError
from autopar.core.layout import Shard
from autopar.core.meta import info
from autopar.rules.context_parallel import BACKWARD, EMBEDDING, FORWARD, require_context_parallel
from autopar.rules.registry import default_registry

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH = 64, 16, 2
A2A = torch.ops._c10d_functional.all_to_all_single.default
QUERY_SPLIT = {"allgather": Shard(2), "ulysses": Shard(1)}  # the query's placement on "cp"


class HeadsMixer(nn.Module):
    """Embedding -> attention over 4 heads -> residual add: no weight matrix, so the only way
    from the embedding's sequence split to a heads split and back is a redistribution."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.q_scale = nn.Parameter(torch.randn(32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, 32)
        b, t, _ = x.shape
        q = (x * self.q_scale).view(b, t, 4, 8).transpose(1, 2)
        kv = x.view(b, t, 4, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        y = out.transpose(1, 2).reshape(b, t, 32) + x
        return (y * y).mean()


def _computed_from(node: fx.Node, target: object, depth: int = 30) -> bool:
    """Whether `node` has a `target` node among its producers, at most `depth` nodes back (the
    schedule may bucket several exchanges into one collective, with views around it)."""
    frontier, seen = [node], {node}
    for _ in range(depth):
        if any(n.target is target for n in frontier):
            return True
        frontier = [p for n in frontier for p in n.all_input_nodes if p not in seen]
        seen.update(frontier)
    return False


def test_ulysses_is_an_all_to_all_around_attention() -> None:
    """On a (4,) "cp" mesh with Ulysses required: the embedding splits the sequence, attention
    splits the heads, and in the emitted forward the query and key/value reach attention from an
    all-to-all (sequence -> heads); the result is equal to serial."""
    torch.manual_seed(0)
    model = HeadsMixer()
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    registry = require_context_parallel(default_registry(), 0, "ulysses")
    compiled = assert_call_matches_serial(model, (4,), (ids,), names=("cp",), registry=registry)
    first = next(iter(compiled.values()))
    for node in first.graph.graph.nodes:
        if node.target in (FORWARD, BACKWARD):
            strategy = info(node).strategy
            assert strategy is not None and all(lay.placements == (Shard(1),) for lay in strategy.inputs[:3])
        if node.target is EMBEDDING:
            assert info(node).layouts[0].placements == (Shard(1),), "the sequence split starts here"
    forward = first.program.forward.graph
    attention = [n for n in forward.nodes if "attention" in str(n.target)]
    assert len(attention) == 1, [str(n.target) for n in attention]
    q, k = attention[0].args[0], attention[0].args[1]
    assert isinstance(q, fx.Node) and isinstance(k, fx.Node)
    assert _computed_from(q, A2A) and _computed_from(k, A2A), "sequence -> heads: an all-to-all"
    backward = first.program.backward.graph
    assert any(n.target is A2A for n in backward.nodes), "the gradients: heads -> sequence"


def _hf_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_cp_axis_at_defaults_splits_the_sequence() -> None:
    """No strategy named: a "cp" axis still requires one of the two (here on (4,), by the cost)."""
    torch.manual_seed(0)
    model = _hf_llama()
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    compiled = compile_every_rank(model, (4,), (), {"input_ids": ids, "labels": ids}, names=("cp",))
    first = next(iter(compiled.values()))
    for node in first.graph.graph.nodes:
        if node.target is FORWARD:
            strategy = info(node).strategy
            assert strategy is not None and strategy.inputs[0].placements[0] in QUERY_SPLIT.values()


def test_cp_axis_without_attention_is_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(UsageError, match="no scaled_dot_product_attention") as caught:
        compile_every_rank(model, (2,), (torch.randn(4, 8),), names=("cp",))
    assert "name the axis otherwise" in (caught.value.hint or "")


class EncoderWithDropout(nn.Module):
    """A user's model: nn.TransformerEncoderLayer at its default dropout (0.1), inside attention too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(ids)))


def test_cp_axis_with_dropout_inside_attention_names_the_dropout() -> None:
    """Attention with dropout is traced as its math, which the sequence split cannot take: the error
    says so and where the model draws, not that the model has no attention."""
    torch.manual_seed(0)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UsageError, match="dropout") as caught:
        compile_every_rank(EncoderWithDropout(), (2, 2), (ids,), names=("dp", "cp"))
    assert caught.value.op and caught.value.where, caught.value
    assert "dropout=0.0" in (caught.value.hint or "")


def test_context_parallel_option_is_checked() -> None:
    with pytest.raises(UsageError, match="not an attention strategy"):
        autopar.PlanOptions(context_parallel="striped")
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(UsageError, match='"cp" mesh axis'):
        autopar.plan(
            model, (2,), example_inputs=(torch.randn(4, 8),), planning=autopar.PlanOptions(context_parallel="ulysses")
        )


def test_ulysses_without_enough_heads_names_what_to_do() -> None:
    """2 heads on a "cp" axis of 4: no heads split; the error says what the axis asks for."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    registry = require_context_parallel(default_registry(), 0, "ulysses")
    with pytest.raises(autopar.AutoparError) as caught:
        compile_every_rank(model, (4,), (), {"input_ids": ids, "labels": ids}, names=("cp",), registry=registry)
    assert "cp" in (caught.value.hint or "") and "heads" in (caught.value.hint or "")


@pytest.mark.parametrize("strategy", ["allgather", "ulysses"])
def test_plan_options_name_the_strategy(strategy: str) -> None:
    """`autopar.plan` with `PlanOptions(context_parallel=...)` on a ("dp", "cp") mesh: the same
    requirement reaches the planner through the public options."""
    torch.manual_seed(0)
    model = _hf_llama()
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    result = autopar.plan(
        model, (2, 4), (), example_kwargs={"input_ids": ids, "labels": ids}, mesh_names=("dp", "cp"),
        device_type="cpu", planning=autopar.PlanOptions(context_parallel=strategy),
    )  # fmt: skip
    forward = [n for n in result.compiled.graph.graph.nodes if n.target is FORWARD]
    assert forward
    for node in forward:
        chosen = info(node).strategy
        assert chosen is not None and chosen.inputs[0].placements[1] == QUERY_SPLIT[strategy], chosen
