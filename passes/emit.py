"""Stage 5, emit: this rank's forward and backward GraphModules on local shapes.

Every compute node is localized by its rule (shape arguments become local shapes; some ops become
local helpers), the joint graph is split into a forward graph (which also returns the values the
backward needs) and a backward graph, and fake-tensor propagation checks that every node's local
shape is the one its layout promises (each distinct op call is propagated once: repeated layers
reuse the result, and every node is still compared with its own layout).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from autopar.core.errors import AutoparError, ShardingError
from autopar.core.mesh import Mesh
from autopar.core.meta import MEMORY_ORDER_KEY, has_info, info, signature
from autopar.passes.view_folds import fold_double_transposes, fold_reshape_chains
from autopar.passes.whole_norms import whole_layer_norms
from autopar.rules import device_attention
from autopar.rules.base import LocalContext, LocalGraph, RuleRegistry
from autopar.rules.calls import op_call
from autopar.rules.localize import localize_sizes
from autopar.runtime.program import EmittedProgram


@dataclass
class CallMemo:
    """The shape check's fake results of op calls, by everything a fake kernel sees of the call
    (`_SharedCallProp`), in the one fake mode that made them: one program's repeated layers reuse
    them, and so do the other ranks' programs of an in-process compile of several ranks
    (`autopar.compiler.rank_share.RankShare`), whose calls are mostly the same local calls."""

    mode: FakeTensorMode = field(default_factory=lambda: FakeTensorMode(allow_non_fake_inputs=True))
    results: dict[Any, Any] = field(default_factory=dict)


def emit(
    gm: fx.GraphModule,
    mesh: Mesh,
    registry: RuleRegistry,
    coords: Sequence[int] | None = None,
    calls: CallMemo | None = None,
) -> EmittedProgram:
    """This rank's program (`coords`, default: the mesh's own rank); `calls`: the shape check's
    results to reuse and add to (default: this program's own)."""
    coords = tuple(coords) if coords is not None else mesh.my_coords()
    sig = signature(gm)
    shape = tuple(mesh.shape)
    groups = tuple(mesh.comm_group(a) for a in range(mesh.ndim))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = [n for n in placeholders if info(n).role in ("param", "buffer", "constant")]
    inputs = [n for n in placeholders if info(n).role == "input"]
    tangents = [n for n in placeholders if info(n).role == "tangent"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    out_values: list[fx.Node] = list(output.args[0])  # type: ignore[arg-type]
    nu = sig.num_user_outputs

    backward_nodes = {
        n for n in gm.graph.nodes if has_info(n) and info(n).phase == "backward" and n.op != "output"
    }
    forward_nodes = [n for n in gm.graph.nodes if n.op != "output" and n not in backward_nodes]
    for node in forward_nodes:
        bad = [i for i in node.all_input_nodes if i in backward_nodes]
        if bad:
            raise ShardingError(f"forward node {node.name} depends on backward node {bad[0].name}")
    grad_values_set = set(out_values[nu:])
    saved = [n for n in forward_nodes if n in grad_values_set or any(u in backward_nodes for u in n.users)]
    if any(n.op == "placeholder" and info(n).role == "input" for n in out_values[nu:]):
        raise ShardingError("a gradient output is a raw input; this graph shape is not supported")

    fwd_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in [*params, *inputs]:
        env[node] = _placeholder(fwd_graph, node)
    for node in forward_nodes:
        if node.op == "placeholder":
            continue
        env[node] = _local_node(fwd_graph, node, env, shape, coords, registry, groups)
    fwd_graph.output(tuple(env[v] for v in [*out_values[:nu], *saved]))

    bwd_graph = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for node in saved:
        benv[node] = bwd_graph.placeholder(f"saved_{node.name}")
        benv[node].meta.update(node.meta)
    for node in tangents:
        benv[node] = _placeholder(bwd_graph, node)
    for node in gm.graph.nodes:
        if node in backward_nodes and node.op != "placeholder":
            benv[node] = _local_node(bwd_graph, node, benv, shape, coords, registry, groups)
    grads = dict(zip(sig.grad_of, out_values[nu:]))
    grad_values = [grads.get(info(n).param_name or "") for n in params]
    grad_values += out_values[sig.num_param_grads_end :]  # the inputs', whole
    bwd_graph.output(tuple(benv[v] if v is not None else None for v in grad_values))

    # Python code is generated on the first call (or print): `autopar.plan` never runs the graphs
    forward = _LazyGraphModule(torch.nn.Module(), fwd_graph)
    backward = _LazyGraphModule(torch.nn.Module(), bwd_graph)
    program = EmittedProgram(
        forward=forward,
        backward=backward,
        param_names=[info(n).param_name or n.name for n in params],
        param_layouts=[info(n).layout for n in params],
        input_layouts=[info(n).layout for n in inputs],
        output_layouts=list(info(output).layouts)[:nu],
        tangent_outputs=[info(n).input_index or 0 for n in tangents],
        num_saved=len(saved),
        coords=coords,
        param_parts={
            n: sig.param_parts[n] for n in (info(p).param_name for p in params) if n in sig.param_parts
        },
        buffer_updates=list(sig.buffer_updates),
        input_updates=list(sig.input_updates),
        constants={
            name: sig.constants[name]
            for name in (info(p).param_name or p.name for p in params if info(p).role == "constant")
        },
        index_checks=list(sig.index_checks),
        value_guards=sig.value_guards,
        input_grads=list(sig.input_grads),
        device_type=mesh.device_type,
    )
    check_local_shapes(program, shape, calls)
    for local in (program.forward, program.backward):
        whole_layer_norms(local)  # (after the shape check: it reads the local values)
        fold_double_transposes(local)
        fold_reshape_chains(local)
    _place_on(program, torch.device(mesh.device_type))
    return program


def _place_on(program: EmittedProgram, device: torch.device) -> None:
    """The trace ran on CPU fake tensors, so every factory, copy and local op that names a device
    names the CPU: make it name the mesh's device, where the program runs. (The shape check runs
    before, on the CPU: on a machine without the mesh's device, torch cannot index a fake tensor of
    that device, which local ops do.)"""
    if device.type == "cpu":
        return

    def placed(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "cpu" else value

    for gm in (program.forward, program.backward):
        for node in gm.graph.nodes:
            node.args = pytree.tree_map(placed, node.args)
            node.kwargs = pytree.tree_map(placed, node.kwargs)
            if node.op == "call_function" and node.target in device_attention.ON_DEVICE:
                # the CPU kernel exists on the CPU alone
                node.target = device_attention.ON_DEVICE[node.target]
        gm.recompile()


def _placeholder(graph: fx.Graph, node: fx.Node) -> fx.Node:
    new = graph.placeholder(node.name)
    new.meta.update(node.meta)
    return new


def _local_node(
    graph: fx.Graph,
    node: fx.Node,
    env: dict[fx.Node, fx.Node],
    mesh_shape: tuple[int, ...],
    coords: tuple[int, ...],
    registry: RuleRegistry,
    groups: tuple[str, ...] = (),
) -> fx.Node:
    node_info = info(node)
    if node.target is operator.getitem or node_info.role == "comm" or node_info.strategy is None:
        new = graph.node_copy(node, lambda n: env[n])
        return new
    if node_info.chunk is not None:  # over-decomposed: its chunk is its in-process coordinate
        coords = (*coords[:-1], node_info.chunk)
    rule = registry.get(node.target)
    localize = rule.localize if rule is not None and rule.localize is not None else localize_sizes
    args = fx.map_arg(node.args, env.__getitem__)
    kwargs = fx.map_arg(node.kwargs, env.__getitem__)
    order = node.meta.get(MEMORY_ORDER_KEY)
    ctx = LocalContext(op_call(node), node_info.strategy, mesh_shape, coords, tuple(args), dict(kwargs), order, groups)
    local = localize(ctx)
    if isinstance(local, LocalGraph):  # several nodes (ring attention): the last stands for the op
        new = local.build(graph, tuple(args), dict(kwargs), node_info)
        new.meta.update(node.meta)
        new.name = node.name
        return new
    target = local.target
    if target is torch.ops.aten.view.default:
        # A redistribution may hand over a contiguous copy where the global graph relied on a
        # producer's strides (e.g. attention output viewed after a transpose): reshape copies then.
        target = torch.ops.aten.reshape.default
    new = graph.call_function(target, tuple(local.args), dict(local.kwargs))
    new.meta.update(node.meta)
    new.name = node.name
    return new


def check_local_shapes(program: EmittedProgram, mesh_shape: tuple[int, ...], calls: CallMemo | None = None) -> None:
    """Propagate fake local tensors through both graphs; every laid-out node must match its layout.

    Each node is compared as soon as it is propagated, so the first wrong local shape is the one
    reported (not a kernel error further down). `calls`: results of op calls propagated before."""
    calls = calls if calls is not None else CallMemo()
    mode, memo = calls.mode, calls.results
    with mode:
        fwd_args = [
            torch.empty(lay.local_shape(mesh_shape, program.coords), dtype=lay.dtype)
            for lay in [*program.param_layouts, *program.input_layouts]
        ]
    _SharedCallProp(program.forward, mode, memo, mesh_shape, program.coords).propagate(*fwd_args)
    out = next(n for n in program.forward.graph.nodes if n.op == "output")
    saved_vals = [n.meta["val"] for n in list(out.args[0])[len(program.output_layouts) :]]  # type: ignore[arg-type]
    with mode:
        tangent_vals = [
            torch.empty(
                program.output_layouts[i].local_shape(mesh_shape, program.coords),
                dtype=program.output_layouts[i].dtype,
            )
            for i in program.tangent_outputs
        ]
    _SharedCallProp(program.backward, mode, memo, mesh_shape, program.coords).propagate(
        *saved_vals, *tangent_vals
    )


class _SharedCallProp(FakeTensorProp):
    """FakeTensorProp that runs each distinct op call once and reuses its result for repeats.

    A functional op's fake result is a function of its target, its constant arguments and its
    tensor arguments' metadata (the key below), so repeated layers need not run their identical
    calls again: a call that differs in anything (a wrong local size argument, an input of
    another shape) gets its own key and runs. Every node is still compared with its own layout.
    """

    def __init__(
        self,
        module: fx.GraphModule,
        mode: FakeTensorMode,
        memo: dict[Any, Any],
        mesh_shape: tuple[int, ...],
        coords: tuple[int, ...],
    ) -> None:
        super().__init__(module, mode)
        self.memo = memo  # call key -> (result, meta val); shared by the forward and backward graphs
        self.value_keys: dict[fx.Node, Any] = {}
        self.mesh_shape = mesh_shape
        self.coords = coords
        self.extra_traceback = False  # errors name the emitted node themselves

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = self._propagate(n)
        except AutoparError:
            raise
        except Exception as exc:  # a fake kernel rejecting the local shapes it was given
            raise ShardingError(
                f"emitted {n.name} fails on its local inputs: {type(exc).__name__}: {exc}",
                op=str(n.target),
                where=info(n).where() if has_info(n) else None,
                hint="this is a bug in a sharding rule's localize step; please report it",
            ) from exc
        if n.op != "output" and has_info(n):
            _check_node(n, self.mesh_shape, self.coords)
        return result

    def _propagate(self, n: fx.Node) -> Any:
        if n.op != "call_function" or not _pure_op(n.target):
            return super().run_node(n)
        try:
            views = _returns_view(n.target)
            key = (n.target, self._arg_key(n.args, views), self._arg_key(n.kwargs, views))
            found = self.memo.get(key)
        except (TypeError, _Unkeyable):  # an unhashable or undescribable argument: just run it
            return super().run_node(n)
        if found is None:
            result = super().run_node(n)
            self.memo[key] = (result, n.meta.get("val"))
            return result
        n.meta["val"] = found[1]
        return found[0]

    def _arg_key(self, x: Any, views: bool) -> Any:
        """`views`: the op returns a view (its result's storage offset follows its inputs')."""
        if isinstance(x, fx.Node):
            key = self.value_keys.get(x)
            if key is None:
                key = self.value_keys[x] = _value_key(self.env[x])
            # where a view starts in its storage matters only to ops that return views
            return key if views or not isinstance(key, _TensorKey) else key.without_offset()
        if isinstance(x, (list, tuple)):
            return (type(x), tuple([self._arg_key(v, views) for v in x]))
        if isinstance(x, dict):
            return (dict, tuple([(k, self._arg_key(v, views)) for k, v in x.items()]))
        if isinstance(x, torch.Tensor):
            raise _Unkeyable  # a tensor constant in the graph
        return (type(x), x)


class _TensorKey(tuple):  # type: ignore[type-arg]
    """A tensor's `_value_key`; index 2 is its storage offset."""

    def without_offset(self) -> tuple[Any, ...]:
        return (*self[:2], *self[3:])


def _value_key(v: Any) -> Any:
    """Everything a fake kernel can see of a value."""
    if isinstance(v, torch.Tensor):
        return _TensorKey(
            (
                tuple(v.shape),
                v.stride(),
                v.storage_offset(),
                v.dtype,
                v.device,
                v.layout,
                v.requires_grad,
                v.is_conj(),
                v.is_neg(),
            )
        )
    if isinstance(v, (list, tuple)):
        return (type(v), tuple([_value_key(x) for x in v]))
    if v is None or isinstance(v, (bool, int, float)):
        return (type(v), v)
    raise _Unkeyable


class _Unkeyable(Exception):
    """A value the call key cannot describe (the node is then propagated on its own)."""


@functools.cache
def _returns_view(target: Any) -> bool:
    """An op whose result aliases an argument (its storage offset follows the argument's)."""
    return any(r.alias_info is not None for r in target._schema.returns)


@functools.cache
def _pure_op(target: Any) -> bool:
    """ATen-style ops whose fake result depends only on argument metadata: no mutation, no
    data-dependent output shape."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable:
        return False
    return not any(
        tag in target.tags for tag in (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
    )


def _check_node(node: fx.Node, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> None:
    layouts = info(node).layouts
    vals = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    if not layouts or len(vals) != len(layouts):
        return
    for val, layout in zip(vals, layouts):
        if tuple(val.shape) != layout.local_shape(mesh_shape, coords):
            raise ShardingError(
                f"emitted {node.name} has local shape {tuple(val.shape)}, its layout "
                f"{layout.per_axis_str()} of {list(layout.shape)} promises "
                f"{list(layout.local_shape(mesh_shape, coords))}",
                op=str(node.target),
                where=info(node).where(),
                hint="this is a bug in a sharding rule's localize step; please report it",
            )


