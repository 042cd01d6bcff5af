"""The model's forward exported with torch.export for the pipeline's stage split
(`autopar.compiler.pipeline_split`): its loss only (or its tensor outputs), the user's model left
as it was, and on a model whose Python reads a tensor's value, a second export on the example's
real values that keeps each condition as a runtime assertion (a value guard)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.core.errors import AutoparError
from autopar.passes.eager_checks import eager_error, on_real_values
from autopar.passes.hooks import take_root_forward_hooks
from autopar.passes.host_random import without_host_draws
from autopar.passes.trace import fake_clone
from autopar.passes.trace_errors import user_frame_of, without_partial_graph
from autopar.passes.value_guards import inputs_have_values


class PipelineSplitError(AutoparError, ValueError):
    """The model cannot be cut into pipeline stages where asked."""


def export_loss(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[Any, type | None, pytree.TreeSpec | None]:
    """torch.export of `model`, keeping only the "loss" of an output mapping (a transformers
    `ModelOutput` with logits and a cache object, a dict): the last stage returns its loss term. A
    mapping without a loss (a transformers model called without labels) keeps its tensor fields
    (logits, hidden states), not its cache. Also returns the mapping's type (None: the model
    returns a tensor or a tuple) and the structure of what the export returns. Where Python reads
    a tensor's value (a branch or an assert on the inputs), the export runs again on the example's
    real values, each condition kept as a runtime assertion for `split_value_guards`."""
    found: list[Any] = [None, None]
    target, target_args, target_kwargs = _exportable(model, args, kwargs)
    try:
        return _export_wrapped(target, target_args, target_kwargs, found), found[0], found[1]
    except AutoparError:
        raise
    except Exception as exc:  # torch raises many types; the user needs the cause and what to do
        failed: Exception = exc
    if _reads_values(failed) and target is model and inputs_have_values(args, kwargs or {}):
        try:
            ep = on_real_values(model, args, kwargs or {}, lambda m, a, k: _export_wrapped(m, a, k, found))
            return ep, found[0], found[1]
        except AutoparError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported below with the cause and what to do
            failed = exc
    raise _export_error(model, args, kwargs, failed) from failed


def _reads_values(exc: Exception) -> bool:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return "GuardOnDataDependent" in type(exc).__name__ or "data-dependent" in first


def _export_wrapped(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None, found: list[Any]
) -> Any:
    """torch.export of `model` whose forward returns only its loss (or its tensor outputs): the
    instance's forward is wrapped for the export and restored after it, as the tensor trace does
    on its copy, and the model's own forward hooks run inside it, on the whole output as in serial
    (`take_root_forward_hooks`), put back after it. `found` receives the output mapping's type and
    the returned structure."""
    had_own = "forward" in model.__dict__
    original = model.forward
    root_hooks, put_back = take_root_forward_hooks(model)

    @functools.wraps(original)
    def loss_only(*a: Any, **k: Any) -> Any:
        result = root_hooks(a, k, original(*a, **k))
        if isinstance(result, Mapping):
            found[0] = type(result)
            if result.get("loss") is not None:
                result = result["loss"]
            else:
                result = {key: v for key, v in result.items() if _tensors_only(v)}
        found[1] = pytree.tree_structure(result)
        return result

    model.forward = loss_only  # type: ignore[method-assign]
    try:
        with without_partial_graph():  # torch's own page of generated code per failed export
            # a numpy or Python random draw would be a constant of every stage's program: refused
            return without_host_draws(
                type(model).__name__, lambda: torch.export.export(model, args, kwargs=kwargs or None, strict=False)
            )
    finally:
        put_back()
        if had_own:
            model.forward = original  # type: ignore[method-assign]
        else:
            del model.forward


def _export_error(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None, exc: Exception
) -> AutoparError:
    """The error for an export that failed: the model's own on a batch it rejects (as serial's),
    otherwise a `PipelineSplitError` with the cause and what to do."""
    own = eager_error(model, args, kwargs or {})
    if own is not None:  # a batch the model itself rejects: its own error, as serial's
        return own
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hint = (
        "the pipeline exports the model's forward with torch.export: a model that returns its loss, "
        "or its output tensors (logits) for inference, as its documentation calls it"
    )
    if _reads_values(exc):
        hint = (
            "Python reads a tensor's value here, and even the example's real values do not fix it (the "
            "inputs are on the meta device, or the value sets a size the rest of the model uses): "
            "compute the branch with tensor ops (torch.where), or pad to fixed sizes"
        )
    if "in output" in first and "pytree" in str(exc):
        hint = (
            "the model returns an object torch.export cannot hand back in a tuple (a transformers "
            "model called with return_dict=False returns its cache there): call it with its default "
            "return_dict, whose ModelOutput's loss (or logits) the pipeline keeps"
        )
    return PipelineSplitError(
        f"torch.export could not trace {type(model).__name__} for the pipeline: {type(exc).__name__}: {first}",
        where=user_frame_of(exc) or None,
        hint=hint,
    )


def _exportable(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any] | None]:
    """What to export: the model itself, or, where some of its tensors are on the meta device (a
    model built on meta, of which this rank made only its stages' tensors), a copy holding fake
    tensors on the inputs' device, called on fake inputs. The graph is the same; its stages read
    the user's tensors when they run, so nothing of the model is allocated for the export."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        return model, args, kwargs
    plain = [
        f"{path}.{key}" if path else key
        for path, module in model.named_modules()
        for key, value in vars(module).items()
        if isinstance(value, torch.Tensor) and value.is_meta
    ]
    if plain:  # no initialization makes it: on meta its value is lost
        raise PipelineSplitError(
            f"{type(model).__name__}.{plain[0]} is a tensor attribute on the meta device that is neither a "
            "parameter nor a buffer, so nothing makes its value",
            where=plain[0],
            hint="register it as a buffer of its module (register_buffer) and set it in the module's "
            "reset_parameters() or _init_weights, or build the model on a real device",
        )
    given = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    device = given[0].device if given else torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    stand_in = fake_clone(model, fake_mode, device=device)
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake_mode.from_tensor, (args, kwargs))
    return stand_in, fake_args, fake_kwargs


def _tensors_only(value: Any) -> bool:
    """Whether an output field is tensors only (logits, a tuple of hidden states), not a cache."""
    leaves = pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(t, torch.Tensor) for t in leaves)
