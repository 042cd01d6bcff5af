"""Zero-bubble's backward split (`autopar.runtime.split_backward`): a rank's backward cut into the
input-gradient part I and the weight-gradient part W gives bitwise the unsplit gradients, I holds
only what input gradients need, W only what they do not, a collective stays with its wait, and
every rank splits alike (in-process lockstep on 1, 2 and 4 ranks, and once on real gloo ranks)."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from multirank import run_ranks
from pass_fixtures import Coords, compile_every_rank, run_lockstep
from torch import nn

from autopar.api import compile_for_rank
from autopar.core.collectives import COLLECTIVES
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.runtime.program import EmittedProgram, local_value
from autopar.runtime.split_backward import SplitBackward, is_collective, is_wait, split_backward
from examples.models import Block, GPTConfig, make_gpt, make_mlp


class MLP(nn.Module):
    """Four linears; `tied`: the two middle ones share a weight (its gradient sums two uses)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)
        if tied:
            self.fc2.weight = self.fc1.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(F.gelu(self.inp(x))))
        return F.mse_loss(self.head(self.fc2(h)), y)


class BlockLoss(nn.Module):
    """A GPT block (layer norms, causal attention, MLP) on embeddings: a pipeline stage's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(GPTConfig(n_embd=32, n_head=4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.block(x) - y).pow(2).mean()


def _case(key: str, wants_grad: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if key == "gpt":  # token inputs: never an input gradient
        return make_gpt(0, batch_size=4, n_layer=1)
    if key == "uneven":  # widths no mesh axis divides: blocks of unequal sizes on the ranks
        mlp, (x, y) = make_mlp(0, d_in=36, hidden=67, n_classes=11)
        return mlp, (x.requires_grad_(wants_grad), y)
    if key == "block":
        model: nn.Module = BlockLoss()
        x, y = torch.randn(4, 8, 32, generator=gen), torch.randn(4, 8, 32, generator=gen)
    else:
        model = MLP(tied=key == "mlp_tied")
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    return model, (x.requires_grad_(wants_grad), y)


@functools.cache
def _compiled(
    key: str, shape: tuple[int, ...], wants_grad: bool, **options: Any
) -> dict[Coords, EmittedProgram]:
    model, inputs = _case(key, wants_grad)
    return {c: comp.program for c, comp in compile_every_rank(model, shape, inputs, **options).items()}


def _forward(
    key: str, wants_grad: bool, programs: dict[Coords, EmittedProgram], shape: tuple[int, ...]
) -> dict[Coords, list[torch.Tensor]]:
    """Every rank's backward arguments (saved values, then tangents: ones for the loss)."""
    model, inputs = _case(key, wants_grad)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    fwd_args = {
        c: [
            local_value(p.param_value(n, state).detach(), lay, shape, c)
            for n, lay in zip(p.param_names, p.param_layouts)
        ]
        + [local_value(x.detach(), lay, shape, c) for x, lay in zip(inputs, p.input_layouts)]
        for c, p in programs.items()
    }
    fwd = run_lockstep({c: p.forward for c, p in programs.items()}, fwd_args, shape)
    args = {}
    for c, p in programs.items():
        layouts = p.output_layouts
        tangents = [
            (torch.ones if i == 0 else torch.zeros)(layouts[i].local_shape(shape, c), dtype=layouts[i].dtype)
            for i in p.tangent_outputs
        ]
        args[c] = [*fwd[c][len(layouts) :], *tangents]
    return args


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b)
    )


# Each model on the mesh that shows the most of it (the suite's time is shared): a tied MLP and a
# block on one rank (undecomposed ops that compute both gradients at once) and on two and four.
CASES = [
    ("mlp", (2, 2), True),
    ("mlp", (2, 2), False),
    ("mlp_tied", (1,), True),
    ("mlp_tied", (2,), False),
    ("block", (1,), True),
    ("block", (2,), False),
    ("block", (2, 2), True),
    ("gpt", (2, 2), False),
    ("uneven", (2, 2), True),
    ("uneven", (2, 2, 2), True),
]
IDS = [f"{k}-{'x'.join(map(str, s))}-{'grad' if g else 'nograd'}" for k, s, g in CASES]


@pytest.mark.parametrize(("key", "shape", "wants_grad"), CASES, ids=IDS)
def test_input_then_weight_part_give_the_unsplit_gradients_bitwise(
    key: str, shape: tuple[int, ...], wants_grad: bool
) -> None:
    programs = _compiled(key, shape, wants_grad)
    first = next(iter(programs.values()))
    assert bool(first.input_grads) == wants_grad
    args = _forward(key, wants_grad, programs, shape)
    whole = run_lockstep({c: p.backward for c, p in programs.items()}, args, shape)
    splits = {c: split_backward(p) for c, p in programs.items()}
    i_out = run_lockstep({c: s.input_part for c, s in splits.items()}, args, shape)
    w_args = {c: [*args[c], *i_out[c][s.num_input_grads :]] for c, s in splits.items()}
    w_out = run_lockstep({c: s.weight_part for c, s in splits.items()}, w_args, shape)
    for c, p in programs.items():
        n = len(p.param_names)
        s = splits[c]
        assert len(i_out[c]) == s.num_input_grads + s.num_carried
        assert _same(i_out[c][: s.num_input_grads], whole[c][n:]), c
        assert _same(w_out[c], whole[c][:n]), c
    # every rank cuts its graph alike, so the parts' collectives line up across ranks
    assert len({s.structure() for s in splits.values()}) == 1
    for part in ("input_part", "weight_part"):
        assert len({_collective_sequence(getattr(s, part)) for s in splits.values()}) == 1


def _collective_sequence(gm: fx.GraphModule) -> tuple[tuple[object, int], ...]:
    """The collectives a part issues, in order: op and mesh axis."""
    return tuple((n.target, info(n).comm.axis) for n in _calls(gm) if is_collective(n))  # type: ignore[union-attr]


def _ancestors(values: list[Any]) -> set[str]:
    seen: set[fx.Node] = set()
    todo = [v for v in values if isinstance(v, fx.Node)]
    while todo:
        node = todo.pop()
        if node not in seen and node.op != "placeholder":
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return {n.name for n in seen}


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _check_shape(program: EmittedProgram, split: SplitBackward) -> None:
    backward = program.backward
    outputs = list(next(n for n in backward.graph.nodes if n.op == "output").args[0])
    needed = _ancestors(outputs[len(program.param_names) :])
    original = [n.name for n in _calls(backward)]
    i_nodes, w_nodes = _calls(split.input_part), _calls(split.weight_part)
    i_names, w_names = [n.name for n in i_nodes], [n.name for n in w_nodes]
    # each node lands in exactly one part, in the original order within it
    assert sorted(i_names + w_names) == sorted(original)
    assert i_names == [x for x in original if x in set(i_names)]
    assert w_names == [x for x in original if x in set(w_names)]
    # I: only what input gradients need (and the waits / getitems of its collectives / tuple ops)
    for node in i_nodes:
        assert node.name in needed or (
            (is_wait(node) or node.target.__name__ == "getitem") and node.all_input_nodes[0].name in i_names
        ), node.name
    # W: nothing an input gradient needs
    assert not needed & set(w_names)
    # a collective and its wait share a part; no collective's raw result crosses between parts
    for part in (split.input_part, split.weight_part):
        for node in _calls(part):
            if is_wait(node):
                assert node.args[0].op == "call_function", node.name  # type: ignore[union-attr]
            if is_collective(node):
                assert any(is_wait(u) for u in node.users), node.name
    i_by_name = {n.name: n for n in split.input_part.graph.nodes}
    assert not any(is_collective(i_by_name[c]) for c in split.carried)  # a wait's result may cross
    count = [
        sum(1 for n in _calls(g) if n.target in COLLECTIVES)
        for g in (backward, split.input_part, split.weight_part)
    ]
    assert count[0] == count[1] + count[2]
    # the collectives no input gradient needs (gradient reductions over data axes) are in W
    w_collectives = {n.name for n in w_nodes if n.target in COLLECTIVES}
    assert w_collectives == {
        n.name for n in _calls(backward) if n.target in COLLECTIVES and n.name not in needed
    }
    # what the parts read: W's saved values are among those the whole backward has
    assert set(split.saved_for_weight()) <= set(range(program.num_saved))
    assert set(split.input_reads) | set(split.weight_reads) <= set(
        range(split.num_saved + split.num_tangents)
    )


@pytest.mark.parametrize(("key", "shape", "wants_grad"), CASES, ids=IDS)
def test_each_part_holds_only_its_own_nodes(key: str, shape: tuple[int, ...], wants_grad: bool) -> None:
    for program in _compiled(key, shape, wants_grad).values():
        split = split_backward(program)
        _check_shape(program, split)
        if not wants_grad:  # no input gradient: I is empty and W is the whole backward
            assert not _calls(split.input_part) and split.num_carried == 0
            assert split.input_part(*[None] * (split.num_saved + split.num_tangents)) == ()
            assert len(_calls(split.weight_part)) == len(_calls(program.backward))


def test_a_multi_rank_block_puts_input_collectives_in_i_and_gradient_reductions_in_w() -> None:
    for program in _compiled("block", (2, 2), True).values():
        split = split_backward(program)
        i_count = sum(1 for n in _calls(split.input_part) if is_collective(n))
        w_count = sum(1 for n in _calls(split.weight_part) if is_collective(n))
        assert i_count > 0 and w_count > 0
        assert split.num_carried > 0  # the output gradients of the linears, read by dW = dY^T X
        assert len(split.saved_for_weight()) < split.num_saved  # the rest can be freed after I


def test_a_one_rank_block_carries_a_multi_output_op_s_weight_results_as_tensors() -> None:
    """Undecomposed layer norm backward makes the input's and the weights' gradients in one op: it
    runs in I and its weight results are carried as tensors (getitems), never as a tuple."""
    (program,) = _compiled("block", (1,), True).values()
    split = split_backward(program)
    names = {n.name: n for n in split.input_part.graph.nodes}
    carried = [names[c] for c in split.carried]
    assert any(n.target.__name__ == "getitem" for n in carried)  # type: ignore[union-attr]
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in carried)


def test_over_decomposed_programs_split_alike_and_bitwise() -> None:
    programs = _compiled("block", (2,), True, over_decompose=2)
    args = _forward("block", True, programs, (2,))
    whole = run_lockstep({c: p.backward for c, p in programs.items()}, args, (2,))
    splits = {c: split_backward(p) for c, p in programs.items()}
    i_out = run_lockstep({c: s.input_part for c, s in splits.items()}, args, (2,))
    w_args = {c: [*args[c], *i_out[c][s.num_input_grads :]] for c, s in splits.items()}
    w_out = run_lockstep({c: s.weight_part for c, s in splits.items()}, w_args, (2,))
    for c, p in programs.items():
        _check_shape(p, splits[c])
        n = len(p.param_names)
        assert _same(i_out[c][: splits[c].num_input_grads], whole[c][n:])
        assert _same(w_out[c], whole[c][:n])


def test_a_compiled_backward_is_refused() -> None:
    (program,) = _compiled("mlp", (1,), True).values()
    with pytest.raises(TypeError, match="split before compiling"):
        split_backward(replace(program, backward=torch.compile(program.backward)))  # type: ignore[arg-type]


def _gloo_step(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh.from_device_mesh(init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",)))
    model, (x, y) = _case("block", True)
    program = compile_for_rank(model, mesh, (x, y), planner="greedy").program
    shape, coords = tuple(mesh.shape), program.coords
    params = dict(model.named_parameters())
    fwd_args = [
        local_value(program.param_value(n, params).detach(), lay, shape, coords)
        for n, lay in zip(program.param_names, program.param_layouts)
    ]
    fwd_args += [local_value(t.detach(), lay, shape, coords) for t, lay in zip((x, y), program.input_layouts)]
    with torch.no_grad():
        results = program.forward(*fwd_args)
        saved = list(results[len(program.output_layouts) :])
        tangents = [
            torch.ones(program.output_layouts[i].local_shape(shape, coords)) for i in program.tangent_outputs
        ]
        whole = list(program.backward(*saved, *tangents))
        split = split_backward(program)
        input_grads, carried = split.run_input(saved, tangents)
        param_grads = split.run_weight(saved, tangents, carried)
    n = len(program.param_names)
    return {
        "structure": split.structure(),
        "input_same": _same(input_grads, whole[n:]),
        "param_same": _same(param_grads, whole[:n]),
        "collectives": sum(
            1 for nd in _calls(split.weight_part) + _calls(split.input_part) if is_collective(nd)
        ),
    }


@pytest.mark.multirank
def test_the_parts_run_with_real_collectives_on_gloo_ranks() -> None:
    results = run_ranks(2, _gloo_step)
    assert all(r["input_same"] and r["param_same"] for r in results), results
    assert results[0]["structure"] == results[1]["structure"]
    assert results[0]["collectives"] > 0


def _hand_built() -> EmittedProgram:
    """A backward whose edge cases real models rarely reach: a parameter gradient that an input
    gradient is computed from (made in I, carried to W), an input gradient that is the tangent
    itself, a parameter without a gradient (None) and one returned twice."""
    aten = torch.ops.aten
    graph = fx.Graph()
    saved, tangent = graph.placeholder("saved_x"), graph.placeholder("tangent")
    shared = graph.call_function(aten.mul.Tensor, (tangent, saved))  # a param grad, and read by I
    grad_in = graph.call_function(aten.add.Tensor, (shared, tangent))
    only_w = graph.call_function(aten.mm.default, (graph.call_function(aten.t.default, (saved,)), tangent))
    graph.output((shared, None, only_w, only_w, grad_in, tangent))
    backward = fx.GraphModule(nn.Module(), graph)
    return EmittedProgram(
        forward=backward,
        backward=backward,
        param_names=["a", "b", "c", "d"],
        param_layouts=[],
        input_layouts=[],
        output_layouts=[],
        tangent_outputs=[0],
        num_saved=1,
        coords=(0,),
        input_grads=[0, 1],
    )


def test_hand_built_edge_cases_split_bitwise() -> None:
    program = _hand_built()
    split = split_backward(program)
    assert [n.name for n in _calls(split.input_part)] == ["mul_tensor", "add_tensor"]
    assert [n.name for n in _calls(split.weight_part)] == ["t_default", "mm_default"]
    assert split.carried == ("mul_tensor",) and split.input_reads == (0, 1) and split.weight_reads == (0, 1)
    saved, tangent = torch.randn(3, 3), torch.randn(3, 3)
    whole = list(program.backward(saved, tangent))
    input_grads, carried = split.run_input([saved], [tangent])
    assert _same(input_grads, whole[4:])
    assert _same(split.run_weight([saved], [tangent], carried), whole[:4])


def test_a_backward_with_the_wrong_number_of_outputs_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 3 parameter gradients and 2 input gradients"):
        split_backward(replace(_hand_built(), param_names=["a", "b", "c"]))
