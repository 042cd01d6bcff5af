"""A model exported on one microbatch and cut into pipeline stage programs at module boundaries
(docs/pipeline.md#runtime-pipeline-axis-alone).

`torch.export` gives one ATen graph whose nodes carry the user's module path (`nn_module_stack`).
Each node goes to a stage: by the unit (`autopar.planning.stage_units.unit_names`) of its module,
an op of the root module with its latest producer. Values computed from no parameter (position
ids, masks: from the inputs, which every rank has, and buffers) are copied into every stage that
reads them, so they never cross a boundary. `torch.fx.passes.split_module` then makes one
GraphModule per stage; its inputs are the user's inputs, the parameters and buffers (fed from the
user's own tensors, so an optimizer of those tensors updates what the stage reads) and the values
that cross into it. The output must be one mean- or sum-reduced loss: it is rewritten to a sum so
that microbatch terms add up to the serial sum, which the caller divides by the whole batch's
count (`LossRule`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.split_module import split_module

from autopar.compiler.pipeline_export import PipelineSplitError, export_loss
from autopar.compiler.pipeline_loss import (
    LossRule,
    OutputLayout,
    PipelineLossError,
    all_arguments,
    check_outputs,
    example_batch_rows,
    find_loss,
    loss_weights,
    returns_loss,
)
from autopar.compiler.pipeline_random import RandomOp, draws, random_op, whole_shapes
from autopar.core.graph_order import written_root
from autopar.core.value_guards import ValueGuards
from autopar.passes.trace_errors import node_where
from autopar.passes.value_guards import inputs_have_values, split_value_guards
from autopar.planning.stage_units import unit_names
from autopar.runtime.pipeline_runtime import TensorSpec

__all__ = [  # the loss and output rules are read from here too (pipeline_loss holds them)
    "LossRule", "OutputLayout", "PipelineLossError", "PipelineSplitError", "StageGraph", "StageProgram",
    "all_arguments", "get_attr", "loss_weights", "split_stages",
]  # fmt: skip

_STAGE = "autopar_pp_stage"


@dataclass
class StageGraph:
    """One stage's program for one microbatch shape. `sources[i]` says what feeds input i of
    `module`: ("input", flat index), ("attr", qualified name in the model) or ("value", node name
    of a value another stage made). `crossing_in` / `crossing_out`: the node names of the values
    received from the previous stage and sent to the next (values another stage made pass through
    when a later stage reads them). `outputs`: the node names `module` returns, in order."""

    index: int
    module: fx.GraphModule
    sources: list[tuple[str, Any]]
    outputs: list[str]
    crossing_in: list[str]
    crossing_out: list[str]
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]
    attrs: tuple[str, ...]  # qualified names of the parameters and buffers it reads


@dataclass
class StageProgram:
    """The model cut into stages for one microbatch shape: a training call's, whose last stage
    returns its loss term (`loss`), or an inference call's, whose last stage returns the model's
    outputs (`outputs`; `loss` None)."""

    stages: list[StageGraph]
    loss: LossRule | None
    loss_dtype: torch.dtype
    units: tuple[str, ...]  # the module units in forward order (what stage boundaries name)
    stage_units: tuple[tuple[str, ...], ...]  # the units each stage holds
    constants: dict[str, Any]  # attributes the export made that the model lacks (lifted constants)
    output_type: type | None = None  # the mapping the model returns its loss in (a ModelOutput)
    outputs: OutputLayout | None = None  # a call without a loss: what its last stage returns
    random_ops: tuple[RandomOp, ...] = ()  # the ops that draw random numbers, in the serial order
    # the conditions on input values the export took its branches under (`pipeline_guards`), and
    # which of the programs traced for the same microbatch shape this is (0: the first)
    value_guards: ValueGuards | None = None
    variant: int = 0


def get_attr(root: nn.Module, qualname: str) -> Any:
    """The attribute a graph's get_attr names (a parameter, buffer or constant of the model)."""
    return functools.reduce(getattr, qualname.split("."), root)


def _value_guards(gm: fx.GraphModule, flat_example: Sequence[Any]) -> ValueGuards | None:
    """The conditions on the microbatch's values the export took its branches under, cut out of
    `gm` (`split_value_guards`: the stages then read no value, and a size the inputs decide is
    fixed at the example's count). The pipeline evaluates them on every call before any stage
    runs (`pipeline_guards`). A branch on a random draw (LayerDrop) is refused: the pipeline draws
    its dropout masks apart from the stages (`pipeline_random`), not the guards' replay."""
    valued = inputs_have_values(tuple(flat_example), {})
    guards = split_value_guards(gm, node_where, flat_example if valued else None)
    if guards is not None and guards.draws:
        raise PipelineSplitError(
            f"a branch on a random draw ({guards.conditions[0]}) is not served on a pipeline yet",
            where=guards.conditions[0],
            hint="turn off random layer skipping (LayerDrop: layerdrop=0 in the model's config), or "
            "train on a mesh without 'pp', whose value guards replay the draw",
        )
    return guards


def _check_batch_statistics(model: nn.Module) -> None:
    """Refuse norms that use or update statistics of the whole batch in training (BatchNorm, and
    InstanceNorm with running stats): a pipeline runs each microbatch apart, so their numbers would
    not be the serial model's (and running statistics would not reach the model's buffers)."""
    found = [
        name or type(m).__name__
        for name, m in model.named_modules()
        if m.training
        and isinstance(m, nn.modules.batchnorm._NormBase)
        and (isinstance(m, nn.modules.batchnorm._BatchNorm) or m.track_running_stats)
    ]
    if found:
        raise PipelineSplitError(
            f"{type(model).__name__} normalizes with batch statistics in training ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}): a pipeline runs each microbatch apart, so its "
            "statistics and running averages would not be the serial model's",
            hint="train it on a mesh without 'pp' (tensor and data axes normalize over the whole batch), or "
            "with a normalization without batch statistics (LayerNorm, GroupNorm); in eval() it pipelines",
        )


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path in ("", "<root>") else str(path)


def _free_nodes(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Nodes computed from no parameter (inputs, buffers and constants only): every stage that reads
    one computes it itself."""
    free: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            free[n] = True
        elif n.op == "get_attr":
            free[n] = not isinstance(get_attr(gm, str(n.target)), nn.Parameter)
        elif n.op == "call_function":  # a random op is drawn once, by one stage, as serial draws it
            seeded = torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
            free[n] = not seeded and all(free[i] for i in n.all_input_nodes)
        else:
            free[n] = False
    return free


def unit_order(gm: fx.GraphModule) -> tuple[list[str], dict[str, str]]:
    """The units of the graph's module paths, in forward order, and each path's unit."""
    paths = [p for p in (_module_path(n) for n in gm.graph.nodes) if p]
    names = unit_names(sorted(set(paths)))
    order: list[str] = []
    for p in paths:
        if names[p] and names[p] not in order:  # "": a container's own ops, placed like the root's
            order.append(names[p])
    return order, names


def assign_stages(gm: fx.GraphModule, boundaries: Sequence[str], num_stages: int) -> dict[fx.Node, set[int]]:
    """The stage (or, for a copied parameter-free value, the stages) of every call node."""
    order, unit_of_path = unit_order(gm)
    hint = f"a stage can start with any of {', '.join(order[1:])}"
    if len(boundaries) != num_stages - 1:
        raise PipelineSplitError(
            f"{num_stages} stages need {num_stages - 1} stage boundaries, got {len(boundaries)}", hint=hint
        )
    positions = []
    for b in boundaries:
        if b not in order[1:]:
            raise PipelineSplitError(
                f"stage boundary {b!r} is not a module unit that can start a stage", hint=hint
            )
        positions.append(order.index(b))
    if positions != sorted(set(positions)):
        raise PipelineSplitError(f"stage boundaries {list(boundaries)} are not in forward order", hint=hint)
    stage_of_unit = {u: sum(p <= i for p in positions) for i, u in enumerate(order)}
    free = _free_nodes(gm)
    stage: dict[fx.Node, int] = {}
    deferred: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or free[n]:
            continue
        producers = [stage[i] for i in n.all_input_nodes if i in stage]
        path = _module_path(n)
        if path and unit_of_path[path]:
            s = stage_of_unit[unit_of_path[path]]
            if producers and max(producers) > s:
                raise PipelineSplitError(
                    f"module {path} (stage {s}) reads a value made in stage {max(producers)}: the model "
                    "calls a module again after a later one, so it cannot be cut there",
                    where=path,
                    hint=hint,
                )
            stage[n] = s
        elif producers:
            stage[n] = max(producers)
        else:
            deferred.append(n)
            stage[n] = -1
    last = num_stages - 1
    for n in reversed(deferred):  # reads only parameters and free values: its first reader's stage
        readers = [stage[u] for u in n.users if stage.get(u, -1) >= 0]
        stage[n] = min(readers) if readers else last
    out: dict[fx.Node, set[int]] = {n: {s} for n, s in stage.items()}
    writes = {n: root for n in gm.graph.nodes if (root := written_root(n)) is not None}
    changed = True
    while changed:  # an in-place write into a free value runs in every stage that reads the value
        changed = False
        for n in reversed(gm.graph.nodes):
            if n.op != "call_function" or not free[n]:
                continue
            need: set[int] = set()
            for u in n.users:
                if u.op == "output":
                    need.add(last)
                else:
                    need |= out.get(u, set())
            if n in writes:
                need |= out.get(writes[n], set())
            if need != out.get(n):
                out[n] = need
                changed = True
    for n, root in writes.items():  # a stage's weights written into a value other stages make alike
        if not free[n] and free.get(root, False) and out.get(root, set()) - out[n]:
            raise PipelineSplitError(
                f"{n.name} ({n.target}) writes a value computed from the weights in place into "
                f"{root.name}, a value made from the inputs alone that other stages compute for "
                "themselves: their copies would miss the write",
                where=_module_path(n) or None,
                hint="write the model's value out of place (torch.where, torch.cat) or train on a mesh "
                "without 'pp'",
            )
    return out


def split_stages(
    model: nn.Module,
    flat_example: Sequence[Any],
    example_args: tuple[Any, ...],
    boundaries: Sequence[str],
    num_stages: int,
    example_kwargs: dict[str, Any] | None = None,
) -> StageProgram:
    """Export `model` on one microbatch (positional and keyword inputs) and cut it into
    `num_stages` stage programs. A model returning a `ModelOutput` (or a dict) with a "loss" runs
    its loss only: the other fields (logits, caches) stay on the last stage."""
    _check_batch_statistics(model)
    ep, output_type, structure = export_loss(model, tuple(example_args), example_kwargs)
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and not n.users:  # export's input guard
            gm.graph.erase_node(n)
    guards = _value_guards(gm, flat_example)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat_example):
        raise PipelineSplitError(
            f"the exported model takes {len(placeholders)} inputs, the example has {len(flat_example)}",
            hint="pass the model's inputs as positional tensors",
        )
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    returned = list(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    loss_node: fx.Node | None = None
    rule: LossRule | None = None
    if returns_loss(returned, output_type, structure):
        loss_node, rule = find_loss(gm)
        returned = [loss_node]
    else:
        check_outputs(returned, example_batch_rows(flat_example))
    stages_of = assign_stages(gm, boundaries, num_stages)
    last = num_stages - 1
    if loss_node is not None and stages_of.get(loss_node) != {last}:
        raise PipelineSplitError(
            "the loss is not computed in the last stage", hint="cut the model before its loss"
        )

    # One graph with every parameter-free value copied into each stage that reads it.
    graph = fx.Graph()
    single: dict[fx.Node, fx.Node] = {}
    per_stage: dict[tuple[fx.Node, int], fx.Node] = {}

    def lookup(n: fx.Node, s: int) -> fx.Node:
        return single[n] if n in single else per_stage[(n, s)]

    returned_names: list[str] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            single[n] = graph.node_copy(n)
        elif n.op == "output":
            results = [lookup(r, last) for r in returned]
            returned_names = [r.name for r in results]
            graph.output(results[0] if loss_node is not None else tuple(results))
        elif n.op == "call_function":
            targets = sorted(stages_of.get(n, set()))  # none: a parameter-free value nobody reads
            for s in targets:
                copy = graph.node_copy(n, functools.partial(lookup, s=s))
                copy.meta[_STAGE] = s
                if len(targets) == 1:
                    single[n] = copy
                else:
                    per_stage[(n, s)] = copy
        else:
            raise PipelineSplitError(
                f"the exported graph has a {n.op} node ({n.name}) the pipeline cannot place"
            )
    split_gm = fx.GraphModule(gm, graph)
    split = split_module(
        split_gm, model, lambda n: int(n.meta[_STAGE]), keep_original_node_name=True, tuple_return=True
    )
    nodes = {n.name: n for n in split_gm.graph.nodes}
    inputs_index = {n.name: i for i, n in enumerate(p for p in split_gm.graph.nodes if p.op == "placeholder")}
    order = {n.name: i for i, n in enumerate(split_gm.graph.nodes)}

    subs: list[fx.GraphModule] = []
    for s in range(num_stages):
        sub = getattr(split, f"submod_{s}", None)
        if not isinstance(sub, fx.GraphModule):
            raise PipelineSplitError(f"stage {s} of the cut {list(boundaries)} holds no operation")
        subs.append(sub)
    produced: dict[str, int] = {}
    read_by: dict[str, list[int]] = {}
    stage_sources: list[list[tuple[str, Any]]] = []
    stage_outputs: list[list[str]] = []
    for s, sub in enumerate(subs):
        sources: list[tuple[str, Any]] = []
        for p in sub.graph.nodes:
            if p.op != "placeholder":
                continue
            orig = nodes[p.name]
            if orig.op == "placeholder":
                sources.append(("input", inputs_index[p.name]))
            elif orig.op == "get_attr":
                sources.append(("attr", str(orig.target)))
            else:
                sources.append(("value", p.name))
                read_by.setdefault(p.name, []).append(s)
        out = next(n for n in sub.graph.nodes if n.op == "output")
        names = [a.name for a in out.args[0]]
        for name in names:
            produced[name] = s
        stage_sources.append(sources)
        stage_outputs.append(names)
    for name in returned_names:  # an output made before the last stage passes through to it
        if produced.get(name, last) < last:
            read_by.setdefault(name, []).append(last)

    def crossing(k: int) -> list[str]:
        return sorted(
            (v for v, s in produced.items() if s < k and max(read_by.get(v, [-1])) >= k),
            key=order.__getitem__,
        )

    def specs(names: list[str]) -> tuple[TensorSpec, ...]:
        out = []
        for name in names:
            val = nodes[name].meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise PipelineSplitError(
                    f"value {name} crosses a stage boundary but is not a tensor ({type(val).__name__})",
                    hint="cut the model elsewhere",
                )
            out.append(TensorSpec(tuple(int(d) for d in val.shape), val.dtype))
        return tuple(out)

    order_units, unit_of_path = unit_order(gm)
    positions = [order_units.index(b) for b in boundaries]
    bounds = [0, *positions, len(order_units)]
    stage_units = tuple(tuple(order_units[bounds[s] : bounds[s + 1]]) for s in range(num_stages))
    stages = []
    for s, sub in enumerate(subs):
        cin = crossing(s) if s > 0 else []
        if s < last:
            cout = crossing(s + 1)
        else:
            cout = [loss_node_name(stage_outputs[s])] if loss_node is not None else returned_names
        stages.append(
            StageGraph(
                index=s,
                module=sub,
                sources=stage_sources[s],
                outputs=stage_outputs[s],
                crossing_in=cin,
                crossing_out=cout,
                input_specs=specs(cin),
                output_specs=specs(cout) if s < num_stages - 1 else (),
                attrs=tuple(str(v) for k, v in stage_sources[s] if k == "attr"),
            )
        )
    constants = {}
    for made in stages:
        for attr in made.attrs:
            try:
                get_attr(model, attr)
            except AttributeError:
                constants[attr] = get_attr(gm, attr)
            if isinstance(constants.get(attr), FakeTensor):  # exported from a model on meta
                raise PipelineSplitError(
                    f"{attr} is a tensor the model makes in its forward (a constant of the export), "
                    "and the model is on the meta device, so its value is unknown",
                    hint="register that tensor as a buffer of its module (register_buffer), so "
                    "that the model's initialization makes it, or build the model on a real device",
                )
    randoms = tuple(random_op(single[n], min(stages_of[n])) for n in gm.graph.nodes if draws(n) and n in single)
    if loss_node is None:
        assert structure is not None  # the export recorded what it returns
        layout = OutputLayout(structure, output_type, specs(returned_names))
        dtype = layout.specs[0].dtype
        return StageProgram(
            stages, None, dtype, tuple(order_units), stage_units, constants, output_type, layout, randoms, guards
        )
    dtype = loss_node.meta["val"].dtype
    return StageProgram(
        stages, rule, dtype, tuple(order_units), stage_units, constants, output_type, None, randoms, guards
    )


@contextlib.contextmanager
def module_flags(model: nn.Module, flags: Sequence[bool]) -> Iterator[None]:
    """Every submodule of `model` (in `modules()` order) in the training mode `flags` gives it while
    a stage program or the batch's random ops are exported, each module's own flag put back after:
    a submodule the user froze (`model.bn.eval()` before parallelize, a fine-tuning habit) stays
    frozen, and the model's own flags are left as they were (`model.train(mode)` set them all)."""
    modules = list(model.modules())
    was = [m.training for m in modules]
    for m, flag in zip(modules, flags, strict=True):
        m.training = flag
    try:
        yield
    finally:
        for m, flag in zip(modules, was, strict=True):
            m.training = flag


def batch_random_ops(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None, *, flags: Sequence[bool]
) -> list[RandomOp | None]:
    """The random ops of the model called on the whole batch with its submodules in modes `flags`,
    in the serial order (None: one the pipeline cannot draw as serial does). Exported once per
    batch shape, for the step's dropout masks (`pipeline_random`)."""
    with module_flags(model, flags):
        ep, _, _ = export_loss(model, args, kwargs)
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    return whole_shapes(gm)


def loss_node_name(outputs: list[str]) -> str:
    if len(outputs) != 1:
        raise PipelineSplitError(f"the last stage returns {len(outputs)} values, expected its loss only")
    return outputs[0]
