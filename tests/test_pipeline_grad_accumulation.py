"""Gradient reduction once per pipeline step (docs/pipeline.md#gradient-reduction-once-per-step):
a stage planned on a sub-mesh with a data axis accumulates its weight gradients unreduced over the
step's microbatches and runs the reduction collectives once, after its last backward. Loss, every
gradient and the parameters after two SGD-with-momentum steps equal serial (pp=2 x dp=2, M=4,
4 gloo ranks), and each stage's reductions run once per step, not once per microbatch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx as fx
from multirank import run_ranks, train_side_by_side
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime.defer_reduction import GradAccumulation, ReductionSplit, owned_buffers, split_reductions
from autopar.runtime.split_backward import is_collective
from examples.models import make_gpt

TOL = {"rtol": 1e-4, "atol": 1e-6}
M = 4


def _collectives(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_collective(n))


def _pp2_dp2(rank: int, world: int) -> dict[str, Any]:
    """Two training steps of a 2-layer GPT on pp=2 x dp=2 beside serial; what the reductions did."""
    model, batch = make_gpt(0, batch_size=8, n_layer=2)
    serial = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, microbatches=M, schedule="1f1b")
    runs = {"local": 0, "reduce": 0}
    splits: list[ReductionSplit] = []
    run_local, run_reduce = ReductionSplit.run_local, ReductionSplit.run_reduce

    def counting_local(self: ReductionSplit, *args: Any) -> Any:
        runs["local"] += 1
        if self not in splits:
            splits.append(self)
        return run_local(self, *args)

    def counting_reduce(self: ReductionSplit, *args: Any) -> Any:
        runs["reduce"] += 1
        return run_reduce(self, *args)

    ReductionSplit.run_local = counting_local  # type: ignore[method-assign]  # this rank's process only
    ReductionSplit.run_reduce = counting_reduce  # type: ignore[method-assign]
    try:
        losses = train_side_by_side([(pmodel, batch), (serial, batch)], steps=2)
    finally:
        ReductionSplit.run_local = run_local  # type: ignore[method-assign]
        ReductionSplit.run_reduce = run_reduce  # type: ignore[method-assign]
    for step in range(2):
        torch.testing.assert_close(losses[2 * step], losses[2 * step + 1], **TOL)
    ref = dict(serial.named_parameters())
    for name, p in pmodel.named_parameters():
        whole = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(whole, ref[name].grad, **TOL, msg=f"grad {name}")
        value = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        torch.testing.assert_close(value, ref[name].detach(), **TOL, msg=f"param {name}")
    return {
        "runs": runs,
        "stages": len(pmodel.stages),
        "reductions": [s.num_reductions for s in splits],
    }


@pytest.mark.multirank
def test_pp2_by_dp2_reduces_gradients_once_per_step_and_equals_serial() -> None:
    """A 2-layer GPT, M=4 (its stage plans mix data and tensor layouts: the weight-gradient
    reductions run once per step; activation-gradient collectives that feed weight-gradient
    matmuls stay in each microbatch's backward, as they must)."""
    for result in run_ranks(4, _pp2_dp2, timeout=300):
        # one program per stage (one microbatch shape): per step M local parts, one reduction
        assert result["runs"] == {"local": 2 * M * result["stages"], "reduce": 2 * result["stages"]}
        # the data axis makes weight gradients Partial: their reductions left the local part
        assert all(r > 0 for r in result["reductions"]), result


def _backward(nonlinear: bool) -> fx.GraphModule:
    """(saved x, weight w, tangent g) -> (grad of w: all_reduce(x^T g), grad of the input: g w^T);
    `nonlinear`: the weight gradient is x^T all_reduce(g) instead (a saved value times a reduced
    one: the sum over microbatches does not commute with it)."""
    graph = fx.Graph()
    x, w, g = graph.placeholder("saved_x"), graph.placeholder("saved_w"), graph.placeholder("tangent")
    c10d = torch.ops._c10d_functional
    aten = torch.ops.aten
    xt = graph.call_function(aten.t.default, (x,))
    if nonlinear:
        reduced = graph.call_function(c10d.all_reduce.default, (g, "sum", "0"))
        waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
        grad_w = graph.call_function(aten.mm.default, (xt, waited))
    else:
        local = graph.call_function(aten.mm.default, (xt, g))
        reduced = graph.call_function(c10d.all_reduce.default, (local, "sum", "0"))
        grad_w = graph.call_function(c10d.wait_tensor.default, (reduced,))
    grad_w = graph.call_function(aten.mul.Tensor, (grad_w, 0.5))
    grad_x = graph.call_function(aten.mm.default, (g, graph.call_function(aten.t.default, (w,))))
    graph.output((grad_w, grad_x))
    return fx.GraphModule(torch.nn.Module(), graph)


class _Program:
    def __init__(self, backward: fx.GraphModule) -> None:
        self.backward = backward
        self.param_names = ["w"]
        self.num_saved = 2


def test_the_cut_moves_linear_reductions_and_keeps_the_others() -> None:
    """In process, on hand-made backwards: x^T g reduced then halved goes to the reduction part
    (the local part returns x^T g, a sum over microbatches of which reduces to the same); x^T
    all_reduce(g) stays local whole (a tensor factor after the reduction is not linear in a sum)."""
    linear = split_reductions(_Program(_backward(nonlinear=False)))  # type: ignore[arg-type]
    assert (linear.num_reductions, _collectives(linear.local_part), linear.num_frontier) == (1, 0, 1)
    x, w, g = torch.randn(3, 2), torch.randn(2, 4), torch.randn(3, 4)
    grad_x, (frontier,) = linear.run_local((x, w), (g,))
    torch.testing.assert_close(frontier, x.t() @ g)  # the unreduced gradient, before the halving
    torch.testing.assert_close(grad_x[0], g @ w.t())
    kept = split_reductions(_Program(_backward(nonlinear=True)))  # type: ignore[arg-type]
    assert (kept.num_reductions, _collectives(kept.local_part), _collectives(kept.reduce_part)) == (0, 1, 0)


def test_accumulation_adds_in_place_into_buffers_it_owns() -> None:
    """In process: a step's microbatch terms are added into one buffer per frontier value (the
    first microbatch's own result), not rebuilt by `a + b` each microbatch; a part of a larger
    storage, a value sharing another's storage (or an input gradient's, an argument's) and a value
    that is the backward's own argument are copied first, so nothing the caller still reads
    changes; a view spanning its whole base is not."""
    program = _Program(_backward(nonlinear=False))
    terms = [torch.randn(2, 4) for _ in range(3)]
    first = terms[0].clone()
    accumulation = GradAccumulation()
    for term in terms:
        accumulation.add(program, [term], (), None)  # type: ignore[arg-type]
    (found,) = accumulation.by_program.values()
    assert found.sums[0] is terms[0]  # one buffer for the whole step
    torch.testing.assert_close(found.sums[0], first + terms[1] + terms[2])
    base, argument, plain = torch.randn(4, 4), torch.randn(3), torch.randn(3)
    owned = owned_buffers([base[:2], base[2:], argument, plain], frozenset({2}))
    assert [o is v for o, v in zip(owned, [base[:2], base[2:], argument, plain])] == [False, False, False, True]
    assert owned[3] is plain and all(o._base is None for o in owned)
    owned[0].add_(1.0)
    owned[2].add_(1.0)
    assert not torch.equal(owned[0], base[:2]) and not torch.equal(owned[2], argument)
    # a view spanning its whole base (a weight gradient made as `t()` of a matmul) is kept as it
    # is; one whose storage an input gradient or an argument of the backward shares is copied
    spanning, sent = torch.randn(4, 3).t(), torch.randn(6)
    whole_view, also_sent = torch.randn(3, 2).view(6), sent.view(2, 3)
    contiguous_view = torch.randn(2, 6).view(12)
    owned = owned_buffers([spanning, contiguous_view, whole_view, also_sent], others=[sent, whole_view])
    assert [o is v for o, v in zip(owned, [spanning, contiguous_view, whole_view, also_sent])] == [
        False, True, False, False,
    ]  # fmt: skip  (the transpose is not contiguous; the others' storage is someone else's)


def test_a_buckets_concatenation_moves_to_the_reduction_part() -> None:
    """In process: two weight gradients flattened and concatenated into one bucket before its
    all_reduce: the local part returns the two gradients (the step sums them), and the flattening
    and the concatenation run once per step in the reduction part, not in every microbatch's."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    graph = fx.Graph()
    x1, x2, g = graph.placeholder("saved_x1"), graph.placeholder("saved_x2"), graph.placeholder("tangent")
    grads = [graph.call_function(aten.mm.default, (graph.call_function(aten.t.default, (x,)), g)) for x in (x1, x2)]
    flat = [graph.call_function(aten.view.default, (w, [-1])) for w in grads]
    bucket = graph.call_function(aten.cat.default, (flat,))
    reduced = graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_reduce.default, (bucket, "sum", "0")),))
    outs = [graph.call_function(aten.view.default, (graph.call_function(aten.slice.Tensor, (reduced, 0, 8 * i, 8 * i + 8)), [2, 4])) for i in range(2)]
    graph.output((*outs, graph.call_function(aten.mul.Tensor, (g, 2.0))))

    class Program:
        backward = fx.GraphModule(torch.nn.Module(), graph)
        param_names = ["w1", "w2"]
        num_saved = 2

    split = split_reductions(Program())  # type: ignore[arg-type]
    local_ops = [n.target for n in split.local_part.graph.nodes]
    reduce_ops = [n.target for n in split.reduce_part.graph.nodes]
    assert aten.cat.default not in local_ops and aten.cat.default in reduce_ops
    assert split.num_frontier == 2 and split.num_reductions == 1
    xa, xb, tangent = torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 4)
    _, frontier = split.run_local((xa, xb), (tangent,))
    torch.testing.assert_close(frontier, [xa.t() @ tangent, xb.t() @ tangent])


def test_later_microbatches_add_each_term_into_its_sum_as_the_backward_makes_it() -> None:
    """In process: from the second microbatch on, each weight gradient the local part computes is
    added into the step's sum before the next one is computed (a probe between the two sees the
    first sum already grown), and the sum stands in its place: the backward holds the sums and one
    term, not every term beside the sums (docs/pipeline.md#a-pipelined-ranks-memory)."""
    aten = torch.ops.aten
    seen: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []

    def probe(g: torch.Tensor) -> torch.Tensor:  # runs between the two gradients, in graph order
        if sums:
            seen.append(sums[0].clone())
        return g

    graph = fx.Graph()
    x1, x2, g = graph.placeholder("saved_x1"), graph.placeholder("saved_x2"), graph.placeholder("tangent")
    grad1 = graph.call_function(aten.mm.default, (graph.call_function(aten.t.default, (x1,)), g))
    later = graph.call_function(probe, (g,))
    grad2 = graph.call_function(aten.mm.default, (graph.call_function(aten.t.default, (x2,)), later))
    graph.output((grad1, grad2, graph.call_function(aten.mul.Tensor, (g, 2.0))))

    class Program:
        backward = fx.GraphModule(torch.nn.Module(), graph)
        param_names = ["w1", "w2"]
        num_saved = 2

    program = Program()
    accumulation = GradAccumulation()
    split = accumulation.split(program)  # type: ignore[arg-type]
    batches = [(torch.randn(3, 2), torch.randn(3, 4), torch.randn(3, 5)) for _ in range(3)]
    for x1_, x2_, g_ in batches:
        into = accumulation.sums_of(program)  # type: ignore[arg-type]
        (grad_x,), frontier = split.run_local((x1_, x2_), (g_,), into)
        torch.testing.assert_close(grad_x, 2.0 * g_)
        if into is None:
            sums.extend(frontier)  # the first microbatch's terms become the sums
        else:
            assert frontier[0] is into[0] and frontier[1] is into[1]  # added already, in place
            torch.testing.assert_close(seen[-1], into[0])  # the first sum grew before grad2 existed
        accumulation.add(program, frontier, (), None)  # type: ignore[arg-type]  # (added once, not twice)
    torch.testing.assert_close(sums[0], sum(x1_.t() @ g_ for x1_, _, g_ in batches))
    torch.testing.assert_close(sums[1], sum(x2_.t() @ g_ for _, x2_, g_ in batches))
    assert len(seen) == 2
