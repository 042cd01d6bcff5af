"""Every rank's graph run in one process, node by node in step, the collectives simulated across
the ranks (`run_lockstep`), and the global joint graph replayed to find where ranks first part
from it (`first_divergence`). Split out of pass_fixtures, which re-exports `run_lockstep`.

Memory: a run holds a node's value on every rank only until its last reader has run (8 ranks of
a 23M-parameter BiT kept every intermediate, weight-sized ones included, and reached 12 GB); a
run asked to `record` every value keeps them all, which is what `first_divergence` reads.
"""

from __future__ import annotations

import collections

import torch
import torch.fx as fx

from autopar.core.collectives import COLLECTIVES
from autopar.core.meta import has_info, info
from autopar.rules import routed_experts
from autopar.rules.routed_experts import ROUTED_OPS
from autopar.testing import assemble
from autopar.testing.threads import run_routed_calls

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

Coords = tuple[int, ...]


def group_of(coords: Coords, axis: int, mesh_shape: tuple[int, ...]) -> list[Coords]:
    """The ranks that share every coordinate but `axis`, in axis order (the process group)."""
    return [tuple(i if a == axis else c for a, c in enumerate(coords)) for i in range(mesh_shape[axis])]


def _collective(
    node: fx.Node,
    coords: Coords,
    inputs: dict[Coords, torch.Tensor],
    mesh_shape: tuple[int, ...],
    splits: dict[Coords, list[int]] | None = None,
):
    axis = info(node).comm.axis  # type: ignore[union-attr]
    group = [inputs[c] for c in group_of(coords, axis, mesh_shape)]
    me = coords[axis]
    g = mesh_shape[axis]
    if node.target in (c10d.all_reduce.default, c10d.all_reduce_.default):  # (in place: its buffer is read once)
        assert node.args[1] == "sum"
        return sum(group[1:], group[0].clone())
    if node.target is c10d.all_gather_into_tensor.default:
        assert node.args[1] == g
        return torch.cat(group, dim=0)
    if node.target is c10d.reduce_scatter_tensor.default:
        assert node.args[1] == "sum" and node.args[2] == g
        return sum(group[1:], group[0].clone()).chunk(g, dim=0)[me].clone()
    if node.target is c10d.all_to_all_single.default:
        # each sender splits by its own sizes (a ring attention pass sends to one rank only)
        sizes = [splits[c] for c in group_of(coords, axis, mesh_shape)]
        assert all(len(s) == g for s in sizes)
        return torch.cat([x.split(list(s), dim=0)[me] for x, s in zip(group, sizes)], dim=0)
    raise AssertionError(node.target)


def _exchanging_op(
    nodes: dict[Coords, fx.Node], envs: dict[Coords, dict[fx.Node, object]], mesh_shape: tuple[int, ...]
) -> dict[Coords, object]:
    """An `autopar::routed_experts(_backward)` local call with its all-to-alls inside, on every
    rank: the ranks of each group of its axes run it as threads (`run_routed_calls`)."""
    return run_routed_calls({c: _load(envs[c], n.args) for c, n in nodes.items()}, mesh_shape)


def _load(env: dict[fx.Node, object], tree: object) -> object:
    """`tree` with each node replaced by its value in `env`. Called for every node of every rank,
    it walks the plain tuples, lists and dicts of fx arguments itself: pytree's `tree_map` costs
    five times the op it feeds, and was most of a lockstep run's time."""
    kind = type(tree)
    if kind is fx.Node:
        return env[tree]  # type: ignore[index]
    if kind is tuple or kind is list or kind is fx.immutable_collections.immutable_list:
        return [_load(env, x) for x in tree] if kind is not tuple else tuple(_load(env, x) for x in tree)  # type: ignore[attr-defined]
    if kind is dict or kind is fx.immutable_collections.immutable_dict:
        return {k: _load(env, v) for k, v in tree.items()}  # type: ignore[attr-defined]
    if isinstance(tree, (tuple, list, dict)):  # a named tuple or another container: pytree knows it
        return torch.utils._pytree.tree_map(lambda x: env[x] if isinstance(x, fx.Node) else x, tree)
    return tree


def last_reads(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """For each position in `nodes`, the nodes whose value is read for the last time there (a node
    nothing reads: at its own position), so that a run can drop them once that node has run."""
    last = {node: i for i, node in enumerate(nodes)}
    for i, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last[used] = i
    out: list[list[fx.Node]] = [[] for _ in nodes]
    for node, i in last.items():
        out[i].append(node)
    return out


def run_lockstep(
    graphs: dict[Coords, fx.GraphModule],
    args: dict[Coords, list],
    mesh_shape: tuple[int, ...],
    record: dict[Coords, dict[str, object]] | None = None,
    *,
    consume: bool = False,
) -> dict[Coords, list]:
    """Run one graph per rank, node by node in step, simulating collectives across the ranks.

    The graphs must have the same structure (they do: only slice offsets and zero_partial differ
    between ranks); a collective's group is read from the node's CommStep axis. Each node starts
    from the same random generator state on every rank, as separate processes seeded alike do.
    `record`, if given, receives every rank's value of every node, by node name; without it each
    value is dropped after its last reader. `consume=True` hands `args` over: its lists are
    emptied at the start, so that an argument the caller holds nowhere else (the saved values a
    backward reads) is freed after its last reader too.
    """
    order = {c: list(gm.graph.nodes) for c, gm in graphs.items()}
    length = {len(nodes) for nodes in order.values()}
    assert len(length) == 1, "per-rank graphs differ in length"
    drops = {c: last_reads(nodes) for c, nodes in order.items()} if record is None else None
    envs: dict[Coords, dict[fx.Node, object]] = {c: {} for c in graphs}
    feeds = {c: collections.deque(a) for c, a in args.items()}
    if consume:
        for a in args.values():
            a.clear()
    result: dict[Coords, list] = {}
    for i in range(length.pop()):
        nodes = {c: order[c][i] for c in graphs}
        _step(nodes, envs, feeds, result, mesh_shape)
        if drops is not None:
            for c, env in envs.items():
                for node in drops[c][i]:
                    env.pop(node, None)
    if record is not None:
        for c, env in envs.items():
            record.setdefault(c, {}).update((n.name, v) for n, v in env.items())
    return result


def _step(
    nodes: dict[Coords, fx.Node],
    envs: dict[Coords, dict[fx.Node, object]],
    feeds: dict[Coords, collections.deque],
    result: dict[Coords, list],
    mesh_shape: tuple[int, ...],
) -> None:
    """One node of every rank's graph: its value into each rank's `envs` (an output node's into
    `result`)."""
    first = next(iter(nodes.values()))
    assert all(n.op == first.op for n in nodes.values())
    # the same op at the same place on every rank (zero_partial: clone on one, zeros on others)
    targets = {n.target for n in nodes.values()} - {aten.clone.default, aten.zeros_like.default}
    assert first.op != "call_function" or len(targets) <= 1, [n.target for n in nodes.values()]
    if first.op == "call_function" and first.target in COLLECTIVES:
        inputs = {c: envs[c][n.args[0]] for c, n in nodes.items()}
        splits = {c: n.args[2] for c, n in nodes.items()}  # all_to_all_single's input split sizes
        for c, n in nodes.items():
            envs[c][n] = _collective(n, c, inputs, mesh_shape, splits)  # type: ignore[arg-type]
        return
    if first.op == "call_function" and first.target in ROUTED_OPS and routed_experts.exchange_axes(first.args):
        # the all-to-all token dispatcher exchanges inside the op: its ranks run it at once
        for c, value in _exchanging_op(nodes, envs, mesh_shape).items():
            envs[c][nodes[c]] = value
        return
    # every rank is its own process with its own generator, at the same state: a random op
    # draws the same numbers on each (`autopar.rules.random`)
    rng = torch.get_rng_state()
    for c, node in nodes.items():
        torch.set_rng_state(rng)
        env = envs[c]
        if node.op == "placeholder":
            env[node] = feeds[c].popleft()
        elif node.op == "output":
            result[c] = list(_load(env, node.args[0]))
        elif node.target is c10d.wait_tensor.default:
            env[node] = env[node.args[0]]
        else:
            a, k = _load(env, (node.args, node.kwargs))
            env[node] = node.target(*a, **k)


def run_global(gm: fx.GraphModule, args: list) -> dict[str, object]:
    """Every node's value of a joint graph run on global tensors (a redistribution's nodes are the
    identity there: it does not change the value it carries), by node name. Random ops draw
    in graph order from the current generator state, as every rank's program does."""
    env: dict[fx.Node, object] = {}
    feed = iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(feed)
        elif node.op == "output":
            break
        elif has_info(node) and info(node).role == "comm":  # a collective, its wait or its glue
            env[node] = env[node.all_input_nodes[0]]
        else:
            a, k = _load(env, (node.args, node.kwargs))
            try:
                env[node] = node.target(*a, **k)  # type: ignore[operator]
            except Exception as exc:
                raise RuntimeError(f"{node.name} = {node.target}{fx.map_arg(node.args, str)}: {exc}") from exc
    return {n.name: v for n, v in env.items()}


def first_divergence(
    joint: fx.GraphModule,
    joint_args: list,
    ranks: dict[Coords, dict[str, object]],
    mesh_shape: tuple[int, ...],
    *,
    atol: float,
    rtol: float,
) -> str | None:
    """The first compute node (in joint-graph order) whose ranks' values, assembled by the node's
    layout, differ from the global graph's value: its op, module path and source line, or None."""
    torch.manual_seed(0)
    try:
        want = run_global(joint, joint_args)
    except Exception as exc:  # a graph whose ops cannot run on global values (none known so far)
        return f"the global graph does not replay: {type(exc).__name__}: {exc}"
    for node in joint.graph.nodes:
        if node.op != "call_function" or not has_info(node) or info(node).role == "comm":
            continue
        value, layouts = want.get(node.name), info(node).layouts
        if not isinstance(value, torch.Tensor) or len(layouts) != 1 or not value.is_floating_point():
            continue
        pieces = {c: env.get(node.name) for c, env in ranks.items()}
        if not all(isinstance(x, torch.Tensor) for x in pieces.values()):
            continue
        try:
            got = assemble(pieces, layouts[0], mesh_shape, atol=atol, rtol=rtol)  # type: ignore[arg-type]
            scale = float(value.abs().max()) if value.numel() else 0.0
            torch.testing.assert_close(got, value, atol=max(atol, rtol * scale), rtol=rtol)
        except AssertionError as exc:
            first_line = str(exc).strip().splitlines()[0]
            return f"first divergence at {node.name} = {node.target} [{info(node).where()}]: {first_line}"
    return None
