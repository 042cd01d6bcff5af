"""Fixed comparison plans (autopar.planning.fixed): the linears found, the closed-form volumes, numbers.

On the two-linear MLP of the insert_comm tests (T = 64 tokens, h = 64, width 4h, no biases, loss
sum((y - t)^2)) each scheme's emitted collectives add up exactly to its closed form in
autopar.cost.symbolic / comm_volumes.md, in the "kept" variant (gathered operands are reused in
backward) and without the terms of fc1's input (a replicated user input: nothing to gather, no
input gradient). Every rank's program is run in lockstep and matches the serial model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch.fx as fx
from pass_fixtures import H, T, assert_matches_serial, gpt_case, run_programs, two_linear_case

from autopar.compiler.driver import graph_fingerprint
from autopar.compiler.fixed import compile_fixed
from autopar.core.meta import has_info, info
from autopar.cost import symbolic
from autopar.passes.emit import emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.propagate import propagate
from autopar.passes.schedule import schedule
from autopar.passes.trace import trace
from autopar.planning.fixed import FixedPlan, find_linears, pair_linears, plan_fixed, split_letters
from autopar.rules.registry import default_registry
from autopar.runtime.program import EmittedProgram
from autopar.testing import all_coords

REGISTRY = default_registry()


@functools.cache
def _traced(key: str) -> fx.GraphModule:
    model, inputs = two_linear_case() if key == "mlp" else gpt_case()
    return trace(model, inputs, decompose=True)


@functools.cache
def _fixed(key: str, p: int) -> FixedPlan:
    return plan_fixed(_traced("mlp"), key, p, REGISTRY)


@functools.cache
def _programs(key: str, p: int) -> dict[tuple[int, ...], EmittedProgram]:
    """Every rank's program of the fixed plan, from one propagated copy of the traced graph."""
    fixed = _fixed(key, p)
    assert fixed.scheme is not None and fixed.plan is not None, fixed.infeasible
    mesh = fixed.scheme.mesh()
    plan = fixed.plan
    done = propagate(copy.deepcopy(_traced("mlp")), plan, mesh.shape)
    out = {}
    for coords in all_coords(mesh.shape):
        gm = schedule(insert_comm(copy.deepcopy(done), mesh, coords), mesh)
        out[coords] = emit(gm, mesh, REGISTRY, coords)
    return out


def _volume(key: str, p: int) -> tuple[float, int]:
    """(elements sent per rank by collectives of non-scalar tensors, number of scalar collectives)."""
    fixed = _fixed(key, p)
    assert fixed.scheme is not None
    shape = fixed.scheme.mesh_shape
    program = _programs(key, p)[(0,) * len(shape)]
    total, scalars = 0.0, 0
    for gm in (program.forward, program.backward):
        for node in gm.graph.nodes:
            step = info(node).comm if has_info(node) else None
            if step is None or not step.is_collective:
                continue
            if len(step.before.shape) == 0:
                scalars += 1
            else:
                total += step.elements_sent(shape)
    return total, scalars


def _forward_letters(key: str, p: int) -> dict[str, tuple[str, ...]]:
    fixed = _fixed(key, p)
    assert fixed.plan is not None
    gm = _traced("mlp")
    nodes = {n.name: n for n in gm.graph.nodes}
    out = {}
    for lin in find_linears(gm):
        fwd = lin.products[0]
        out[lin.module] = split_letters(fixed.plan.strategies[fwd.node], fwd, nodes[fwd.node].target)
    return out


def test_linears_their_products_and_pairs() -> None:
    gm = _traced("mlp")
    fc1, fc2 = find_linears(gm)
    assert (fc1.param, fc1.tokens, fc1.k, fc1.n) == ("fc1.weight", T, H, 4 * H)
    assert (fc2.param, fc2.tokens, fc2.k, fc2.n) == ("fc2.weight", T, 4 * H, H)
    # fc1: forward and weight gradient (its input is a user input: no input gradient)
    assert [p.letters for p in fc1.products] == [("T", "k", "n"), ("n", "T", "k")]
    # fc2: forward, input gradient dY @ W, weight gradient dY^T @ X
    assert [p.letters for p in fc2.products] == [("T", "k", "n"), ("T", "n", "k"), ("n", "T", "k")]
    assert pair_linears(gm, [fc1, fc2]) == [((fc1,), fc2)]


def test_megatron_1d_volume_is_the_closed_form() -> None:
    p = 4
    fixed = _fixed("megatron_1d", p)
    assert fixed.scheme is not None and fixed.scheme.mesh_shape == (p,)
    assert _forward_letters("megatron_1d", p) == {"fc1": ("n",), "fc2": ("k",)}
    total, scalars = _volume("megatron_1d", p)
    # one all-reduce of fc2's output (as reduce-scatter + all-gather); no weight moves at all
    assert total == symbolic.megatron_1d(T, H, p) / 4
    assert scalars == 1  # the loss


def test_summa_2d_volume_is_the_closed_form() -> None:
    p = 4
    fixed = _fixed("summa_2d", p)
    assert fixed.scheme is not None
    grid = (2, 2)
    pr, pc = grid
    letters = _forward_letters("summa_2d", p)
    assert letters["fc1"] == letters["fc2"] and sorted(letters["fc1"]) == ["T", "n"]
    total, _ = _volume("summa_2d", p)
    kept = 2 / 3 * (symbolic.summa_2d_linear(T, H, 4 * H, grid) + symbolic.summa_2d_linear(T, 4 * H, H, grid))
    fc1_input = 2 * (pc - 1) * T * H / p  # gather of fc1's input and reduce-scatter of its gradient
    assert total == pytest.approx(kept - fc1_input, rel=1e-12)
    assert pr * pc == p


def test_cube_3d_volume_is_the_closed_form() -> None:
    p, q = 8, 2
    fixed = _fixed("cube_3d", p)
    assert fixed.scheme is not None and fixed.scheme.mesh_shape == (q, q, q)
    letters = _forward_letters("cube_3d", p)
    assert sorted(letters["fc1"]) == sorted(letters["fc2"]) == ["T", "k", "n"]
    # the second linear swaps the contraction and output axes; tokens stay on one axis
    token_axis = letters["fc1"].index("T")
    assert letters["fc2"][token_axis] == "T"
    assert {(a, b) for a, b in zip(letters["fc1"], letters["fc2"]) if a != "T"} == {("k", "n"), ("n", "k")}
    total, _ = _volume("cube_3d", p)
    closed = symbolic.cube_3d_linear(T, H, 4 * H, p) + symbolic.cube_3d_linear(T, 4 * H, H, p)
    fc1_input = 2 * (q - 1) / q**3 * T * H
    assert total == pytest.approx(closed - fc1_input, rel=1e-12)


@pytest.mark.parametrize(("key", "p"), [("megatron_1d", 4), ("summa_2d", 4), ("cube_3d", 8)])
def test_fixed_plans_compute_the_serial_model(key: str, p: int) -> None:
    model, inputs = two_linear_case()
    programs = _programs(key, p)
    fixed = _fixed(key, p)
    assert fixed.scheme is not None
    shape = fixed.scheme.mesh_shape
    fwd, bwd = run_programs(programs, model, inputs, shape)
    prog = programs[(0,) * len(shape)]
    assert_matches_serial(prog, fwd, bwd, model, inputs, shape, loss_tol=(1e-4, 1e-5), grad_tol=(1e-4, 1e-4))


def test_compile_fixed_goes_through_the_whole_compiler() -> None:
    model, inputs = two_linear_case()
    fixed = _fixed("cube_3d", 8)
    compiled = compile_fixed(
        model, inputs, fixed, traced_fingerprint=graph_fingerprint(_traced("mlp")), registry=REGISTRY
    )
    total = sum(c.elements for c in compiled.report.collectives if not c.layout_before.startswith("f32[]"))
    assert total == _volume("cube_3d", 8)[0]
    assert all(compiled.graph.meta["autopar_roles"][a] == r for a, r in enumerate(fixed.scheme.roles))  # type: ignore[union-attr]


def test_a_changed_graph_is_refused() -> None:
    model, inputs = two_linear_case()
    with pytest.raises(Exception, match="another graph"):
        compile_fixed(model, inputs, _fixed("cube_3d", 8), traced_fingerprint="0" * 64, registry=REGISTRY)


def test_infeasible_schemes_say_why() -> None:
    gpt = _traced("gpt")  # 4 heads, batch 8
    megatron = plan_fixed(gpt, "megatron_1d", 8, REGISTRY)
    assert megatron.plan is None and megatron.infeasible is not None
    assert "heads 4 % 8 != 0" in megatron.infeasible
    relaxed = plan_fixed(gpt, "megatron_1d", 8, REGISTRY, require_heads=False)
    assert relaxed.plan is not None and relaxed.scheme is not None and "heads 4 % 8" in relaxed.scheme.note
    assert "q^3" in (plan_fixed(gpt, "cube_3d", 4, REGISTRY).infeasible or "")
    assert "p = 2" in (plan_fixed(gpt, "summa_2d", 2, REGISTRY).infeasible or "")
    mlp = plan_fixed(_traced("mlp"), "cube_3d", 64, REGISTRY)  # h = 64 splits 4 ways, but the batch 64 ...
    assert mlp.plan is not None  # ... divides by q = 4: feasible


def test_gpt_pairs_are_attention_and_mlp() -> None:
    gm = _traced("gpt")
    linears = find_linears(gm)
    modules = [lin.module for lin in linears]
    # the LM head is tied to the token embedding: not a plain linear
    assert modules == [
        f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]
    pairs = pair_linears(gm, linears)
    assert [
        (tuple(a.module.split(".")[-1] for a in firsts), b.module.split(".")[-1]) for firsts, b in pairs
    ] == [
        (("qkv",), "proj"),
        (("fc",), "proj"),
    ] * 2
    cube = plan_fixed(gm, "cube_3d", 8, REGISTRY)
    assert cube.plan is not None and cube.variants == 6
    for firsts, b in pairs:  # every product of a paired linear is forced
        for lin in (*firsts, b):
            assert all(prod.node in cube.forced for prod in lin.products)
            assert len(lin.products) == 3
