"""The plan: one Strategy per node, chosen by the plan choice and carried out by the stages.

It is plain data keyed by node names so that every rank can compare it, and it sits in the
vocabulary because the driver hands it from the planners to `autopar.passes.propagate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.core.layout import Layout
from autopar.core.strategy import Strategy

MAX_REGATHER_NODES = 16  # a weight chain longer than this is not worth copying into backward


@dataclass
class Plan:
    """The choice, keyed by node name so that it is plain data every rank can compare."""

    strategies: dict[str, Strategy] = field(default_factory=dict)
    layouts: dict[str, tuple[Layout, ...]] = field(default_factory=dict)
    output_layouts: list[Layout | None] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    roles: tuple[str, ...] = ()
    decided: list[str] = field(default_factory=list)  # nodes whose strategy was a choice (not implied)
    # per decided node and input: "param" / "replica" if the input was still to be laid out
    deferred_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a deferred value -> (the decided node that laid it out, that node's input index)
    resolved_by: dict[str, tuple[str, int]] = field(default_factory=dict)
    # a parameter stored by the greedy pass -> the layout it computes with, which its storage
    # splits further (`planning.storage`): its storage on a mesh of other sizes is derived from it
    stored_from: dict[str, Layout] = field(default_factory=dict)
