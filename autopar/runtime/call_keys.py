"""What selects a compiled program for a call (`ParallelModule`): the call's mode and its
arguments' structure, shapes, dtypes and plain values, and how a new key is described in the log
line a compile writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar.core.errors import InputMismatchError
from autopar.core.precision import AutocastState, describe


@dataclass(frozen=True)
class CallMode:
    """What a program depends on besides its inputs: the module's mode, whether gradients are on,
    the autocast regions of the call, the dtype of every parameter and buffer (after
    `pmodel.to(torch.bfloat16)` the programs compiled for float32 weights no longer fit), and the
    training flag of every submodule (`flags`, by path: a dropout the user keeps in eval inside a
    training model)."""

    training: bool
    forward_only: bool
    autocast: AutocastState = ()
    dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    flags: tuple[tuple[str, bool], ...] = ()


def call_key(spec: Any, flat: Sequence[Any], mode: CallMode) -> tuple[Any, ...]:
    """What selects a program: the arguments' structure, each tensor's shape, dtype and (with
    gradients on) whether it requires grad, which arguments are one tensor passed twice (the
    trace reads such a tensor once: `labels=input_ids`), each other argument's value, and the
    call's `CallMode`."""
    grad = not mode.forward_only
    first_of: dict[int, int] = {}
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            first_of.setdefault(id(x), i)
    leaves = tuple(
        ("tensor", tuple(x.shape), x.dtype, grad and x.requires_grad, first_of[id(x)])
        if isinstance(x, torch.Tensor)
        else ("value", type(x), _hashable(x))  # the type too: a flag True is not the number 1
        for x in flat
    )
    return (spec, leaves, mode)


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def leaf_text(leaf: tuple[Any, ...], index: int) -> str:
    if leaf[0] == "tensor":
        same = f", the tensor of input {leaf[4]}" if leaf[4] != index else ""
        return describe_spec((leaf[1], leaf[2])) + (" requiring grad" if leaf[3] else "") + same
    return repr(leaf[2])


def describe_spec(spec: tuple[tuple[int, ...], torch.dtype] | None) -> str:
    if spec is None:
        return "not a tensor"
    shape, dtype = spec
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


def value_only_differences(key: tuple[Any, ...], others: Sequence[tuple[Any, ...]]) -> dict[int, set[Any]]:
    """For a new call `key`, the plain (non-tensor) arguments whose value alone tells it apart from
    a compiled program's key (same structure, shapes and mode): argument index -> the values seen.
    A number passed where a tensor would do (a diffusion timestep) compiles a program per value."""
    spec, leaves, mode = key
    found: dict[int, set[Any]] = {}
    for other_spec, other_leaves, other_mode in others:
        if other_spec != spec or other_mode != mode:
            continue
        differ = [i for i, (a, b) in enumerate(zip(leaves, other_leaves)) if a != b]
        # the same argument as a plain value of one type in both calls: a 0-d tensor, or a flag
        # where a number was, is another program but not another value of the number
        if differ and all(leaves[i][0] == other_leaves[i][0] == "value" and leaves[i][1] is other_leaves[i][1] for i in differ):
            for i in differ:
                found.setdefault(i, set()).update((leaves[i][2], other_leaves[i][2]))
    return found


def difference_from(last_key: tuple[Any, ...], key: tuple[Any, ...]) -> str:
    """What is new about a call (`key`): its inputs, or its mode, next to the last program's."""
    spec, leaves, mode = key
    last_spec, last_leaves, last = last_key
    changes = []
    if spec != last_spec:
        changes.append("another structure of arguments")
    else:
        changes += [
            f"input {i}: {leaf_text(new, i)} (was {leaf_text(old, i)})"
            for i, (new, old) in enumerate(zip(leaves, last_leaves))
            if new != old
        ]
    if mode.training != last.training:
        changes.append("train() mode" if mode.training else "eval() mode")
    flipped = [path for (path, new), (_, old) in zip(mode.flags, last.flags) if new != old]
    if flipped and mode.training == last.training:
        now = "train()" if dict(mode.flags)[flipped[0]] else "eval()"
        more = f" (and {len(flipped) - 1} more submodules)" if len(flipped) > 1 else ""
        changes.append(f"submodule {flipped[0]} in {now}{more}")
    if mode.forward_only != last.forward_only:
        changes.append("torch.no_grad(): forward only" if mode.forward_only else "gradients on")
    if mode.autocast != last.autocast:
        changes.append(describe(mode.autocast))
    changed = [name for (name, new), (_, old) in zip(mode.dtypes, last.dtypes) if new != old]
    if changed:
        changes.append(
            f"{changed[0]} is {str(dict(mode.dtypes)[changed[0]]).removeprefix('torch.')}"
            + (f" (and {len(changed) - 1} more tensors)" if len(changed) > 1 else "")
        )
    return "; ".join(changes) or "a call seen before, compiled again"


def check_example_call(
    flat: Sequence[Any], spec: Any, in_spec: Any, example_specs: Sequence[tuple[tuple[int, ...], torch.dtype] | None]
) -> None:
    """For a module without a compiler: the call must be the example's (structure, shapes, dtypes)."""
    if spec != in_spec:
        raise InputMismatchError(
            f"inputs have structure {spec}, but the module was compiled for {in_spec}",
            hint="call with the same arguments as example_inputs, or parallelize again",
        )
    for index, (value, expected) in enumerate(zip(flat, example_specs)):
        if expected is None:
            continue
        got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
        if got != expected:
            raise InputMismatchError(
                f"input {index} is {describe_spec(got)}, but the module was compiled for {describe_spec(expected)}",
                hint="shapes are compiled into the plan: pass inputs shaped like example_inputs, "
                "or call autopar.parallelize again with the new shapes",
            )
