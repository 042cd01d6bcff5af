"""Split a rank's emitted backward into a per-microbatch part that leaves the parameter gradients
unreduced and a reduction part run once per step (docs/pipeline.md#gradient-reduction-once-per-step).

A pipelined stage runs its backward once per microbatch. The emitted backward ends with the
collectives that take each parameter gradient to its storage layout (the reduce-scatters and
all-reduces over data axes, bucketed by the schedule pass); run per microbatch, a step reduces its
gradients M times. Those collectives are linear, so summing the unreduced values over the
microbatches and reducing the sum once gives the same gradients (up to float summation order), as
Megatron's and torchtitan's gradient accumulation do. This pass cuts the backward in two:

- **R (reduce)**: the gradient-only collectives (those whose results reach parameter gradients and
  no input gradient) and everything after them, provided each of those nodes is a linear op of the
  accumulated values (`_LINEAR`) and reads no value that is not a gradient (a saved activation
  times a reduced value is not linear in the microbatch sum). A node that breaks this goes back to
  the local part with its ancestors in R (that gradient is then reduced per microbatch, as before).
- **L (local)**: every other node, in the original order. It returns the input gradients, then the
  *frontier*: the values R reads and the parameter gradients L itself makes (those need no
  reduction and just accumulate).

L runs per microbatch; the runtime sums its frontier over microbatches (a sum of Partials is a
Partial) and runs R once on the sums, after the stage's last backward. As with `split_backward`,
the cut depends only on the graph's edges, equal on every rank of one program, so every rank of the
stage runs the same collectives in each part, in the same order. The memory cost: the accumulated
frontier is the unreduced gradient (a full weight where the stored one is 1/d of it, like
Megatron's full-size gradient buffers), held for the whole step.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.fx as fx

from autopar.core.graph_order import ancestors
from autopar.core.precision import autocast_off
from autopar.runtime.groups import failures_named
from autopar.runtime.program import EmittedProgram
from autopar.runtime.split_backward import cut_backward, is_collective, is_wait, open_backward

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Ops that are linear in their gradient-valued arguments, with the others constants (shapes, dims):
# R(sum of x_m) = sum of R(x_m) holds node by node.
_LINEAR = {
    operator.getitem,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.select.int,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.expand.default,
    aten.cat.default,
    aten.stack.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.neg.default,
    aten.sum.dim_IntList,
    aten.constant_pad_nd.default,
    aten.alias.default,
    aten._to_copy.default,
}
_SCALED = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}  # by a number only
# Linear ops whose output is as large as their gradient inputs together: moved from L to R in
# front of a reduction, they leave its frontier no larger (a cast or a sum would change its size).
_GATHERING = {
    aten.cat.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
}


@dataclass(frozen=True)
class ReductionSplit:
    """The two parts of a rank's backward for gradient accumulation.

    `local_part(*saved, *tangents) -> (*input_grads, *frontier)`;
    `reduce_part(*frontier) -> param_grads` (a tuple, `None` where the backward returned `None`).
    `num_reductions` counts the collectives moved to R (0: nothing to defer)."""

    local_part: fx.GraphModule
    reduce_part: fx.GraphModule
    num_param_grads: int
    num_input_grads: int
    num_frontier: int
    num_reductions: int
    # frontier positions that are the backward's own arguments (a tangent R reads as it is): the
    # accumulation copies those before adding into them, the others are L's fresh results
    frontier_arguments: frozenset[int] = frozenset()

    def run_local(
        self,
        saved: Sequence[torch.Tensor],
        tangents: Sequence[torch.Tensor],
        sums: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """Run L: (input gradients, this microbatch's frontier values to accumulate).

        With the step's `sums` (every microbatch after the first), each frontier value L computes
        for the output alone is added into its sum as soon as it exists and dropped, and the sum
        stands in its place in the result (`GradAccumulation.add` skips it): the backward then
        holds the sums and one term, not the sums and every term of the microbatch at once."""
        if sums is None:
            out = list(self.local_part(*saved, *tangents))
        else:
            adds = {node: sums[i] for i, node in self._added_as_computed.items()}
            out = list(_AddingAsComputed(self.local_part, adds).run(*saved, *tangents))
        return out[: self.num_input_grads], out[self.num_input_grads :]

    @cached_property
    def _added_as_computed(self) -> dict[int, fx.Node]:
        """Frontier positions whose value L computes for its output alone, at one position (not
        an argument, not an input gradient too): those the backward may add into their sums as it
        makes them. Found once per split, not on every microbatch's backward."""
        output = next(n for n in self.local_part.graph.nodes if n.op == "output")
        values = list(output.args[0])
        inputs, frontier = values[: self.num_input_grads], values[self.num_input_grads :]
        found: dict[int, fx.Node] = {}
        for i, node in enumerate(frontier):
            if (
                isinstance(node, fx.Node) and node.op == "call_function" and i not in self.frontier_arguments
                and list(node.users) == [output] and frontier.count(node) == 1 and node not in inputs
            ):  # fmt: skip
                found[i] = node
        return found

    def run_reduce(self, frontier: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Run R on the accumulated frontier: the parameter gradients in storage layout. R takes
        the list (it is emptied) and drops each value after its last read, so an accumulated sum
        is freed once a bucket has copied it, not held until every reduction has run (the sums,
        the buckets and the reduced gradients are all a stage's gradient size)."""
        return list(fx.Interpreter(self.reduce_part, garbage_collect_values=True).boxed_run(frontier))


class _AddingAsComputed(fx.Interpreter):
    """Runs a local part, adding each of `adds`' values into its sum as soon as it is computed;
    the sum takes the value's place, so the term is freed at once (`ReductionSplit.run_local`)."""

    def __init__(self, module: fx.GraphModule, adds: dict[fx.Node, torch.Tensor]) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.adds = adds

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        total = self.adds.get(n)
        if total is None:
            return value
        total.add_(value)
        return total


def split_reductions(program: EmittedProgram) -> ReductionSplit:
    """Cut `program.backward` into its per-microbatch local part and its once-per-step reduction."""
    bw = open_backward(program, "split_reductions")
    nodes, placeholders, values, num_params = bw.nodes, bw.placeholders, bw.values, bw.num_params
    param_values, input_values = values[:num_params], values[num_params:]

    tangent_side = _from_tangents(nodes, placeholders[program.num_saved :])
    feeds_inputs = ancestors([v for v in input_values if isinstance(v, fx.Node)])
    reduce_side: set[fx.Node] = set()
    for n in nodes:  # graph order: a node's inputs are decided first
        if n in feeds_inputs or n.op in ("placeholder", "output"):
            continue
        if is_collective(n) or any(i in reduce_side for i in n.all_input_nodes):
            reduce_side.add(n)
    # keep in R only what is linear in gradient values; the rest (and its ancestors in R) goes back
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if n in reduce_side and not _movable(n, reduce_side, tangent_side):
                for a in ancestors([n]) | _waits_of(n):
                    if a in reduce_side:
                        reduce_side.discard(a)
                        changed = True
    # a wait or getitem whose producer stays local stays local (only plain tensors cross)
    for n in nodes:
        follows = is_wait(n) or n.target is operator.getitem
        if n in reduce_side and follows and any(i not in reduce_side for i in n.all_input_nodes):
            reduce_side.discard(n)
    # a bucket's concatenation of gradient values that only R reads (and the views and copies
    # before it) goes to R as well: L then returns the weight gradients themselves, which the step
    # sums, instead of copying them into a bucket in every microbatch's backward (the gradients
    # and their bucket copy alive at once); R concatenates the sums once
    changed = bool(reduce_side)
    while changed:
        changed = False
        for n in reversed(nodes):
            if (
                n.target in _GATHERING and n not in reduce_side and n not in feeds_inputs
                and n.users and all(u in reduce_side for u in n.users)
                and all(i in tangent_side for i in n.all_input_nodes)
            ):  # fmt: skip
                reduce_side.add(n)
                changed = True

    frontier: list[fx.Node] = []
    for n in nodes:
        if n in reduce_side or n.op == "output":
            continue
        if any(u in reduce_side for u in n.users) or n in param_values:
            frontier.append(n)

    local = {n for n in nodes if n.op not in ("placeholder", "output") and n not in reduce_side}
    local_part, reduce_part = cut_backward(
        bw, local, frontier, second_reads_placeholders=False, carried_as="accumulated"
    )
    return ReductionSplit(
        local_part=local_part,
        reduce_part=reduce_part,
        num_param_grads=num_params,
        num_input_grads=len(input_values),
        num_frontier=len(frontier),
        num_reductions=sum(1 for n in reduce_side if is_collective(n)),
        frontier_arguments=frozenset(i for i, n in enumerate(frontier) if n.op == "placeholder"),
    )


def _movable(n: fx.Node, reduce_side: set[fx.Node], tangent_side: set[fx.Node]) -> bool:
    """Whether R may hold `n`: a collective or wait (linear: sums, gathers, scatters), or a linear
    op whose tensor inputs all carry gradient values (from R or from the tangents)."""
    if is_collective(n) or is_wait(n):
        return all(i in reduce_side or i in tangent_side for i in n.all_input_nodes)
    if n.op != "call_function":
        return False
    tensor_inputs = n.all_input_nodes
    if not all(i in reduce_side or i in tangent_side for i in tensor_inputs):
        return False
    if n.target in _LINEAR:
        if n.target is aten._to_copy.default:  # a cast or a move: the dtype stays floating
            dtype = n.kwargs.get("dtype")
            return dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)
        return True
    if n.target in _SCALED:  # x * c or x / c with a number c (a tensor factor would be nonlinear)
        return len(tensor_inputs) == 1 and isinstance(n.args[0], fx.Node)
    return False


def _from_tangents(nodes: Sequence[fx.Node], tangents: Sequence[fx.Node]) -> set[fx.Node]:
    """The nodes whose value depends on a tangent: gradient values (linear in the tangents)."""
    found = set(tangents)
    for n in nodes:
        if any(i in found for i in n.all_input_nodes):
            found.add(n)
    return found


def _waits_of(n: fx.Node) -> set[fx.Node]:
    """A collective's waits (through a coalesced collective's getitems): they go where it goes."""
    out: set[fx.Node] = set()
    for u in n.users:
        if is_wait(u):
            out.add(u)
        elif u.target is operator.getitem:
            out |= {w for w in u.users if is_wait(w)} | {u}
    return out if is_collective(n) else set()


@dataclass
class _Accumulated:
    """One program's frontier summed over the step's microbatches, and what mapping R's local
    gradients back to the module's parameters needs (the last call's parameter views)."""

    split: ReductionSplit
    sums: list[torch.Tensor]
    local_params: tuple[torch.Tensor, ...]
    timeout: timedelta | None


@dataclass
class GradAccumulation:
    """Given to a `ParallelModule`'s calls for one step (`accumulating_gradients`): their backwards
    run the local part only, returning no parameter gradients and adding the unreduced ones here;
    `ParallelModule.reduced_gradients` runs the reductions once on the sums."""

    splits: dict[int, ReductionSplit] = field(default_factory=dict)  # the module's, by program backward
    by_program: dict[int, _Accumulated] = field(default_factory=dict)

    def split(self, program: EmittedProgram) -> ReductionSplit:
        found = self.splits.get(id(program.backward))
        if found is None:
            found = self.splits[id(program.backward)] = split_reductions(program)
        return found

    def add(
        self,
        program: EmittedProgram,
        frontier: Sequence[torch.Tensor],
        local_params: tuple[torch.Tensor, ...],
        timeout: timedelta | None,
        others: Sequence[Any] = (),
    ) -> None:
        """Add one microbatch's frontier (each value a gradient term: a sum of them is exact), in
        place: one buffer per value for the whole step. `sums = [a + b ...]` would hold the old sums,
        this microbatch's terms and the new sums at once, three unreduced gradients at the last
        backward of the step (docs/large-models.md#pipelined-pp2-x-22 measures it). The terms
        `run_local` added as it computed them are the sums themselves here, and are skipped.
        `others`: the backward's arguments and input gradients (`owned_buffers` keeps no buffer
        sharing their storage)."""
        key = id(program.backward)
        found = self.by_program.get(key)
        split = self.split(program)
        if found is None:
            sums = owned_buffers(frontier, split.frontier_arguments, others)
            self.by_program[key] = _Accumulated(split, sums, local_params, timeout)
            return
        for total, term in zip(found.sums, frontier, strict=True):
            if term is not total:  # (a sum the backward added its term into, `run_local`)
                total.add_(term)
        found.local_params = local_params

    def sums_of(self, program: EmittedProgram) -> list[torch.Tensor] | None:
        """The step's sums of `program`'s frontier so far (None before its first backward):
        `ReductionSplit.run_local` adds the next microbatch's terms into them as it computes them."""
        found = self.by_program.get(id(program.backward))
        return found.sums if found is not None else None

    def reduce(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Run every program's reduction once on its sums and return the gradients of `params`
        (the module's parameters: DTensors), summed over programs; empties the accumulation, each
        program's sums as soon as its reduction has run."""
        totals: list[torch.Tensor | None] = [None] * len(params)
        for key in list(self.by_program):
            acc = self.by_program.pop(key)
            with failures_named(acc.timeout), autocast_off():
                local_grads = acc.split.run_reduce(acc.sums)  # (takes the sums: freed as R reads them)
            add_grads(totals, params_grads(acc.local_params, local_grads, params))
        return totals


def owned_buffers(
    values: Sequence[torch.Tensor], copy: frozenset[int] = frozenset(), others: Sequence[Any] = ()
) -> list[torch.Tensor]:
    """`values` as buffers an accumulation may add into in place: each kept as it is where it holds
    its storage alone (contiguous over the whole storage, a view of a base it spans included, no
    storage shared with another value or with one of `others`: the backward's arguments and input
    gradients, which are still read or sent), copied otherwise and at the positions `copy`.

    A weight gradient the backward made as a view (`t()` of a matmul, a reshape) spans its base:
    copying it held both until the backward's end, 52 MiB on the last stage of the proxies'
    first backward (docs/pipeline.md#a-pipelined-ranks-memory)."""
    taken = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
    seen: set[int] = set()
    out = []
    for i, v in enumerate(values):
        storage = v.untyped_storage()
        pointer = storage.data_ptr()
        alone = (
            v.is_contiguous() and v.storage_offset() == 0 and v.numel() * v.element_size() == storage.nbytes()
            and pointer not in seen and pointer not in taken and i not in copy
        )  # fmt: skip
        seen.add(pointer)
        out.append(v if alone else v.clone(memory_format=torch.contiguous_format))
    return out


def params_grads(
    views: Sequence[torch.Tensor], local_grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of `params` given those of the views a program read of them (to_local, a
    fused part, a cast): autograd through the views, whose graph the pipeline's backward left
    untouched (it asked for input gradients only)."""
    pairs = [(v, g) for v, g in zip(views, local_grads, strict=True) if g is not None and v.requires_grad]
    if not pairs:
        return tuple(None for _ in params)
    return torch.autograd.grad([v for v, _ in pairs], list(params), [g for _, g in pairs], allow_unused=True)


def add_grads(totals: list[torch.Tensor | None], found: Sequence[torch.Tensor | None]) -> None:
    """Add each parameter's gradient in `found` into `totals` (None: none yet), in place: the
    gradients of several programs (or their weight parts) of one module summed per parameter."""
    for i, g in enumerate(found):
        if g is not None:
            before = totals[i]
            totals[i] = g if before is None else before + g
