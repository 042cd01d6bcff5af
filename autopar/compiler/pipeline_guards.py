"""Value guards on a pipeline (docs/debugging.md#value-guards): which of the stage programs
exported for a microbatch shape serves a microbatch of this call, decided on every rank alike
before any stage runs.

A pipeline exports its stage programs on one microbatch, so the branches its Python takes
(`if x.sum() > 0:`, `assert (labels >= 0).all()`, BART's end-of-sequence check) are the
microbatch's. The serial model takes them on the whole batch. A program serves a microbatch only
where its branch conditions hold on the whole batch (then the microbatch's rows go through the ops
the serial model runs on them) and its counts (`nonzero_static` sizes) hold on the microbatch.
Every rank holds the whole batch, and the conditions are functions of the inputs alone, so every
rank decides the same: a batch the serial model rejects raises the model's own error on every rank,
and no rank waits in a send for a peer that raised."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils import _pytree as pytree

from autopar.compiler.pipeline_split import PipelineSplitError, StageProgram
from autopar.passes.eager_checks import eager_error

BRANCH_HINT = (
    "a pipeline runs each microbatch through a program of its own, traced on that microbatch's "
    "values; compute the branch with tensor ops (torch.where) so both sides are in one program, "
    "choose microbatches whose rows decide it as the whole batch does, or train on a mesh without 'pp'"
)


Call = tuple[tuple[Any, ...], dict[str, Any]]  # a call's (args, kwargs)


def serving(programs: Sequence[StageProgram], whole: Call, micro: Sequence[Any], device: str) -> StageProgram | None:
    """The first of `programs` (exported for the microbatch's signature) whose guards hold for the
    microbatch whose flat inputs are `micro`, of the call `whole`; None where none does."""
    whole_values = whole_flat(whole)
    return next((p for p in programs if not failing(p, whole_values, micro, device)), None)


def export_for_branch(
    model: nn.Module,
    micro: tuple[Sequence[Any], Call],
    whole: Call,
    microbatch: int,
    known: Sequence[StageProgram],
    same_shape: Sequence[tuple[Sequence[Any], Call]],
    export: Callable[[Sequence[Any], Call], StageProgram],
    device: str,
) -> StageProgram:
    """A program for microbatch `microbatch` (`micro`: its flat inputs and call) where none of the
    `known` programs of its signature serves it. Where some exist, the batch goes another way than
    they were traced for: the serial model's own error comes first, if it raises on `whole`. The
    program is exported (`export(flat, call)`) on the microbatch, or, where its rows take another
    branch than the whole batch, on another microbatch of the call with its shape (`same_shape`)
    whose rows take the whole batch's; where none does, the call is refused."""
    flat, call = micro
    whole_values = whole_flat(whole)
    if known:
        refused = refuse_batch(model, whole, microbatch, failing(known[0], whole_values, flat, device))
        if not isinstance(refused, PipelineSplitError):
            raise refused
    first_failed: list[str] = []
    for example_flat, example in [(flat, call), *same_shape]:
        program = export(example_flat, example)
        failed = failing(program, whole_values, flat, device)
        if not failed:
            return program
        first_failed = first_failed or failed
    raise refuse_batch(model, whole, microbatch, first_failed)


def failing(program: StageProgram, whole: Sequence[Any], micro: Sequence[Any], device: str) -> list[str]:
    """The conditions of `program`'s guards that fail for a microbatch whose flat inputs are
    `micro`, of a call whose flat inputs are `whole` (`ValueGuards.failing_per_microbatch`)."""
    guards = program.value_guards
    if guards is None:
        return []
    try:
        return guards.failing_per_microbatch(whole, micro, device)
    except Exception as exc:  # noqa: BLE001 - a guard whose ops only fit the microbatch's shapes
        raise PipelineSplitError(
            f"the condition {guards.conditions[0]} cannot be evaluated on the whole batch: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            where=guards.conditions[0],
            hint="the condition's ops are traced on one microbatch's shapes (a view to a fixed size); "
            + BRANCH_HINT,
        ) from exc


def refuse_batch(model: nn.Module, call: Call, microbatch: int, failed: Sequence[str]) -> Exception:
    """The error for a call no program can serve, the same on every rank: the model's own
    AssertionError / ValueError where the serial model rejects the batch (run eagerly on a copy),
    otherwise a microbatch whose rows take another branch than the whole batch."""
    args, kwargs = call
    own = eager_error(model, args, kwargs)
    if own is not None:
        return own
    return PipelineSplitError(
        f"microbatch {microbatch} of this call takes another branch at {failed[0]} than the whole "
        "batch takes in the serial model",
        where=failed[0],
        hint=BRANCH_HINT,
    )


def whole_flat(call: Call) -> list[Any]:
    """The call's flat inputs, in the order a microbatch program's guards index them."""
    return pytree.tree_leaves(call)
