"""The precision a call runs in, which a compiled program bakes in.

`torch.autocast` decides at dispatch time which ops run in a lower precision. An emitted program
is a graph of ATen ops whose dtypes were fixed when it was traced, so the autocast state at the
call selects the program (like input shapes do): the trace enters the same autocast regions inside
the traced forward, the casts become explicit nodes, and the programs then run with autocast off
(`autocast_off`), or it would cast again what the graph already cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autopar.core.errors import UsageError

# where a user can turn autocast on for a CPU or accelerator mesh; others are added by the mesh
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Autocast:
    """One active `torch.autocast` region: its device type and lower-precision dtype."""

    device_type: str
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"autocast({self.device_type}, {str(self.dtype).removeprefix('torch.')})"


AutocastState = tuple[Autocast, ...]  # the active regions, one per device type; () when off


def autocast_now(device_types: Iterable[str] = AUTOCAST_DEVICE_TYPES) -> AutocastState:
    """The autocast regions active in this thread for `device_types`."""
    return tuple(
        Autocast(kind, torch.get_autocast_dtype(kind))
        for kind in dict.fromkeys(device_types)
        if torch.is_autocast_enabled(kind)
    )


def compilable_autocast(device_types: Iterable[str]) -> AutocastState:
    """`autocast_now`, refused where a program cannot bake it in yet: the trace runs on CPU fake
    tensors, so another device's autocast op lists would not apply there."""
    state = autocast_now(device_types)
    if any(region.device_type != "cpu" for region in state):
        raise UsageError(
            f"{describe(state)}: autocast is compiled into the programs on CPU meshes only so far",
            hint="call without autocast on this device, or cast the model with .to(torch.bfloat16)",
        )
    return state


@contextlib.contextmanager
def autocast_as(state: AutocastState) -> Iterator[None]:
    """Enter the regions of `state` (nothing when it is empty)."""
    with contextlib.ExitStack() as stack:
        for region in state:
            stack.enter_context(torch.autocast(region.device_type, dtype=region.dtype))
        yield


@contextlib.contextmanager
def autocast_off(device_types: Iterable[str] = AUTOCAST_DEVICE_TYPES) -> Iterator[None]:
    """Turn off every autocast region active for `device_types` (the rest stay as they are)."""
    with contextlib.ExitStack() as stack:
        for region in autocast_now(device_types):
            stack.enter_context(torch.autocast(region.device_type, enabled=False))
        yield


@dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy for the whole model, as FSDP2's `MixedPrecisionPolicy`: every
    parameter read in the forward is a `param_dtype` copy of the stored (master) parameter;
    floating-point inputs are cast to it (`cast_forward_inputs`), outputs to `output_dtype`."""

    param_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @staticmethod
    def of(policy: Any) -> MixedPrecision | None:
        """From torch's `MixedPrecisionPolicy` (or this class); None when it casts nothing.
        Gradient reductions run where the plan puts them, in the dtype the gradient has there, so
        a `reduce_dtype` other than `param_dtype` cannot be honoured and is refused."""
        if policy is None:
            return None
        names = ("param_dtype", "output_dtype", "cast_forward_inputs")
        if not all(hasattr(policy, name) for name in names):
            raise UsageError(
                f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}",
                hint="MixedPrecisionPolicy(param_dtype=torch.bfloat16)",
            )
        reduce_dtype = getattr(policy, "reduce_dtype", None)
        if reduce_dtype is not None and reduce_dtype != policy.param_dtype:
            raise UsageError(
                f"mp_policy reduce_dtype={reduce_dtype} differs from param_dtype={policy.param_dtype}: "
                "autopar reduces a gradient where its plan does, in the dtype it has there",
                hint="leave reduce_dtype unset (reductions in param_dtype, as FSDP2's default), or "
                "train under torch.autocast, whose gradients reach float32 before most reductions",
            )
        found = MixedPrecision(policy.param_dtype, policy.output_dtype, bool(policy.cast_forward_inputs))
        return found if found.param_dtype is not None or found.output_dtype is not None else None


def describe(state: AutocastState) -> str:
    return " + ".join(map(str, state)) if state else "no autocast"
