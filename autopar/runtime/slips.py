"""The common slip: an optimizer over the original model's parameters instead of the parallel
module's, `SGD(model.parameters())` after `pmodel = parallelize(model, ...)`.

The parallel module holds its own copies of the weights (each rank's blocks, as DTensors), and
its backward fills their gradients only: the original parameters never get one, so such an
optimizer steps over no gradient at all and the model trains on nothing, without a word. The
original model stays usable (a serial reference, evaluation), so it is not changed; instead each
`parallelize` watches optimizer steps (torch's hook on every optimizer's step) for as long as its
module lives and refuses a step that can only be this slip: the optimizer holds parameters of the
parallelized model, none of its parameters has a gradient, and the parallel module's do (its
backward ran). A serial model trained beside the parallel one has its gradients and is left
alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

from autopar.core.errors import UsageError


def watch_optimizers(source: nn.Module, parallel: nn.Module) -> None:
    """Refuse, while `parallel` lives, an optimizer step over `source`'s parameters that would
    train nothing (see the module doc). Holds neither module."""
    originals: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {
        id(p): (name, weakref.ref(p)) for name, p in source.named_parameters()
    }
    handle = register_optimizer_step_pre_hook(_before_step(originals, weakref.ref(parallel)))
    weakref.finalize(parallel, handle.remove)


def _before_step(
    originals: dict[int, tuple[str, weakref.ref[torch.Tensor]]], parallel: weakref.ref[nn.Module]
) -> Callable[[Optimizer, Any, Any], None]:
    def before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        named = [
            originals[id(p)][0] for p in params if id(p) in originals and originals[id(p)][1]() is p
        ]
        if not named or any(p.grad is not None for p in params):
            return
        module = parallel()
        if module is None or all(q.grad is None for q in module.parameters()):
            return
        raise UsageError(
            f"the optimizer steps over the original model's parameters ({named[0]} and "
            f"{len(named) - 1} more), which autopar does not train: the parallel module holds its "
            "own copies and its backward fills only their gradients, so this step would change nothing",
            hint="build the optimizer over the parallel module's parameters: "
            "torch.optim.SGD(pmodel.parameters(), ...) with pmodel = autopar.parallelize(model, ...)",
        )

    return before_step
