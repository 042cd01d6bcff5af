"""`schedule=False` keeps insert_comm's order (each wait right after its collective) and changes no number.

In process: the unscheduled compile leaves every wait immediately after its collective in the joint
graph and in both emitted graphs, while the scheduled one moves waits later; both hold the same
compute nodes. Every rank of (2,2,2) run in lockstep: the two compiles give bit-identical losses and
gradients, and both match the serial model. (Real gloo ranks run the scheduled programs, the
default, in every `parallelize` job: tests/test_parallelize_multirank.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from pass_fixtures import compile_every_rank, gpt_case, gpt_compiled, lockstep_step

import autopar
from autopar.api import compile_for_rank
from autopar.core.collectives import COLLECTIVES
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.testing import assemble
from examples.models import make_gpt

WAIT = torch.ops._c10d_functional.wait_tensor.default
MESH = (2, 2, 2)


def _wait_gaps(gm: fx.GraphModule) -> list[int]:
    """For each collective, how many positions later in the graph its wait comes."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    gaps = []
    for node in nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            (wait,) = node.users
            assert wait.target is WAIT, node.name
            gaps.append(position[wait] - position[node])
    return gaps


# views emit's `passes/view_folds.py` may fold (a reshape of a reshape, a transpose of a transpose),
# which depends on where the collectives' waits stand between them: not the schedule's computation
_FOLDABLE = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.t.default)  # fmt: skip


def _compute_nodes(gm: fx.GraphModule) -> list[str]:
    return sorted(
        n.name for n in gm.graph.nodes if has_info(n) and info(n).role == "compute" and n.target not in _FOLDABLE
    )


def test_unscheduled_waits_follow_their_collectives_and_scheduled_ones_move() -> None:
    model, inputs = gpt_case()
    plain = compile_for_rank(model, Mesh.from_shape(MESH), inputs, coords=(0, 0, 0), schedule=False)
    scheduled, _ = gpt_compiled(MESH, (0, 0, 0))
    for name, gm_plain, gm_sched in (
        ("joint", plain.graph, scheduled.graph),
        ("forward", plain.program.forward, scheduled.program.forward),
        ("backward", plain.program.backward, scheduled.program.backward),
    ):
        gaps = _wait_gaps(gm_plain)
        assert len(gaps) > 10, name  # the GPT on (2,2,2) has hundreds of collectives
        assert set(gaps) == {1}, (name, sorted(set(gaps)))
        assert max(_wait_gaps(gm_sched)) > 1, name  # at least one wait moved past other work
        # the same computation (the schedule stage may merge collectives, never touches compute)
        compute = _compute_nodes(gm_plain)
        assert len(compute) > 10 and compute == _compute_nodes(gm_sched), name
    assert len(_wait_gaps(plain.graph)) == len(plain.report.collectives)
    assert plain.report.schedule is None
    assert scheduled.report.schedule is not None and scheduled.report.schedule.waits_moved > 0


def test_in_flight_cap_defaults_to_the_memory_limits_headroom_over_the_plan() -> None:
    """The schedule may prefetch into what the memory limit leaves after the plan's modeled memory,
    never more: the cap moves one for one with the limit, stays below it, and an explicit
    `in_flight_bytes` wins. A limit below the plan's need leaves no headroom (one in flight)."""
    model, batch = gpt_case()
    mesh = Mesh.from_shape(MESH)

    def cap(**options: Any) -> int:
        compiled = compile_for_rank(
            model, mesh, batch, coords=(0, 0, 0), planner="greedy", hardware="h100-nvlink-ib", **options
        )
        report = compiled.report.schedule
        assert report is not None and report.in_flight_cap is not None
        return int(report.in_flight_cap)

    limit = 2**30
    roomy, roomier = cap(memory_limit=limit), cap(memory_limit=limit + 2**20)
    assert 0 < roomy < limit and roomier - roomy == 2**20
    default = cap()  # 90 % of the table's 80 GB
    assert default - roomy == int(0.9 * 80e9) - limit
    assert cap(in_flight_bytes=12345) == 12345
    need = limit - roomy  # the plan's modeled bytes per rank
    with pytest.raises(autopar.MemoryLimitError):  # the greedy plan cannot shrink below it
        cap(memory_limit=need // 4)


def test_scheduled_and_unscheduled_are_bitwise_equal_and_serial() -> None:
    model, batch = make_gpt(0, n_layer=1)
    steps = {}
    for flag in (True, False):
        compiled = compile_every_rank(model, MESH, batch, schedule=flag)
        steps[flag] = (compiled, *lockstep_step(compiled, model, MESH, batch, {}))
    (compiled, fwd, bwd), (_, plain_fwd, plain_bwd) = steps[True], steps[False]
    program = next(iter(compiled.values())).program
    assert next(iter(steps[False][0].values())).program.param_names == program.param_names
    grads = range(len(program.param_names))
    for c in compiled:
        assert torch.equal(fwd[c][0], plain_fwd[c][0]), c
        assert all(torch.equal(bwd[c][i], plain_bwd[c][i]) for i in grads), c
    torch.manual_seed(0)  # as lockstep_step seeds the ranks' forward
    serial_loss = model(*batch)
    serial_loss.backward()
    params = dict(model.named_parameters())
    for c in compiled:
        assert float(fwd[c][0]) == pytest.approx(float(serial_loss), rel=1e-5, abs=1e-6), c
    compared: set[str] = set()
    for i, (name, layout) in enumerate(zip(program.param_names, program.param_layouts)):
        part = program.param_parts.get(name)  # a chunk of a fused parameter (split_fused)
        source = part.source if part is not None else name
        if source not in params:  # a buffer
            continue
        grad, want = assemble({c: bwd[c][i] for c in compiled}, layout, MESH), params[source].grad
        assert want is not None
        want = part.of(want) if part is not None else want
        assert float((grad - want).abs().max() / (want.abs().max() + 1e-6)) < 1e-4, name
        compared.add(source)
    assert compared == set(params)
