"""emit folds a transpose of a transpose into the tensor itself and a reshape of a reshape into
one reshape (`autopar.passes.view_folds`): each linear's weight gradient was `t(t(mm(...)))`, two
ATen calls a linear at every step, and the trace's reshapes of reshapes one call each."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from pass_fixtures import assert_compiled_matches_serial, compile_every_rank, model_case

import autopar.passes.emit as emit_module
from autopar.passes.view_folds import fold_double_transposes, fold_reshape_chains

aten = torch.ops.aten
DDP = (4,)  # every weight whole on every rank, the batch split: DDP's plan


def _double_ts(gm: fx.GraphModule) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if n.target is aten.t.default and getattr(n.args[0], "target", None) is aten.t.default
    )


def _reshape_chains(gm: fx.GraphModule) -> int:
    views = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
    return sum(1 for n in gm.graph.nodes if n.target in views and getattr(n.args[0], "target", None) in views)


def _calls(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))


def test_the_fold_reads_the_tensor_itself_and_keeps_a_transpose_read_elsewhere() -> None:
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    tx = graph.call_function(aten.t.default, (x,))
    ttx = graph.call_function(aten.t.default, (tx,))  # folded: x, and tx goes with it
    ty = graph.call_function(aten.t.default, (y,))
    tty = graph.call_function(aten.t.default, (ty,))  # folded: y; ty stays (mm reads it)
    mm = graph.call_function(aten.mm.default, (ty, tty))
    graph.output((graph.call_function(aten.add.Tensor, (ttx, mm)),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    args = (torch.randn(3, 3), torch.randn(3, 3))
    want = gm(*args)[0]
    assert fold_double_transposes(gm) == 2
    assert [(n.name, [str(a) for a in n.args]) for n in gm.graph.nodes if n.op == "call_function"] == [
        ("t_default_2", ["y"]), ("mm_default", ["t_default_2", "y"]), ("add_tensor", ["x", "mm_default"]),
    ]  # fmt: skip
    assert torch.equal(gm(*args)[0], want)


def test_a_replicated_gpt_has_no_double_transpose_and_runs_as_serial(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = model_case("gpt")
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    compiled = compile_every_rank(model, DDP, batch, hardware="cpu-gloo", storage="replicated")
    folded = next(iter(compiled.values())).program
    assert _double_ts(folded.forward) == 0 and _double_ts(folded.backward) == 0
    assert _reshape_chains(folded.forward) == 0 and _reshape_chains(folded.backward) == 0
    assert_compiled_matches_serial(compiled, model, DDP, batch)
    monkeypatch.setattr(emit_module, "fold_double_transposes", lambda gm: 0)
    unfolded = next(iter(compile_every_rank(model, DDP, batch, hardware="cpu-gloo", storage="replicated").values()))
    # two calls fewer for each linear's weight gradient (a fused qkv is cut in 3: 2 more linears)
    assert _double_ts(unfolded.program.backward) >= linears
    assert _calls(unfolded.program.backward) - _calls(folded.backward) == 2 * _double_ts(unfolded.program.backward)
    assert _calls(unfolded.program.forward) == _calls(folded.forward)


def _chain(in_place: bool) -> fx.GraphModule:
    """x [2, 3, 4] transposed (not contiguous), reshaped to [6, 4] (a copy), viewed as [24], viewed
    as [4, 6]; with `in_place`, the last is filled in place."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    xt = graph.call_function(aten.transpose.int, (x, 0, 1))
    a = graph.call_function(aten.reshape.default, (xt, [6, 4]))
    b = graph.call_function(aten.view.default, (a, [24]))
    c = graph.call_function(aten._unsafe_view.default, (b, [4, 6]))
    if in_place:
        c = graph.call_function(aten.add_.Tensor, (c, 1.0))
    graph.output((c, graph.call_function(aten.neg.default, (a,))))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_chain_of_reshapes_becomes_one_reshape_of_its_input() -> None:
    x = torch.randn(2, 3, 4)
    gm = _chain(False)
    want = gm(x)
    assert fold_reshape_chains(gm) == 2
    calls = [(n.target, n.args[0].name) for n in gm.graph.nodes if n.op == "call_function"]
    # `view` of the transposed input would be refused: the folded node is a reshape (it copies)
    assert calls == [
        (aten.transpose.int, "x"), (aten.reshape.default, "transpose_int"),
        (aten.reshape.default, "transpose_int"), (aten.neg.default, "reshape_default"),
    ]  # fmt: skip
    assert all(torch.equal(g, w) for g, w in zip(gm(x), want))
    # a graph that writes in place is left alone (a copy instead of a view would change a value)
    in_place = _chain(True)
    assert fold_reshape_chains(in_place) == 0
