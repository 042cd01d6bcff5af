"""Fixed comparison plans: 1-D Megatron, 2-D SUMMA and the 3-D cube as forced layouts of the linears.

The hand schemes of comm_volumes.md fix how each linear's three products (forward, input gradient,
weight gradient) are split over the mesh. Here they are written as forced strategies for those
matmul nodes of the traced joint graph and handed to the greedy planner (`greedy_plan(forced=...)`),
which lays out everything else (attention, layer norms, residual stream, embeddings, loss) around
them as it would for any plan. The result goes through insert_comm / schedule / emit and is priced
like the chosen plan, so the comparison is between real plans of the same graph on the same table.

A linear is a 2-D parameter whose only forward use is one `mm`/`addmm` (through transposes) as the
right operand. Linears pair up in graph order when the second reads the first's output (qkv ->
proj, fc1 -> fc2); only paired linears are forced (a lone one, such as a tied LM head, is planned
freely). Letters: T tokens (rows of the activation), k input features, n output features.

Per mesh axis, a scheme names the letter it splits in the first and in the second linear of a pair:

| scheme | mesh | first linear | second linear |
|---|---|---|---|
| 1-D Megatron | (p,) | n (column-parallel) | k (row-parallel) |
| 2-D SUMMA | pr x pc grid | T on pr, n on pc | T on pr, n on pc |
| 3-D cube | (q, q, q) | T, k, n | T, n, k |
| 3-D grid (search seed only) | (gx, gy, gz), not all equal | T, k, n | T, n, k |

Weights are stored split further over every axis that does not split them (SUMMA's pr, the cube's
token axis) and all-gathered per use, as the planner does for any weight; insert_comm reuses a
redistributed value for all its consumers, so gathered inputs and weights are kept for backward
(the "kept" variants of the closed forms). Which mesh axis gets which letter changes how splits
nest and so the plan around the linears: every order (and for 2-D every grid whose rows divide the
batch) is planned and the cheapest, priced by `plan_cost.plan_cost`, is kept.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError
from autopar.core.layout import Layout, P, Placement, R, Shard
from autopar.core.mesh import Mesh
from autopar.core.meta import info, signature
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy
from autopar.planning.greedy import greedy_plan
from autopar.planning.plan_cost import plan_cost
from autopar.planning.search_cost import ElementCost, TimeCost
from autopar.rules.base import RuleRegistry, admissible, combine
from autopar.rules.calls import call_key, op_call
from autopar.rules.matmul import SPECS

aten = torch.ops.aten
LETTERS = ("T", "k", "n")
MATMULS = (aten.mm.default, aten.addmm.default)
_FLIPS = (aten.t.default, aten.transpose.int, aten.permute.default)
_SAME = (aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.clone.default, aten.detach.default)
SCHEMES = ("megatron_1d", "summa_2d", "cube_3d")
# The cube's letters on three axes of unequal sizes (AxoNN's / Tensor3D's grid): a seed of the
# search, not a comparison scheme (`plan_fixed` over every grid of p would plan dozens of layouts).
# No role assignment's greedy pass reaches it: on 4x16x8 (GPT h = 4096, b = 8) the best role seed
# searched ends at 75.1 M elements per rank per layer, the grid seed at 35.9.
GRID_3D = "grid_3d"
SEED_SCHEMES = (*SCHEMES, GRID_3D)
TITLES = {"megatron_1d": "1-D Megatron", "summa_2d": "2-D SUMMA", "cube_3d": "3-D cube", GRID_3D: "3-D grid"}


class InfeasibleScheme(AutoparError):
    """A fixed scheme cannot run on this graph and mesh size (heads, divisibility, p not a cube)."""


@dataclass(frozen=True)
class Product:
    """One matmul of a linear: its node and which letter each of its m, k, n dims carries."""

    node: str
    letters: tuple[str, str, str]


@dataclass(frozen=True)
class Linear:
    """A weight used as `x @ W^T` once in forward, with its sizes and its products in the graph."""

    param: str
    module: str
    tokens: int
    k: int
    n: int
    forward: str  # the forward product's node
    activation: str  # its left operand
    products: tuple[Product, ...]  # forward, then the backward ones found (input / weight grad)


@dataclass(frozen=True)
class Scheme:
    """One layout of a scheme on a mesh: the letter each axis splits in a pair's two linears."""

    key: str
    mesh_shape: tuple[int, ...]
    first: tuple[str, ...]
    second: tuple[str, ...]
    note: str = ""

    @property
    def title(self) -> str:
        return TITLES[self.key]

    @property
    def roles(self) -> tuple[str, ...]:
        """Axis roles for the planner's other parameter consumers: token where tokens are split
        (a unit axis, letter "-", splits nothing and its role changes nothing)."""
        return tuple("token" if letter == "T" else "tensor" for letter in self.first)

    def mesh(self) -> Mesh:
        return Mesh.from_shape(self.mesh_shape)

    def describe(self) -> str:
        names = self.mesh().axis_names
        axes = ", ".join(
            f"{n}={g}: {a}" + (f"/{b}" if b != a else "")
            for n, g, a, b in zip(names, self.mesh_shape, self.first, self.second)
        )
        return f"{self.title} ({axes}{'; ' + self.note if self.note else ''})"


@dataclass
class FixedPlan:
    """A scheme's cheapest plan of the graph, or why the scheme cannot run (`infeasible`)."""

    key: str
    scheme: Scheme | None = None
    plan: Plan | None = None
    infeasible: str | None = None
    forced: dict[str, Strategy] = field(default_factory=dict)
    variants: int = 0  # layouts of the scheme that were planned and priced

    @property
    def title(self) -> str:
        return TITLES[self.key]


# ---- finding the linears ---------------------------------------------------------------------------


def find_linears(gm: fx.GraphModule) -> list[Linear]:
    """Every linear of the joint graph with its forward, input-gradient and weight-gradient products."""
    sig = signature(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    grads = list(output.args[0])[sig.num_user_outputs :]  # type: ignore[arg-type]
    grad_of = dict(zip(sig.grad_of, grads))
    found = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or info(node).role != "param" or len(node.meta["val"].shape) != 2:
            continue
        uses, other = _weight_uses(node)
        forward = [(m, pos, lab) for m, pos, lab in uses if info(m).phase == "forward"]
        if other or len(forward) != 1 or forward[0][1] != 1 or forward[0][2] != ("k", "n"):
            continue  # not a plain linear (e.g. tied to an embedding, or used twice)
        fwd, _, _ = forward[0]
        a, _ = _operands(fwd)
        tokens, k = a.meta["val"].shape
        n = fwd.meta["val"].shape[1]
        products = [Product(fwd.name, ("T", "k", "n"))]
        for m, pos, (x, y) in uses:
            if info(m).phase == "backward" and m.target is aten.mm.default:
                rest = _third(x, y)
                products.append(Product(m.name, (x, y, rest) if pos == 0 else (rest, x, y)))
        grad = grad_of.get(info(node).param_name or "")
        weight_grad = _weight_grad_product(grad) if isinstance(grad, fx.Node) else None
        if weight_grad is not None and all(p.node != weight_grad.node for p in products):
            products.append(weight_grad)
        found.append(
            Linear(
                info(node).param_name or node.name, info(fwd).module_path, int(tokens), int(k), int(n),
                fwd.name, a.name, tuple(products),
            )
        )
    return found


def pair_linears(gm: fx.GraphModule, linears: Sequence[Linear]) -> list[tuple[tuple[Linear, ...], Linear]]:
    """Consecutive linears (graph order) where the second reads the first's output. Linears that
    read the same activation count as one first linear (q, k and v cut from a fused qkv)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    pairs: list[tuple[tuple[Linear, ...], Linear]] = []
    pending: list[Linear] = []
    for lin in linears:
        reads = nodes[lin.activation]
        if pending and any(_depends(reads, nodes[p.forward], order) for p in pending):
            pairs.append((tuple(pending), lin))
            pending = []
        elif pending and _unviewed(reads) is _unviewed(nodes[pending[0].activation]):
            pending.append(lin)
        else:
            pending = [lin]
    return pairs


def _unviewed(node: fx.Node) -> fx.Node:
    """`node` before any reshapes (each of q, k, v flattens the same activation on its own)."""
    while node.op == "call_function" and node.target in _SAME and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _weight_uses(param: fx.Node) -> tuple[list[tuple[fx.Node, int, tuple[str, str]]], bool]:
    """(matmul, operand position, letters of the weight's dims there) reached through transposes,
    and whether the weight has any other forward use."""
    uses = []
    other = False
    stack: list[tuple[fx.Node, tuple[str, str]]] = [(param, ("n", "k"))]  # nn.Linear: (out, in)
    while stack:
        value, labels = stack.pop()
        for user in value.users:
            if user.target in MATMULS:
                a, b = _operands(user)
                if value is a or value is b:
                    uses.append((user, 0 if value is a else 1, labels))
            elif user.target in _FLIPS and _is_2d_flip(user):
                stack.append((user, (labels[1], labels[0])))
            elif user.target in _SAME and _same_shape(user, value):
                stack.append((user, labels))
            elif info(user).phase == "forward":
                other = True
    return uses, other


def _weight_grad_product(grad: fx.Node) -> Product | None:
    """The backward matmul whose result, through transposes, is the weight's gradient."""
    labels = ("n", "k")
    node = grad
    while node.op == "call_function":
        if node.target is aten.mm.default:
            return Product(node.name, (labels[0], _third(*labels), labels[1]))
        src = node.args[0]
        if not isinstance(src, fx.Node):
            return None
        if node.target in _FLIPS and _is_2d_flip(node):
            labels = (labels[1], labels[0])
        elif not (node.target in _SAME and _same_shape(node, src)):
            return None
        node = src
    return None


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    if node.target is aten.addmm.default:
        return node.args[1], node.args[2]  # type: ignore[return-value]
    return node.args[0], node.args[1]  # type: ignore[return-value]


def _is_2d_flip(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]  # type: ignore[arg-type]
    return True


def _same_shape(node: fx.Node, src: fx.Node) -> bool:
    a, b = node.meta.get("val"), src.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape


def _third(a: str, b: str) -> str:
    return next(c for c in LETTERS if c not in (a, b))


def _depends(node: fx.Node, ancestor: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether `node` is computed from `ancestor` (searching back no further than `ancestor`)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur is ancestor:
            return True
        if cur in seen or cur.op != "call_function" or order[cur] < order[ancestor]:
            continue
        seen.add(cur)
        stack.extend(cur.all_input_nodes)
    return False


# ---- the schemes ------------------------------------------------------------------------------------


def scheme_variants(key: str, p: int, gm: fx.GraphModule, require_heads: bool = True) -> list[Scheme]:
    """Every way to lay the scheme on p ranks: its grids and the order of its letters over the mesh
    axes (which changes how splits nest, hence the plan around the linears); the cheapest is kept.

    Raises `InfeasibleScheme` when none fits: heads not divisible by the 1-D degree, p not a cube,
    no grid whose token axis divides the batch. `require_heads=False` keeps 1-D where the heads do
    not divide: its linears are still 1-D, attention is then laid out by the planner (not Megatron).
    """
    batch = _batch(gm)
    if key == "megatron_1d":
        note = ""
        for heads in sorted(_attention_heads(gm)):
            if heads % p and require_heads:
                raise InfeasibleScheme(
                    f"1-D Megatron splits attention heads {p} ways: heads {heads} % {p} != 0",
                    hint="use a tensor-parallel degree that divides the number of heads",
                )
            if heads % p:
                note = f"heads {heads} % {p} != 0: linears only, attention laid out by the planner"
        return [Scheme(key, (p,), ("n",), ("k",), note)]
    if key == "summa_2d":
        grids = [(pr, p // pr) for pr in range(2, p // 2 + 1) if p % pr == 0]
        if not grids:
            raise InfeasibleScheme(f"2-D needs p = pr * pc with both > 1; p = {p}")
        fits = [g for g in grids if batch is None or batch % g[0] == 0]
        if not fits:
            raise InfeasibleScheme(
                f"2-D splits whole sequences over the grid rows: no row count of a {p}-rank grid divides "
                f"the batch {batch}"
            )
        variants = []
        for pr, pc in fits:  # tokens (pr) on the first or the last axis
            note = f"grid {pr}x{pc}"
            variants.append(Scheme(key, (pc, pr), ("n", "T"), ("n", "T"), note))
            variants.append(Scheme(key, (pr, pc), ("T", "n"), ("T", "n"), note))
        return variants
    if key == "cube_3d":
        q = round(p ** (1 / 3))
        if q < 2 or q**3 != p:
            raise InfeasibleScheme(f"the 3-D cube needs p = q^3 with q > 1; p = {p}")
        if batch is not None and batch % q:
            raise InfeasibleScheme(f"the 3-D cube splits whole sequences {q} ways: batch {batch} % {q} != 0")
        return [Scheme(key, (q, q, q), first, second) for first, second in _cube_letters()]
    if key == GRID_3D:
        grid_shapes = [
            (gx, gy, p // (gx * gy))
            for gx in range(2, p // 4 + 1)
            for gy in range(2, p // (2 * gx) + 1)
            if p % (gx * gy) == 0 and p // (gx * gy) > 1 and len({gx, gy, p // (gx * gy)}) > 1
        ]
        variants = [
            Scheme(key, grid, first, second)
            for grid in grid_shapes
            for first, second in _cube_letters()
            if batch is None or batch % grid[first.index("T")] == 0
        ]
        if not variants:
            raise InfeasibleScheme(
                f"a 3-D grid of unequal axes needs p = gx * gy * gz with each > 1 and a token axis dividing the "
                f"batch {batch}; p = {p}"
            )
        return variants
    raise AutoparError(f"unknown fixed scheme {key!r}", hint=f"use one of {', '.join(SEED_SCHEMES)}")


def _cube_letters() -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """The cube's (first, second) letters per axis in every order over three axes: k, n, T in the
    first linear of a pair, n, k, T in the second (the contracted and the split features swap)."""
    return [
        (tuple(("k", "n", "T")[i] for i in order), tuple(("n", "k", "T")[i] for i in order))
        for order in itertools.permutations(range(3))
    ]


def variants_on(key: str, mesh_shape: Sequence[int], gm: fx.GraphModule) -> list[Scheme]:
    """The scheme's variants that lay out on `mesh_shape` itself: those whose mesh is `mesh_shape`
    without its unit axes, the letters moved onto the non-unit axes and "-" (no split) on the unit
    ones ((1, 8, 8) takes the 8x8 grids of 2-D). 1-D keeps linears-only variants (heads that do not
    divide: attention is laid out by the planner). Raises `InfeasibleScheme` as `scheme_variants`."""
    shape = tuple(int(g) for g in mesh_shape)
    sized = [a for a, g in enumerate(shape) if g > 1]
    if not sized:
        raise InfeasibleScheme(f"mesh {shape} has no axis to split over")
    out = []
    for scheme in scheme_variants(key, math.prod(shape), gm, require_heads=False):
        if scheme.mesh_shape != tuple(shape[a] for a in sized):
            continue
        first, second = ["-"] * len(shape), ["-"] * len(shape)
        for a, x, y in zip(sized, scheme.first, scheme.second):
            first[a], second[a] = x, y
        out.append(Scheme(key, shape, tuple(first), tuple(second), scheme.note))
    return out


def _attention_heads(gm: fx.GraphModule) -> set[int]:
    heads = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and "scaled_dot_product" in str(node.target) and info(node).phase == "forward":
            for arg in node.args[:3]:
                val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
                if isinstance(val, torch.Tensor) and val.dim() == 4:
                    heads.add(int(val.shape[1]))
    return heads


def _batch(gm: fx.GraphModule) -> int | None:
    first = next((n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "input"), None)
    if first is None or first.meta["val"].dim() < 2:
        return None
    return int(first.meta["val"].shape[0])


# ---- forcing and planning ----------------------------------------------------------------------


def forced_strategies(
    gm: fx.GraphModule,
    scheme: Scheme,
    pairs: Sequence[tuple[tuple[Linear, ...], Linear]],
    registry: RuleRegistry,
    memo: dict[Any, Strategy] | None = None,
) -> dict[str, Strategy]:
    """The strategy of every product of every paired linear under `scheme`. `memo` (shared by
    calls on one graph) answers a repeated layer's identical product or transpose at once."""
    nodes = {n.name: n for n in gm.graph.nodes}
    memo = memo if memo is not None else {}
    forced: dict[str, Strategy] = {}
    for firsts, second in pairs:
        for lin, letters in [*((first, scheme.first) for first in firsts), (second, scheme.second)]:
            for product in lin.products:
                node = nodes[product.node]
                key = (node.target, call_key(op_call(node)), product.letters, letters, scheme.mesh_shape)
                strategy = memo.get(key)
                if strategy is None:  # a failure raises and ends the scheme: only answers are kept
                    strategy = memo[key] = _strategy(node, product, letters, scheme, registry)
                forced[product.node] = strategy
                _, (ia, ib), _ = SPECS[node.target]
                for index in (ia, ib):
                    _through_transposes(node.args[index], strategy.inputs[index], forced, registry, memo)
    return forced


def _through_transposes(
    node: Any, want: Layout, forced: dict[str, Strategy], registry: RuleRegistry, memo: dict[Any, Strategy]
) -> None:
    """Force the transposes feeding a product to take their input in the wanted layout (transposed).

    Otherwise a transpose of a value picks its own layout (usually a free slice) and the product
    redistributes the transpose's result: the weight would be gathered again in backward, and the
    output gradient gathered twice (once for each backward product), where the scheme moves it once.
    """
    while isinstance(node, fx.Node) and node.op == "call_function" and node.name not in forced:
        flip = node.target in _FLIPS and _is_2d_flip(node)
        src = node.args[0]
        if not isinstance(src, fx.Node) or not (flip or (node.target in _SAME and _same_shape(node, src))):
            return
        rule = registry.get(node.target)
        if rule is None:
            return
        call = op_call(node)
        key = ("through", node.target, call_key(call), flip, want)
        strategy = memo.get(key)
        if strategy is None:
            per_axis = []
            for placement in want.placements:
                source = Shard(1 - placement.dim) if flip and isinstance(placement, Shard) else placement
                match = next(
                    (s for s in rule.strategies(call) if s.inputs[0] == source and s.outputs == (placement,)),
                    None,
                )
                if match is None:
                    return
                per_axis.append(match)
            strategy = memo[key] = combine(call, per_axis)
        forced[node.name] = strategy
        node, want = src, strategy.inputs[0]


def _strategy(
    node: fx.Node, product: Product, letters: Sequence[str | None], scheme: Scheme, registry: RuleRegistry
) -> Strategy:
    rule = registry.get(node.target)
    if rule is None:
        raise InfeasibleScheme(f"no rule for {node.target}", op=str(node.target))
    call = op_call(node)
    _, (ia, ib), _ = SPECS[node.target]
    options = rule.strategies(call)
    per_axis = []
    for axis, letter in enumerate(letters):
        a, b, out = _placements(product.letters.index(letter) if letter in LETTERS else None)
        match = next(
            (s for s in options if s.inputs[ia] == a and s.inputs[ib] == b and s.outputs == (out,)), None
        )
        if match is None:
            raise InfeasibleScheme(
                f"{scheme.title}: {node.target} has no strategy splitting {letter} on axis {axis}",
                op=str(node.target), where=info(node).where(),
            )
        per_axis.append(match)
    strategy = combine(call, per_axis)
    if not admissible(strategy, scheme.mesh_shape):
        shapes = ", ".join(str(list(lay.shape)) for lay in strategy.inputs)
        raise InfeasibleScheme(
            f"{scheme.title} on mesh {scheme.mesh_shape}: {node.target} with inputs {shapes} "
            f"does not split evenly as {strategy}",
            op=str(node.target), where=info(node).where(),
            hint="uneven shards are not supported by the fixed schemes",
        )
    return strategy


def _placements(position: int | None) -> tuple[Placement, Placement, Placement]:
    """(left operand, right operand, output) on one axis when it splits the product's m / k / n dim."""
    if position == 0:
        return Shard(0), R, Shard(0)
    if position == 1:
        return Shard(1), Shard(0), P
    if position == 2:
        return R, Shard(1), Shard(1)
    return R, R, R


def plan_fixed(
    gm: fx.GraphModule,
    key: str,
    p: int,
    registry: RuleRegistry,
    hardware: str | None = None,
    require_heads: bool = True,
) -> FixedPlan:
    """The scheme's cheapest plan of `gm` on p ranks over its variants (`scheme_variants`), priced
    by `plan_cost.plan_cost` on `hardware` (element counts without one); or why it cannot run."""
    fixed = FixedPlan(key)
    try:
        linears = find_linears(gm)
        pairs = pair_linears(gm, linears)
        if not pairs:
            raise InfeasibleScheme("no pair of linears (one feeding the next) in the graph")
        variants = scheme_variants(key, p, gm, require_heads)
    except AutoparError as exc:
        fixed.infeasible = exc.message
        return fixed
    best = float("inf")
    caches: dict[tuple[int, ...], dict[Any, list[Strategy]]] = {}
    memo: dict[Any, Strategy] = {}
    reasons = []
    for scheme in variants:
        mesh = scheme.mesh()
        try:
            forced = forced_strategies(gm, scheme, pairs, registry, memo)
            cache = caches.setdefault(scheme.mesh_shape, {})
            plan = greedy_plan(gm, mesh, registry, roles=scheme.roles, forced=forced, expand_cache=cache)
        except AutoparError as exc:
            reasons.append(exc.message)
            continue
        cost = TimeCost(hardware, mesh.shape) if hardware is not None else ElementCost(mesh.shape)
        value = plan_cost(gm, plan, mesh, cost)
        fixed.variants += 1
        if value < best:
            best = value
            fixed.scheme, fixed.plan, fixed.forced = scheme, plan, forced
    if fixed.plan is None:
        fixed.infeasible = reasons[0] if reasons else "no variant"
    return fixed


def split_letters(strategy: Strategy, product: Product, target: Any) -> tuple[str, ...]:
    """Per mesh axis, the letter (T, k, n) a product's strategy splits there, or "-" (replicated)."""
    _, (ia, ib), _ = SPECS[target]
    a, b = strategy.inputs[ia].placements, strategy.inputs[ib].placements
    out = []
    for pa, pb in zip(a, b):
        if pa == Shard(0) and pb == R:
            out.append(product.letters[0])
        elif pa == Shard(1) and pb == Shard(0):
            out.append(product.letters[1])
        elif pa == R and pb == Shard(1):
            out.append(product.letters[2])
        else:
            out.append("-" if pa == R and pb == R else "?")
    return tuple(out)
