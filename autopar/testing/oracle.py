"""In-process oracle for sharding rules and redistributions (no processes needed).

Shard random global tensors into one local piece per mesh coordinate, run the op each rank would
run, assemble the results by the output layouts (summing Partial axes, checking that replicas
agree) and compare with the op on the full tensors.

A rank's local tensors need not have the serial tensor's strides: a redistribution hands over
contiguous copies where the serial model held a channels-last activation (a conv after attention's
reshape of a transpose), a slice step hands over a view. Kernels whose result depends on strides
(native_group_norm_backward reads its gradient in its input's memory format) were right in the
serial trace only because autograd's `.contiguous(format)` calls were no-ops there, and the trace
drops them. So the oracle can hand each input's pieces over in another memory layout
(`MEMORY_LAYOUTS`): the op must give the same values whatever the strides.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.core.layout import (
    Layout,
    Partial,
    Replicate,
    RowDisjoint,
    Shard,
    from_balanced,
    is_balanced,
    swap_blocks,
    to_balanced,
)
from autopar.core.meta import NODE_KEY, NodeInfo
from autopar.core.redistribute import CommStep
from autopar.core.strategy import OpCall, Strategy
from autopar.rules import expert_parallel
from autopar.rules.base import LocalContext, LocalGraph, RuleRegistry, make_call
from autopar.rules.localize import localize_sizes

_c10d = torch.ops._c10d_functional

Coords = tuple[int, ...]
Pieces = dict[Coords, torch.Tensor]
# Row-disjoint (D) axes: mesh axis -> the coordinate on it that owns each global row (dim 0).
RowOwners = dict[int, Sequence[int]]

# How a rank's piece of an input may be laid out in memory: as sharded (contiguous), dense with the
# channel dim (1) innermost (channels-last), dense with the dims reversed (a transpose's strides),
# or not dense (a view of every other element of a larger buffer, as a slice hands over).
MEMORY_LAYOUTS = ("contiguous", "channels_last", "reversed", "strided")


def all_coords(mesh_shape: Sequence[int]) -> list[Coords]:
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def local_block(
    full: torch.Tensor, layout: Layout, mesh_shape: Sequence[int], coords: Coords
) -> torch.Tensor:
    """The rank's block of a full tensor, ignoring Partial axes (a copy along a load-balanced
    dim, whose two chunks are not one view)."""
    out = full
    local = layout.local_shape(mesh_shape, coords)
    for d in range(full.ndim):
        if local[d] != full.shape[d]:
            pieces = [out.narrow(d, start, n) for start, n in layout.local_chunks(mesh_shape, coords, d)]
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
    return out


def _block_index(layout: Layout, mesh_shape: Sequence[int], coords: Coords) -> tuple[torch.Tensor, ...]:
    """Advanced-indexing tensors that address the rank's block of the whole tensor."""
    ndim = len(layout.shape)
    return tuple(
        layout.local_indices(mesh_shape, coords, d).reshape([-1 if k == d else 1 for k in range(ndim)])
        for d in range(ndim)
    )


def default_row_owners(layout: Layout, mesh_shape: Sequence[int]) -> RowOwners:
    """Owners of the rows on `layout`'s D axes when a test names none: an uneven, fixed pattern,
    the same for every input of a call (as values an op may combine must share their owners)."""
    rows = layout.shape[0] if layout.shape else 0
    return {
        a: [(r * r + 3 * r) % mesh_shape[a] for r in range(rows)]
        for a, p in enumerate(layout.placements)
        if isinstance(p, RowDisjoint)
    }


def _row_mask(
    layout: Layout, mesh_shape: Sequence[int], coords: Coords, owners: RowOwners, like: torch.Tensor
) -> torch.Tensor:
    """1 on the rows of this rank's block that it owns on every D axis, else 0 (shaped to broadcast)."""
    rows = layout.local_indices(mesh_shape, coords, 0)
    keep = torch.ones(like.shape[0], dtype=torch.bool)
    for a, owner in owners.items():
        keep &= torch.as_tensor(list(owner), dtype=torch.long)[rows] == coords[a]
    return keep.reshape(-1, *([1] * (like.ndim - 1)))


def shard_tensor(
    full: torch.Tensor,
    layout: Layout,
    mesh_shape: Sequence[int],
    generator: torch.Generator | None = None,
    row_owners: RowOwners | None = None,
) -> Pieces:
    """Local pieces of `full`; along Partial axes the block is split into random summands, along
    row-disjoint (D) axes each row goes whole to its owner (`row_owners`, default
    `default_row_owners`) and the others hold zeros."""
    disjoint = [a for a, p in enumerate(layout.placements) if isinstance(p, RowDisjoint)]
    if disjoint:
        owners = row_owners if row_owners is not None else default_row_owners(layout, mesh_shape)
        plain = Layout(
            tuple(Replicate() if a in disjoint else p for a, p in enumerate(layout.placements)),
            layout.shape,
            layout.dtype,
        )
        summands = shard_tensor(full, plain, mesh_shape, generator)
        mine = {a: owners[a] for a in disjoint}
        return {
            c: torch.where(_row_mask(layout, mesh_shape, c, mine, piece), piece, torch.zeros_like(piece))
            for c, piece in summands.items()
        }
    pieces: Pieces = {}
    partial_axes = layout.partial_axes()
    for coords in all_coords(mesh_shape):
        block = local_block(full, layout, mesh_shape, coords).clone()
        pieces[coords] = block
    if not partial_axes:
        return pieces
    floating = full.is_floating_point()
    # Replicas (ranks differing only along Replicate axes) must hold the same summand: draw the
    # summands on the canonical replica (Replicate coords 0) and copy them to the others.
    replicate_axes = [a for a, p in enumerate(layout.placements) if isinstance(p, Replicate)]

    def canonical(coords: Coords) -> Coords:
        return tuple(0 if a in replicate_axes else v for a, v in enumerate(coords))

    # Group ranks that differ only in their Partial coordinates; their pieces must sum to the block.
    for coords in all_coords(mesh_shape):
        if any(coords[a] != 0 for a in partial_axes) or canonical(coords) != coords:
            continue
        group = []
        for combo in itertools.product(*(range(mesh_shape[a]) for a in partial_axes)):
            group.append(_with_coords(coords, partial_axes, combo))
        block = pieces[coords]
        rest = torch.zeros_like(block)
        for c in group[1:]:
            if floating:
                noise = torch.randn(block.shape, generator=generator, dtype=block.dtype)
            else:
                noise = torch.randint(-3, 4, block.shape, generator=generator, dtype=block.dtype)
            pieces[c] = noise
            rest = rest + noise
        pieces[coords] = block - rest
    for coords in all_coords(mesh_shape):
        if canonical(coords) != coords:
            pieces[coords] = pieces[canonical(coords)].clone()
    return pieces


def in_memory_layout(piece: torch.Tensor, memory_layout: str) -> torch.Tensor:
    """The same values as `piece`, with the strides `memory_layout` (one of MEMORY_LAYOUTS) names."""
    if memory_layout == "contiguous" or piece.ndim == 0 or piece.numel() == 0:
        return piece
    if memory_layout == "strided":
        wide = torch.zeros((*piece.shape[:-1], 2 * piece.shape[-1]), dtype=piece.dtype)
        out = wide[..., ::2]
        out.copy_(piece)
        return out
    if memory_layout == "channels_last":
        order = [0, *range(2, piece.ndim), 1]  # outermost first: dim 1 innermost
    elif memory_layout == "reversed":
        order = list(range(piece.ndim))[::-1]
    else:
        raise ValueError(f"unknown memory layout {memory_layout!r}; one of {MEMORY_LAYOUTS}")
    if piece.ndim < 2:  # one dim: dense is contiguous
        return piece
    inverse = [order.index(d) for d in range(piece.ndim)]
    return piece.permute(order).contiguous().permute(inverse)


def _with_coords(coords: Coords, axes: Sequence[int], values: Sequence[int]) -> Coords:
    out = list(coords)
    for a, v in zip(axes, values):
        out[a] = v
    return tuple(out)


def assemble(
    pieces: Pieces, layout: Layout, mesh_shape: Sequence[int], *, atol: float = 1e-5, rtol: float = 1e-4
) -> torch.Tensor:
    """Full tensor from local pieces; raises if replicas along a Replicate axis disagree."""
    first = next(iter(pieces.values()))
    full = torch.zeros(layout.shape, dtype=first.dtype)
    written = torch.zeros(layout.shape, dtype=torch.bool)
    partial_axes = layout.partial_axes()
    for coords in all_coords(mesh_shape):
        if any(coords[a] != 0 for a in partial_axes):
            continue
        total = pieces[coords].clone()
        for combo in itertools.product(*(range(mesh_shape[a]) for a in partial_axes)):
            if not any(combo):
                continue
            total = total + pieces[_with_coords(coords, partial_axes, combo)]
        if tuple(total.shape) != layout.local_shape(mesh_shape, coords):
            raise AssertionError(
                f"rank {coords}: local shape {tuple(total.shape)} != {layout.local_shape(mesh_shape, coords)} "
                f"for {layout}"
            )
        index = _block_index(layout, mesh_shape, coords)
        target = full[index] if index else full
        if bool((written[index] if index else written).all()):
            if not torch.allclose(target.double(), total.double(), atol=atol, rtol=rtol):
                raise AssertionError(f"replicas disagree at rank {coords} for {layout}")
        elif index:
            full[index] = total
            written[index] = True
        else:
            full.copy_(total)
            written.fill_(True)
    return full


def run_local(
    call: OpCall,
    strategy: Strategy,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh_shape: Sequence[int],
    registry: RuleRegistry,
    generator: torch.Generator | None = None,
    memory_layouts: Sequence[str] | None = None,
    row_owners: RowOwners | None = None,
) -> tuple[dict[Coords, list[torch.Tensor]], list[Pieces]]:
    """Run the op on every rank's pieces. Returns outputs per rank and the input pieces.

    `memory_layouts`, one per tensor input (MEMORY_LAYOUTS), lays each input's pieces out so in
    memory; by default they are contiguous. `row_owners`: who holds each row of the D inputs
    (`shard_tensor`)."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensor_positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    input_pieces = [
        shard_tensor(flat[i], strategy.inputs[k], mesh_shape, generator, row_owners)
        for k, i in enumerate(tensor_positions)
    ]
    if memory_layouts is not None:
        if len(memory_layouts) != len(input_pieces):
            raise ValueError(f"{len(memory_layouts)} memory layouts for {len(input_pieces)} tensor inputs")
        input_pieces = [
            {c: in_memory_layout(piece, how) for c, piece in pieces.items()}
            for pieces, how in zip(input_pieces, memory_layouts)
        ]
    rule = registry.get(call.op)
    localize = rule.localize if rule is not None and rule.localize is not None else localize_sizes
    outputs: dict[Coords, list[torch.Tensor]] = {}
    graphs: dict[Coords, tuple[fx.Graph, list[torch.Tensor]]] = {}
    for coords in all_coords(mesh_shape):
        local_flat = list(flat)
        for k, i in enumerate(tensor_positions):
            local_flat[i] = input_pieces[k][coords]
        local_args, local_kwargs = pytree.tree_unflatten(local_flat, spec)
        ctx = LocalContext(call, strategy, tuple(mesh_shape), coords, tuple(local_args), dict(local_kwargs))
        local_call = localize(ctx)
        if isinstance(local_call, LocalGraph):
            graphs[coords] = _local_graph(local_call, local_flat, spec, tensor_positions)
            continue
        result = local_call.target(*local_call.args, **local_call.kwargs)
        outputs[coords] = [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
    if graphs:
        for coords, result in run_graphs_in_step(graphs, mesh_shape).items():
            outputs[coords] = [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
    return outputs, input_pieces


def _local_graph(
    local: LocalGraph, local_flat: list[Any], spec: Any, tensor_positions: list[int]
) -> tuple[fx.Graph, list[torch.Tensor]]:
    """A rank's nodes of a LocalGraph, built on placeholders for its tensors, and those tensors."""
    graph = fx.Graph()
    feeds = list(local_flat)
    for k, i in enumerate(tensor_positions):
        feeds[i] = graph.placeholder(f"input_{k}")
    args, kwargs = pytree.tree_unflatten(feeds, spec)
    result = local.build(graph, tuple(args), dict(kwargs), NodeInfo(role="compute", phase="forward"))
    graph.output(result)
    return graph, [local_flat[i] for i in tensor_positions]


def run_graphs_in_step(
    graphs: dict[Coords, tuple[fx.Graph, list[torch.Tensor]]], mesh_shape: Sequence[int]
) -> dict[Coords, Any]:
    """Every rank's graph (built alike: the same nodes in the same order) node by node in step, its
    all_to_all_single collectives exchanged between the ranks of the axis their CommStep names,
    each sender splitting by its own sizes (a ring's pass to the next rank sends to one rank)."""
    order = {c: list(g.nodes) for c, (g, _) in graphs.items()}
    feeds = {c: iter(tensors) for c, (_, tensors) in graphs.items()}
    envs: dict[Coords, dict[fx.Node, Any]] = {c: {} for c in graphs}
    results: dict[Coords, Any] = {}
    for i in range(len(next(iter(order.values())))):
        nodes = {c: order[c][i] for c in graphs}
        first = next(iter(nodes.values()))
        if first.target is _c10d.all_to_all_single.default:
            step = first.meta[NODE_KEY].comm
            for c, node in nodes.items():
                received = []
                for peer in _axis_group(c, step.axis, mesh_shape[step.axis]):
                    sender = nodes[peer]
                    pieces = envs[peer][sender.args[0]].split(list(sender.args[2]), dim=0)
                    received.append(pieces[c[step.axis]])
                envs[c][node] = torch.cat(received, dim=0)
            continue
        for c, node in nodes.items():
            env = envs[c]
            if node.op == "placeholder":
                env[node] = next(feeds[c])
            elif node.op == "output":
                results[c] = pytree.tree_map(lambda x, e=env: e[x] if isinstance(x, fx.Node) else x, node.args[0])
            elif node.target is _c10d.wait_tensor.default:
                env[node] = env[node.args[0]]
            else:
                args, kwargs = pytree.tree_map(
                    lambda x, e=env: e[x] if isinstance(x, fx.Node) else x, (node.args, node.kwargs)
                )
                env[node] = node.target(*args, **kwargs)
    return results


def check_strategy(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    strategy: Strategy,
    mesh_shape: Sequence[int],
    registry: RuleRegistry,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    generator: torch.Generator | None = None,
    memory_layouts: Sequence[str] | None = None,
    row_owners: RowOwners | None = None,
) -> None:
    """Assert that running `op` sharded by `strategy` and assembling equals the full op (run on
    contiguous tensors); `memory_layouts` as in `run_local`. Row-disjoint (D) inputs give each row
    to its owner in `row_owners` (default `default_row_owners`), and D outputs must hold every
    row only on that owner, zeros elsewhere."""
    expected = op(*args, **kwargs)
    call = make_call(op, args, kwargs, expected)
    experts = expert_parallel.experts_layout(op, strategy)
    if row_owners is None and experts is not None and experts.shard_axes(expert_parallel.EXPERT_DIM):
        offs = args[2] if len(args) > 2 else kwargs["offs"]
        row_owners = expert_parallel.row_owners(offs, experts, mesh_shape)
    outputs, _ = run_local(
        call, strategy, args, kwargs, mesh_shape, registry, generator, memory_layouts, row_owners
    )
    expected_flat = [x for x in pytree.tree_leaves(expected) if isinstance(x, torch.Tensor)]
    for index, (want, layout) in enumerate(zip(expected_flat, strategy.outputs)):
        pieces = {c: outs[index] for c, outs in outputs.items()}
        check_row_disjoint(pieces, layout, mesh_shape, row_owners)
        got = assemble(pieces, layout, mesh_shape, atol=atol, rtol=rtol)
        if want.is_floating_point():
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{op} {strategy}: {m}")
        else:
            if not torch.equal(got, want):
                raise AssertionError(f"{op} {strategy}: integer output {index} differs")


def check_row_disjoint(
    pieces: Pieces, layout: Layout, mesh_shape: Sequence[int], row_owners: RowOwners | None = None
) -> None:
    """Raise unless every rank's piece is zero on the rows it does not own on `layout`'s D axes."""
    disjoint = [a for a, p in enumerate(layout.placements) if isinstance(p, RowDisjoint)]
    if not disjoint:
        return
    owners = row_owners if row_owners is not None else default_row_owners(layout, mesh_shape)
    for coords, piece in pieces.items():
        mask = _row_mask(layout, mesh_shape, coords, {a: owners[a] for a in disjoint}, piece)
        stray = torch.where(mask, torch.zeros_like(piece), piece)
        if bool((stray != 0).any()):
            raise AssertionError(f"rank {coords}: nonzero rows it does not own for {layout}")


def simulate_steps(pieces: Pieces, steps: Sequence[CommStep], mesh_shape: Sequence[int]) -> Pieces:
    """Run redistribution steps on in-process pieces, as the collectives would on real ranks."""
    for step in steps:
        pieces = _simulate_step(pieces, step, mesh_shape)
    return pieces


def _axis_group(coords: Coords, axis: int, size: int) -> list[Coords]:
    return [tuple(v if a != axis else i for a, v in enumerate(coords)) for i in range(size)]


def _simulate_step(pieces: Pieces, step: CommStep, mesh_shape: Sequence[int]) -> Pieces:
    g = mesh_shape[step.axis]
    out: Pieces = {}
    for coords, local in pieces.items():
        group = [pieces[c] for c in _axis_group(coords, step.axis, g)]
        me = coords[step.axis]
        # a load-balanced split on the step's axis: its dim is reordered before it is cut and
        # after it is gathered, as insert_comm does
        gathered_balanced = is_balanced(step.before.placements[step.axis])
        cut_balanced = is_balanced(step.after.placements[step.axis])
        if step.kind == "all_gather":
            assert step.dim is not None
            whole = torch.cat(group, dim=step.dim)
            if step.swap is not None:
                whole = swap_blocks(whole, step.dim, *step.swap)
            out[coords] = from_balanced(whole, step.dim, g) if gathered_balanced else whole
        elif step.kind == "all_reduce":
            out[coords] = sum(group[1:], group[0].clone())
        elif step.kind == "reduce_scatter":
            assert step.dim is not None
            total = sum(group[1:], group[0].clone())
            if step.swap is not None:
                total = swap_blocks(total, step.dim, *step.swap)
            if cut_balanced:
                total = to_balanced(total, step.dim, g)
            out[coords] = total.chunk(g, dim=step.dim)[me].clone()
        elif step.kind == "all_to_all":
            assert step.dim is not None and step.dst_dim is not None
            dst_dim = step.dst_dim
            sent = [to_balanced(p, dst_dim, g) if cut_balanced else p for p in group]
            whole = torch.cat([p.chunk(g, dim=dst_dim)[me] for p in sent], dim=step.dim)
            out[coords] = from_balanced(whole, step.dim, g) if gathered_balanced else whole
        elif step.kind == "slice":
            assert step.dim is not None
            ordered = to_balanced(local, step.dim, g) if cut_balanced else local
            out[coords] = ordered.chunk(g, dim=step.dim)[me].clone()
        elif step.kind == "zero_partial":
            out[coords] = local.clone() if me == 0 else torch.zeros_like(local)
        elif step.kind == "forbidden":
            raise AssertionError(f"no redistribution makes a row-disjoint sum: {step.before} -> {step.after}")
        else:  # pragma: no cover
            raise AssertionError(step.kind)
    return out


def placements_on_axis(layout: Layout, axis: int) -> str:
    p = layout.placements[axis]
    return (
        "S"
        if isinstance(p, Shard)
        else "R"
        if isinstance(p, Replicate)
        else "D"
        if isinstance(p, RowDisjoint)
        else "P"
        if isinstance(p, Partial)
        else "?"
    )


def mesh_size(mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape)
