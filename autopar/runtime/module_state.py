"""What a parallel module does with the ways users move a model's state: a serial state dict
loads into it (each rank keeping its block of each full tensor), `full_state_dict()` gives the
serial model's (plain whole tensors), and pickling or deep-copying it, which cannot give a
working module (each rank holds only its blocks, bound to process groups), is refused with what
to do instead."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from autopar.core.errors import CheckpointError, UsageError
from autopar.runtime.groups import failures_named


class NotDataParallel:
    """Wrapping the module in `DistributedDataParallel` (as transformers' `Trainer` and
    accelerate do under torchrun) raises `UsageError`: the parallel module already splits the
    batch and reduces gradients across ranks, and DDP's broadcast of its parameters (DTensors)
    has no sharding strategy (torch's raw NotImplementedError otherwise). DDP reads this
    attribute at construction, before any collective."""

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> NoReturn:
        raise UsageError(
            f"DistributedDataParallel around a {type(self).__name__}: the parallel module already "
            "splits the work over the mesh and reduces gradients across ranks; DDP cannot wrap it",
            hint="train the parallel module itself in your own loop (loss = ...(pmodel(batch)); "
            "loss.backward(); optimizer.step() with an optimizer over pmodel.parameters()); "
            "transformers' Trainer wraps the model in DDP under torchrun, so write the loop instead "
            "(docs/api.md: transformers' Trainer and accelerate)",
        )


class NotCopyable(NotDataParallel):
    """`pickle.dumps`, `torch.save` and `copy.deepcopy` of the module raise `UsageError`."""

    def _refuse(self, how: str) -> NoReturn:
        kind = type(self).__name__
        raise UsageError(
            f"{how} a {kind}: each rank holds only its blocks of the model, bound to this job's "
            "process groups, so a copy could not run anywhere",
            hint="save with autopar.save_checkpoint(pmodel, path) on every rank (load it with "
            "autopar.load_checkpoint), or take pmodel.state_dict(); to copy the model, copy the "
            "serial model before parallelize; for EMA/SWA weights (AveragedModel deep-copies), "
            "average the parameters instead: diffusers' EMAModel(pmodel.parameters()), or "
            "torch.optim.swa_utils.get_ema_multi_avg_fn(decay) applied to "
            "[p.detach().clone() for p in pmodel.parameters()] after each optimizer step",
        )

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self._refuse("cannot pickle (pickle.dumps, torch.save)")

    def __deepcopy__(self, memo: Any) -> NoReturn:
        self._refuse("cannot deep-copy")


class FullState(NotCopyable):
    """`full_state_dict()`: what `serial_model.load_state_dict` takes. `state_dict()` stays the
    distributed one (DTensors, each rank's blocks) that torch.distributed.checkpoint saves; torch
    refuses to copy those into a plain model ("mixed torch.Tensor and DTensor"), which autopar
    cannot intercept from inside the serial model, so the docs name this method instead."""

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The module's state dict with every distributed tensor made whole (plain tensors, the
        serial model's names and shapes): `serial.load_state_dict(pmodel.full_state_dict())`.
        Every rank must call it (each tensor is gathered, one at a time). With `rank0_only`, ranks
        other than 0 keep nothing and get `{}`; the whole model is held by rank 0 only."""
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        full: dict[str, torch.Tensor] = {}
        groups = getattr(self, "_groups", None)
        state = self.state_dict()  # type: ignore[attr-defined]
        with failures_named(groups.timeout if groups is not None else None):  # a rank gone: named
            for name, value in state.items():
                whole = value.full_tensor() if isinstance(value, DTensor) else value  # a collective
                if keep:
                    full[name] = whole.detach()
        return full


def serial_to_blocks(module: Any, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """`state_dict` with each plain tensor whose key names one of `module`'s DTensors replaced by
    a DTensor of this rank's block of it (`module.stored_block`), laid out as the module's; the
    whole tensor must have the module's global shape."""
    own = module.state_dict(keep_vars=True)
    converted: dict[str, Any] = {}
    for key, value in state_dict.items():
        target = own.get(key)
        if not isinstance(target, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            converted[key] = value
            continue
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(
                f"load_state_dict: {key} has shape {list(value.shape)}, but the model's is {list(target.shape)}",
                hint="load the state dict of this model's configuration (sizes, vocabulary)",
            )
        block = value[module.stored_block(key)] if value.dim() else value
        converted[key] = DTensor.from_local(
            block.detach().to(target.dtype).contiguous(),
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
    return converted


def load_serial_state(module: Any, load: Any, state_dict: Mapping[str, Any], strict: bool, assign: bool) -> _IncompatibleKeys:
    """`nn.Module.load_state_dict` (`load`) on `module`, taking a serial state dict; torch's
    errors (a missing or unexpected key) as `CheckpointError`."""
    if assign:
        raise UsageError(
            "load_state_dict(assign=True) on a parallel module would replace its distributed tensors",
            hint="call load_state_dict(state_dict) without assign: each rank copies its blocks in",
        )
    converted = serial_to_blocks(module, state_dict)
    try:
        result: _IncompatibleKeys = load(converted, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(
            f"load_state_dict: {' '.join(str(exc).split())[:400]}",
            hint="load the state dict of this model (pmodel.state_dict() or the serial model's), or "
            "pass strict=False; for files, autopar.load_checkpoint(pmodel, path)",
        ) from exc
    return result
