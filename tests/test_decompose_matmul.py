"""Decomposed collective matmuls (`autopar.passes.decompose_matmul`): the rewritten graph, and
training steps of every rank in lockstep equal to serial (and to the undecomposed programs)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from multirank import run_ranks
from pass_fixtures import Coords, compile_every_rank, lockstep_step, two_linear_case

from autopar.api import compile_for_rank, parallelize
from autopar.compiler import decompose_choice
from autopar.compiler.decompose_choice import DecompositionChoice
from autopar.compiler.driver import trace_for
from autopar.compiler.lowering import scheduled_step_time
from autopar.core.collectives import (
    COLLECTIVES,
    DECOMPOSED_KEY,
    DECOMPOSED_STEPS_KEY,
    MATMUL_FLOPS_KEY,
    PIECE_KEY,
    DecomposedPair,
)
from autopar.core.errors import AutoparError, UsageError
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.options import PlanOptions
from autopar.passes import decompose_pairs
from autopar.planning.search import search_layouts
from autopar.planning.search_cost import TimeCost
from autopar.reporting.timeline_views import chrome_trace, overlap_text, write_png
from autopar.rules.registry import default_registry
from autopar.testing import assemble
from examples.models import GPT, GPTConfig, make_gpt, make_mlp

HW = "h100-nvlink-ib"
aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _pieces(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES and PIECE_KEY in n.meta]


def _assembled_grads(compiled: dict[Coords, object], bwd: dict[Coords, list], shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient put together from the ranks' blocks (fused parts into their source)."""
    first = next(iter(compiled.values())).program  # type: ignore[attr-defined]
    out: dict[str, torch.Tensor] = {}
    for i, (name, lay) in enumerate(zip(first.param_names, first.param_layouts)):
        grad = assemble({c: bwd[c][i] for c in bwd}, lay, shape, atol=1e-5, rtol=1e-5)
        part = first.param_parts.get(name)
        if part is None:
            out[name] = grad
        else:
            whole = out.get(part.source)
            if whole is None:
                sizes = list(grad.shape)
                sizes[part.dim] *= part.count
                whole = out[part.source] = torch.zeros(sizes, dtype=grad.dtype)
            part.of(whole).copy_(grad)
    return out


def _train_in_lockstep(
    make: object, shape: tuple[int, ...], steps: int = 2, **options: object
) -> tuple[list[float], list[float], float, float, dict[Coords, object]]:
    """`steps` SGD-momentum steps of the model serially and of every rank's program in lockstep
    (the ranks' gradients assembled, applied to a copy of the weights): the losses of each, the
    largest gradient and parameter differences, and the compiled programs."""
    serial, batch = make()  # type: ignore[operator]
    parallel = copy.deepcopy(serial)
    compiled = compile_every_rank(parallel, shape, batch, **options)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    losses_s, losses_p, grad_diff = [], [], 0.0
    for _ in range(steps):
        fwd, bwd = lockstep_step(compiled, parallel, shape, batch, {})  # type: ignore[arg-type]
        losses_p.append(max(float(fwd[c][0]) for c in fwd))
        grads = _assembled_grads(compiled, bwd, shape)
        opt_s.zero_grad()
        torch.manual_seed(0)
        loss = serial(*batch)
        loss.backward()
        losses_s.append(float(loss.detach()))
        for (name, p), q in zip(parallel.named_parameters(), serial.parameters()):
            p.grad = grads[name].clone()
            grad_diff = max(grad_diff, float((p.grad - q.grad).abs().max()))  # type: ignore[operator]
        opt_s.step()
        opt_p.step()
    param_diff = max(float((p - q).abs().max()) for p, q in zip(parallel.parameters(), serial.parameters()))
    return losses_s, losses_p, grad_diff, param_diff, compiled  # type: ignore[return-value]


def _decomposed(compiled: dict[Coords, object]) -> list:
    return [r for r in next(iter(compiled.values())).graph.meta[DECOMPOSED_KEY] if r.kept]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model", "shape", "planner"),
    [("gpt", (4,), "greedy"), ("gpt", (2, 2), "search"), ("mlp", (4,), "search")],
)
def test_decomposed_programs_train_as_serial(model: str, shape: tuple[int, ...], planner: str) -> None:
    make = (lambda: make_gpt(0, n_layer=1)) if model == "gpt" else (lambda: make_mlp(0))
    losses_s, losses_p, grad_diff, param_diff, compiled = _train_in_lockstep(
        make, shape, planner=planner, decompose_matmuls="on"
    )
    kinds = {r.kind for r in _decomposed(compiled)}
    assert kinds == {"all_gather", "reduce_scatter"}, kinds
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses_s, losses_p)), (losses_s, losses_p)
    assert grad_diff < 2e-5 and param_diff < 1e-5, (grad_diff, param_diff)


def _compile(key: str, shape: tuple[int, ...], mode: str, **options: object):  # type: ignore[no-untyped-def]
    model, batch = two_linear_case() if key == "two_linear" else make_gpt(0, n_layer=1)
    return compile_for_rank(
        model, Mesh.from_shape(shape), batch, coords=(0,) * len(shape), decompose_matmuls=mode, **options
    )


def _collectives(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target]


def test_gather_and_scatter_pairs_become_pieces() -> None:
    """The one-layer GPT on (4,), greedy plan: all-gathers feed matmuls along their rows (M, the
    attention projection's input), columns (N, gathered weights) and contracted dim (K: a hidden
    dim gathered into the next linear), weight gradients are reduce-scattered; "on" cuts each pair
    into 4 pieces, each piece's matmul reading its own piece's collective, and the original
    collectives and matmuls are gone from the scheduled graph."""
    off = _compile("gpt", (4,), "off", planner="greedy", schedule=False).graph  # unbucketed: original names
    on = _compile("gpt", (4,), "on", planner="greedy").graph
    pairs = on.meta[DECOMPOSED_KEY]
    assert {r.kind for r in pairs} == {"all_gather", "reduce_scatter"}
    assert {d for r in pairs if r.kind == "all_gather" for d in r.dims} == {"M", "N", "K"}
    assert all(r.kept and r.chunks == 4 for r in pairs)
    names_off = {n.name for n in off.graph.nodes}
    names_on = {n.name for n in on.graph.nodes}
    for r in pairs:  # the pair whole without the pass, gone with it
        assert r.collective in names_off and set(r.matmuls) <= names_off
        assert r.collective not in names_on and not set(r.matmuls) & names_on
    assert not _pieces(off)
    for kind, target in (("all_gather", c10d.all_gather_into_tensor.default), ("reduce_scatter", c10d.reduce_scatter_tensor.default)):
        pieces = [n for n in _pieces(on) if n.target is target]
        count = sum(r.kind == kind for r in pairs)
        assert len(pieces) == 4 * count and len({n.meta[PIECE_KEY] for n in pieces}) == 4 * count  # not bucketed
    original = {n.name: info(n).comm for n in off.graph.nodes if n.name in {r.collective for r in pairs}}
    for n in _pieces(on):  # each piece carries a quarter of its original collective's block
        whole, piece = original[n.meta[PIECE_KEY].split(":")[0]], info(n).comm
        assert whole is not None and piece is not None and whole.dim == piece.dim is not None
        assert piece.before.shape[piece.dim] * 4 == whole.before.shape[whole.dim]
        assert piece.before.local_numel((4,)) * 4 == whole.before.local_numel((4,))
    for coll in [n for n in _pieces(on) if n.target is c10d.all_gather_into_tensor.default]:
        seen, frontier, matmuls = set(), [coll], []  # each gathered piece reaches matmul pieces through views
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if MATMUL_FLOPS_KEY in user.meta:
                    matmuls.append(user)
                elif user.target not in (aten.stack.default, aten.view.default) and user not in seen:
                    seen.add(user)
                    frontier.append(user)
        assert matmuls and all(m.target in (aten.mm.default, aten.addmm.default) for m in matmuls)
    matmul_pieces = [n for n in on.graph.nodes if MATMUL_FLOPS_KEY in n.meta]
    assert len(matmul_pieces) == 4 * sum(len(r.matmuls) for r in pairs)
    assert any(n.target is aten.stack.default for n in on.graph.nodes)  # outputs interleaved
    assert any(n.target is aten.cat.default for n in on.graph.nodes)  # scattered pieces concatenated


def test_contracted_pairs_add_partial_products() -> None:
    """The two-linear MLP on (4,), greedy plan: fc1's output is gathered along the hidden dim that
    fc2 contracts. "on" turns fc2's matmul into 4 matmuls, piece c multiplying gathered piece c by
    the rows of the weight that piece holds (a select of piece c of every rank block) and adding
    onto the running sum (`addmm` of the previous piece): a chain whose c-th link reads the c-th
    gather only."""
    on = _compile("two_linear", (4,), "on", planner="greedy").graph
    contracted = [r for r in on.meta[DECOMPOSED_KEY] if "K" in r.dims]
    assert contracted and all(r.kept and r.chunks == 4 for r in contracted)
    gathers = {n.meta[PIECE_KEY]: n for n in _pieces(on) if n.target is c10d.all_gather_into_tensor.default}
    for record in contracted:
        ends = [n for n in on.graph.nodes if MATMUL_FLOPS_KEY in n.meta and not any(MATMUL_FLOPS_KEY in u.meta for u in n.users)]
        chains = []
        for end in ends:  # walk each accumulation back to its first piece
            links = [end]
            while links[-1].target is aten.addmm.default and MATMUL_FLOPS_KEY in getattr(links[-1].args[0], "meta", {}):
                links.append(links[-1].args[0])  # type: ignore[arg-type]
            chains.append(links[::-1])
        chains = [c for c in chains if len(c) == 4]
        assert chains, "no matmul pieces chained by addmm"
        for links in chains:
            for c, link in enumerate(links):
                reads = _collectives_upstream(link)
                assert reads == {gathers[f"{record.collective}:{c}"]}, (c, reads)
                assert any(n.target is aten.select.int and n.args[2] == c for n in _upstream(link, stop=set(links[:c])))


def _upstream(node: fx.Node, stop: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    frontier = [a for a in node.all_input_nodes if a not in stop]
    while frontier:
        n = frontier.pop()
        if n in seen or n in stop or n.op != "call_function":
            continue
        seen.add(n)
        if n.target is c10d.wait_tensor.default:
            seen.add(n.args[0])  # type: ignore[arg-type]
            continue
        frontier.extend(n.all_input_nodes)
    return seen


def _collectives_upstream(link: fx.Node) -> set[fx.Node]:
    """The all-gather pieces a matmul piece reads, not counting the earlier pieces' sum."""
    stop = {link.args[0]} if link.target is aten.addmm.default and isinstance(link.args[0], fx.Node) and MATMUL_FLOPS_KEY in link.args[0].meta else set()
    return {n for n in _upstream(link, stop) if PIECE_KEY in n.meta and n.target is c10d.all_gather_into_tensor.default}


@pytest.mark.parametrize(
    ("key", "shape", "planner", "most"),
    [("two_linear", (4,), "greedy", None), ("gpt", (2, 2), "search", None), ("gpt", (4,), "greedy", 2)],
)
def test_decomposed_programs_equal_undecomposed(
    key: str, shape: tuple[int, ...], planner: str, most: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows and columns cut (M, N) sum each output element over the same contracted length as the
    whole matmul, and each reduce-scatter piece adds the same summands; a contracted dim cut (K)
    adds the k partial products in another order. The programs' loss and gradients equal the
    undecomposed programs' to float32 rounding: within 1e-6 of each tensor's values, or of the
    rank's largest gradient where a gradient sums to zero (its values are rounding noise then).
    `most`: every pair cut into at most that many pieces, fewer than the group's ranks (the counts
    "auto" prices beside the group size), so that each piece's collective holds several rows of
    every rank's block."""
    if most is not None:
        whole = decompose_pairs._pieces
        monkeypatch.setattr(decompose_pairs, "_pieces", lambda rows, g, cap: whole(rows, g, most))
    model, batch = two_linear_case() if key == "two_linear" else make_gpt(0, n_layer=1)
    results = {}
    for mode in ("off", "on"):
        compiled = compile_every_rank(model, shape, batch, planner=planner, decompose_matmuls=mode)
        results[mode] = lockstep_step(compiled, model, shape, batch, {})
        if mode == "on":
            assert {d for r in _decomposed(compiled) for d in r.dims} >= {"K", "M"}
            assert {r.chunks for r in _decomposed(compiled)} == ({most} if most else {max(shape)})
    (fwd_off, bwd_off), (fwd_on, bwd_on) = results["off"], results["on"]
    for c in fwd_off:
        assert torch.allclose(fwd_off[c][0], fwd_on[c][0], rtol=1e-6, atol=0)
        scale = max(float(g.abs().max()) for g in bwd_off[c] if g is not None and g.numel())
        for a, b in zip(bwd_off[c], bwd_on[c]):
            assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-6, atol=1e-6 * scale)


def test_auto_keeps_the_shortest_modeled_step() -> None:
    """"auto" models the step whole and, where some pair prices shorter, with those pairs and with
    every pair decomposed, and keeps the shortest: never longer than "off" (nor than "on" where it
    compared every pair), and the report says what it compared."""
    steps = {}
    for mode in ("off", "on", "auto"):
        compiled = _compile("two_linear", (4,), mode, planner="greedy", hardware="h100-nvlink-ib")
        assert compiled.timelines is not None
        steps[mode] = compiled.timelines[1].step_time
    chosen = compiled.graph.meta[DECOMPOSED_STEPS_KEY]
    assert "whole" in chosen and abs(chosen["whole"] - steps["off"]) <= 1e-9 * steps["off"]
    assert steps["auto"] <= steps["off"] * (1 + 1e-9), steps
    if "every pair" in chosen:
        assert steps["auto"] <= steps["on"] * (1 + 1e-9), steps
    assert abs(steps["auto"] - min(chosen.values())) <= 1e-9 * steps["auto"], (steps, chosen)
    text = str(compiled.report)
    assert "decomposed collective matmuls:" in text and "chosen by the modeled step" in text


def test_the_timeline_pictures_show_the_pieces(tmp_path: Path) -> None:
    """The modeled timeline marks each piece's collective with the collective it stands for, and
    the overlap table, the Chrome trace and the PNG show them apart from whole collectives."""
    compiled = _compile("two_linear", (4,), "on", planner="greedy", hardware="h100-nvlink-ib")
    assert compiled.timelines is not None
    before, after = compiled.timelines
    kept = {r.collective: r.chunks for r in compiled.graph.meta[DECOMPOSED_KEY] if r.kept}
    pieces = [c for c in after.collectives if c.piece]
    assert kept and {c.piece.split(":")[0] for c in pieces} == set(kept)
    for name, chunks in kept.items():
        assert len([c for c in pieces if c.piece.startswith(name + ":")]) == chunks
    assert " piece" in overlap_text(before, after)
    traced = [e for e in chrome_trace(after)["traceEvents"] if e.get("cat") in ("all_gather", "reduce_scatter")]
    assert {e["args"]["piece_of"] for e in traced} >= {c.piece for c in pieces}
    pytest.importorskip("matplotlib")
    write_png(tmp_path / "t.png", after, before)
    assert (tmp_path / "t.png").stat().st_size > 0


def test_decompose_option_is_validated() -> None:
    with pytest.raises(UsageError, match="decompose_matmuls"):
        PlanOptions(decompose_matmuls="yes")
    model, batch = two_linear_case()
    with pytest.raises(UsageError, match="decompose_matmuls"):
        compile_for_rank(model, Mesh.from_shape((2,)), batch, coords=(0,), decompose_matmuls=True)  # type: ignore[arg-type]
    assert PlanOptions().decompose_matmuls == "auto"


def _train_on_gloo(rank: int, world_size: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    serial, batch = make_gpt(0, n_layer=1)
    model, _ = make_gpt(0, n_layer=1)
    pmodel = parallelize(model, mesh, example_inputs=batch, planning=PlanOptions(planner="greedy", decompose_matmuls="on"))
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(2):
        for module, opt in ((serial, opt_s), (pmodel, opt_p)):
            opt.zero_grad()
            loss = module(*batch)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    diff = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters()))
    decomposed = [d.kind for d in pmodel.report.decomposed if d.kept]
    return {"losses": losses, "params": diff, "decomposed": decomposed}


@pytest.mark.multirank
def test_decomposed_gpt_trains_as_serial_on_four_gloo_ranks() -> None:
    for result in run_ranks(4, _train_on_gloo, timeout=600):
        serial, parallel = result["losses"][0::2], result["losses"][1::2]  # type: ignore[index]
        assert all(abs(a - b) < 1e-5 for a, b in zip(serial, parallel)), result
        assert result["params"] < 1e-5, result  # type: ignore[operator]
        assert set(result["decomposed"]) == {"all_gather", "reduce_scatter"}, result  # type: ignore[arg-type]


def test_the_mesh_choices_step_prices_the_decomposition() -> None:
    """`scheduled_step_time`, the step the mesh choice ranks its candidates by, decomposes the
    collective matmuls as the compile does: on GPT-2 small cut to 2 layers on a (2, 2, 8) mesh (H100
    table) some pairs model shorter cut into pieces, so its step with "auto" is shorter than with
    "off" (the default, which the mesh choice uses), each equal to the step of the program
    `compile_for_rank` builds from the same plan with that mode (the compile, which also tries every
    pair decomposed, is never longer). (On (2, 4, 8), since the exchange-first reduce-scatter, the
    search's plan is cheaper by its objective and no pair shortens its scheduled step.)"""
    with torch.device("meta"):  # nothing runs: weights not allocated
        model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=2, n_head=12, n_embd=768))
    idx = torch.zeros(8, 1024, dtype=torch.long)
    mesh = Mesh.from_shape((2, 2, 8))
    gm = trace_for(model, mesh, (idx, idx))
    plan = search_layouts(gm, mesh, default_registry(), cost=TimeCost(HW, mesh.shape))
    steps = {mode: scheduled_step_time(gm, plan, mesh, default_registry(), HW, decompose_matmuls=mode) for mode in ("off", "auto")}
    assert steps["auto"] < steps["off"], steps
    assert steps["off"] == scheduled_step_time(gm, plan, mesh, default_registry(), HW)  # the default
    for mode in ("off", "auto"):
        compiled = compile_for_rank(
            model, mesh, (idx, idx), coords=(0, 0, 0), hardware=HW, decompose_matmuls=mode, agree=lambda g, make: plan
        )
        assert compiled.timelines is not None
        step = compiled.timelines[1].step_time
        if mode == "off":
            assert step == pytest.approx(steps["off"], rel=1e-9)
        else:
            assert step <= steps["auto"] * (1 + 1e-9) and any(r.kept for r in compiled.report.decomposed)


def test_auto_decides_once_for_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" chooses the pairs once per program, not per rank: on a (4,) mesh (H100 table, a GPT
    whose pairs model shorter alone, so every trial runs) the trials' steps are modeled for the
    first rank only, and every rank reports the same pairs, pieces and modeled steps."""
    modeled: list[object] = []
    simulate = decompose_choice.simulate
    monkeypatch.setattr(decompose_choice, "simulate", lambda *a: modeled.append(a) or simulate(*a))
    with torch.device("meta"):  # nothing runs: weights not allocated
        model = GPT(GPTConfig(vocab_size=4096, block_size=256, n_layer=1, n_head=8, n_embd=1024))
    idx = torch.zeros(8, 256, dtype=torch.long)
    compiled = compile_every_rank(model, (4,), (idx, idx), hardware=HW)
    first = compiled[(0,)].graph.meta
    assert len(first[DECOMPOSED_STEPS_KEY]) == 3 and len(modeled) == 3, (first[DECOMPOSED_STEPS_KEY], len(modeled))
    for comp in compiled.values():
        assert comp.graph.meta[DECOMPOSED_KEY] == first[DECOMPOSED_KEY] and comp.report.decomposed
        assert comp.graph.meta[DECOMPOSED_STEPS_KEY] == first[DECOMPOSED_STEPS_KEY]


def _agreed_by_on() -> tuple[object, tuple, tuple[DecomposedPair, ...]]:
    """A small GPT, its batch, and the pairs "on" decomposes on a (2, 2) mesh (records, all kept)."""
    model, batch = make_gpt(0, n_layer=1)
    records = compile_every_rank(model, (2, 2), batch, hardware=HW, decompose_matmuls="on")[(0, 0)].report.decomposed
    assert records and all(r.kept for r in records)
    return model, batch, tuple(records)


def test_every_rank_applies_the_agreed_pairs() -> None:
    """A choice made elsewhere (here: the pairs "on" cuts, handed to "auto" as if rank 0 had chosen
    them) is applied alike on every rank of a (2, 2) mesh: the same collectives cut into the same
    pieces, the same report, and the programs train as serial in lockstep."""
    _, _, records = _agreed_by_on()
    choice = DecompositionChoice(records)
    losses_s, losses_p, grad_diff, param_diff, compiled = _train_in_lockstep(
        lambda: make_gpt(0, n_layer=1), (2, 2), steps=1, hardware=HW, agree_choice=lambda decide, wire: choice
    )
    pieces = {c: [(n.name, n.target) for n in _pieces(comp.graph)] for c, comp in compiled.items()}  # type: ignore[attr-defined]
    assert pieces[(0, 0)] and all(p == pieces[(0, 0)] for p in pieces.values()), pieces
    assert all(tuple(comp.report.decomposed) == records for comp in compiled.values())  # type: ignore[attr-defined]
    assert abs(losses_s[0] - losses_p[0]) < 1e-5 and grad_diff < 2e-5 and param_diff < 1e-5


def test_a_rank_that_cannot_cut_the_agreed_pieces_is_refused() -> None:
    """A rank handed a choice its own block cannot follow (another piece count) raises, naming the
    collective and its source line, before any collective could go unmatched."""
    model, batch, records = _agreed_by_on()
    kept = records[0]
    choice = DecompositionChoice((replace(kept, chunks=kept.chunks + 1), *records[1:]))
    with pytest.raises(AutoparError, match=f"{kept.collective}.*cannot be cut") as err:
        compile_every_rank(model, (2, 2), batch, hardware=HW, agree_choice=lambda decide, wire: choice)
    assert kept.where in str(err.value) and 'decompose_matmuls="off"' in str(err.value)
