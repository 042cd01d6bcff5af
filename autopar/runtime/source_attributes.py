"""What a parallel module answers besides its parameters, buffers and submodules: the source
model's plain attributes (`pmodel.config`, which transformers and diffusers training scripts read:
`unet.config.in_channels`), `dtype` and `device`, and for anything else an error that says where
to read it instead of a bare AttributeError."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

from autopar.core.errors import AutoparError

# nn.Module keeps these in __dict__ itself; never forwarded
_OWN = frozenset({"training", "call_super_init", "dump_patches"})

# What a loop written for DDP or FSDP2 reads off its wrapper, and what replaces it here (a probe's
# `with pmodel.no_sync():` got "neither the parallel module nor Sequential has an attribute
# 'no_sync'", hint "check the name").
WRAPPER_HABITS = {
    "no_sync": (
        "DistributedDataParallel's no_sync()",
        "no context is needed for gradient accumulation: the parallel module reduces each "
        "gradient in every backward, so call (loss / n).backward() on each micro-step and "
        "opt.step() after the last",
    ),
    "set_requires_gradient_sync": (
        "FSDP2's set_requires_gradient_sync()",
        "no switch is needed for gradient accumulation: call (loss / n).backward() on each "
        "micro-step and opt.step() after the last",
    ),
    "module": (
        "DistributedDataParallel's and FSDP's .module",
        "the parallel module stands for the model itself: pmodel.config and the submodules "
        "(pmodel.encoder) are offered, pmodel.full_state_dict() gives the whole trained weights",
    ),
}


class ModuleAttributeError(AutoparError, AttributeError):
    """An attribute the source model has (a method, a property computed from its weights) that
    the parallel module does not offer; an AttributeError, so `hasattr` and `getattr(m, n, d)`
    behave as for a missing attribute."""


# Where a module's whole trained weights are read: a tensor-only module gathers them itself; a
# pipelined one holds only its stages, so they go through a checkpoint.
WHOLE_WEIGHTS = "pmodel.full_state_dict() gives the whole trained weights"
PIPELINE_WHOLE_WEIGHTS = (
    "a pipelined module holds only its stages: autopar.save_checkpoint(pmodel, dir) on every rank, "
    "then torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=dir) gives the serial "
    "model the whole trained weights (docs/pipeline.md#checkpoints)"
)


def remember_source(module: nn.Module, source: nn.Module) -> None:
    """Keep on `module` the source model's plain attributes (not tensors, modules or methods:
    `config`, `name_or_path`, a flag) and, weakly, the source itself (the source may be freed;
    `config` of a diffusers model is a property)."""
    plain = {
        name: value
        for name, value in vars(source).items()
        if not name.startswith("_")
        and name not in _OWN
        and not isinstance(value, (torch.Tensor, nn.Module))
        and not callable(value)
    }
    for table in (source._modules, source._parameters, source._buffers):  # set to None in the source
        plain.update({name: None for name, value in table.items() if value is None})
    module.__dict__["_source_plain"] = plain
    module.__dict__["_source_ref"] = weakref.ref(source)
    module.__dict__["_source_type"] = type(source)


def source_attribute(module: nn.Module, name: str, whole_weights: str = WHOLE_WEIGHTS) -> Any:
    """`name` looked up on what `remember_source` kept, once nn.Module's own lookup failed: the
    source's plain attribute, or an error saying where to read it instead (`whole_weights`: how
    this kind of module gives the whole trained weights)."""
    plain = module.__dict__.get("_source_plain", {})
    if name in plain:
        return plain[name]
    source_type = module.__dict__.get("_source_type")
    if source_type is None or name.startswith("__"):
        raise AttributeError(f"{type(module).__name__!r} object has no attribute {name!r}")
    kind = getattr(source_type, name, None)
    ref = module.__dict__.get("_source_ref")
    source = ref() if ref is not None else None
    if isinstance(kind, property) and source is not None and name == "config":
        return getattr(source, name)  # diffusers' config: a property over a frozen dict
    model = source_type.__name__
    if name in WRAPPER_HABITS and kind is None:
        habit, hint = WRAPPER_HABITS[name]
        raise ModuleAttributeError(
            f"{habit} belongs to a wrapper the parallel module is not (it is the parallel "
            f"{model}, not a DDP or FSDP wrapper around it)",
            hint=hint.replace(WHOLE_WEIGHTS, whole_weights),
        )
    if name == "full_state_dict" and kind is None:
        raise ModuleAttributeError(f"{type(module).__name__} has no full_state_dict()", hint=whole_weights)
    if kind is None and source is not None and not hasattr(source, name):
        raise ModuleAttributeError(
            f"neither the parallel module nor {model} has an attribute {name!r}",
            hint="check the name",
        )
    what = "method" if callable(kind) else "property" if isinstance(kind, property) else "attribute"
    raise ModuleAttributeError(
        f"{model}.{name} is a {what} of the source model, which the parallel module does not "
        "offer: it holds this rank's blocks of the weights, and a method or property of the "
        "source would read the source's own (whole, or freed) weights",
        hint=f"call it on the original model (model.{name}) for what does not depend on the trained "
        "weights; pmodel.config, pmodel.dtype, pmodel.device and the submodules (pmodel.encoder) "
        f"are offered; {whole_weights}",
    )


def first_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the first floating-point parameter, as transformers' and diffusers' models
    report theirs (float32 where there is none)."""
    floating = (p.dtype for p in module.parameters() if p.is_floating_point())
    return next(floating, torch.float32)


class SourceAttributes(nn.Module):
    """Mixin for the parallel module: the source model's plain attributes (`remember_source`),
    `dtype` and `device`, and for anything else an error saying where to read it."""

    def remember_source(self, source: nn.Module) -> None:
        remember_source(self, source)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point parameter (`first_dtype`)."""
        return first_dtype(self)

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (its device of the mesh)."""
        first = next(self.parameters(), None)
        if first is None:
            return torch.device("cpu")
        return first.to_local().device if hasattr(first, "to_local") else first.device

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        return source_attribute(self, name)
