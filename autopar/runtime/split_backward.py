"""Split a rank's emitted backward into an input-gradient program (I) and a weight-gradient one (W).

Zero-bubble pipeline schedules (ZB-H1, ZB-V) run the part of a stage's backward that the previous
stage waits for (I: the gradients of the stage's inputs) as soon as the output gradient arrives,
and the parameter gradients (W) later, in what would otherwise be a bubble. emit produces one
backward graph, `(saved..., tangents...) -> (param_grads..., input_grads...)`; this pass cuts it in
two without recomputing anything:

- I is every node an input gradient needs (its ancestors), plus the `wait_tensor` of any
  collective in I (a collective and its wait never straddle the parts) and the `getitem`s of any
  multi-output op in I (so that only tensors cross between the parts). It returns the input
  gradients, then the *carried* values: the nodes of I that W reads or returns.
- W is every other node, in the original order, reading carried values as extra placeholders. A
  collective that serves only parameter gradients (the gradient reduce-scatters and all-reduces
  over data axes) is not an ancestor of an input gradient, so it lands in W.

Each part keeps the original relative order of its nodes, and every node is copied unchanged
(same ATen op on the same values), so I's input gradients and W's parameter gradients are bitwise
those of the unsplit backward. The split depends only on the graph's structure (its edges), which
is the same on every rank of one program: ranks differ only in local sizes, slice offsets and
zero_partial's clone-or-zeros_like, which read the same nodes. So every rank puts the same
collectives in I, in the same order, and the rest in W, and running I then W on every rank issues
collectives in an order all ranks agree on. (A plan whose per-rank graphs differed in their edges
would break this; `structure` gives what ranks can compare.)

The backward must be the emitted fx graph, not one compiled by Inductor: split first, then compile
each part.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import Argument

from autopar.core.collectives import COLLECTIVES
from autopar.runtime.program import EmittedProgram

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class SplitBackward:
    """The two halves of a rank's backward and what calling them needs.

    `input_part(*saved, *tangents) -> (*input_grads, *carried)`;
    `weight_part(*saved, *tangents, *carried) -> param_grads` (a tuple, `None` where the original
    backward returned `None`). Both parts take every saved value and tangent, like the original
    backward, so a caller passes the same arguments to each; `input_reads` / `weight_reads` say
    which of those arguments (indices into `(*saved, *tangents)`) each part actually reads.
    """

    input_part: fx.GraphModule
    weight_part: fx.GraphModule
    num_saved: int
    num_tangents: int
    num_param_grads: int
    num_input_grads: int
    carried: tuple[str, ...]  # names of the backward nodes I hands to W, in output order
    # where I's nodes and the carried ones stand in the backward's node list (names are not
    # comparable across ranks: a rank's zeros_like where another has a clone shifts fx's counters)
    input_positions: tuple[int, ...]
    carried_positions: tuple[int, ...]
    input_reads: tuple[int, ...]
    weight_reads: tuple[int, ...]

    @property
    def num_carried(self) -> int:
        return len(self.carried)

    def saved_for_weight(self) -> tuple[int, ...]:
        """Indices of the saved values W still reads: the others can be freed once I has run (a
        carried value may still be a view of a freed one's storage, which then stays alive)."""
        return tuple(i for i in self.weight_reads if i < self.num_saved)

    def run_input(
        self, saved: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """Run I: (input gradients, carried values to hand to `run_weight`)."""
        out = list(self.input_part(*saved, *tangents))
        return out[: self.num_input_grads], out[self.num_input_grads :]

    def run_weight(
        self, saved: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor], carried: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Run W: the parameter gradients, in `program.param_names` order."""
        return list(self.weight_part(*saved, *tangents, *carried))

    def structure(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Which of the backward's nodes went to I and which I carries to W, by position: equal on
        every rank of one program (compare across ranks to check that they all issue the same
        collectives in each part)."""
        return self.input_positions, self.carried_positions


@dataclass(frozen=True)
class BackwardGraph:
    """An emitted backward program's fx graph opened for cutting: its nodes in order, its
    placeholders (saved values, then tangents), and the values it returns (parameter gradients,
    then input gradients)."""

    gm: fx.GraphModule
    nodes: list[fx.Node]
    placeholders: list[fx.Node]
    values: list[Argument]
    num_params: int


def open_backward(program: EmittedProgram, cutter: str) -> BackwardGraph:
    """`program.backward` as a `BackwardGraph`; a compiled (non-fx) backward cannot be cut, which
    `cutter` (the caller's name) says."""
    gm = program.backward
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(
            f"{cutter} needs the emitted fx backward, got {type(gm).__name__}: split before compiling"
        )
    nodes = list(gm.graph.nodes)
    output = next(n for n in reversed(nodes) if n.op == "output")
    return BackwardGraph(
        gm=gm,
        nodes=nodes,
        placeholders=[n for n in nodes if n.op == "placeholder"],
        values=list(output.args[0]),  # type: ignore[arg-type]
        num_params=len(program.param_names),
    )


def split_backward(program: EmittedProgram) -> SplitBackward:
    """Split `program.backward` into its input-gradient part and its weight-gradient part."""
    bw = open_backward(program, "split_backward")
    nodes, placeholders, values, num_params = bw.nodes, bw.placeholders, bw.values, bw.num_params
    if len(values) != num_params + len(program.input_grads):
        raise ValueError(
            f"backward returns {len(values)} values, expected {num_params} parameter gradients "
            f"and {len(program.input_grads)} input gradients"
        )
    if len(placeholders) < program.num_saved:
        raise ValueError(
            f"backward takes {len(placeholders)} arguments, fewer than {program.num_saved} saved"
        )
    param_values, input_values = values[:num_params], values[num_params:]
    in_i = input_side(nodes, input_values)

    # what W needs from I: read by a W node, or returned by W as a parameter gradient
    returned_by_w = {v for v in param_values if isinstance(v, fx.Node)}
    carried = [
        n
        for n in nodes
        if n in in_i and (n in returned_by_w or any(u not in in_i and u.op != "output" for u in n.users))
    ]

    input_part, weight_part = cut_backward(bw, in_i, carried, second_reads_placeholders=True, carried_as="carried")

    def reads(part_nodes: set[fx.Node], outputs: Sequence[object]) -> tuple[int, ...]:
        return tuple(
            i for i, p in enumerate(placeholders) if p in outputs or any(u in part_nodes for u in p.users)
        )

    position = {n: i for i, n in enumerate(nodes)}
    w_nodes = {n for n in nodes if n.op not in ("placeholder", "output") and n not in in_i}
    return SplitBackward(
        input_part=input_part,
        weight_part=weight_part,
        num_saved=program.num_saved,
        num_tangents=len(placeholders) - program.num_saved,
        num_param_grads=num_params,
        num_input_grads=len(input_values),
        carried=tuple(c.name for c in carried),
        input_positions=tuple(position[n] for n in nodes if n in in_i),
        carried_positions=tuple(position[c] for c in carried),
        input_reads=reads(in_i, input_values),
        weight_reads=reads(w_nodes, param_values),
    )


def cut_backward(
    bw: BackwardGraph,
    first: set[fx.Node],
    carried: Sequence[fx.Node],
    *,
    second_reads_placeholders: bool,
    carried_as: str,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The backward cut in two GraphModules, as both of its splits cut it (I/W here, the local part
    and the once-per-step reduction in `defer_reduction`): the first runs the `first` nodes on the
    backward's arguments and returns the input gradients, then the `carried` values; the second
    takes the backward's arguments (if `second_reads_placeholders`) then the carried values (named
    `{carried_as}_{name}`), runs every other node and returns the parameter gradients. Both keep
    the backward's meta."""
    param_values, input_values = bw.values[: bw.num_params], bw.values[bw.num_params :]
    first_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: first_graph.node_copy(p) for p in bw.placeholders}
    for n in bw.nodes:
        if n in first:
            env[n] = first_graph.node_copy(n, env.__getitem__)
    first_graph.output(tuple([*(_mapped(v, env) for v in input_values), *(env[c] for c in carried)]))

    second_graph = fx.Graph()
    senv: dict[fx.Node, fx.Node] = {}
    if second_reads_placeholders:
        senv = {p: second_graph.node_copy(p) for p in bw.placeholders}
    for c in carried:
        senv[c] = second_graph.placeholder(f"{carried_as}_{c.name}")
        senv[c].meta.update(c.meta)
    for n in bw.nodes:
        if n.op not in ("placeholder", "output") and n not in first:
            senv[n] = second_graph.node_copy(n, senv.__getitem__)
    second_graph.output(tuple(_mapped(v, senv) for v in param_values))

    parts = []
    for graph in (first_graph, second_graph):
        graph.lint()
        part = fx.GraphModule(bw.gm, graph)
        part.meta.update(bw.gm.meta)
        parts.append(part)
    return parts[0], parts[1]


def input_side(nodes: Sequence[fx.Node], input_values: Sequence[Argument]) -> set[fx.Node]:
    """The non-placeholder nodes that go to I: the ancestors of the input gradients, closed under
    "a collective's wait goes with it" and "a multi-output op's getitems go with it" (the added
    nodes read only nodes already in I, so the set stays closed under inputs)."""
    found: set[fx.Node] = set()
    stack = [v for v in input_values if isinstance(v, fx.Node)]
    while stack:
        n = stack.pop()
        if n in found or n.op == "placeholder":
            continue
        found.add(n)
        stack.extend(n.all_input_nodes)
    for n in nodes:  # graph order: an added getitem's own wait (coalesced collectives) comes later
        inputs = n.all_input_nodes
        if n not in found and _follows_producer(n) and inputs and all(i in found for i in inputs):
            found.add(n)
    return found


def is_collective(node: fx.Node) -> bool:
    """A functional collective (whose result must be waited on in the same part): those autopar
    emits, and any other op of torch's functional collectives but the wait."""
    if node.op != "call_function" or is_wait(node):
        return False
    return node.target in COLLECTIVES or getattr(node.target, "namespace", None) == "_c10d_functional"


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is c10d.wait_tensor.default


def _follows_producer(node: fx.Node) -> bool:
    return is_wait(node) or (node.op == "call_function" and node.target is operator.getitem)


def _mapped(value: Argument, env: dict[fx.Node, fx.Node]) -> Argument:
    return env[value] if isinstance(value, fx.Node) else value
