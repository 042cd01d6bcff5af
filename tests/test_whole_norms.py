"""emit puts a layer norm back whole (`native_layer_norm` and its backward) where the plan computes
it on whole rows, and leaves the trace's decomposition where a sum crosses ranks
(`autopar.passes.whole_norms`)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from pass_fixtures import assert_compiled_matches_serial, compile_every_rank, is_comm, model_case
from torch.fx.experimental.proxy_tensor import make_fx

import autopar.passes.emit as emit_module
from autopar.passes.whole_norms import whole_layer_norms
from autopar.rules.decompositions import sharding_decompositions

aten = torch.ops.aten
FORWARD, BACKWARD = aten.native_layer_norm.default, aten.native_layer_norm_backward.default
DDP = (4,)  # every weight whole on every rank, the batch split: DDP's plan


def _ops(gm: fx.GraphModule) -> collections.Counter[Any]:
    """The ATen calls a graph makes, by op."""
    return collections.Counter(
        n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    )


def _norms(model: torch.nn.Module) -> int:
    return sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def _replicated(**options: Any) -> dict[Any, Any]:
    model, batch = model_case("gpt")
    return compile_every_rank(model, DDP, batch, hardware="cpu-gloo", storage="replicated", **options)


def test_a_replicated_plan_runs_every_layer_norm_whole_and_as_serial() -> None:
    model, batch = model_case("gpt")
    compiled = _replicated()
    n = _norms(model)
    for comp in compiled.values():
        fwd, bwd = _ops(comp.program.forward), _ops(comp.program.backward)
        assert (fwd[FORWARD], bwd[BACKWARD]) == (n, n)
        assert fwd[aten.rsqrt.default] == 0 and bwd[aten.rsqrt.default] == 0
    assert_compiled_matches_serial(compiled, model, DDP, batch)


def test_each_whole_norm_saves_ten_calls_in_forward_and_thirteen_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decomposition is 11 calls in forward, 15 in backward (its bias gradient, one sum, stays)."""
    model, _ = model_case("gpt")
    n = _norms(model)
    whole = next(iter(_replicated().values())).program
    monkeypatch.setattr(emit_module, "whole_layer_norms", lambda gm: 0)
    split = next(iter(_replicated().values())).program
    assert _ops(split.forward)[FORWARD] == 0
    assert sum(_ops(split.forward).values()) - sum(_ops(whole.forward).values()) == 10 * n
    assert sum(_ops(split.backward).values()) - sum(_ops(whole.backward).values()) == 13 * n
    assert split.num_saved == whole.num_saved  # the same values cross from forward to backward


def test_a_norm_whose_sums_cross_ranks_stays_decomposed() -> None:
    """greedy on 2x4 splits the GPT's hidden dim around some norms: their sums are all-reduced
    inside them, and those stay decomposed; the others are whole, and the step is serial's."""
    model, batch = model_case("gpt")
    n = _norms(model)
    compiled = compile_every_rank(model, (2, 4), batch, planner="greedy", split_fused=False)
    kept = 0
    for comp in compiled.values():
        for gm, op in ((comp.program.forward, FORWARD), (comp.program.backward, BACKWARD)):
            decomposed = [node for node in gm.graph.nodes if str(node.meta.get("original_aten")) == str(op)]
            whole = _ops(gm)[op]
            assert whole <= n and (whole == n) == (not decomposed)
            if decomposed:  # a collective's result is read inside what stays
                assert any(is_comm(i) for node in decomposed for i in node.all_input_nodes)
            kept += n - whole
    assert kept > 0
    assert_compiled_matches_serial(compiled, model, (2, 4), batch)


def _traced_norm() -> fx.GraphModule:
    """A layer norm and its backward as the trace writes them with more than one rank."""

    def step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, grad: torch.Tensor) -> Any:
        out, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
        gx, gw, gb = aten.native_layer_norm_backward(grad, x, [8], mean, rstd, w, b, [True, True, True])
        return out, gx, gw, gb

    args = (torch.randn(2, 3, 8), torch.randn(8), torch.randn(8), torch.randn(2, 3, 8))
    with fx_traceback.preserve_node_meta():
        return make_fx(step, decomposition_table=sharding_decompositions(), tracing_mode="fake")(*args)


def _run(gm: fx.GraphModule, args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list(gm(*args))


def test_the_pass_computes_the_kernels_results() -> None:
    gm = _traced_norm()
    args = (torch.randn(2, 3, 8), torch.randn(8), torch.randn(8), torch.randn(2, 3, 8))
    before = _run(gm, args)
    assert whole_layer_norms(gm) == 2
    assert (_ops(gm)[FORWARD], _ops(gm)[BACKWARD]) == (1, 1)
    after = _run(gm, args)
    out, mean, rstd = aten.native_layer_norm(args[0], [8], args[1], args[2], 1e-5)
    want = [out, *aten.native_layer_norm_backward(args[3], args[0], [8], mean, rstd, args[1], args[2], [True] * 3)]
    for got, old, ref in zip(after, before, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(old, ref, rtol=1e-4, atol=1e-4)


def test_a_norm_read_inside_or_summed_over_a_split_dim_is_left_alone() -> None:
    # an intermediate (the variance plus eps) read outside the norm
    gm = _traced_norm()
    inner = next(n for n in gm.graph.nodes if n.target is aten.rsqrt.default).args[0]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((*output.args[0], inner),)
    gm.recompile()
    assert _ops(gm)[aten.rsqrt.default] == 1
    assert whole_layer_norms(gm) == 1  # the backward alone
    assert _ops(gm)[FORWARD] == 0 and _ops(gm)[aten.rsqrt.default] == 1
    # sums divided by a count the local rows do not hold (a rank's half of a split normalized dim)
    gm = _traced_norm()
    for node in gm.graph.nodes:
        if node.target is aten.div.Tensor and node.args[1] == 8:
            node.args = (node.args[0], 16)
    gm.recompile()
    assert whole_layer_norms(gm) == 0
