"""What a pipelined call returns, read from its exported graph: a training call's loss and how
its microbatch terms add up to the serial loss (`LossRule`: a mean rewritten to a sum, divided
by the whole batch's count), or an inference call's outputs (`OutputLayout`: tensors with the
batch on dim 0, put back together from the microbatches'). See docs/pipeline.md."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autopar.core.errors import AutoparError
from autopar.runtime.pipeline_runtime import TensorSpec

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # torch's Reduction enum


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


@dataclass(frozen=True)
class OutputLayout:
    """What a call without a loss returns (inference): the last stage returns `specs`, the model's
    output tensors for one microbatch (each with the microbatch's rows on dim 0, so the batch's are
    their concatenation); `structure` rebuilds them as the model returned them, `output_type`
    (a transformers `ModelOutput`, a dict; None: a tensor or a tuple) wraps the rebuilt mapping,
    whose other fields (a cache object, None values) are left out."""

    structure: pytree.TreeSpec
    output_type: type | None
    specs: tuple[TensorSpec, ...]


def find_loss(gm: fx.GraphModule) -> tuple[fx.Node, LossRule]:
    """The loss node (the graph's only output) and its rule; rewrites a mean reduction to a sum."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    hint = (
        "a pipelined model is trained: compute the loss inside forward (a transformers model: pass its "
        "labels) and return it, or a ModelOutput / dict with a 'loss'; the pipeline runs F.cross_entropy / "
        "nll_loss / mse_loss / l1_loss / binary cross entropy (mean or sum) or .mean() / .sum() of a tensor; "
        "for inference return the outputs (logits) themselves, with the batch on dim 0"
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
        if n.op == "get_attr" and isinstance(functools.reduce(getattr, str(n.target).split("."), gm), nn.Parameter):
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


def returns_loss(returned: list[Any], output_type: type | None, structure: pytree.TreeSpec | None) -> bool:
    """Whether the export returns a loss (a training call) rather than outputs (inference): the
    "loss" of a mapping, or one 0-d tensor (which must then be a loss the pipeline can split)."""
    if output_type is not None:
        return structure is not None and structure.is_leaf()
    if len(returned) != 1 or not isinstance(returned[0], fx.Node):
        return False
    val = returned[0].meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def example_batch_rows(flat: Sequence[Any]) -> int:
    """The rows of one microbatch: dim 0 of its tensor inputs (the pipeline cut them there)."""
    return next(int(t.shape[0]) for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0)


def check_outputs(returned: list[Any], rows: int) -> None:
    """An inference call's outputs are put back together from the microbatches' on dim 0: each must
    be a tensor the model computes with the microbatch's rows there."""
    hint = (
        "return the outputs with the batch on dim 0 (logits [batch, ...]); compute a per-batch "
        "value (a metric) from the returned outputs, or return a loss to train"
    )
    for r in returned:
        val = r.meta.get("val") if isinstance(r, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise PipelineLossError(f"the model returns {type(val or r).__name__}, not a tensor", hint=hint)
        if r.op != "call_function":
            raise PipelineLossError(
                f"the model returns its {r.op} {r.name} unchanged: the pipeline returns what its last stage computes",
                hint=hint,
            )
        if val.dim() == 0 or val.shape[0] != rows:
            raise PipelineLossError(
                f"the model returns {r.name} of shape {tuple(val.shape)}: without the microbatch's {rows} rows "
                "on dim 0, the microbatches' outputs cannot be put back into the batch's",
                hint=hint,
            )
