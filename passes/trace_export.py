"""torch.export of the user's model for the trace (`autopar.passes.trace`): the export itself, on
fake tensors or on the example's real values, with the routes and quiet contexts it needs and the
errors it raises named for the user; and the constants an export on real values leaves behind."""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.meta import NodeInfo, info, set_info, signature
from autopar.passes.ctc import CTCRoute
from autopar.passes.eager_checks import model_error
from autopar.passes.masked_writes import is_view_op
from autopar.passes.trace_errors import export_error, raised_in_user_code, without_partial_graph
from autopar.passes.value_guards import quiet_symbolic_shapes, reading_real_values


def foreign_buffers_as_constants(gm: fx.GraphModule, forward: nn.Module, model: nn.Module) -> None:
    """Tensors the forward made on the example's real values (`torch.tensor(pad_id)` in
    transformers' `shift_tokens_right`) come out of torch.export's unlifted module as attributes
    the joint trace reads as buffers, which the user's model does not have: they become constants
    of the program (role "constant", their values in the signature), as the tensors a trace on
    fake values makes do (`_lift_constants`)."""
    own = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    sig = signature(gm)
    for node in gm.graph.nodes:
        if node.op != "placeholder" or info(node).role != "buffer" or info(node).param_name in own:
            continue
        name = str(info(node).param_name)
        owner_path, _, attr = name.rpartition(".")
        value = getattr(forward.get_submodule(owner_path), attr)
        set_info(node, NodeInfo(role="constant", phase="forward", param_name=name))
        sig.constants[name] = value.detach().clone()
        sig.buffer_names.remove(name)


def export_model(
    model: nn.Module,
    fake_model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reading_values: bool = False,
) -> Any:
    """torch.export of `fake_model` (the user's `model` with fake tensors); `reading_values`: of a
    copy holding the real tensors, run on the example's real values, which decide every value
    Python reads, each condition kept as a runtime assertion (`autopar.passes.value_guards`)."""
    try:
        # CTCRoute: F.ctc_loss as autopar's fixed-shape op (torch's sizes an output by values)
        with warnings.catch_warnings(), CTCRoute(), quiet_symbolic_shapes(), without_partial_graph():
            # nn.LSTM / nn.GRU re-assign their weight list
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights")
            if not reading_values:
                return torch.export.export(fake_model, args, kwargs, strict=False)
            with reading_real_values():
                return torch.export.export(fake_model, args, kwargs, strict=False)
    except (AssertionError, ValueError) as exc:
        if reading_values and raised_in_user_code(exc):  # the model's own check failed on these values
            raise model_error(model, exc) from exc
        raise export_error(model, exc) from exc
    except Exception as exc:  # torch raises many types; the user needs the location and the cause
        raise export_error(model, exc) from exc




def outputs_as_copies_of_views(module: fx.GraphModule) -> int:
    """Where several outputs of `module` (torch.export's module) are views of one intermediate
    value, make all but the first copies, in place; returns how many. The joint export returns
    the base of such views as an extra output, with a tangent of the base's shape, for torch's
    runtime to rebuild the views (ProphetNet's logits and n-gram logits, slices of its predicting
    streams); a copy is the same values, and a lone view of an intermediate the joint export
    already returns as a plain output. Views of inputs and weights are left: torch handles those
    without an extra output."""
    graph = module.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    seen: dict[fx.Node, fx.Node] = {}  # base -> the first output viewing it
    copies: dict[fx.Node, fx.Node] = {}

    def base_of(node: fx.Node) -> fx.Node | None:
        base = node
        while base.op == "call_function" and (is_view_op(base) or base.target is operator.getitem):
            if not base.args or not isinstance(base.args[0], fx.Node):
                return None
            base = base.args[0]
        return base if base is not node and base.op == "call_function" else None

    def copied(node: fx.Node) -> fx.Node:
        base = base_of(node)
        if base is None or seen.setdefault(base, node) is node:
            return node
        if node not in copies:
            with graph.inserting_before(output):
                copies[node] = graph.call_function(torch.ops.aten.clone.default, (node,))
            copies[node].meta.update(node.meta)
        return copies[node]

    output.args = fx.map_arg(output.args, copied)
    if copies:
        graph.lint()
        module.recompile()
    return len(copies)
