"""The model run eagerly on a copy of itself and of the example (the user's model, batch and
generator untouched): the serial model's behaviour where the trace needs it. Its random draws
(`autopar.passes.random_guards`), and its own error on a batch it rejects, which the trace may meet
later and elsewhere (BART's end-of-sequence count check is deferred by torch.export to run time,
so a bad batch fails the trace in a view the count sizes): the user gets the serial model's
AssertionError / ValueError, not a trace failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.core.errors import ModelAssertionError, ModelValueError
from autopar.core.value_guards import generators_kept
from autopar.passes.trace_errors import user_frame_of
from autopar.passes.value_guards import (
    inputs_have_values,
    private_inputs,
    quiet_symbolic_shapes,
    reading_real_values,
    valued_copy,
)

T = TypeVar("T")


def eager_run(
    model: nn.Module, device: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[], Any]:
    """The model run eagerly on copies of the example (`valued_copy`, `private_inputs`), without
    gradients: its random draws are the serial model's (`eager_draw_states`)."""

    def run() -> Any:
        copy_ = valued_copy(model, device)
        private_args, private_kwargs = private_inputs(args, kwargs, frozen=True)
        with torch.no_grad():
            return copy_(*private_args, **private_kwargs)

    return run


def model_error(model: nn.Module, exc: AssertionError | ValueError) -> ModelAssertionError | ModelValueError:
    """The model's own check failing on the call's inputs, as the autopar error a user can catch
    as the serial model's (an AssertionError or ValueError too), naming the line that raised."""
    kind = ModelAssertionError if isinstance(exc, AssertionError) else ModelValueError
    return kind(
        f"{type(model).__name__} raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        where=user_frame_of(exc),
        hint="the serial model raises this on the same inputs: check the batch (no rank has run "
        "any collective for this call)",
    )


def eager_error(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ModelAssertionError | ModelValueError | None:
    """The model's own AssertionError / ValueError on these inputs, run eagerly on a copy (the
    user's model and batch untouched), or None: where the model holds its weights (on meta, zeros
    would stand in for them and decide nothing about the serial model) and the inputs values."""
    if not inputs_have_values(args, kwargs) or any(
        t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]
    ):
        return None
    device = next((x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
    try:
        with torch.random.fork_rng(devices=[]):  # the user's generator stays where it was
            eager_run(model, device or torch.device("cpu"), args, kwargs)()
    except (AssertionError, ValueError) as exc:  # what the serial model raises on this batch, wherever
        return model_error(model, exc)
    except Exception:  # noqa: BLE001 - any other failure is not the model's check: the trace's error stands
        return None
    return None


def on_real_values(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    export: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], T],
) -> T:
    """`export(copy, args, kwargs)` run with torch.export's real-tensor propagation on a copy of
    the model (`valued_copy`) and of the inputs: where Python reads a value, the example's value
    decides and the condition stays in the graph as a runtime assertion (a value guard). The
    user's model, batch and random generators are left as they were (the forward runs for real,
    dropout included). The model's own AssertionError / ValueError on these inputs is raised as
    the serial model's (`eager_error`)."""
    device = next((x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
    device = device or torch.device("cpu")
    copy_ = valued_copy(model, device)
    private_args, private_kwargs = private_inputs(args, kwargs, frozen=False)
    try:
        with generators_kept(device), quiet_symbolic_shapes(), reading_real_values():
            return export(copy_, private_args, private_kwargs)
    except (AssertionError, ValueError) as exc:
        own = eager_error(model, args, kwargs)
        if own is not None:
            raise own from exc
        raise
