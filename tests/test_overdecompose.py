"""Over-decomposition: each rank's batch in chunks, one graph running them all, equal to serial."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
from pass_fixtures import all_coords, compile_every_rank, model_case, run_programs

from autopar.api import compile_for_rank
from autopar.compiler import driver
from autopar.compiler.chunk_choice import OVER_DECOMPOSITION, ChunkChoice
from autopar.compiler.driver import Compiled
from autopar.core.collectives import COLLECTIVES
from autopar.core.errors import AutoparError
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.planning.overdecompose import OverDecompositionError
from autopar.testing import assemble
from examples.models import GPT, GPTConfig

c10d = torch.ops._c10d_functional


@functools.cache
def _every_rank(key: str, shape: tuple[int, ...], chunks: int) -> dict[tuple[int, ...], Compiled]:
    """Every rank's program as a job compiles them (`compile_every_rank`: one trace, rank 0's plan,
    each distinct lowered graph scheduled once), shared by this file's tests of the same case."""
    model, inputs = model_case(key)
    return compile_every_rank(model, shape, inputs, over_decompose=chunks)


def _compiled(key: str, shape: tuple[int, ...], chunks: int, coords: tuple[int, ...]) -> Compiled:
    return _every_rank(key, shape, chunks)[coords]


def _step(key: str, shape: tuple[int, ...], chunks: int) -> tuple[list[float], float, float]:
    """Losses of every rank, the serial loss, and the worst gradient error relative to serial."""
    model, inputs = model_case(key)
    programs = {c: _compiled(key, shape, chunks, c).program for c in all_coords(shape)}
    fwd, bwd = run_programs(programs, model, inputs, shape)
    params = dict(model.named_parameters())
    model.zero_grad()
    serial = model(*inputs)
    serial.backward()
    first = next(iter(programs.values()))
    worst = 0.0
    grads = {name: p.grad for name, p in params.items()}
    for i, (name, layout) in enumerate(zip(first.param_names, first.param_layouts)):
        got = assemble({c: bwd[c][i] for c in programs}, layout, shape)
        want = first.param_value(name, grads)
        assert want is not None
        worst = max(worst, float((got - want).abs().max() / (want.abs().max() + 1e-4)))
    return [float(out[0]) for out in fwd.values()], float(serial.detach()), worst


@pytest.mark.parametrize(("key", "shape", "chunks"), [("gpt1", (2, 2, 2), 2), ("mlp", (2, 2), 2)])
def test_chunked_programs_equal_serial_on_every_rank(key: str, shape: tuple[int, ...], chunks: int) -> None:
    losses, serial, grad_err = _step(key, shape, chunks)
    assert all(loss == pytest.approx(serial, rel=1e-6) for loss in losses)
    assert grad_err < 1e-5
    assert _compiled(key, shape, chunks, (0,) * len(shape)).chunks == chunks


def _collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]


@functools.cache
def _unscheduled() -> Compiled:
    """Rank (0, 0, 0)'s two-chunk GPT layer on 2x2x2 before scheduling: the graph as merged and
    ordered by chunks (read, never changed, by the two tests below)."""
    model, inputs = model_case("gpt1")
    return compile_for_rank(model, Mesh.from_shape((2, 2, 2)), inputs, coords=(0, 0, 0), over_decompose=2, schedule=False)


def test_merged_graph_runs_each_chunk_and_shares_what_is_whole() -> None:
    compiled = _unscheduled()
    gm = compiled.graph
    assert compiled.graph_mesh is not None and compiled.graph_mesh.shape == (2, 2, 2, 2)
    assert str(compiled.graph_mesh).endswith("chunk=2 in-process)")
    colls = _collectives(gm)
    assert colls and not [n for n in colls if "<chunk>" in str(n.args[-1])]  # chunk axis: local ops only
    by_chunk = {c: [n for n in colls if info(n).chunk == c] for c in (None, 0, 1)}
    # activations: every chunk runs its own collectives, the same ones
    assert by_chunk[0] and len(by_chunk[0]) == len(by_chunk[1])
    assert [info(n).comm.kind for n in by_chunk[0]] == [info(n).comm.kind for n in by_chunk[1]]  # type: ignore[union-attr]
    # weight gathers are shared; every gradient leaves the rank once, summed over the chunks first
    shared = by_chunk[None]
    assert any(info(n).phase == "forward" and info(n).comm.kind == "all_gather" for n in shared)  # type: ignore[union-attr]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    grads = output.args[0][compiled.graph.meta["autopar_signature"].num_user_outputs :]  # type: ignore[index]
    for grad in grads:
        if isinstance(grad, fx.Node) and has_info(grad):
            assert info(grad).chunk is None, grad.name
    sums = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and info(n).chunk is None]
    assert sums  # the chunks' partial gradients (and the loss) added in memory


def test_forward_chunks_take_whole_segments_in_turn() -> None:
    """Chunk 0 runs all its forward work between two of its waits before chunk 1 runs the same
    segment, so chunk 0's collective can overlap the whole of chunk 1's segment (zipped node by
    node, it overlapped only chunk 1's last node); the backward stays zipped."""
    gm = _unscheduled().graph
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and has_info(n)]
    depth: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:  # waits on the longest path to the node
        depth[n] = max((depth[i] for i in n.all_input_nodes), default=0) + int(
            n.target is c10d.wait_tensor.default
        )
    forward = [n for n in nodes if info(n).phase == "forward" and info(n).chunk is not None]
    segments = sorted({depth[n] for n in forward})
    assert len(segments) >= 4
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for segment in segments:
        places = {
            c: [position[n] for n in forward if depth[n] == segment and info(n).chunk == c] for c in (0, 1)
        }
        assert places[0] and places[1] and max(places[0]) < min(places[1]), segment
    # backward: still node by node, chunk 1's copy of a node right after chunk 0's
    backward = [n for n in nodes if info(n).phase == "backward" and info(n).chunk is not None]
    pairs = [(a, b) for a, b in zip(backward, backward[1:]) if b.name == a.name.replace("_c0", "_c1")]
    assert len(pairs) >= len(backward) // 3


def test_schedule_overlaps_one_chunks_collectives_with_the_others_compute() -> None:
    gm = _compiled("gpt1", (2, 2, 2), 2, (0, 0, 0)).graph
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    overlapped = 0
    for coll in [n for n in _collectives(gm) if info(n).chunk == 0]:
        wait = next(iter(coll.users))
        overlapped += any(
            order[coll] < order[n] < order[wait] and info(n).role == "compute" and info(n).chunk == 1
            for n in gm.graph.nodes
            if n.op == "call_function" and has_info(n)
        )
    assert overlapped >= 2


def test_the_interface_stays_on_the_device_mesh() -> None:
    program = _compiled("gpt1", (2, 2, 2), 2, (1, 0, 1)).program
    assert program.coords == (1, 0, 1)
    for layout in [*program.param_layouts, *program.input_layouts, *program.output_layouts]:
        assert len(layout.placements) == 3


def test_a_batch_the_chunks_do_not_divide_is_refused_by_name() -> None:
    model, inputs = model_case("gpt1")  # batch 8 on 8 ranks: one row each
    with pytest.raises(OverDecompositionError) as err:
        compile_for_rank(model, Mesh.from_shape((8,)), inputs, over_decompose=2)
    text = str(err.value)
    assert "batch chunks" in text and "at:" in text and "over_decompose=1" in text
    with pytest.raises(AutoparError, match="over_decompose"):
        compile_for_rank(model, Mesh.from_shape((2, 2, 2)), inputs, over_decompose=0)


def test_auto_keeps_the_fastest_modeled_step() -> None:
    """A GPT layer of the overlap benchmark's shape on one H100 node (1x2x4), greedy plan: two
    chunks hide forward tensor-parallel collectives behind the other chunk's compute; four do not
    fit the batch."""
    cfg = GPTConfig(vocab_size=512, block_size=2048, n_layer=1, n_head=32, n_embd=4096)
    with torch.device("meta"):
        model = GPT(cfg)
    inputs = (torch.zeros(8, 2048, dtype=torch.long), torch.zeros(8, 2048, dtype=torch.long))
    compiled = compile_for_rank(
        model,
        Mesh.from_shape((1, 2, 4)),
        inputs,
        over_decompose="auto",
        hardware="h100-nvlink-ib",
        planner="greedy",  # its plan leaves forward collectives on the critical path for chunks to hide
    )
    times = compiled.chunk_step_times
    assert times is not None and set(times) == {1, 2}  # 4 chunks do not divide the per-rank batch
    assert compiled.chunks == 2 and times[2] < times[1]
    assert compiled.timelines is not None
    assert compiled.timelines[1].step_time == pytest.approx(times[2], rel=1e-9)


def test_auto_decides_once_for_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" chooses the chunk count once per program, not per rank: on a (2, 2) mesh the counts
    are lowered, scheduled and modeled for the first rank only, and every rank runs the count it
    chose, with the same modeled steps reported."""
    trials: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    step_times = driver.chunk_step_times
    monkeypatch.setattr(
        driver, "chunk_step_times", lambda *a: trials.append((a[4], tuple(a[5]))) or step_times(*a)
    )
    model, inputs = model_case("mlp")
    compiled = compile_every_rank(model, (2, 2), inputs, over_decompose="auto")
    compared = [(coords, counts) for coords, counts in trials if len(counts) > 1]
    assert compared == [((0, 0), (1, 2, 4))], trials
    first = compiled[(0, 0)]
    assert first.chunk_step_times is not None and set(first.chunk_step_times) == {1, 2}  # 4 do not fit the batch
    for comp in compiled.values():
        assert (comp.chunks, comp.chunk_step_times) == (first.chunks, first.chunk_step_times)


def test_every_rank_runs_the_agreed_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A count chosen elsewhere (two chunks, as if rank 0 had modeled them fastest) is run by every
    rank of a (2, 2) mesh without trials of its own, and the programs equal serial."""
    monkeypatch.setattr(driver, "chunk_step_times", lambda *a: pytest.fail("a rank ran the trials itself"))
    agreed = ChunkChoice(2, ((1, 2.0), (2, 1.0)))
    model, inputs = model_case("mlp")
    compiled = compile_every_rank(
        model, (2, 2), inputs, over_decompose="auto",
        agree_choice=lambda decide, wire: agreed if wire is OVER_DECOMPOSITION else decide(),
    )  # fmt: skip
    assert all(c.chunks == 2 and c.chunk_step_times == {1: 2.0, 2: 1.0} for c in compiled.values())
    fwd, bwd = run_programs({c: comp.program for c, comp in compiled.items()}, model, inputs, (2, 2))
    model.zero_grad()
    serial = model(*inputs)
    serial.backward()
    assert all(float(out[0]) == pytest.approx(float(serial.detach()), rel=1e-6) for out in fwd.values())
    first = compiled[(0, 0)].program
    grads = {name: p.grad for name, p in model.named_parameters()}
    for i, (name, layout) in enumerate(zip(first.param_names, first.param_layouts)):
        want = first.param_value(name, grads)
        assert want is not None
        got = assemble({c: bwd[c][i] for c in compiled}, layout, (2, 2))
        assert float((got - want).abs().max()) <= 1e-5 * (float(want.abs().max()) + 1e-4), name
