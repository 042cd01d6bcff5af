"""torch.export of the user's model for the trace (`autopar.passes.trace`): the export itself, on
fake tensors or on the example's real values, with the routes and quiet contexts it needs and the
errors it raises named for the user; and the constants an export on real values leaves behind."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.meta import NodeInfo, info, set_info, signature
from autopar.passes.ctc import CTCRoute
from autopar.passes.eager_checks import model_error
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


