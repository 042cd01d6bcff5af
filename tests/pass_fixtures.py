"""Shared, cached compilations for the per-stage tests (test_pass_*.py, test_dump.py).

Tracing dominates the cost of a compile, so every graph here is built once per test session.
Callers must not mutate what these functions return; tests that corrupt a graph build their own.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import gc
import itertools
import pickle
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from lockstep_fixtures import Coords, first_divergence, run_lockstep
from torch import nn

from autopar.api import compile_for_rank
from autopar.compiler.driver import Compiled, trace_for
from autopar.compiler.rank_share import RankShare
from autopar.core.collectives import COLLECTIVES
from autopar.core.layout import Layout, P, R
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, has_info, info, set_info, signature
from autopar.core.plan import Plan
from autopar.core.redistribute import CommStep
from autopar.passes.emit import emit
from autopar.passes.insert_comm import insert_comm
from autopar.passes.propagate import propagate
from autopar.passes.schedule import schedule
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.rules.registry import default_registry
from autopar.runtime.program import EmittedProgram, local_value
from autopar.runtime.wire import JsonWire, allowed_loads
from autopar.testing import all_coords, assemble
from examples.models import GPT, GPTConfig, make_gpt, make_mlp

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# The two-linear MLP of the insert_comm tests: T tokens, hidden H, width 4H, no biases.
T, H = 64, 64

_Choice = TypeVar("_Choice")  # a choice compile_every_rank makes once for every rank


class TwoLinear(nn.Module):
    def __init__(self, h: int = H) -> None:
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h, bias=False)
        self.fc2 = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(F.gelu(self.fc1(x))) - t) ** 2).sum()


def two_linear_case(seed: int = 0) -> tuple[TwoLinear, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = TwoLinear()
    gen = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen))


@functools.cache
def gpt_case() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return make_gpt(0)


@functools.cache
def model_case(key: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The models of these tests by name: gpt, gpt1 (one layer), mlp (examples), two_linear, and
    mlp_uneven / gpt1_vocab67 (sizes the meshes do not divide)."""
    if key == "gpt":
        return gpt_case()
    if key == "gpt1":
        return make_gpt(0, n_layer=1)
    if key == "mlp":
        return make_mlp(0)
    if key == "mlp_uneven":  # widths no axis of 8 divides: every weight in torch.chunk blocks
        return make_mlp(0, d_in=36, hidden=67, n_classes=11)
    if key == "gpt1_vocab67":  # a vocabulary no axis divides
        return make_gpt(0, n_layer=1, vocab_size=67)
    if key == "two_linear":
        return two_linear_case()
    raise KeyError(key)


@functools.cache
def propagated(key: str, shape: tuple[int, ...]) -> fx.GraphModule:
    """A model's joint graph after trace + propagate only (no communication inserted)."""
    model, inputs = model_case(key)
    mesh = Mesh.from_shape(shape)
    gm = trace(model, inputs, decompose=mesh.size > 1)
    return propagate(gm, choose_layouts(gm, mesh, default_registry()), mesh.shape)


def gpt_propagated(shape: tuple[int, ...]) -> fx.GraphModule:
    return propagated("gpt", shape)


@functools.cache
def rank_programs(
    key: str, shape: tuple[int, ...], scheduled: bool = True
) -> dict[tuple[int, ...], tuple[fx.GraphModule, EmittedProgram]]:
    """Stages 3-5 for every rank of the mesh, from one shared propagated graph (copied per rank)."""
    mesh = Mesh.from_shape(shape)
    registry = default_registry()
    out = {}
    for coords in all_coords(shape):
        gm = insert_comm(copy.deepcopy(propagated(key, shape)), mesh, coords)
        if scheduled:
            gm = schedule(gm)
        out[coords] = (gm, emit(gm, mesh, registry, coords))
    return out


def simulate_step(
    key: str, shape: tuple[int, ...], scheduled: bool = True
) -> tuple[dict[tuple[int, ...], list], dict[tuple[int, ...], list]]:
    """One forward + backward of every rank's emitted program, collectives simulated in step.

    Returns (forward outputs, backward outputs) per rank; the tangent of the loss is 1.0.
    """
    model, inputs = model_case(key)
    programs = {c: p for c, (_, p) in rank_programs(key, shape, scheduled).items()}
    return run_programs(programs, model, inputs, shape)


def run_programs(
    programs: dict[tuple[int, ...], EmittedProgram], model: nn.Module, inputs: tuple, shape: tuple[int, ...]
) -> tuple[dict[tuple[int, ...], list], dict[tuple[int, ...], list]]:
    """Every rank's forward then backward in lockstep, from the model's weights and the full
    inputs (each rank's blocks cut by its layouts); the tangent of each output is ones.

    Returns (forward outputs + saved values, parameter gradients) per rank."""
    params = dict(model.named_parameters())
    fwd_args = {
        c: [
            local_value(p.param_value(n, params).detach(), lay, shape, c)
            for n, lay in zip(p.param_names, p.param_layouts)
        ]
        + [local_value(x, lay, shape, c) for x, lay in zip(inputs, p.input_layouts)]
        for c, p in programs.items()
    }
    fwd = run_lockstep({c: p.forward for c, p in programs.items()}, fwd_args, shape)
    bwd_args = {}
    for c, p in programs.items():
        tangents = [torch.ones(p.output_layouts[i].local_shape(shape, p.coords)) for i in p.tangent_outputs]
        bwd_args[c] = [*fwd[c][len(p.output_layouts) :], *tangents]
    bwd = run_lockstep({c: p.backward for c, p in programs.items()}, bwd_args, shape)
    return fwd, bwd


def assert_matches_serial(
    program: EmittedProgram,
    fwd: dict[tuple[int, ...], list],
    bwd: dict[tuple[int, ...], list],
    model: nn.Module,
    inputs: tuple,
    shape: tuple[int, ...],
    *,
    loss_tol: tuple[float, float] = (1e-5, 1e-5),
    grad_tol: tuple[float, float] = (2e-5, 1e-4),
    replica_tol: tuple[float, float] = (1e-4, 1e-4),
) -> None:
    """A lockstep step (`run_programs`) against one serial step of `model`: every rank's loss (its
    first output) and every parameter gradient, assembled from the ranks' blocks (replicas agreeing
    to `replica_tol`), equal the serial model's. Tolerances are (atol, rtol)."""
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    for c in fwd:
        torch.testing.assert_close(fwd[c][0], loss.detach(), atol=loss_tol[0], rtol=loss_tol[1])
    grads = {name: p.grad for name, p in model.named_parameters()}
    for i, (name, lay) in enumerate(zip(program.param_names, program.param_layouts)):
        grad = assemble({c: bwd[c][i] for c in bwd}, lay, shape, atol=replica_tol[0], rtol=replica_tol[1])
        want = program.param_value(name, grads)
        torch.testing.assert_close(grad, want, atol=grad_tol[0], rtol=grad_tol[1], msg=name)


@functools.cache
def gpt_compiled(shape: tuple[int, ...], coords: tuple[int, ...]) -> tuple[Compiled, Path]:
    """compile_for_rank on the GPT, with its stage dumps written to a session temp dir."""
    model, inputs = gpt_case()
    dump = Path(tempfile.mkdtemp(prefix="autopar_dump_"))
    atexit.register(shutil.rmtree, dump, True)
    compiled = compile_for_rank(model, Mesh.from_shape(shape), inputs, coords=coords, dump_dir=dump)
    return compiled, dump / "rank0"


def two_linear_after_insert_comm(
    shape: tuple[int, ...] = (2, 2, 2), coords: tuple[int, ...] | None = None
) -> fx.GraphModule:
    model, inputs = two_linear_case()
    mesh = Mesh.from_shape(shape)
    gm = trace(model, inputs, decompose=mesh.size > 1)
    gm = propagate(gm, choose_layouts(gm, mesh, default_registry()), mesh.shape)
    return insert_comm(gm, mesh, coords if coords is not None else (0,) * len(shape))


def collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]


def is_comm(node: fx.Node) -> bool:
    return has_info(node) and info(node).role == "comm"


# ---- hand-built graphs: nodes with the metadata the passes read -------------------------------------
def call_node(
    graph: fx.Graph, name: str, target: object, args: tuple, role: str = "compute", **extra: object
) -> fx.Node:
    node = graph.create_node("call_function", target, args, {}, name=name)
    set_info(node, NodeInfo(**{"role": role, "phase": "forward", **extra}))  # type: ignore[arg-type]
    return node


def backward_node(
    graph: fx.Graph, name: str, target: object, args: tuple, role: str = "compute", **extra: object
) -> fx.Node:
    return call_node(graph, name, target, args, role, phase="backward", **extra)


def input_node(graph: fx.Graph, name: str, index: int) -> fx.Node:
    """A user input placeholder (index-th input of the graph)."""
    node = graph.placeholder(name)
    set_info(node, NodeInfo(role="input", phase="forward", input_index=index))
    return node


def all_reduce_node(
    graph: fx.Graph, x: fx.Node, name: str, shape: tuple[int, ...], axis: int, ndim: int
) -> fx.Node:
    """A sum over mesh axis `axis` (group "<x>" or "<y>") and its wait, as insert_comm emits it."""
    before = [R] * ndim
    before[axis] = P
    step = CommStep("all_reduce", axis, Layout(tuple(before), shape), Layout((R,) * ndim, shape))
    group = f"<{'xy'[axis]}>"
    coll = call_node(
        graph,
        f"ar_{name}",
        c10d.all_reduce.default,
        (x, "sum", group),
        role="comm",
        comm=step,
        comm_group=group,
    )
    return call_node(
        graph, f"w_{name}", c10d.wait_tensor.default, (coll,), role="comm", layouts=(step.after,)
    )


def node_names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def run_joint(
    gm: fx.GraphModule, model: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run a traced joint graph on the model's real parameters and buffers, the loss's tangent
    1.0; returns (loss, gradient by parameter name)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    args: list[torch.Tensor] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        node_info = info(node)
        if node_info.role == "param":
            args.append(params[node_info.param_name].detach())
        elif node_info.role == "buffer":
            args.append(buffers[node_info.param_name])
        elif node_info.role == "input":
            args.append(inputs[node_info.input_index])
        else:
            assert node_info.role == "tangent"
            args.append(torch.tensor(1.0))
    sig = signature(gm)
    out = gm(*args)
    assert len(out) == sig.num_user_outputs + len(sig.grad_of)
    return out[0], dict(zip(sig.grad_of, out[sig.num_user_outputs :]))


def eager_step(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eager autograd's (loss, gradient by parameter name); the model's grads are left cleared."""
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def isomorphism_failure(a: fx.GraphModule, b: fx.GraphModule) -> str | None:
    """None if the two graphs are the same graph up to node names: the same nodes in the same order
    (op, target, phase, module path, role, parameter name, shape) reading the same values; else
    the first difference."""
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        return f"{len(nodes_a)} nodes against {len(nodes_b)}"
    same: dict[fx.Node, fx.Node] = {}
    for x, y in zip(nodes_a, nodes_b):
        if x.op != y.op or (x.op != "placeholder" and x.target != y.target):
            return f"{x.name} ({x.op} {x.target}) against {y.name} ({y.op} {y.target})"
        fx_, fy = info(x), info(y)
        facts_x = (fx_.phase, fx_.module_path, fx_.source, fx_.role, fx_.param_name, fx_.input_index)
        facts_y = (fy.phase, fy.module_path, fy.source, fy.role, fy.param_name, fy.input_index)
        if facts_x != facts_y:
            return f"{x.name} {facts_x} against {y.name} {facts_y}"
        val_x, val_y = x.meta.get("val"), y.meta.get("val")
        if isinstance(val_x, torch.Tensor) and (val_x.shape, val_x.dtype) != (val_y.shape, val_y.dtype):
            return f"{x.name} {val_x.shape} against {y.name} {val_y.shape}"
        mapped = fx.map_arg((x.args, x.kwargs), lambda n: same[n])
        if repr(mapped) != repr((y.args, y.kwargs)):
            return f"{x.name} reads {mapped} where {y.name} reads {(y.args, y.kwargs)}"
        same[x] = y
    return None


def compile_every_rank(
    model: nn.Module,
    shape: tuple[int, ...],
    args: tuple,
    kwargs: dict | None = None,
    names: tuple[str, ...] | None = None,
    **options: Any,
) -> dict[Coords, Compiled]:
    """`compile_for_rank` for every coordinate of a mesh of `shape` (axes named `names`, default
    x, y, z), all with the plan and the collective-matmul decomposition chosen for the first (as
    `parallelize` makes rank 0's choices everyone's), and each distinct lowered graph scheduled
    once (`RankShare`; `share=None` schedules every rank's own). The cyclic garbage collector is
    off for all of it, not only inside each rank's compile (`compile_conditions`): turned back on
    between ranks, its full passes walked every earlier rank's graphs, fake tensors and plans."""
    chosen: list[Plan] = []
    choices: dict[str, Any] = {}

    def plan_once(gm: fx.GraphModule, make_plan: Callable[[], Plan]) -> Plan:
        if not chosen:  # as the other ranks of a job read it: pickled, through the allow-list
            chosen.append(allowed_loads(pickle.dumps(make_plan())))
        return chosen[0]

    def choose_once(decide: Callable[[], _Choice], wire: JsonWire[_Choice]) -> _Choice:
        if wire.what not in choices:  # as every rank of a job applies it: through its JSON
            choices[wire.what] = wire.carried(decide())
        return choices[wire.what]  # type: ignore[no-any-return]

    decide = options.pop("agree_choice", choose_once)  # a test's own choice, else the first rank's
    share = options.pop("share", RankShare())
    mesh = Mesh.from_shape(shape, names)
    trace_options = {
        k: options[k] for k in ("planner", "split_fused", "forward_only", "token_dispatch") if k in options
    }
    with gc_paused():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # a random branch (LayerDrop) takes the outcome the lockstep's seed draws
            traced = trace_for(model, mesh, args, kwargs, **trace_options)  # once, as each process of a job
        return {
            c: compile_for_rank(
                model,
                mesh,
                args,
                example_kwargs=kwargs,
                coords=c,
                agree=plan_once,
                agree_choice=decide,
                traced=traced,
                share=share,
                **options,
            )
            for c in all_coords(shape)
        }


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside (as it was before, after)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def lockstep_step(
    compiled: dict[Coords, Compiled],
    model: nn.Module,
    shape: tuple[int, ...],
    args: tuple,
    kwargs: dict,
    record: dict[Coords, dict[str, object]] | None = None,
    *,
    state: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[Coords, list], dict[Coords, list]]:
    """Every rank's forward, then backward from the first output (the loss), in lockstep from the
    model's current weights (or `state`'s, by name), with the generator seeded 0 (as the serial
    call it is compared with): each rank's forward outputs and parameter gradients. The values
    saved for backward are handed to it and freed after their last reader (`run_lockstep`)."""
    programs = {c: comp.program for c, comp in compiled.items()}
    if state is None:
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    flat_inputs = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    fwd_args = {
        c: [local_value(p.param_value(n, state).detach(), lay, shape, c) for n, lay in zip(p.param_names, p.param_layouts)]
        + [local_value(x, lay, shape, c) for x, lay in zip(flat_inputs, p.input_layouts)]
        for c, p in programs.items()
    }
    torch.manual_seed(0)  # dropout draws the serial model's numbers: the serial call starts here too
    fwd = run_lockstep({c: p.forward for c, p in programs.items()}, fwd_args, shape, record, consume=True)
    bwd_args = {}
    for c, p in programs.items():
        tangents = [
            (torch.ones if i == 0 else torch.zeros)(p.output_layouts[i].local_shape(shape, c), dtype=p.output_layouts[i].dtype)
            for i in p.tangent_outputs
        ]
        bwd_args[c] = [*fwd[c][len(p.output_layouts) :], *tangents]
        del fwd[c][len(p.output_layouts) :]
    bwd = run_lockstep({c: p.backward for c, p in programs.items()}, bwd_args, shape, record, consume=True)
    return fwd, bwd


def train_in_lockstep(
    model: nn.Module,
    shape: tuple[int, ...],
    batches: list[tuple[torch.Tensor, ...]] | list[dict[str, torch.Tensor]],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    **options: Any,
) -> dict[str, Any]:
    """What a gloo job training `model` beside a serial copy measures, without processes: the
    programs are compiled from the first batch (as `parallelize` compiles them), then for each batch
    every rank's program runs in lockstep from the model's current weights, and the model takes an
    optimizer step on the gradients assembled from the ranks' blocks (what the runtime's DTensor
    parameters hold), the serial copy one on its own. Returns `compiled`, every rank's (loss,
    serial loss) per step (`losses`), the worst loss difference, the worst gradient error relative
    to the tensor's largest entry (`grad_err`) and the worst parameter difference after the last
    step (`param_err`). A batch is the positional arguments, or a dict of keyword arguments (a
    model output's `.loss` is the serial loss then). Each step draws from seed 0 on the ranks and
    serially, so dropout takes the same masks; frozen parameters take no step."""

    def call_args(batch: tuple[torch.Tensor, ...] | dict[str, torch.Tensor]) -> tuple[tuple, dict]:
        return ((), batch) if isinstance(batch, dict) else (batch, {})

    serial = copy.deepcopy(model)
    compiled = compile_every_rank(model, shape, *call_args(batches[0]), **options)
    first = next(iter(compiled.values())).program
    loss_layout = first.output_layouts[0]
    assert not loss_layout.partial_axes() and loss_layout.shape == (), loss_layout  # each rank's loss whole
    params, serial_params = dict(model.named_parameters()), dict(serial.named_parameters())
    opt, serial_opt = make_optimizer(list(params.values())), make_optimizer(list(serial_params.values()))
    result: dict[str, Any] = {"compiled": compiled, "losses": [], "loss_err": 0.0, "grad_err": 0.0}
    for batch in batches:
        args, kwargs = call_args(batch)
        fwd, bwd = lockstep_step(compiled, model, shape, args, kwargs)
        torch.manual_seed(0)  # the ranks' seed (lockstep_step)
        out = serial(*args, **kwargs)
        serial_loss = out if isinstance(out, torch.Tensor) else out.loss
        serial_loss.backward()
        for c in compiled:
            result["losses"].append((float(fwd[c][0]), float(serial_loss)))
            result["loss_err"] = max(result["loss_err"], abs(float(fwd[c][0]) - float(serial_loss)))
        for i, (name, layout) in enumerate(zip(first.param_names, first.param_layouts)):
            part = first.param_parts.get(name)
            target = params.get(part.source if part is not None else name)
            if target is None or not target.requires_grad:  # a buffer, constant or frozen weight
                continue
            grad = assemble({c: bwd[c][i] for c in compiled}, layout, shape, atol=1e-4, rtol=1e-4)
            if part is None:
                target.grad = grad
            else:  # a part of a fused parameter (split_fused): its chunk of the whole gradient
                if target.grad is None:
                    target.grad = torch.zeros_like(target)
                part.of(target.grad).copy_(grad)
        missing = [n for n, p in params.items() if p.requires_grad and p.grad is None]
        assert not missing, f"no gradient from the programs for {missing}"
        for name, p in params.items():
            if not p.requires_grad:
                continue
            want = serial_params[name].grad
            assert want is not None and p.grad is not None and p.grad.shape == want.shape, name
            err = float((p.grad - want).abs().max() / (want.abs().max() + 1e-6))
            result["grad_err"] = max(result["grad_err"], err)
        opt.step()
        serial_opt.step()
        opt.zero_grad(set_to_none=True)
        serial_opt.zero_grad(set_to_none=True)
    result["param_err"] = max(float((p - serial_params[n]).abs().max()) for n, p in params.items())
    return result


def assert_call_matches_serial(
    model: nn.Module,
    shape: tuple[int, ...],
    args: tuple,
    kwargs: dict | None = None,
    *,
    atol: float = 2e-5,
    rtol: float = 1e-4,
    explain: bool = True,
    **options: Any,
) -> dict[Coords, Compiled]:
    """One training step of every rank's program in lockstep against `model(*args, **kwargs)` called
    serially, backward from the first tensor of the output (the loss): every output tensor, every
    buffer the forward updates (BatchNorm running stats) and every parameter gradient, assembled
    from the ranks' blocks, and every rank's gradient of each input that requires grad, equals
    serial. `explain`: on a mismatch, name the first node where the ranks part from the global
    graph (`first_divergence`: every rank runs again, every value kept)."""
    kwargs = kwargs or {}
    compiled = compile_every_rank(model, shape, args, kwargs, **options)
    assert_compiled_matches_serial(compiled, model, shape, args, kwargs, atol=atol, rtol=rtol, explain=explain)
    return compiled


def assert_compiled_matches_serial(
    compiled: dict[Coords, Compiled],
    model: nn.Module,
    shape: tuple[int, ...],
    args: tuple,
    kwargs: dict | None = None,
    *,
    atol: float = 2e-5,
    rtol: float = 1e-4,
    explain: bool = True,
) -> None:
    """`assert_call_matches_serial`'s check for programs compiled already: a later training step
    (new weights after an optimizer step, a new batch of the same shapes) runs the same programs."""
    kwargs = kwargs or {}
    first = next(iter(compiled.values())).program
    flat_inputs = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    # what the serial call updates in place (running statistics, inputs a model writes), as it is
    # before: the search for the first divergence re-runs the ranks from it, and only on a failure
    # (recording every rank's every value is most of a run's memory)
    before = {name: b.detach().clone() for name, b in model.named_buffers()}
    inputs_before = {i: flat_inputs[i].detach().clone() for i in first.input_updates}
    guards = first.value_guards
    if guards is not None:  # the program is the one a call on these inputs (at seed 0) would pick
        torch.manual_seed(0)
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        assert guards.hold(flat), f"the program's guards fail at seed 0: {guards.failing(flat)}"
    fwd, bwd = lockstep_step(compiled, model, shape, args, kwargs)

    model.zero_grad(set_to_none=True)
    for x in flat_inputs:
        x.grad = None
    torch.manual_seed(0)
    out = model(*args, **kwargs)
    serial = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    serial[0].backward()
    buffers = dict(model.named_buffers())  # after the serial call: updated
    written = [flat_inputs[i] for i in first.input_updates]  # after the serial call: as serial left them
    wanted = [t.detach() for t in serial] + written + [buffers[name] for name in first.buffer_updates]
    assert len(first.output_layouts) == len(wanted)
    try:
        _compare_with_serial(model, first, fwd, bwd, wanted, shape, atol, rtol)
        _compare_input_grads(first, bwd, flat_inputs, atol, rtol)
    except AssertionError as exc:
        if not explain:
            raise
        del fwd, bwd, out, serial, wanted  # and the comparison's frames' references to them:
        traceback.clear_frames(exc.__traceback__)
        state = {**dict(model.named_parameters()), **before}
        where = _where_ranks_part(compiled, model, shape, (args, kwargs), state, inputs_before, atol, rtol)
        raise AssertionError(f"{exc}; {where or 'every node agrees with the global graph'}") from exc


def _where_ranks_part(
    compiled: dict[Coords, Compiled],
    model: nn.Module,
    shape: tuple[int, ...],
    call: tuple[tuple, dict],
    state: dict[str, torch.Tensor],
    inputs_before: dict[int, torch.Tensor],
    atol: float,
    rtol: float,
) -> str | None:
    """`first_divergence` of a step that did not match serial: the ranks run again from `state`
    and the inputs as they were before the serial call (`inputs_before`: those it wrote, by their
    index among the call's tensors), every value recorded, against the global joint graph."""
    leaves, spec = torch.utils._pytree.tree_flatten(call)
    tensor_index = itertools.count()
    leaves = [inputs_before.get(next(tensor_index), x) if isinstance(x, torch.Tensor) else x for x in leaves]
    args, kwargs = torch.utils._pytree.tree_unflatten(leaves, spec)
    flat_inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
    record: dict[Coords, dict[str, object]] = {}
    lockstep_step(compiled, model, shape, args, kwargs, record, state=state)
    joint = next(iter(compiled.values())).graph
    joint_args = _joint_args(joint, next(iter(compiled.values())).program, state, flat_inputs)
    return first_divergence(joint, joint_args, record, shape, atol=atol, rtol=rtol)


def _joint_args(
    joint: fx.GraphModule, program: EmittedProgram, state: dict[str, torch.Tensor], inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The global joint graph's arguments: the model's values (copied: the serial call updates
    buffers in place), the call's inputs, the first output's gradient 1 and the others' 0."""
    args: list[torch.Tensor] = []
    tangents = 0
    for node in joint.graph.nodes:
        if node.op != "placeholder":
            continue
        node_info = info(node)
        if node_info.role == "input":
            args.append(inputs[node_info.input_index])
        elif node_info.role == "tangent":
            val = node.meta["val"]
            args.append((torch.ones if tangents == 0 else torch.zeros)(val.shape, dtype=val.dtype))
            tangents += 1
        else:
            args.append(program.param_value(node_info.param_name, state).detach().clone())
    return args


def _compare_with_serial(
    model: nn.Module,
    first: EmittedProgram,
    fwd: dict[Coords, list],
    bwd: dict[Coords, list],
    wanted: list[torch.Tensor],
    shape: tuple[int, ...],
    atol: float,
    rtol: float,
) -> None:
    for i, (want, lay) in enumerate(zip(wanted, first.output_layouts)):
        got = assemble({c: fwd[c][i] for c in fwd}, lay, shape, atol=1e-4, rtol=1e-4)
        # as for gradients below: an entry near zero keeps a float32 error of the tensor's scale
        # (a deep CNN's logits, whose batch statistics are summed in another order)
        scale = float(want.abs().max()) if want.numel() and want.is_floating_point() else 0.0
        torch.testing.assert_close(got, want, atol=max(atol, rtol * scale), rtol=rtol, msg=f"output {i}")
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for i, (name, lay) in enumerate(zip(first.param_names, first.param_layouts)):
        part = first.param_parts.get(name)
        if (part.source if part is not None else name) not in grads:  # a buffer, constant or frozen weight
            continue
        got = assemble({c: bwd[c][i] for c in bwd}, lay, shape, atol=1e-4, rtol=1e-4)
        want = first.param_value(name, grads)
        # float32 sums round with the size of their terms: an entry that cancels to near zero
        # keeps an error of the tensor's scale (as `_rel_err` in the gloo tests measures it)
        scale = float(want.abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(got, want, atol=max(atol, rtol * scale), rtol=rtol, msg=name)


def _compare_input_grads(
    first: EmittedProgram, bwd: dict[Coords, list], inputs: list[torch.Tensor], atol: float, rtol: float
) -> None:
    """Every rank holds the whole gradient of every input that requires grad, the serial one."""
    wanting = [i for i, x in enumerate(inputs) if x.requires_grad]
    assert sorted(first.input_grads) == wanting, (first.input_grads, wanting)
    for k, index in enumerate(first.input_grads):
        want = inputs[index].grad
        assert want is not None
        scale = float(want.abs().max()) if want.numel() else 0.0
        for c, values in bwd.items():
            got = values[len(first.param_names) + k]
            torch.testing.assert_close(got, want, atol=max(atol, rtol * scale), rtol=rtol, msg=f"input {index} on {c}")


def gpt_meta_graph(n_embd: int, n_head: int, batch: int, seq: int, n_layer: int = 2) -> fx.GraphModule:
    """The example GPT built on meta, traced as the planners plan it (decomposed, fused ops split):
    the graph of the mesh screen's and bound's tests, at any size with no memory."""
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return trace(model, (idx, idx), decompose=True, split_fused=True)
