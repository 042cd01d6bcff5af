"""Value guards: the conditions on input values a program was traced under.

Where the model's Python reads a tensor's value (`if mask.any():`, `assert (labels >= 0).all()`,
`.item()` feeding a branch), one graph cannot serve every batch. The trace then runs the model on
the example batch's real values, takes the branches those values take, and keeps each condition
Python evaluated as a guard (torch.export's runtime assertions, computed from the inputs). Every
call evaluates the guards on the global inputs, identically on every rank and before any
collective: a program is used only for a batch whose guards hold, and a batch that goes the other
way gets its own program (`autopar.runtime.module`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx


@dataclass
class ValueGuards:
    """`module` computes every guard's condition from the user's inputs at `inputs` (positions in
    the flat leaves of the call's `(args, kwargs)`); `conditions` says what each one checks and
    where the model reads the value, for the log line a recompile writes."""

    module: fx.GraphModule
    inputs: tuple[int, ...]
    conditions: tuple[str, ...]

    def hold(self, flat: Sequence[Any]) -> bool:
        """Whether every condition holds for a call whose flat `(args, kwargs)` leaves are `flat`
        (the global inputs: each rank computes the same answer)."""
        values = self.module(*(flat[i] for i in self.inputs))
        return all(bool(v) for v in values)

    def failing(self, flat: Sequence[Any]) -> list[str]:
        """The conditions that do not hold for `flat`."""
        values = self.module(*(flat[i] for i in self.inputs))
        return [text for text, v in zip(self.conditions, values) if not bool(v)]
