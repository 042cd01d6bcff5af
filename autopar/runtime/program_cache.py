"""A parallel module's cached programs (`CachedProgram`), and the warning it gives when the cache
thrashes: batches padded each to their own length are a new input signature each, and a signature
compiles its own program (seconds of CPU). Past the cache's size (`MAX_PROGRAMS` in
`runtime/module.py`) the least recently used program is dropped, and a second epoch over the same
lengths compiles at every step. The first time a dropped signature comes back, the user is told
why and what to do, once per module."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.core.layout import Layout
from autopar.core.meta import OutputStructure
from autopar.core.user_warning import warn_at_caller
from autopar.runtime.call_checks import InputGate
from autopar.runtime.param_feed import FeedPlan
from autopar.runtime.program import EmittedProgram

BUCKET_HINT = (
    "pad batches to a few fixed lengths (bucket lengths: pad_to_multiple_of=64 in transformers' "
    "DataCollatorWithPadding, padding='max_length', or a sampler grouping similar lengths into "
    "padded buckets) so that a few programs serve every batch"
)


class ProgramCacheWarning(UserWarning):
    """A program dropped from the parallel module's cache was compiled again."""


class CacheThrash:
    """Remembers the signatures whose programs were dropped, and warns the first time one is
    compiled again (the cache is then too small for the inputs' variety)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.signatures: set[Hashable] = set()  # every signature compiled, kept or dropped
        self.dropped: set[Hashable] = set()
        self.warned = False

    def compiling(self, key: Hashable) -> None:
        """A program is being compiled for `key`: warn if it was compiled before and dropped."""
        self.signatures.add(key)
        if key in self.dropped and not self.warned:
            self.warned = True
            warn_at_caller(
                f"autopar: compiling again a program this module compiled before and dropped: it has "
                f"been called with {len(self.signatures)} distinct input signatures (shapes: many "
                f"distinct batch lengths?), and at most {self.capacity} programs are kept, so calls "
                f"compile again (seconds each); {BUCKET_HINT}",
                ProgramCacheWarning,
            )

    def dropping(self, key: Hashable) -> None:
        self.dropped.add(key)


@dataclass
class CachedProgram:
    """A compiled program in a parallel module's cache, and what calling it needs besides the
    parameters."""

    program: EmittedProgram
    outputs: OutputStructure | None
    source_layouts: dict[str, Layout]
    constants: dict[str, torch.Tensor]
    feed: FeedPlan
    why: str = ""
    gate: InputGate | None = None  # where the forward settles the call's input check (`gate_forward`)
    # programs for the same call signature traced under other input values (`ValueGuards`)
    others: list[CachedProgram] = field(default_factory=list)

    def holding(self, flat: Sequence[Any], device: str) -> CachedProgram | None:
        """This program or one of `others` whose value guards hold for the call's `flat` inputs
        (and, for guards on random draws, the generators' state now) on `device`."""
        for run in (self, *self.others):
            guards = run.program.value_guards
            if guards is None or guards.hold(flat, device):
                return run
        return None
