"""A custom op's sharding rules, tested the way you would test your own (examples/custom_op.py).

1. Property tests: every strategy the rules offer, on random meshes of 1 to 4 axes, random shapes
   and (through the rules) random layouts, computes the full op when run per rank and assembled.
2. Without the rules, compiling the model fails with MissingRuleError naming the op.
3. With them, every rank's compiled program (compile_for_rank's stages), run together in this
   process with the collectives simulated, gives the serial loss and gradients on a (2, 2, 2) mesh.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from pass_fixtures import run_programs

from autopar.api import compile_for_rank
from autopar.core.errors import MissingRuleError
from autopar.core.layout import Layout, R, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.passes.emit import emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.propagate import propagate
from autopar.passes.schedule import schedule
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.rules.base import AxisStrategy, Strategy, make_call
from autopar.rules.registry import default_registry
from autopar.runtime.program import EmittedProgram
from autopar.testing import all_coords, assemble, check_strategy
from autopar.testing.strategies import (
    candidate_strategies,
    check_random_strategies,
    mesh_shapes,
    random_tensor,
    seeds,
    tensor_shapes,
)
from examples.custom_op import (
    RMS_SCALE,
    RMS_SCALE_BACKWARD,
    ROPE,
    custom_registry,
    make_model,
    rms_scale_rule,
    rope_rule,
)

REGISTRY = custom_registry()
SETTINGS = settings(max_examples=30, deadline=None)
MESH = (2, 2, 2)
EPS = 1e-6


def _gen(data: st.DataObject) -> torch.Generator:
    return torch.Generator().manual_seed(data.draw(seeds()))


# ---------------------------------------------------------------- 1. rules against the oracle


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(), backward=st.booleans())
def test_rms_scale_rules(data: st.DataObject, mesh: tuple[int, ...], backward: bool) -> None:
    g = _gen(data)
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    x = random_tensor(shape, generator=g)
    weight = random_tensor(shape[-1:], generator=g)
    if backward:
        grad = random_tensor(shape, generator=g)
        checked = check_random_strategies(
            data, RMS_SCALE_BACKWARD, (grad, x, weight, EPS), {}, mesh, REGISTRY
        )
    else:
        checked = check_random_strategies(data, RMS_SCALE, (x, weight, EPS), {}, mesh, REGISTRY)
    assert checked


@SETTINGS
@given(data=st.data(), mesh=mesh_shapes(), inverse=st.booleans())
def test_rope_rule(data: st.DataObject, mesh: tuple[int, ...], inverse: bool) -> None:
    g = _gen(data)
    leading = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))  # ..., positions
    x = random_tensor((*leading, data.draw(st.sampled_from([2, 4, 6]))), generator=g)
    offset = data.draw(st.integers(0, 7))
    assert check_random_strategies(data, ROPE, (x, offset, inverse), {}, mesh, REGISTRY)


def _one_axis(op: object, args: tuple, axis: AxisStrategy) -> Strategy:
    call = make_call(op, args, {}, op(*args))  # type: ignore[operator]
    ins = tuple(Layout((p,), s.shape, s.dtype) for p, s in zip(axis.inputs, call.inputs))
    outs = tuple(Layout((p,), s.shape, s.dtype) for p, s in zip(axis.outputs, call.outputs))
    return Strategy(ins, outs)


def test_rules_offer_the_splits_the_oracle_checks() -> None:
    """Not vacuous: on a 2-rank axis, rows and positions can be split, the normalized dim cannot."""
    x, w = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    offered = candidate_strategies(RMS_SCALE, (x, w, EPS), {}, (2,), REGISTRY)
    assert {s.inputs[0].placements for s in offered} == {(Shard(0),), (Shard(1),), (R,)}
    rope_offered = candidate_strategies(ROPE, (x, 3, False), {}, (2,), REGISTRY)
    assert {s.inputs[0].placements for s in rope_offered} >= {(Shard(0),), (Shard(1),)}
    assert (Shard(2),) not in {s.inputs[0].placements for s in rope_offered}


def test_oracle_rejects_wrong_rules() -> None:
    """What the property tests would catch: a split normalized dim, and rope without its offsets."""
    x, w = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    wrong = _one_axis(RMS_SCALE, (x, w, EPS), AxisStrategy((Shard(2), Shard(0)), (Shard(2),)))
    with pytest.raises(AssertionError):
        check_strategy(RMS_SCALE, (x, w, EPS), {}, wrong, (2,), REGISTRY)
    positions = _one_axis(ROPE, (x, 3, False), AxisStrategy((Shard(1),), (Shard(1),)))
    check_strategy(ROPE, (x, 3, False), {}, positions, (2,), REGISTRY)  # with localize_rope: right
    no_localize = default_registry()
    no_localize.register(ROPE, rope_rule, family="mylib")
    with pytest.raises(AssertionError):
        check_strategy(ROPE, (x, 3, False), {}, positions, (2,), no_localize)
    offered = rms_scale_rule(make_call(RMS_SCALE, (x, w, EPS), {}, x))
    assert AxisStrategy((Shard(2), R), (Shard(2),)) not in offered


# ---------------------------------------------------------------- 2. no rule: a clear error


@pytest.mark.parametrize(
    ("registered", "missing"),
    [((), "mylib.rope.default"), ((ROPE, RMS_SCALE), "mylib.rms_scale_backward.default")],
    ids=["no custom rules", "forward rules only"],
)
def test_missing_rule_error_names_the_op(registered: tuple, missing: str) -> None:
    registry = default_registry()
    for op in registered:
        rule = REGISTRY.get(op)
        assert rule is not None
        registry.register(op, rule.strategies, family=rule.family, localize=rule.localize)
    model, batch = make_model(0)
    with pytest.raises(MissingRuleError) as err:
        compile_for_rank(model, Mesh.from_shape(MESH), batch, coords=(0, 0, 0), registry=registry)
    assert err.value.op == missing
    assert f"no sharding rule for {missing}" in str(err.value)
    assert err.value.hint is not None and "registry.register" in err.value.hint
    if not registered:  # forward ops point at the user's line
        assert err.value.where is not None and "custom_op.py" in err.value.where


# ---------------------------------------------------------------- 3. parallel = serial


def _run_all_ranks(
    programs: dict[tuple[int, ...], EmittedProgram], model: torch.nn.Module, batch: tuple
) -> tuple[dict, dict]:
    """Forward then backward of every rank's program in step (pass_fixtures.run_programs)."""
    return run_programs(programs, model, batch, MESH)


def _rank_programs(model: torch.nn.Module, batch: tuple) -> tuple[fx.GraphModule, dict]:
    """compile_for_rank's stages for every rank, tracing and planning once (as pass_fixtures does)."""
    mesh = Mesh.from_shape(MESH)
    traced = trace(model, batch, decompose=True)
    planned = propagate(traced, choose_layouts(traced, mesh, REGISTRY), mesh.shape)
    programs = {}
    for c in all_coords(MESH):
        gm = schedule(insert_comm(copy.deepcopy(planned), mesh, c))
        programs[c] = emit(gm, mesh, REGISTRY, c)
    return planned, programs


def test_parallel_step_matches_serial_on_2x2x2() -> None:
    model, batch = make_model(0)
    planned, programs = _rank_programs(model, batch)
    # the custom ops are split (their rules are used), and rope runs at each rank's own positions
    custom = [n for n in planned.graph.nodes if n.target in (ROPE, RMS_SCALE, RMS_SCALE_BACKWARD)]
    assert len(custom) == 4
    for node in custom:
        strategy = info(node).strategy
        assert strategy is not None and not strategy.inputs[0].is_replicated, node.name
    for c, program in programs.items():
        for phase in (program.forward, program.backward):
            for node in (n for n in phase.graph.nodes if n.target is ROPE):
                layout = info(node).strategy.inputs[0]  # type: ignore[union-attr]
                assert node.args[1] == layout.local_offsets(MESH, c)[1], (c, node.name)

    fwd, bwd = _run_all_ranks(programs, model, batch)
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    for c in all_coords(MESH):
        torch.testing.assert_close(fwd[c][0], loss.detach(), atol=1e-5, rtol=1e-5)
    prog = programs[(0, 0, 0)]
    params = dict(model.named_parameters())
    assert sorted(prog.param_names) == sorted(params)
    for i, (name, lay) in enumerate(zip(prog.param_names, prog.param_layouts)):
        grad = assemble({c: bwd[c][i] for c in bwd}, lay, MESH, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(grad, params[name].grad, atol=2e-5, rtol=1e-4, msg=name)
