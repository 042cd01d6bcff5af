"""What a sharding rule is: per mesh axis, the placements an op accepts and produces.

A rule is written for ONE mesh axis and returns `AxisStrategy`s; `expand` takes the product over
the mesh axes (that product is where the 2-D and 3-D algorithms come from) and drops layouts whose
split dims do not divide evenly, unless the rule is registered `uneven=True`: then a dim split by
one axis into `torch.chunk` blocks is kept too, provided every tensor that axis splits in the call
splits a dim of that same size (an elementwise correspondence; a view that merges the dim fails it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.core.layout import Layout, Partial, Placement, Replicate, Shard, chunks_nonempty, is_balanced
from autopar.core.meta import NodeInfo
from autopar.core.strategy import AxisStrategy, OpCall, Strategy, TensorSpec

R = Replicate()
P = Partial()


StrategyFn = Callable[[OpCall], list[AxisStrategy]]


@dataclass(frozen=True)
class LocalCall:
    """What a rank runs in place of the global op: target and rewritten non-tensor arguments."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class LocalGraph:
    """What a rank runs in place of the global op when it is several nodes with collectives between
    them (ring attention: one block computation per step, an exchange with the next rank
    overlapping each). `build(graph, args, kwargs, base)` adds them to `graph`, reading the op's
    local arguments (`args`, `kwargs`: nodes of `graph` where the op's were), tags each with a
    `NodeInfo` made from `base` (the op's), and returns the node that stands for the op's result."""

    build: Callable[[fx.Graph, tuple[Any, ...], dict[str, Any], NodeInfo], fx.Node]


@dataclass(frozen=True)
class LocalContext:
    call: OpCall
    strategy: Strategy
    mesh_shape: tuple[int, ...]
    coords: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # a random op's input dims in the serial model's memory order (outermost first), if known
    memory_order: tuple[int, ...] | None = None
    # the process group name of each mesh axis, for a LocalGraph's collectives (empty: none known)
    groups: tuple[str, ...] = ()


Localizer = Callable[[LocalContext], "LocalCall | LocalGraph"]
# a rule's filter of its whole-mesh strategies (a per-axis rule cannot see the other axes)
Admits = Callable[[OpCall, Strategy, tuple[int, ...]], bool]


@dataclass(frozen=True)
class Requirement:
    """A user's demand on an op's whole-mesh strategies (a mesh axis role such as "cp"): the
    planners offer only the strategies `admits` accepts. Per-axis rules cannot express it, since
    `expand` takes the same per-axis list on every axis. `hint` is what an error says to do when
    no strategy is left."""

    admits: Callable[[OpCall, Strategy], bool]
    hint: str


def both(first: Requirement | None, second: Requirement) -> Requirement:
    """A requirement admitting what both admit (`first` None: `second`): a registry's own
    requirement kept when another is put on the same op."""
    if first is None:
        return second
    return Requirement(
        lambda call, chosen: first.admits(call, chosen) and second.admits(call, chosen), f"{first.hint}; and {second.hint}"
    )


@dataclass(frozen=True)
class OpRule:
    op: Any
    strategies: StrategyFn
    family: str
    localize: Localizer | None = None
    # Ops whose choice shapes the whole plan (matmuls, attention, embedding) get every candidate
    # evaluated; cheap followers take the best per-axis matches.
    anchor: bool = False
    # Whether the rule's strategies (and its localize step) stay right on uneven `torch.chunk`
    # blocks; property tests draw uneven shapes for every rule that says so.
    uneven: bool = False
    # a user's demand on the whole-mesh strategies (None: every admissible one is offered)
    requirement: Requirement | None = None
    # the rule's own filter of its whole-mesh strategies (None: every admissible one)
    admits: Admits | None = None


class RuleRegistry:
    """Op overload -> rule. Built explicitly and passed around; never a module global."""

    def __init__(self) -> None:
        self._rules: dict[Any, OpRule] = {}
        self._seed_orders: tuple[tuple[str, RuleRegistry], ...] = ()

    def seed_from(self, name: str, registry: RuleRegistry) -> None:
        """Also seed the plan search with the greedy plans of `registry` (named `name`): a
        narrower copy of this one whose plans lie in a region the search's local moves do not
        reach from this registry's own seeds (`planning.search_seeds.order_seeds`: the
        load-balanced causal order, which pays off only once a whole residual stream takes it)."""
        self._seed_orders = (*self._seed_orders, (name, registry))

    def seed_orders(self) -> tuple[tuple[str, RuleRegistry], ...]:
        """The registries whose greedy plans also seed the search (`seed_from`)."""
        return self._seed_orders

    def register(
        self,
        op: Any,
        strategies: StrategyFn,
        *,
        family: str,
        localize: Localizer | None = None,
        anchor: bool = False,
        uneven: bool = False,
        admits: Admits | None = None,
    ) -> None:
        self._rules[op] = OpRule(op, strategies, family, localize, anchor, uneven, admits=admits)

    def family(self, name: str, *, uneven: bool = False) -> FamilyRules:
        """Registers one family's rules with what they share: the family name and whether they
        stay right on uneven blocks (every built-in family does; a user's rule opts in)."""
        return FamilyRules(self, name, uneven)

    def require(self, op: Any, requirement: Requirement) -> None:
        """Offer only the strategies of `op` that `requirement` admits (the op must have a rule)."""
        self._rules[op] = dataclasses.replace(self._rules[op], requirement=requirement)

    def admit(self, op: Any, admits: Admits | None) -> None:
        """Replace the rule's own filter of its whole-mesh strategies (`OpRule.admits`)."""
        self._rules[op] = dataclasses.replace(self._rules[op], admits=admits)

    def replace(self, rule: OpRule) -> None:
        """Put `rule` in place of the rule of its op (a transformed copy of it)."""
        self._rules[rule.op] = rule

    def get(self, op: Any) -> OpRule | None:
        return self._rules.get(op)

    def __contains__(self, op: Any) -> bool:
        return op in self._rules

    def ops(self) -> list[Any]:
        return list(self._rules)

    def rules(self) -> list[OpRule]:
        return list(self._rules.values())

    def copy(self) -> RuleRegistry:
        new = RuleRegistry()
        new._rules = dict(self._rules)
        new._seed_orders = self._seed_orders
        return new


@dataclass(frozen=True)
class FamilyRules:
    """`RuleRegistry.register` with the family's name and uneven support filled in."""

    registry: RuleRegistry
    name: str
    uneven: bool

    def register(
        self,
        op: Any,
        strategies: StrategyFn,
        *,
        localize: Localizer | None = None,
        anchor: bool = False,
        admits: Admits | None = None,
    ) -> None:
        self.registry.register(
            op, strategies, family=self.name, localize=localize, anchor=anchor, uneven=self.uneven, admits=admits
        )


def all_replicated(call: OpCall) -> AxisStrategy:
    return AxisStrategy((R,) * len(call.inputs), (R,) * len(call.outputs))


def with_replicated(call: OpCall, strategies: Iterable[AxisStrategy]) -> list[AxisStrategy]:
    """Deduplicated strategies, always including all-replicated (so every op has a fallback)."""
    out: list[AxisStrategy] = []
    for s in [*strategies, all_replicated(call)]:
        if len(s.inputs) != len(call.inputs) or len(s.outputs) != len(call.outputs):
            raise ValueError(f"strategy {s} does not match {call.op} arity")
        if s not in out:
            out.append(s)
    return out


def layouts_for(specs: Sequence[TensorSpec], per_axis: Sequence[Sequence[Placement]]) -> tuple[Layout, ...]:
    return tuple(
        Layout(tuple(axis[i] for axis in per_axis), spec.shape, spec.dtype) for i, spec in enumerate(specs)
    )


def combine(call: OpCall, per_axis: Sequence[AxisStrategy]) -> Strategy:
    """One AxisStrategy per mesh axis -> full Strategy."""
    ins = layouts_for(call.inputs, [s.inputs for s in per_axis])
    outs = layouts_for(call.outputs, [s.outputs for s in per_axis])
    return Strategy(ins, outs)


def is_even(strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    return all(lay.is_even(mesh_shape) for lay in (*strategy.inputs, *strategy.outputs))


def admissible(strategy: Strategy, mesh_shape: Sequence[int], uneven: bool = False) -> bool:
    """Even; or, for `uneven` rules, uneven dims that fit and split the same size on every tensor."""
    layouts = (*strategy.inputs, *strategy.outputs)
    if all(lay.is_even(mesh_shape) for lay in layouts):
        return True
    if not uneven or not all(lay.fits(mesh_shape) for lay in layouts):
        return False
    uneven_axes = {lay.shard_axes(d)[0] for lay in layouts for d in lay.uneven_dims(mesh_shape)}
    for a in uneven_axes:
        sizes = {lay.shape[p.dim] for lay in layouts if isinstance(p := lay.placements[a], Shard)}
        if len(sizes) != 1:
            return False
    return True


def expand(
    call: OpCall, axis_strategies: Sequence[AxisStrategy], mesh_shape: Sequence[int], uneven: bool = False
) -> list[Strategy]:
    """Product of the single-axis strategies over the mesh, keeping the admissible ones.

    Axes of size 1 only get all-replicated (any placement there is equivalent). On big meshes the
    product is most of the mesh choice's screen, so it is walked axis by axis (`_Walk`): a prefix
    that no later axis can make admissible is dropped whole, and each tensor's layout is built
    once per placements; the list is `admissible` filtering the whole product, in its order.
    """
    options = [[all_replicated(call)] if size == 1 else list(axis_strategies) for size in mesh_shape]
    walk = _Walk.of(call, options, tuple(mesh_shape), uneven)
    if walk is None:  # a rule's strategy of the wrong arity: fail as `combine` does
        every = (combine(call, combo) for combo in itertools.product(*options))
        return [strategy for strategy in every if admissible(strategy, mesh_shape, uneven)]
    walk.run(0, [], [[1] * len(spec.shape) for spec in walk.specs], (0,) * len(walk.specs))
    return walk.result


def expand_signature(call: OpCall, mesh_shape: Sequence[int], uneven: bool = False) -> tuple[Any, ...]:
    """All `expand` reads of the mesh for `call`: which axes have one rank, which products of
    axes divide each of the call's dim sizes, and (uneven rules) which axes cut each size into
    non-empty `torch.chunk` blocks. Meshes with the same signature get the same list (layouts
    and strategies name axes, not sizes), so the mesh choice expands once for all of them."""
    sizes = sorted({size for spec in (*call.inputs, *call.outputs) for size in spec.shape})
    n = len(mesh_shape)
    divides = []
    for mask in range(1, 1 << n):
        g = math.prod(mesh_shape[a] for a in range(n) if mask >> a & 1)
        divides.append(sum(1 << i for i, size in enumerate(sizes) if size % g == 0))
    nonempty = tuple(chunks_nonempty(size, g) for g in mesh_shape for size in sizes) if uneven else ()
    return n, tuple(size == 1 for size in mesh_shape), tuple(sizes), tuple(divides), nonempty


@dataclass
class _Walk:
    """`expand`'s depth-first product. A dim split by axes whose sizes do not divide it stays
    uneven whatever later axes do, so the checks of `admissible` are made at the axis that splits
    the dim: an uneven dim must be split by that axis alone (a later split of it fails), into
    non-empty `torch.chunk` blocks, of a rule that allows it, and every tensor that axis splits
    must split a dim of the same size. Each tensor's placements so far are one int (`codes`), the
    key of its layouts."""

    call: OpCall
    specs: tuple[TensorSpec, ...]
    options: list[list[tuple[Placement, ...]]]  # per axis, per option: one placement per tensor
    codes: list[list[tuple[int, ...]]]  # the same, each placement as a digit (1 + its index)
    radix: int
    mesh_shape: tuple[int, ...]
    uneven: bool
    layouts: list[dict[int, Layout]]  # per tensor: placements (as digits) -> layout
    result: list[Strategy]
    balanced: bool = False  # whether any option holds a load-balanced split (`Layout.balanced_fits`)

    @staticmethod
    def of(
        call: OpCall, options: list[list[AxisStrategy]], mesh_shape: tuple[int, ...], uneven: bool
    ) -> _Walk | None:
        specs = (*call.inputs, *call.outputs)
        digits: dict[Placement, int] = {}
        flat: list[list[tuple[Placement, ...]]] = []
        for axis in options:
            row = []
            for s in axis:
                if len(s.inputs) != len(call.inputs) or len(s.outputs) != len(call.outputs):
                    return None
                placements = (*s.inputs, *s.outputs)
                for p, spec in zip(placements, specs):
                    if isinstance(p, Shard) and not 0 <= p.dim < len(spec.shape):
                        Layout((p,), spec.shape, spec.dtype)  # raises as `combine` would
                    digits.setdefault(p, len(digits) + 1)
                row.append(placements)
            flat.append(row)
        codes = [[tuple(digits[p] for p in placements) for placements in row] for row in flat]
        balanced = any(is_balanced(p) for p in digits)
        return _Walk(
            call, specs, flat, codes, len(digits) + 1, mesh_shape, uneven, [{} for _ in specs], [], balanced
        )

    def run(self, a: int, chosen: list[int], factors: list[list[int]], keys: tuple[int, ...]) -> None:
        """Extend the prefix `chosen` (option per axis before `a`; `factors`: per tensor and dim,
        the product of the sizes of the axes splitting it so far; `keys`: per tensor, its
        placements so far as digits)."""
        if a == len(self.mesh_shape):
            strategy = self._strategy(chosen, keys)
            if not self.balanced or all(
                lay.balanced_fits(self.mesh_shape) for lay in (*strategy.inputs, *strategy.outputs)
            ):
                self.result.append(strategy)
            return
        g, radix = self.mesh_shape[a], self.radix
        for k, placements in enumerate(self.options[a]):
            grown = self._split(placements, g, factors)
            if grown is not None:
                chosen.append(k)
                self.run(
                    a + 1, chosen, grown, tuple(key * radix + c for key, c in zip(keys, self.codes[a][k]))
                )
                chosen.pop()

    def _split(
        self, placements: tuple[Placement, ...], g: int, factors: list[list[int]]
    ) -> list[list[int]] | None:
        """`factors` after this axis (of `g` ranks) splits the dims `placements` name; None: no
        extension is admissible."""
        grown = factors
        sizes = set()
        odd = False
        for t, p in enumerate(placements):
            if not isinstance(p, Shard):
                continue
            size, before = self.specs[t].shape[p.dim], factors[t][p.dim]
            if is_balanced(p) and size % (before * 2 * g):
                return None  # a load-balanced split: 2g equal chunks of each outer block
            if size % (before * g):
                if not self.uneven or before != 1 or not chunks_nonempty(size, g):
                    return None
                odd = True
            sizes.add(size)
            if grown is factors:
                grown = [list(f) for f in factors]
            grown[t][p.dim] = before * g
        return None if odd and len(sizes) > 1 else grown

    def _strategy(self, chosen: list[int], keys: tuple[int, ...]) -> Strategy:
        layouts = []
        for t, (spec, key, known) in enumerate(zip(self.specs, keys, self.layouts)):
            found = known.get(key)
            if found is None:
                placements = tuple(self.options[a][k][t] for a, k in enumerate(chosen))
                found = known[key] = Layout(placements, spec.shape, spec.dtype)
            layouts.append(found)
        n_in = len(self.call.inputs)
        return Strategy(tuple(layouts[:n_in]), tuple(layouts[n_in:]))


def spec_of(value: Any) -> TensorSpec | None:
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(int(s) for s in value.shape), value.dtype)
    return None


def make_call(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> OpCall:
    """OpCall from real or fake tensors (or any objects with .shape/.dtype) in args and outputs."""

    def to_spec(x: Any) -> Any:
        s = spec_of(x)
        return s if s is not None else x

    spec_args = pytree.tree_map(to_spec, args)
    spec_kwargs = pytree.tree_map(to_spec, kwargs)
    flat_in = [x for x in pytree.tree_leaves((spec_args, spec_kwargs)) if isinstance(x, TensorSpec)]
    flat_out = [s for s in (spec_of(x) for x in pytree.tree_leaves(outputs)) if s is not None]
    return OpCall(op, tuple(spec_args), dict(spec_kwargs), tuple(flat_in), tuple(flat_out))


def shard(dim: int) -> Shard:
    return Shard(dim)


def normalize_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0
