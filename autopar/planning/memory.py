"""Memory per rank of a plan, before any collective exists: what the plan search constrains.

It counts what `autopar.plan` measures on the emitted program: stored parameter shards, their
gradients and AdamW states (in the parameter's dtype: 4 bytes kept per stored byte), and the
activations the forward hands to the backward. A pipeline stage counts its saved activations once
per microbatch in flight, and where it sums its microbatches' gradients before one reduction, the
sums (`unreduced_grad_bytes`: the gradients as the backward computes them, a Partial one whole) in
place of the stored gradient when they are more (the backward adds each term into its sum as it
makes it, `runtime.defer_reduction`, so one term at a time exists beside them). A choice that prices another weight state (the
mesh choice with pipeline depths under `PlanOptions.weight_state`: mixed precision's float32
gradient, master and AdamW states beside a bfloat16 weight, 9 bytes per stored byte) records its
`StateRatios` on the traced graph (`set_state_ratios`), and every plan of that graph is counted with
them, so the search fits the limit with the state the step will hold, whatever storage a plan picks
(replicated weights hold p times the sharded state). Backward
reuses a redistribution made in forward (insert_comm makes each (value, layout) once), so a value
that forward gathered and backward wants gathered is saved gathered; this is where the gathered
weights that the search keeps for backward come from.

A *weight chain* value (a parameter and views / casts of it, all-gathered from its storage before
use) can be built again in backward instead ("regathered", `autopar.passes.regather`): its saved
copies disappear and its all-gathers run a second time. `autopar.planning.recompute.choose_savings`
picks which, with the activations to recompute, cheapest seconds per byte first, to bring a plan
under a memory limit.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core.layout import Layout
from autopar.core.meta import activation_copies, gradient_copies, info, is_backward, signature
from autopar.core.plan import MAX_REGATHER_NODES, Plan
from autopar.cost.formulas import ADAMW_STATE_FACTOR, MemoryBreakdown
from autopar.cost.work import is_view
from autopar.planning.working import op_working_bytes
from autopar.rules.calls import tensor_inputs

MEMORY_HEADROOM = 0.9  # default limit: this share of device memory (as MemoryBreakdown.fits)
STATE_RATIOS_KEY = "autopar_state_ratios"  # gm.meta: the graph's `StateRatios`, when not plain


@dataclass(frozen=True)
class StateRatios:
    """Bytes a rank keeps per byte of stored parameter beyond the parameter itself: its gradient
    and its optimizer state (a float32 master and AdamW's two states). The default is what
    `parallelize` keeps: gradient and AdamW states in the parameter's dtype (1 + 2)."""

    grad: float = 1.0
    optimizer: float = ADAMW_STATE_FACTOR

    @property
    def total(self) -> float:
        """Bytes kept per stored byte, the parameter included."""
        return 1.0 + self.grad + self.optimizer


def state_ratios(gm: fx.GraphModule) -> StateRatios:
    """The weight state the plans of `gm` are counted with (module doc); plain if none was set."""
    ratios = gm.meta.get(STATE_RATIOS_KEY)
    return ratios if isinstance(ratios, StateRatios) else StateRatios()


def set_state_ratios(gm: fx.GraphModule, ratios: StateRatios) -> None:
    """Count every plan of `gm` with `ratios` (a choice pricing a weight state other than plain)."""
    gm.meta[STATE_RATIOS_KEY] = ratios


@dataclass(frozen=True)
class SavedValue:
    """A forward value the backward needs, and what keeping it costs one rank."""

    name: str
    layout: Layout  # the value's own layout
    bytes: float  # per rank: its saved copies (own layout and forward redistributions backward reuses)
    regatherable: bool  # a weight chain: backward can gather it again from the stored parameter


@dataclass
class PlanMemory:
    """Per-rank memory of one plan; `breakdown(regather)` with some weight chains regathered."""

    param_bytes: float  # stored shards of parameters and buffers
    saved: list[SavedValue] = field(default_factory=list)
    ratios: StateRatios = field(default_factory=StateRatios)  # gradient and optimizer bytes per stored byte
    activation_copies: int = 1  # microbatches whose saved values the rank holds at once (a pipeline stage's)
    # a stage summing its microbatches' gradients: the sums' bytes (unreduced gradients times copies)
    unreduced_grad_bytes: float = 0.0
    # the working memory at the step's peak op, beyond the saved values (`planning.working`):
    # held once, whatever the microbatches in flight (one op runs at a time)
    working_bytes: float = 0.0
    # (op, working bytes while it runs) in the traced order, whose most is `working_bytes`
    working_steps: list[tuple[str, float]] = field(default_factory=list)

    def activation_bytes(self, regather: Collection[str] = ()) -> float:
        return sum(s.bytes for s in self.saved if s.name not in regather)

    def breakdown(self, regather: Collection[str] = ()) -> MemoryBreakdown:
        return self.with_activations(self.activation_bytes(regather))

    def with_activations(self, activation_bytes: float) -> MemoryBreakdown:
        """The breakdown with `activation_bytes` saved per microbatch (what recomputation leaves,
        `planning.recompute`), held `activation_copies` times."""
        params, ratios, held = self.param_bytes, self.ratios, self.activation_copies * activation_bytes
        grads = max(params * ratios.grad, self.unreduced_grad_bytes)
        return MemoryBreakdown(params, grads, params * ratios.optimizer, float(held), self.working_bytes)


def saved_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Forward values that some backward node, or a gradient output, uses. Placeholders are among
    them; they are stored anyway, but a forward redistribution of one that backward reuses is not."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    grads = {v for v in list(output.args[0])[signature(gm).num_user_outputs :] if isinstance(v, fx.Node)}
    return [
        n
        for n in gm.graph.nodes
        if n.op in ("call_function", "placeholder")
        and not is_backward(n)
        and isinstance(n.meta.get("val"), torch.Tensor)
        and (any(is_backward(u) for u in n.users) or n in grads)
    ]


def weight_chain(node: fx.Node, decided: Collection[str]) -> list[fx.Node] | None:
    """`node` and its forward ancestors if it is computed from parameters by a few undecided ops
    (views, casts; no chosen compute, no random op), else None."""
    if node.op == "placeholder":  # stored anyway: nothing to gather again
        return None
    closure: list[fx.Node] = []
    seen = {node}
    frontier = [node]
    params = 0
    while frontier:
        current = frontier.pop()
        if current.op == "placeholder":
            role = info(current).role
            if role not in ("param", "buffer", "constant"):
                return None
            params += role == "param"
            continue
        tags = getattr(current.target, "tags", ())
        if (
            current.op != "call_function"
            or current.name in decided
            or is_backward(current)
            or torch.Tag.nondeterministic_seeded in tags
        ):
            return None
        closure.append(current)
        if len(closure) > MAX_REGATHER_NODES:
            return None
        for i in current.all_input_nodes:
            if i not in seen:
                seen.add(i)
                frontier.append(i)
    return closure if params else None


def unreduced_grad_bytes(gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int]) -> float:
    """Per rank, the parameter gradients as the backward computes them, before any collective takes
    them to their storage layout (a Partial one is the whole local block): what a pipeline stage
    sums over its microbatches before reducing once (`runtime.defer_reduction`)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    sig = signature(gm)
    grads = list(output.args[0])[sig.num_user_outputs : sig.num_param_grads_end]
    shape = tuple(mesh_shape)
    total = 0.0
    for node in grads:
        layouts = plan.layouts.get(node.name) if isinstance(node, fx.Node) else None
        if layouts:
            total += layouts[0].local_bytes(shape)
    return total


def views_stored(node: fx.Node, plan: Plan) -> bool:
    """Whether `node`, in its own layout, is a view of a stored tensor's block (a parameter's
    transpose taken without gathering it first): saving it for backward keeps no memory of its own.
    The proxies of docs/pipeline.md#a-pipelined-ranks-memory saved 48 MiB of such transposes per
    microbatch that the step never allocated."""
    current = node
    while current.op != "placeholder":
        inputs = current.all_input_nodes
        if current.op != "call_function" or len(inputs) != 1 or not is_view(current) or is_backward(current):
            return False
        strategy = plan.strategies.get(current.name)
        source = plan.layouts.get(inputs[0].name)
        if strategy is None or not source:
            return False
        wants = [w for i, w in zip(tensor_inputs(current), strategy.inputs) if i is inputs[0]]
        if any(w != source[0] for w in wants):  # redistributed first: a new tensor
            return False
        current = inputs[0]
    return info(current).role in ("param", "buffer", "constant")


def broadcast_source(node: fx.Node, plan: Plan) -> tuple[str, Layout] | None:
    """(value, layout it is read in) whose block `node` shares if `node` is a view of a broadcast
    (`expand`, through views that read their input in its own layout): grouped-query attention's
    keys and values repeated for every query head are such views, and keep only the block they
    expand (the all-gather strategy's gathered keys were counted once per query head)."""
    current = node
    while current.op == "call_function" and is_view(current) and not is_backward(current):
        inputs = current.all_input_nodes
        strategy = plan.strategies.get(current.name)
        if strategy is None or len(inputs) != 1:
            return None
        wants = [w for i, w in zip(tensor_inputs(current), strategy.inputs) if i is inputs[0]]
        if not wants:
            return None
        if current.target is torch.ops.aten.expand.default:
            return inputs[0].name, wants[0]
        if wants[0] != plan.layouts.get(inputs[0].name, (None,))[0]:  # redistributed first: a new tensor
            return None
        current = inputs[0]
    return None


def plan_memory(gm: fx.GraphModule, plan: Plan, mesh_shape: Sequence[int], working: bool = True) -> PlanMemory:
    """Memory per rank of `plan` on `gm` (see the module docstring for what is counted).
    `working=False` leaves the working memory at 0: a caller that reads only the saved values (the
    search's per-value memory model) skips the walk over every op, as long as the whole graph."""
    shape = tuple(mesh_shape)
    param_bytes = float(
        sum(
            plan.layouts[n.name][0].local_bytes(shape)
            for n in gm.graph.nodes
            if n.op == "placeholder" and info(n).role in ("param", "buffer", "constant")
        )
    )
    decided = set(plan.decided)
    memory = PlanMemory(param_bytes, ratios=state_ratios(gm), activation_copies=activation_copies(gm))
    if gradient_copies(gm) > 0:
        memory.unreduced_grad_bytes = gradient_copies(gm) * unreduced_grad_bytes(gm, plan, shape)
    held: dict[str, set[Layout]] = {}  # saved values and the layouts they are kept in
    for node in saved_nodes(gm):
        have = plan.layouts[node.name][0]
        forward_wants: set[Layout] = set()
        backward_wants: list[Layout] = []
        for user in node.users:
            strategy = plan.strategies.get(user.name)
            if strategy is None:
                wants = [have]
            else:
                wants = [w for i, w in zip(tensor_inputs(user), strategy.inputs) if i is node]
            (backward_wants.extend if is_backward(user) else forward_wants.update)(wants)
        kept = {w if w in forward_wants else have for w in backward_wants} or {have}
        held[node.name] = {*kept, have}
        if node.op == "placeholder" or views_stored(node, plan):  # its own layout is memory held anyway
            kept.discard(have)
            if not kept:
                continue
        nbytes = float(sum(lay.local_bytes(shape) for lay in kept))
        source = broadcast_source(node, plan) if kept == {have} else None
        if source is not None:  # the block it expands, once (not at all if that block is saved itself)
            name, layout = source
            nbytes = min(nbytes, 0.0 if layout in held.get(name, ()) else float(layout.local_bytes(shape)))
        memory.saved.append(SavedValue(node.name, have, nbytes, weight_chain(node, decided) is not None))
    if working:
        memory.working_steps = op_working_bytes(gm, plan, shape, held)
        memory.working_bytes = max((b for _, b in memory.working_steps), default=0.0)
    return memory
