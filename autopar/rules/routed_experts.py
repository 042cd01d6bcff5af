"""One MoE layer's routed experts as ONE op of the joint graph, so that the all-to-all token
dispatcher can be planned.

The all-to-all dispatcher (`autopar.rules.token_dispatch`) moves rows whose number per rank is
known only at run time, while every value of the joint graph has a static shape and a layout. So
the whole routed-expert computation of a layer (dispatch, the local experts' gated MLPs, combine)
is one op with static inputs and outputs, traced in place of transformers' experts module
(`autopar.passes.routed_experts_trace`) when `PlanOptions(token_dispatch=...)` asks for it:

    autopar::routed_experts(x (t, H), ids (t, k), weights (t, k), gate_up (E, 2I, H), down (E, H, I), act)
        -> (t, H)
    autopar::routed_experts_backward(grad (t, H), x, ids, weights, gate_up, down, act)
        -> (grad_x, grad_weights, grad_gate_up, grad_down)

serially `out[t] = sum_k weights[t, k] * down_e @ (act(gate) * up)`, `gate, up = gate_up_e @ x[t]`
with `e = ids[t, k]`: transformers' concatenated, non-transposed gated experts. The rows' run-time
counts live inside the op's local call; its inputs and outputs keep static shapes.

Per mesh axis the op offers four strategies (`forward_strategies`, `backward_strategies`):

| name | x, ids, weights | gate_up, down | out | grad_x, grad_weights | expert grads |
|---|---|---|---|---|---|
| replicated | R | R | R | R | R |
| data | S(0) | R | S(0) | S(0) | P |
| all-gather dispatcher | R | S(0) | P | P | S(0) |
| all-to-all dispatcher | S(0) | S(0) | S(0) | S(0) | S(0) |

The all-gather one is Megatron-Core's all-gather dispatcher, its collectives made by insert_comm
(all-gather of the tokens and the routing into R, reduce-scatter of the P output). The all-to-all
one exchanges inside the local call (`localize`): counts of rows per expert, then the routed rows
with those split sizes, then the results back (`autopar.rules.token_dispatch`'s scheme, on pairs).
Its backward sends each pair's token row and output gradient (2H) and gets the token's gradient
and the pair's expert output back (2H): nothing of run-time shape is saved between the two ops.
No insert_comm redistribution shows those exchanges, so the planners add
`autopar.planning.ring_cost.routed_exchange_cost` to the candidate (as for ring attention).

The rule is written for one axis and expanded over the mesh as every rule is; the product may split
the experts over several mesh axes (`expert_split_admitted`), nested as any dim's split (the
earlier axis outer: rank (i, j) of axes of sizes (a, b) holds expert block i * b + j; rank (i, j, l)
of (a, b, c) block (i * b + j) * c + l), with one dispatcher on all of them: the all-gather (tokens
whole on each, each rank its own block's offset) or the all-to-all (tokens split on each; the
exchange runs over the axes' groups as one, `token_dispatch.axes_exchange`: Megatron-Core's expert
group spanning its data and tensor groups, or one expert per rank of a (2, 2, 2) mesh). Other axes
may split the tokens (data). The local call names its exchange in one string argument, a
(process group, mesh axis) pair per axis (`encode_exchange` / `decode_exchange`), so any number
of axes takes the same op; the plan uses up to `MAX_EXPERT_AXES` (a planning choice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx

from autopar.core.errors import AutoparError
from autopar.core.layout import P, R, Shard
from autopar.core.strategy import AxisStrategy, OpCall, Strategy
from autopar.rules.base import LocalCall, LocalContext, Requirement, RuleRegistry, both
from autopar.rules.token_dispatch import Exchange, GroupExchange, _expert_major, axes_exchange

aten = torch.ops.aten

# the activations the op's gate may apply: forward, and backward (grad, input) -> grad_input
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]] = {
    "silu": (F.silu, lambda g, x: aten.silu_backward(g, x)),
    "gelu": (F.gelu, lambda g, x: aten.gelu_backward(g, x)),
    "relu": (F.relu, lambda g, x: aten.threshold_backward(g, x, 0.0)),
}
TOKEN_DISPATCHERS = ("allgather", "alltoall", "auto")


class SingleExchange:
    """`Exchange` of one rank: the identity (replicated, data and all-gather strategies)."""

    size = 1
    rank = 0

    def all_to_all(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class _Route:
    """Where this rank's (token, choice) pairs go: `order` the kept pairs in the order sent (by
    expert), the split sizes each way, and on the experts' side the expert-major regrouping."""

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor
    per_expert: list[int]  # rows of each local expert, expert-major
    pairs: int


def _route(ids: torch.Tensor, local: int, first_expert: int, exchange: Exchange) -> _Route:
    """Pairs routed to experts first_expert.. first_expert + local * ranks - 1 (the others are
    dropped: they belong to another rank of an all-gather split, which adds them)."""
    ranks = exchange.size
    flat = ids.reshape(-1).to(torch.int64) - first_expert
    held = local * ranks
    kept = ((flat >= 0) & (flat < held)).nonzero().squeeze(1)
    if ranks > 1 and kept.numel() != flat.numel():
        raise AutoparError(
            f"an expert index outside 0..{held - 1} reached the all-to-all token dispatcher",
            op="autopar::routed_experts",
            hint="the router's indices must name one of the layer's experts",
        )
    order = kept[torch.argsort(flat[kept], stable=True)]
    counts = torch.bincount(flat[order], minlength=held)
    received = exchange.all_to_all(counts, [local] * ranks, [local] * ranks).view(ranks, local)
    return _Route(
        order=order,
        send_splits=[int(c) for c in counts.view(ranks, local).sum(1).tolist()],
        recv_splits=[int(c) for c in received.sum(1).tolist()],
        regroup=_expert_major(received),
        per_expert=[int(c) for c in received.sum(0).tolist()],
        pairs=flat.numel(),
    )


def _send(rows: torch.Tensor, route: _Route, exchange: Exchange) -> torch.Tensor:
    """Pair rows (pair order) -> the rows this rank's experts multiply, expert-major."""
    return exchange.all_to_all(rows[route.order].contiguous(), route.recv_splits, route.send_splits)[route.regroup]


def _back(rows: torch.Tensor, route: _Route, exchange: Exchange) -> torch.Tensor:
    """The experts' result rows (expert-major) -> pair rows (pair order; dropped pairs zero)."""
    source_major = torch.empty_like(rows).index_copy(0, route.regroup, rows)
    got = exchange.all_to_all(source_major, route.send_splits, route.recv_splits)
    return rows.new_zeros(route.pairs, rows.shape[1]).index_copy(0, route.order, got)


def _mlp(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str, counts: list[int]) -> torch.Tensor:
    forward = ACTIVATIONS[act][0]
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    start = 0
    for j, n in enumerate(counts):
        if n:
            gate, up = (rows[start : start + n] @ gate_up[j].T).chunk(2, dim=-1)
            out[start : start + n] = (forward(gate) * up) @ down[j].T
        start += n
    return out


def _mlp_backward(
    rows: torch.Tensor, grad: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of rows, output rows, grad gate_up, grad down) of `_mlp` on the same rows."""
    forward, backward = ACTIVATIONS[act]
    grad_rows = torch.zeros_like(rows)
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    grad_gate_up = torch.zeros_like(gate_up, memory_format=torch.contiguous_format)
    grad_down = torch.zeros_like(down, memory_format=torch.contiguous_format)
    start = 0
    for j, n in enumerate(counts):
        if n:
            x, g = rows[start : start + n], grad[start : start + n]
            gate, up = (x @ gate_up[j].T).chunk(2, dim=-1)
            a = forward(gate)
            m = a * up
            out[start : start + n] = m @ down[j].T
            grad_down[j] = g.T @ m
            grad_m = g @ down[j]
            grad_h = torch.cat([backward(grad_m * up, gate), grad_m * a], dim=-1)
            grad_gate_up[j] = grad_h.T @ x
            grad_rows[start : start + n] = grad_h @ gate_up[j]
        start += n
    return grad_rows, out, grad_gate_up, grad_down


def _check_act(act: str) -> None:
    if act not in ACTIVATIONS:
        raise AutoparError(
            f"routed experts with activation {act!r}",
            op="autopar::routed_experts",
            hint=f"the op supports {', '.join(ACTIVATIONS)}; use token_dispatch='allgather' for other experts",
        )


def experts_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    first_expert: int,
    exchange: Exchange,
) -> torch.Tensor:
    """This rank's share of the layer output: its tokens' (all-to-all over `exchange`) or the
    pairs of experts first_expert.. (one rank) results, summed per token with the router's weights."""
    _check_act(act)
    tokens, top_k = ids.shape
    route = _route(ids, gate_up.shape[0], first_expert, exchange)
    rows = _send(x.repeat_interleave(top_k, dim=0), route, exchange)
    pairs = _back(_mlp(rows, gate_up, down, act, route.per_expert), route, exchange)
    weighted = pairs.view(tokens, top_k, down.shape[1]) * weights.unsqueeze(-1).to(pairs.dtype)
    return weighted.sum(1).to(x.dtype)


def experts_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    first_expert: int,
    exchange: Exchange,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `experts_forward`: each pair sends its token row and its output's gradient
    (2H) to its expert, which returns the token's gradient and the pair's output (2H)."""
    _check_act(act)
    tokens, top_k = ids.shape
    hidden = x.shape[1]
    route = _route(ids, gate_up.shape[0], first_expert, exchange)
    grad_pairs = (grad.unsqueeze(1) * weights.unsqueeze(-1).to(grad.dtype)).reshape(tokens * top_k, hidden)
    both = _send(torch.cat([x.repeat_interleave(top_k, dim=0), grad_pairs.to(x.dtype)], dim=1), route, exchange)
    grad_rows, out_rows, grad_gate_up, grad_down = _mlp_backward(
        both[:, :hidden], both[:, hidden:], gate_up, down, act, route.per_expert
    )
    back = _back(torch.cat([grad_rows, out_rows], dim=1), route, exchange).view(tokens, top_k, 2 * hidden)
    grad_x = back[:, :, :hidden].sum(1)
    grad_weights = (back[:, :, hidden:] * grad.unsqueeze(1).to(back.dtype)).sum(-1)
    return grad_x.to(x.dtype), grad_weights.to(weights.dtype), grad_gate_up, grad_down


EXCHANGE_SEPARATOR = ";"  # between the axes of an encoded exchange ("group:axis;group:axis")


def encode_exchange(pairs: Sequence[tuple[str, int]]) -> str:
    """The local call's `exchange` argument: the (process group, mesh axis) of each axis whose ranks
    exchange the tokens, in mesh-axis order, as "group:axis;group:axis" ("" for none). One string,
    because torch op schemas take no list of strings; read back by `decode_exchange` only."""
    for group, axis in pairs:
        if not group or EXCHANGE_SEPARATOR in group or axis < 0:
            raise AutoparError(
                f"cannot name the exchange of mesh axis {axis} by process group {group!r}",
                op="autopar::routed_experts",
                hint=f"a group name must be non-empty and hold no {EXCHANGE_SEPARATOR!r}, an axis must be >= 0",
            )
    return EXCHANGE_SEPARATOR.join(f"{group}:{axis}" for group, axis in pairs)


def decode_exchange(spec: str) -> tuple[tuple[str, int], ...]:
    """The (group, axis) pairs of `encode_exchange`'s string (the axis after the last ":", so a
    group name may hold one)."""
    pairs = []
    for part in spec.split(EXCHANGE_SEPARATOR) if spec else ():
        group, sep, axis = part.rpartition(":")
        if not group or not sep or not axis.isdigit():
            raise AutoparError(
                f"malformed token exchange {spec!r}",
                op="autopar::routed_experts",
                hint="the exchange argument is 'group:axis;group:axis', made by routed_experts.encode_exchange",
            )
        pairs.append((group, int(axis)))
    return tuple(pairs)


def _exchange(spec: str) -> Exchange:
    """The exchange of an all-to-all local call's process groups (`decode_exchange`, one per mesh
    axis in mesh-axis order), over several axes as one (`token_dispatch.axes_exchange`); none:
    `SingleExchange`."""
    pairs = decode_exchange(spec)
    if not pairs:
        return SingleExchange()
    return axes_exchange(
        [GroupExchange(dist.distributed_c10d._resolve_process_group(g)) for g, _ in pairs]  # type: ignore[arg-type]
    )


# Custom ops (with fake kernels and a registered backward): one node each in the joint graph.
# `first_expert` and `exchange` (the axes whose ranks exchange the tokens, `encode_exchange`) are
# the local call's (`localize`): the global op leaves them at their defaults.
@torch.library.custom_op("autopar::routed_experts", mutates_args=())
def _routed_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    first_expert: int = 0,
    exchange: str = "",
) -> torch.Tensor:
    return experts_forward(x, ids, weights, gate_up, down, act, first_expert, _exchange(exchange))


@_routed_experts.register_fake
def _routed_experts_fake(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    first_expert: int = 0,
    exchange: str = "",
) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autopar::routed_experts_backward", mutates_args=())
def _routed_experts_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    first_expert: int = 0,
    exchange: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return experts_backward(grad, x, ids, weights, gate_up, down, act, first_expert, _exchange(exchange))


@_routed_experts_backward.register_fake
def _routed_experts_backward_fake(
    grad: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    first_expert: int = 0,
    exchange: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(x, memory_format=contiguous),
        torch.empty_like(weights, memory_format=contiguous),
        torch.empty_like(gate_up, memory_format=contiguous),
        torch.empty_like(down, memory_format=contiguous),
    )


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, ids, weights, gate_up, down, *args = inputs
    ctx.save_for_backward(x, ids, weights, gate_up, down)
    ctx.args = tuple(args)  # act, first_expert, exchange


def _backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, ids, weights, gate_up, down = ctx.saved_tensors
    grad_x, grad_weights, grad_gate_up, grad_down = ROUTED_EXPERTS_BACKWARD(grad, x, ids, weights, gate_up, down, *ctx.args)
    return grad_x, None, grad_weights, grad_gate_up, grad_down, *([None] * len(ctx.args))


_routed_experts.register_autograd(_backward, setup_context=_setup_context)

ROUTED_EXPERTS = torch.ops.autopar.routed_experts.default
ROUTED_EXPERTS_BACKWARD = torch.ops.autopar.routed_experts_backward.default
ROUTED_OPS = (ROUTED_EXPERTS, ROUTED_EXPERTS_BACKWARD)

# node.meta key of a routed-experts node: the busiest expert's load over the mean for the model
# it was traced from (`cost.dispatch.routing_imbalance`, set by the trace stage). Untagged nodes
# are priced at the cost object's `routing_imbalance`.
IMBALANCE_META = "autopar_routing_imbalance"


def node_routing_imbalance(node: fx.Node) -> float | None:
    """The routing imbalance the trace recorded on a routed-experts node, if any."""
    value = node.meta.get(IMBALANCE_META)
    return float(value) if value is not None else None


def routed_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str
) -> torch.Tensor:
    """The serial layer (what the trace records)."""
    _check_act(act)
    return torch.ops.autopar.routed_experts(x, ids, weights, gate_up, down, act)


# ---- strategies ------------------------------------------------------------------------------

EXPERTS = Shard(0)
# per axis, for (x, ids, weights, gate_up, down) -> out: replicated, data, all-gather, all-to-all
_FORWARD = (
    AxisStrategy((R, R, R, R, R), (R,)),
    AxisStrategy((Shard(0), Shard(0), Shard(0), R, R), (Shard(0),)),
    AxisStrategy((R, R, R, EXPERTS, EXPERTS), (P,)),
    AxisStrategy((Shard(0), Shard(0), Shard(0), EXPERTS, EXPERTS), (Shard(0),)),
)
# for (grad, x, ids, weights, gate_up, down) -> (grad_x, grad_weights, grad_gate_up, grad_down)
_BACKWARD = (
    AxisStrategy((R, R, R, R, R, R), (R, R, R, R)),
    AxisStrategy((Shard(0), Shard(0), Shard(0), Shard(0), R, R), (Shard(0), Shard(0), P, P)),
    AxisStrategy((R, R, R, R, EXPERTS, EXPERTS), (P, P, EXPERTS, EXPERTS)),
    AxisStrategy((Shard(0), Shard(0), Shard(0), Shard(0), EXPERTS, EXPERTS), (Shard(0), Shard(0), EXPERTS, EXPERTS)),
)


def tokens_index(op: object) -> int:
    """Index of x among the tensor inputs (after grad in the backward)."""
    return 1 if op == ROUTED_EXPERTS_BACKWARD else 0


def _offset(call: OpCall) -> int:
    return tokens_index(call.op)


def forward_strategies(call: OpCall) -> list[AxisStrategy]:
    """Replicated, data (tokens split), all-gather dispatcher, all-to-all dispatcher."""
    return list(_FORWARD)


def backward_strategies(call: OpCall) -> list[AxisStrategy]:
    """The forward's four, on the gradients."""
    return list(_BACKWARD)


def expert_axes(op: object, strategy: Strategy) -> tuple[int, ...]:
    """The mesh axes splitting the experts (nested in mesh-axis order, as any dim's split)."""
    return strategy.inputs[tokens_index(op) + 3].shard_axes(0)


def all_to_all_axes(op: object, strategy: Strategy) -> tuple[int, ...]:
    """The mesh axes whose ranks exchange the tokens inside the op (tokens and experts split on
    each; admitted only where they are all of `expert_axes`), or (): the candidate uses the
    all-gather dispatcher, data or replication (or `op` is not a routed-experts op)."""
    if op not in ROUTED_OPS:
        return ()
    tokens = strategy.inputs[tokens_index(op)].shard_axes(0)
    return tuple(a for a in expert_axes(op, strategy) if a in tokens)


def all_to_all_axis(op: object, strategy: Strategy) -> int | None:
    """The first of `all_to_all_axes`, or None: whether the candidate exchanges tokens inside."""
    axes = all_to_all_axes(op, strategy)
    return axes[0] if axes else None


# The most mesh axes the plan splits the experts over. A planning choice, not the op's limit (its
# local call takes any number, `encode_exchange`): admitting four made the search of a (2, 2, 2, 2)
# mesh worse on a 16-expert Mixtral (0.500 ms against 0.459 ms with the experts over three axes).
MAX_EXPERT_AXES = 3


def expert_split_admitted(call: OpCall, strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Experts split evenly over at most `MAX_EXPERT_AXES` mesh axes, and one dispatcher on all of
    them: the tokens split on every expert axis (the all-to-all, one exchange over their ranks) or
    on none (the all-gather: each rank its own offset, the others' pairs summed by the P output). A
    mix would leave an exchange group holding experts that are not one contiguous block per rank.
    Tokens split evenly over their axes."""
    axes = expert_axes(call.op, strategy)
    if len(axes) > MAX_EXPERT_AXES:
        return False
    at = _offset(call)
    experts = strategy.inputs[at + 3].shape[0]
    tokens = strategy.inputs[at].shape[0]
    if experts % math.prod(mesh_shape[a] for a in axes):
        return False
    if all_to_all_axes(call.op, strategy) not in ((), axes):
        return False
    return tokens % math.prod(mesh_shape[a] for a in strategy.inputs[at].shard_axes(0)) == 0


def dispatcher_required(dispatcher: str) -> Requirement | None:
    """What `PlanOptions(token_dispatch=...)` asks of the op: "alltoall" every candidate that
    splits the experts to exchange tokens inside (no all-gather dispatcher), "auto" nothing."""
    if dispatcher != "alltoall":
        return None
    return Requirement(
        lambda call, s: not expert_axes(call.op, s) or all_to_all_axis(call.op, s) is not None,
        "token_dispatch='alltoall' needs the tokens split on the axis that splits the experts",
    )


def localize(ctx: LocalContext) -> LocalCall:
    """The op on the rank's blocks, as (..., act, first_expert, exchange): its experts' offset
    (all-gather split; no exchange), or the process groups of the axes whose ranks exchange the
    tokens (all-to-all split; several: the earlier mesh axis outer, `token_dispatch.axes_exchange`),
    encoded in one string (`encode_exchange`)."""
    call = ctx.call
    tensors = ctx.args[: _offset(call) + 5]
    act = ctx.args[_offset(call) + 5] if len(ctx.args) > _offset(call) + 5 else ctx.kwargs["act"]
    a2a = all_to_all_axes(call.op, ctx.strategy)
    if a2a:
        groups = [ctx.groups[a] if ctx.groups else "" for a in a2a]
        if not all(groups):
            raise AutoparError(
                "the all-to-all token dispatcher needs the process groups of its mesh axes",
                op=str(call.op),
                hint="compile through autopar (emit hands the rules the mesh's groups)",
            )
        return LocalCall(call.op, (*tensors, act, 0, encode_exchange(list(zip(groups, a2a, strict=True)))), {})
    experts = ctx.strategy.inputs[_offset(call) + 3]
    first = experts.local_offsets(ctx.mesh_shape, ctx.coords)[0] if expert_axes(call.op, ctx.strategy) else 0
    return LocalCall(call.op, (*tensors, act, first, ""), {})


def exchange_axes(local_args: Sequence[object]) -> tuple[int, ...]:
    """The mesh axes of a local call's exchange (its last argument, `localize`): () where it
    exchanges nothing (replicated, data, all-gather)."""
    spec = local_args[-1]
    return tuple(axis for _, axis in decode_exchange(spec)) if isinstance(spec, str) else ()


def local_call_parts(local_args: Sequence[Any]) -> tuple[tuple[Any, ...], int]:
    """(the op's arguments up to `first_expert`, how many of them are tensors) of a local call."""
    head = tuple(local_args[:-1])
    return head, len(head) - 2


def register(registry: RuleRegistry) -> None:
    rules = registry.family("routed_experts")
    admits = expert_split_admitted
    rules.register(ROUTED_EXPERTS, forward_strategies, localize=localize, anchor=True, admits=admits)
    rules.register(ROUTED_EXPERTS_BACKWARD, backward_strategies, localize=localize, anchor=True, admits=admits)


def require_dispatcher(registry: RuleRegistry, dispatcher: str) -> RuleRegistry:
    """A copy of `registry` whose routed-experts ops offer what `dispatcher` admits, and what a
    requirement the registry already puts on them admits (a user's placement of the experts)."""
    if dispatcher not in TOKEN_DISPATCHERS:
        raise AutoparError(
            f"no token dispatcher {dispatcher!r}",
            op="PlanOptions.token_dispatch",
            hint=f"use one of {', '.join(TOKEN_DISPATCHERS)}",
        )
    requirement = dispatcher_required(dispatcher)
    if requirement is None or ROUTED_EXPERTS not in registry:
        return registry
    registry = registry.copy()
    for op in ROUTED_OPS:
        rule = registry.get(op)
        registry.require(op, both(rule.requirement if rule is not None else None, requirement))
    return registry
