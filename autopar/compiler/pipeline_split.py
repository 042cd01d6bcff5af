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

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from autopar.core.errors import AutoparError
from autopar.planning.stage_units import unit_names
from autopar.runtime.pipeline_runtime import TensorSpec

aten = torch.ops.aten

_STAGE = "autopar_pp_stage"
_MEAN, _SUM = 1, 2  # torch's Reduction enum


class PipelineSplitError(AutoparError, ValueError):
    """The model cannot be cut into pipeline stages where asked."""


class PipelineLossError(AutoparError, ValueError):
    """The model's output is not a loss the pipeline can split over microbatches exactly."""


# Losses whose mean the pipeline rewrites to a sum: op -> how its denominator is counted.
# "targets": targets that are not ignore_index; "numel": elements of the input.
_REDUCED_LOSSES = {
    aten.cross_entropy_loss.default: "targets",
    aten.nll_loss.default: "targets",
    aten.nll_loss_nd.default: "targets",
    aten.nll_loss2d.default: "targets",
    aten.mse_loss.default: "numel",
    aten.l1_loss.default: "numel",
    aten.smooth_l1_loss.default: "numel",
    aten.huber_loss.default: "numel",
    aten.binary_cross_entropy.default: "numel",
    aten.binary_cross_entropy_with_logits.default: "numel",
}


@dataclass(frozen=True)
class LossRule:
    """How a microbatch's loss term relates to the serial loss: serial = sum of terms / sum of
    counts. `kind` "targets": a count is the number of targets other than `ignore_index`
    (`target` computes the targets from the flat microbatch inputs); "numel": `numel`, the
    element count of the reduced tensor; "one": the loss was a sum already (counts of 1, divided
    out by `summed`)."""

    op: str
    kind: str
    numel: int = 1
    ignore_index: int = -100
    target: fx.GraphModule | None = None

    def count(self, flat_inputs: Sequence[Any]) -> int:
        """The denominator of this microbatch's mean (1 for a sum-reduced loss)."""
        if self.kind == "targets":
            assert self.target is not None
            tgt = self.target(*flat_inputs)
            return int((tgt != self.ignore_index).sum())
        return self.numel if self.kind == "numel" else 1


def loss_weights(counts: Sequence[int]) -> list[float]:
    """Each microbatch's weight in the serial mean, count_m / sum of counts: the serial loss is
    sum_m weight_m * (microbatch m's mean). The runtime uses the equivalent sum_m (microbatch m's
    sum) / sum of counts, which stays defined when a microbatch counts 0 (all targets ignored)."""
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


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
    """The model cut into stages for one microbatch shape."""

    stages: list[StageGraph]
    loss: LossRule
    loss_dtype: torch.dtype
    units: tuple[str, ...]  # the module units in forward order (what stage boundaries name)
    stage_units: tuple[tuple[str, ...], ...]  # the units each stage holds
    constants: dict[str, Any]  # attributes the export made that the model lacks (lifted constants)
    output_type: type | None = None  # the mapping the model returns its loss in (a ModelOutput)


def get_attr(root: nn.Module, qualname: str) -> Any:
    """The attribute a graph's get_attr names (a parameter, buffer or constant of the model)."""
    return functools.reduce(getattr, qualname.split("."), root)


def _export_loss(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[Any, type | None]:
    """torch.export of `model`, keeping only the "loss" of an output mapping (a transformers
    `ModelOutput` with logits and a cache object, a dict): the last stage returns its loss term. The
    instance's forward is wrapped for the export and restored after it, as the tensor trace does
    on its copy. Also returns the mapping's type (None: the model returns its loss itself)."""
    found: list[type | None] = [None]
    had_own = "forward" in model.__dict__
    original = model.forward

    @functools.wraps(original)
    def loss_only(*a: Any, **k: Any) -> Any:
        result = original(*a, **k)
        if isinstance(result, Mapping) and "loss" in result:
            found[0] = type(result)
            return result["loss"]
        return result

    model.forward = loss_only  # type: ignore[method-assign]
    try:
        ep = torch.export.export(model, args, kwargs=kwargs or None, strict=False)
    except AutoparError:
        raise
    except Exception as exc:  # torch raises many types; the user needs the cause and what to do
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (
            "a pipelined model is trained: its forward must return its loss (pass the labels or "
            "targets as its documentation does); inference without a loss runs on a mesh without 'pp'"
        )
        if "in output" in first and "pytree" in str(exc):
            hint = (
                "the model returns an object torch.export cannot hand back in a tuple (a transformers "
                "model called with return_dict=False returns its cache there): call it with its default "
                "return_dict, whose ModelOutput's loss the pipeline keeps"
            )
        raise PipelineSplitError(
            f"torch.export could not trace {type(model).__name__} for the pipeline: {type(exc).__name__}: {first}",
            hint=hint,
        ) from exc
    finally:
        if had_own:
            model.forward = original  # type: ignore[method-assign]
        else:
            del model.forward
    return ep, found[0]


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


def _find_loss(gm: fx.GraphModule) -> tuple[fx.Node, LossRule]:
    """The loss node (the graph's only output) and its rule; rewrites a mean reduction to a sum."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    hint = (
        "a pipelined model is trained: compute the loss inside forward (a transformers model: pass its "
        "labels) and return it, or a ModelOutput / dict with a 'loss'; the pipeline runs F.cross_entropy / "
        "nll_loss / mse_loss / l1_loss / binary cross entropy (mean or sum) or .mean() / .sum() of a tensor; "
        "inference without a loss (logits only) runs on a mesh without 'pp'"
    )
    if len(flat) != 1 or not isinstance(flat[0], fx.Node):
        raise PipelineLossError(
            f"the model returns {len(flat)} values, not one loss",
            hint=hint + " (a transformers model called with return_dict=False: call it with its default)",
        )
    node = flat[0]
    target = node.target
    if target in _REDUCED_LOSSES:
        kwargs = all_arguments(node)
        reduction = int(kwargs.get("reduction", _MEAN))
        if reduction == _SUM:
            return node, LossRule(str(target), "one")
        if reduction != _MEAN:
            raise PipelineLossError(f"the loss {target} is not reduced (reduction='none')", hint=hint)
        kind = _REDUCED_LOSSES[target]
        if kind == "targets" and kwargs.get("weight") is not None:
            raise PipelineLossError(
                f"the loss {target} has class weights: its mean divides by the targets' summed weights",
                hint="compute the weighted loss with reduction='sum' and divide by a count you pass in, "
                "or drop the class weights",
            )
        kwargs["reduction"] = _SUM
        node.args, node.kwargs = tuple(kwargs.values()), {}
        if kind == "targets":
            ignore = int(kwargs.get("ignore_index", -100))
            return node, LossRule(
                str(target), kind, ignore_index=ignore, target=_target_program(gm, kwargs["target"])
            )
        val = kwargs["self"].meta["val"]
        return node, LossRule(str(target), kind, numel=int(val.numel()))
    if target is aten.sum.default or (target is aten.sum.dim_IntList and _all_dims(node)):
        return node, LossRule(str(target), "one")
    if target is aten.mean.default or (target is aten.mean.dim and _all_dims(node)):
        numel = int(node.args[0].meta["val"].numel())  # type: ignore[union-attr]
        node.target = aten.sum.default if target is aten.mean.default else aten.sum.dim_IntList
        return node, LossRule(str(target), "numel", numel=numel)
    raise PipelineLossError(
        f"the model's output is {target}, not a loss the pipeline can split exactly", hint=hint
    )


def all_arguments(node: fx.Node) -> dict[str, Any]:
    """Every argument of an ATen call by its schema name, defaults filled in, in schema order."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value
    return out


def _all_dims(node: fx.Node) -> bool:
    val = node.args[0].meta["val"]  # type: ignore[union-attr]
    dims = node.args[1] if len(node.args) > 1 else None
    return dims is None or len(dims) == 0 or {d % max(val.dim(), 1) for d in dims} == set(range(val.dim()))  # type: ignore[arg-type,union-attr]


def _target_program(gm: fx.GraphModule, target: fx.Node) -> fx.GraphModule:
    """A program that computes the loss's targets from the flat inputs (all placeholders kept),
    so the counts are known before any forward. Targets computed from a parameter or an
    activation are refused."""
    needed: set[fx.Node] = set()
    todo = [target]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op == "get_attr" and isinstance(get_attr(gm, str(n.target)), nn.Parameter):
            raise PipelineLossError(
                "the loss's targets are computed from a parameter; the pipeline counts them before any forward",
                hint="pass the targets as an input of the model",
            )
        if n.op not in ("placeholder", "get_attr", "call_function"):
            raise PipelineLossError(f"the loss's targets depend on {n.op} {n.name}")
        todo.extend(n.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[target])
    return fx.GraphModule(gm, graph)


def _free_nodes(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Nodes computed from no parameter (inputs, buffers and constants only): every stage that reads
    one computes it itself."""
    free: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            free[n] = True
        elif n.op == "get_attr":
            free[n] = not isinstance(get_attr(gm, str(n.target)), nn.Parameter)
        elif n.op == "call_function":
            free[n] = all(free[i] for i in n.all_input_nodes)
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
    for n in reversed(gm.graph.nodes):
        if n.op != "call_function" or not free[n]:
            continue
        need: set[int] = set()
        for u in n.users:
            if u.op == "output":
                need.add(last)
            else:
                need |= out.get(u, set())
        out[n] = need
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
    ep, output_type = _export_loss(model, tuple(example_args), example_kwargs)
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and not n.users:  # export's input guard
            gm.graph.erase_node(n)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat_example):
        raise PipelineSplitError(
            f"the exported model takes {len(placeholders)} inputs, the example has {len(flat_example)}",
            hint="pass the model's inputs as positional tensors",
        )
    loss_node, rule = _find_loss(gm)
    stages_of = assign_stages(gm, boundaries, num_stages)
    if stages_of.get(loss_node) != {num_stages - 1}:
        raise PipelineSplitError(
            "the loss is not computed in the last stage", hint="cut the model before its loss"
        )

    # One graph with every parameter-free value copied into each stage that reads it.
    graph = fx.Graph()
    single: dict[fx.Node, fx.Node] = {}
    per_stage: dict[tuple[fx.Node, int], fx.Node] = {}

    def lookup(n: fx.Node, s: int) -> fx.Node:
        return single[n] if n in single else per_stage[(n, s)]

    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            single[n] = graph.node_copy(n)
        elif n.op == "output":
            graph.output(lookup(loss_node, num_stages - 1))
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
        cout = crossing(s + 1) if s < num_stages - 1 else [loss_node_name(stage_outputs[s])]
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
    loss_val = loss_node.meta["val"]
    return StageProgram(stages, rule, loss_val.dtype, tuple(order_units), stage_units, constants, output_type)


def loss_node_name(outputs: list[str]) -> str:
    if len(outputs) != 1:
        raise PipelineSplitError(f"the last stage returns {len(outputs)} values, expected its loss only")
    return outputs[0]
