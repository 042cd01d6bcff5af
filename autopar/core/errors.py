"""Errors a user can act on: each names what failed, where in their model, and what to do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class AutoparError(Exception):
    """Base class. `where` is the user's module path and source line when known."""

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        where: str | None = None,
        layouts: Sequence[str] = (),
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.op = op
        self.where = where
        self.layouts = tuple(layouts)
        self.hint = hint
        parts = [message]
        if op:
            parts.append(f"  op: {op}")
        if where:
            parts.append(f"  at: {where}")
        for layout in self.layouts:
            parts.append(f"  layout: {layout}")
        if hint:
            parts.append(f"  hint: {hint}")
        super().__init__("\n".join(parts))


class MeshError(AutoparError):
    """The mesh does not fit the job (size, dims, process groups)."""


class TraceError(AutoparError):
    """torch.export or the joint forward/backward trace failed on the user's model."""


class MissingRuleError(AutoparError):
    """An op in the graph has no sharding rule."""


class ShardingError(AutoparError):
    """No layout satisfies an op on this mesh (divisibility, unsupported split)."""


class MemoryLimitError(AutoparError):
    """No plan fits the per-rank memory limit: `memory` is the leanest plan's need, `limit` the
    limit, both in bytes per rank."""

    def __init__(self, message: str, *, memory: float = 0.0, limit: float = 0.0, **kwargs: Any) -> None:
        self.memory = memory
        self.limit = limit
        super().__init__(message, **kwargs)


class InputMismatchError(AutoparError):
    """Inputs at call time differ from the example inputs the module was compiled for."""


class IndexOutOfRangeError(AutoparError, IndexError):
    """An input's value indexes past what it indexes (a token id past the vocabulary, a target
    class past the classes): raised on every rank alike before the call's first collective, an
    IndexError as the serial model's."""


class ModelAssertionError(AutoparError, AssertionError):
    """The model's own `assert` failed on this call's inputs, as the serial model's does on the
    same batch (the trace runs the model's Python on the values where it reads them): raised on
    every rank alike, before the call's first collective; an AssertionError as serial's."""


class ModelValueError(AutoparError, ValueError):
    """The model's own code raised ValueError on this call's inputs (a check like "all examples
    must have the same number of <eos> tokens"), as the serial model does on the same batch."""


class UnknownNameError(AutoparError, KeyError):
    """A name that names nothing here (a graph node to explain); a KeyError, as a lookup's."""

    def __str__(self) -> str:  # KeyError's would quote the whole message
        return self.args[0] if self.args else ""


class RankFailureError(AutoparError, RuntimeError):
    """A collective broke or timed out because another rank failed, left or never came."""


class UsageError(AutoparError, ValueError):
    """An argument that cannot work (a malformed spec, a module that does not import)."""


class UnknownHardwareError(AutoparError, FileNotFoundError):
    """No hardware table of that name or path."""


class InitError(AutoparError):
    """A model built on the meta device could not be initialized rank by rank as serial would."""


class CheckpointError(AutoparError):
    """A checkpoint could not be loaded into the parallel module (missing, truncated or foreign)."""


class InternalError(AutoparError):
    """A bug in autopar: an exception inside a compiler stage that is not one of the errors above.
    It names the stage and the graph node being worked on; the original is its `__cause__`."""


class ForwardHookWarning(UserWarning):
    """A forward hook that will not run at each call as in serial. Either the model's hook returned
    None while autopar traced it (it ran once, at the trace: what it did to the tensors is in the
    program, its Python side effects, such as features appended to a list or a call counter, are
    not; filter the warning for hooks whose work is on the tensors only, `output.requires_grad_()`),
    or a hook was registered on a submodule of the parallel module, which its program never calls."""


class PipelineClipWarning(UserWarning):
    """A pipelined module's gradients were all scaled by one factor after the backward, as
    `torch.nn.utils.clip_grad_norm_(pmodel.parameters(), c)` does: it sees one rank's stages only,
    so each stage is clipped by its own norm, unlike serial. `pmodel.clip_grad_norm_(c)` is the
    serial clip (`autopar.runtime.clip_watch`)."""


class OriginalModelWarning(UserWarning):
    """The model given to `parallelize` was changed afterwards (`model.eval()`, a hook registered on
    it): the parallel module, which holds its own flags and traced the hooks it had then, does not
    see the change (`autopar.runtime.source_watch`). Filter it where the original model is kept as
    a serial reference on purpose."""
