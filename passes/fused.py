"""Part of stage 1, trace: cut fused linears whose output is split into equal pieces into one linear
per piece, each with its own slice of the weight and bias as a parameter.

A fused projection such as GPT's `qkv = nn.Linear(h, 3h)` followed by `.split(h, dim=-1)` cannot be
split by heads as one matrix: a contiguous block of its 3h output columns mixes q, k and v, and the
pieces a rank needs (its heads of q, of k and of v) are not one block. Layouts have no strided split,
so the plan re-split the output by heads with all-to-alls (11 M elements per layer and rank at
p = 64 on the GPT of comm_volumes.md). With one linear per piece, each piece is a matrix of its own
that the planner splits by heads like any linear, and the all-to-alls disappear.

The rewrite runs on torch.export's graph, before the joint forward+backward export, so autograd
derives the pieces' backward itself. The user's parameter stays one parameter outside the compiler:
`JointSignature.param_parts` says which chunk of it each piece is, the runtime keeps the user's
parameter whole and hands the program chunks of its local shard (`ParallelModule`), and every piece
is stored in the same layout with the split dim whole (`autopar.planning.storage.unify_part_storage`), so the
local shard is an ordinary DTensor shard of the user's parameter.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.core.meta import ParamPart

aten = torch.ops.aten
_PART = "__part"  # part parameter names: "<weight name>__part<i>"


def wanted(split_fused: bool | None, planner: str) -> bool:
    """`split_fused=None` (the default): cut with the search planner, not with greedy. The search
    moves q, k and v together and plans the cut graph below the fused one (plan quality at 64 and
    512 ranks, docs/planning.md); greedy decides op by op and its plans of the cut graph are worse."""
    return planner == "search" if split_fused is None else bool(split_fused)


def split_fused_linears(
    module: fx.GraphModule, fake_mode: FakeTensorMode, tied: Iterable[str] = ()
) -> dict[str, ParamPart]:
    """Rewrite every `linear(x, W, b)` whose only use is a split of its output features into equal
    pieces (`split`, `split_with_sizes`, `chunk`) as one linear per piece on new parameters
    `<W>__part<i>` (and `<b>__part<i>`). Returns part name -> ParamPart. Weights used anywhere else
    (tied, shared, read directly) are left alone."""
    tied_names = set(tied)
    parts: dict[str, ParamPart] = {}
    graph = module.graph
    for linear in list(graph.nodes):
        found = _fused(linear, tied_names)
        if found is None:
            continue
        split, count = found
        x, weight = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else None
        params = [p for p in (weight, bias) if isinstance(p, fx.Node)]
        names: dict[fx.Node, list[str]] = {p: _add_parts(module, str(p.target), count, fake_mode) for p in params}
        for p in params:
            parts.update(
                {name: ParamPart(str(p.target), 0, i, count) for i, name in enumerate(names[p])}
            )
        for getitem in list(split.users):
            i = getitem.args[1]
            assert isinstance(i, int)
            with graph.inserting_before(getitem):
                args = [x] + [graph.get_attr(names[p][i]) for p in params]
                piece = graph.call_function(aten.linear.default, tuple(args))
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn"):
                if key in linear.meta:
                    piece.meta[key] = linear.meta[key]
            getitem.replace_all_uses_with(piece)
            graph.erase_node(getitem)
        graph.erase_node(split)
        graph.erase_node(linear)
        for p in params:
            graph.erase_node(p)
            owner, _, leaf = str(p.target).rpartition(".")
            delattr(module.get_submodule(owner) if owner else module, leaf)
    if parts:
        graph.lint()
        module.recompile()
    return parts


def _fused(linear: fx.Node, tied: set[str]) -> tuple[fx.Node, int] | None:
    """(split node, piece count) if `linear` is a fused linear this pass cuts."""
    if linear.op != "call_function" or linear.target is not aten.linear.default or len(linear.users) != 1:
        return None
    weight = linear.args[1]
    bias = linear.args[2] if len(linear.args) > 2 else None
    for p in (weight, bias):
        if p is None:
            continue
        if not isinstance(p, fx.Node) or p.op != "get_attr" or len(p.users) != 1 or str(p.target) in tied:
            return None
    (split,) = linear.users
    out = linear.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() < 1:
        return None
    n = out.shape[-1]
    sizes = _piece_sizes(split, n, out.dim())
    if sizes is None or len(sizes) < 2 or len(set(sizes)) != 1:
        return None
    indices = set()
    for user in split.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        indices.add(user.args[1])
    if indices != set(range(len(sizes))):
        return None  # a piece nobody reads would leave a parameter without a gradient
    return split, len(sizes)


def _piece_sizes(split: fx.Node, n: int, ndim: int) -> list[int] | None:
    """Sizes of the pieces `split` cuts the last dim (of size n) into; None if not such a split."""
    if split.op != "call_function":
        return None
    args = list(split.args) + [None] * 3
    dim = split.kwargs.get("dim", args[2] if args[2] is not None else 0)
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        return None
    if split.target is aten.split.Tensor and isinstance(args[1], int) and args[1] > 0:
        size = args[1]
        return [size] * (n // size) + ([n % size] if n % size else [])
    if split.target is aten.split_with_sizes.default and isinstance(args[1], (list, tuple)):
        return [int(s) for s in args[1]]
    if split.target is aten.chunk.default and isinstance(args[1], int) and args[1] > 0:
        size = -(-n // args[1])
        return [size] * (n // size) + ([n % size] if n % size else [])
    return None


def _add_parts(module: fx.GraphModule, target: str, count: int, fake_mode: FakeTensorMode) -> list[str]:
    """Register `count` parameters `<target>__part<i>`, each one chunk of `target`'s shape."""
    owner_path, _, leaf = target.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    whole = getattr(owner, leaf)
    shape = (whole.shape[0] // count, *whole.shape[1:])
    names = []
    with fake_mode:
        for i in range(count):
            piece = nn.Parameter(torch.empty(shape, dtype=whole.dtype), requires_grad=whole.requires_grad)
            owner.register_parameter(f"{leaf}{_PART}{i}", piece)
            names.append(f"{target}{_PART}{i}")
    return names
