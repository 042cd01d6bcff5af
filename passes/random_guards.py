"""Guards on random draws (LayerDrop's `if self.training and torch.rand([]) < p: skip the layer`).

The draw that decides the branch comes from the same generator as every other random op of the
forward (dropout masks, earlier layers' draws), at a point of the serial stream that only the ops
before it decide. Before the program runs, each call replays those ops from the generator's state
at the call: the draws before the decision on empty stand-ins of their inputs' shapes (their
numbers depend on the shapes, dtype and device alone), then the decision draws themselves, and
restores the state after (`autopar.core.value_guards.ValueGuards.draws`). The program itself keeps
every draw, the decisions included, so its generator ends where the serial step's does, and the
outcome selects the program compiled for it, as any guard does.

Only draws whose numbers depend on shapes alone are replayed (`REPLAYABLE`); a branch decided by a
draw after another kind of random op (`multinomial` of activations, whose stream position depends
on values) is refused, naming that op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from autopar.core.errors import TraceError
from autopar.core.graph_order import inputs_with_writes, reachable

aten = torch.ops.aten

# random ops whose values are the draw alone (their inputs give a shape, a dtype, a device)
SHAPE_ONLY = frozenset(
    {
        aten.rand.default,
        aten.randn.default,
        aten.rand_like.default,
        aten.randn_like.default,
        aten.bernoulli.p,
        aten.uniform_.default,
        aten.uniform.default,
        aten.normal_.default,
        aten.bernoulli_.float,
    }
)
_SDPA = aten.scaled_dot_product_attention.default
# random ops whose numbers (and how far they move the generator) depend on their inputs' shapes,
# dtypes and device alone, never on their values; attention draws its dropout mask as its math
# decomposition does (autopar traces it so: `autopar.rules.device_attention`)
REPLAYABLE = SHAPE_ONLY | {
    aten.dropout.default,
    aten.native_dropout.default,
    aten.feature_dropout.default,
    aten.alpha_dropout.default,
    aten.feature_alpha_dropout.default,
    _SDPA,
}

RANDOM_ORDER_HINT = (
    "a branch chosen by a random draw (LayerDrop) is decided before the program runs by replaying "
    "the random ops before it from the serial generator state, which works for ops that draw by "
    "shape (dropout, rand, randn, bernoulli with a constant p); draw this one after the decision, "
    "or turn off random layer skipping (LayerDrop: layerdrop=0 in the model's config)"
)


def draws(node: fx.Node) -> bool:
    """Whether `node` is a random op (torch tags them nondeterministic_seeded; dropout, a composite,
    draws inside)."""
    target = node.target
    if target in REPLAYABLE:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def replayable(node: fx.Node) -> bool:
    """Whether `node` is a random op that a replay on stand-ins of its inputs draws alike."""
    return node.target in REPLAYABLE


# a step for `reachable`: the nodes one node's value depends on
ValueStep = Callable[[fx.Node], Iterable[fx.Node]]


def value_inputs(graph: fx.Graph) -> ValueStep:
    """A step for `reachable` that walks to what a node's value depends on: its inputs and the
    in-place writes into what they read (`inputs_with_writes`); the inputs of a draw whose value is
    the draw alone (`SHAPE_ONLY`) give it only their shapes, so the walk stops at it. It scans the
    whole graph once: build it once per graph and reuse it while nodes are only erased or their
    arguments rewired; a node added afterwards is unknown to it (build it again)."""
    inputs = inputs_with_writes(graph)
    return lambda node: () if node.target in SHAPE_ONLY else inputs(node)


def value_ancestors(start: Collection[fx.Node], inputs: ValueStep) -> set[fx.Node]:
    """`start` and every node whose value they depend on, transitively, along `inputs` (the
    graph's `value_inputs`)."""
    return reachable(start, inputs)


def draws_before(graph: fx.Graph, chain: set[fx.Node], where: Callable[[fx.Node], str]) -> list[fx.Node]:
    """The random ops that run before the last draw in `chain` (the guards' nodes) and are not in
    it: what a call replays to bring the generator to each decision, in graph (serial) order."""
    decisions = [n for n in graph.nodes if n in chain and draws(n)]
    if not decisions:
        return []
    last = decisions[-1]
    before: list[fx.Node] = []
    for node in graph.nodes:
        if node is last:
            break
        if node in chain or not draws(node):
            continue
        if not replayable(node):
            raise TraceError(
                "a branch is chosen by a random draw, and a random op before that draw moves the "
                "generator by an amount its input values decide, so the draw cannot be replayed "
                "before the program runs",
                op=str(node.target),
                where=where(node),
                hint=RANDOM_ORDER_HINT,
            )
        before.append(node)
    return before


def copy_drawing(
    graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node], device: fx.Node
) -> fx.Node | None:
    """Copy random op `node` into `graph`, each tensor it reads replaced by an empty tensor of that
    tensor's shape, strides and dtype on `device` (a placeholder: the program's device): it then
    draws what the op draws in the program, whatever the values. Attention draws as its math
    decomposition does: a dropout of the attention weights' shape (None where it draws nothing)."""

    def stand_in(arg: fx.Node) -> fx.Node:
        value = arg.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return env[arg]
        return empty(tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride()), value.dtype)

    def empty(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> fx.Node:
        return graph.call_function(torch.empty_strided, (shape, stride), {"dtype": dtype, "device": device})

    if node.target is not _SDPA:
        return graph.node_copy(node, stand_in)
    q, k = (a.meta["val"] for a in node.args[:2])  # type: ignore[union-attr]
    p = float(node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0))  # type: ignore[arg-type]
    if p == 0.0:
        return None
    shape = (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], k.shape[-2])
    weights = empty(
        tuple(int(s) for s in shape),
        tuple(int(s) for s in torch.empty(shape, device="meta").stride()),
        q.dtype,
    )
    return graph.call_function(aten.native_dropout.default, (weights, p, True))


# Python-level calls that draw a decision's numbers (`torch.rand([]) < p`)
_FACTORIES = frozenset(
    {torch.rand, torch.randn, torch.rand_like, torch.randn_like, torch.bernoulli, torch.Tensor.uniform_}
)


class _DrawStates(TorchFunctionMode):
    """Each Python call of a random factory in `_FACTORIES`, in order: `states` None records the
    generators' state before each call; a list sets the state before call k to `states[k]`."""

    def __init__(self, device: torch.device, states: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        super().__init__()
        self.device = device
        self.recorded: list[tuple[torch.Tensor, ...]] = []
        self.states = states
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _FACTORIES:
            if self.states is None:
                self.recorded.append(_generator_state(self.device))
            elif self.calls < len(self.states):
                _set_generator_state(self.device, self.states[self.calls])
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _generator_state(device: torch.device) -> tuple[torch.Tensor, ...]:
    cpu = torch.random.get_rng_state()
    if device.type == "cpu":
        return (cpu,)
    return (cpu, torch.get_device_module(device.type).get_rng_state(device))


def _set_generator_state(device: torch.device, state: tuple[torch.Tensor, ...]) -> None:
    torch.random.set_rng_state(state[0])
    if device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state[1], device)


def eager_draw_states(run: Callable[[], Any], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The generators' state before each random factory call of `run` (the model run eagerly on
    the example), up to where it stops: what `serial_draws` replays in a trace. The trace's own
    numbers differ from eager ones after a dropout (fake tensors run dropout's decomposition, which
    draws in another way than the kernel), so a decision would otherwise take another outcome
    than serial and than the guards' replay."""
    mode = _DrawStates(device)
    with contextlib.suppress(Exception), mode:  # a model's own check failing: the trace reports it
        run()
    return mode.recorded


def serial_draws(states: list[tuple[torch.Tensor, ...]], device: torch.device) -> _DrawStates:
    """Inside, the k-th random factory call draws from `states[k]` (`eager_draw_states`)."""
    return _DrawStates(device, states)
