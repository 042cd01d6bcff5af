"""The calls a pipeline stage makes on its `ParallelModule` besides forward: a zero-bubble schedule
runs a call's backward in two parts (input gradients now, weight gradients later), and a step of
microbatches reduces its parameter gradients once at the end instead of at every backward
(docs/pipeline.md). Kept apart from the module's call path: only the pipeline runtime uses them,
and what they set is read by one line of `ParallelModule.forward` (which part of backward runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from autopar.core.precision import autocast_off
from autopar.runtime.defer_reduction import GradAccumulation, ReductionSplit, add_grads, params_grads
from autopar.runtime.groups import failures_named
from autopar.runtime.run_program import WeightDeferral
from autopar.runtime.split_backward import SplitBackward


class StageCalls:
    """Mixin of `ParallelModule`: the state below is set by its constructor."""

    _inductor: bool
    _deferral: WeightDeferral | None  # set around a zero-bubble call (deferring_weights)
    _splits: dict[int, SplitBackward]  # each program's backward cut in two, once
    _accumulation: GradAccumulation | None  # set around a pipeline's calls
    _reduction_splits: dict[int, ReductionSplit]  # each backward cut at its reductions

    @contextlib.contextmanager
    def deferring_weights(self, deferral: WeightDeferral) -> Iterator[None]:
        """Calls inside run their backward's input-gradient part only and leave the weight-gradient
        part in `deferral` (zero-bubble pipelines); `weight_gradients` runs it."""
        deferral.splits = self._splits
        self._deferral = deferral
        try:
            yield
        finally:
            self._deferral = None

    @property
    def can_accumulate_gradients(self) -> bool:
        """Whether `accumulating_gradients` works: the programs' backwards are fx graphs, not
        compiled by Inductor (which would need the cut made before compiling)."""
        return not self._inductor

    @contextlib.contextmanager
    def accumulating_gradients(self, accumulation: GradAccumulation) -> Iterator[None]:
        """Calls inside run their backward without the parameter gradients' reductions, adding the
        unreduced gradients to `accumulation` (and returning none); `accumulation.reduce(params)`
        reduces the sums once (a pipeline step's microbatches, docs/pipeline.md)."""
        assert self.can_accumulate_gradients
        accumulation.splits = self._reduction_splits
        self._accumulation = accumulation
        try:
            yield
        finally:
            self._accumulation = None

    def weight_gradients(
        self, deferral: WeightDeferral, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Run the weight-gradient parts `deferral` holds (after their input-gradient parts ran) and
        return the gradients of `params` (this module's parameters: DTensors), summed over them."""
        totals: list[torch.Tensor | None] = [None] * len(params)
        for job in deferral.pending:
            with failures_named(job.timeout), autocast_off():
                local_grads = job.split.run_weight(job.saved, job.tangents, job.carried)
            add_grads(totals, params_grads(job.local_params, local_grads, params))
        deferral.pending.clear()
        return totals
