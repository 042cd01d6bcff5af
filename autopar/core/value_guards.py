"""Value guards: the conditions on input values a program was traced under.

Where the model's Python reads a tensor's value (`if mask.any():`, `assert (labels >= 0).all()`,
`.item()` feeding a branch), one graph cannot serve every batch. The trace then runs the model on
the example batch's real values, takes the branches those values take, and keeps each condition
Python evaluated as a guard (torch.export's runtime assertions, computed from the inputs). Every
call evaluates the guards on the global inputs, identically on every rank and before any
collective: a program is used only for a batch whose guards hold, and a batch that goes the other
way gets its own program (`autopar.runtime.module`).

A condition may also read random draws (LayerDrop's `torch.rand([]) < p`): the guard program then
replays the forward's random ops up to the last such draw from the generator's state at the call
(the state every rank shares, and serial has at this point), and restores the state after, so the
program draws the same numbers again (`autopar.passes.random_guards`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx


@dataclass
class ValueGuards:
    """`module` computes every guard's condition from the user's inputs at `inputs` (positions in
    the flat leaves of the call's `(args, kwargs)`); `conditions` says what each one checks and
    where the model reads the value, for the log line a recompile writes. `draws`: the conditions
    read random draws, and `module` takes the program's device after the inputs. `counts[i]`:
    condition i pins a count of nonzero values that sizes the program (`nonzero_static`), not a
    branch: on a pipeline it holds per microbatch, while a branch is the whole batch's."""

    module: fx.GraphModule
    inputs: tuple[int, ...]
    conditions: tuple[str, ...]
    draws: bool = False
    counts: tuple[bool, ...] = ()

    def hold(self, flat: Sequence[Any], device: torch.device | str = "cpu") -> bool:
        """Whether every condition holds for a call whose flat `(args, kwargs)` leaves are `flat`
        (the global inputs: each rank computes the same answer) on a program running on
        `device`. The random generators are left as they were."""
        return all(bool(v) for v in self._values(flat, device))

    def failing(self, flat: Sequence[Any], device: torch.device | str = "cpu") -> list[str]:
        """The conditions that do not hold for `flat`."""
        return [text for text, v in zip(self.conditions, self._values(flat, device)) if not bool(v)]

    def failing_per_microbatch(
        self, whole: Sequence[Any], micro: Sequence[Any], device: torch.device | str = "cpu"
    ) -> list[str]:
        """For a program traced on one microbatch of a pipeline (`micro`, its flat inputs): the
        conditions that fail. A branch is the serial model's, so it is evaluated on the `whole`
        batch (the program may serve a microbatch only where its branches are the whole batch's);
        a count sizes the microbatch's own program, so it is evaluated on `micro`."""
        on_whole = self._values(whole, device)
        on_micro = self._values(micro, device) if any(self.counts) else on_whole
        counts = self.counts or (False,) * len(self.conditions)
        return [
            text
            for text, count, w, m in zip(self.conditions, counts, on_whole, on_micro, strict=True)
            if not bool(m if count else w)
        ]

    def _values(self, flat: Sequence[Any], device: torch.device | str) -> list[Any]:
        args = [flat[i] for i in self.inputs]
        if not self.draws:
            return list(self.module(*args))
        with generators_kept(torch.device(device)):
            return [bool(v) for v in self.module(*args, torch.device(device))]


@contextlib.contextmanager
def generators_kept(device: torch.device) -> Iterator[None]:
    """The CPU generator's state, and `device`'s where it is an accelerator, restored on exit:
    what draws inside does not move the stream the program and the serial model draw from."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            yield
        return
    with torch.random.fork_rng(devices=[device], device_type=device.type):
        yield
