"""The pieces a pipeline cut is made of: module calls of the traced joint graph in forward order,
each priced on a hardware table, and the tensors that cross each place the graph can be cut.

A *unit* is a call of a top-level module or of one block of a repeated container (`wte`, `wpe`,
`blocks.3`, `ln_f`, `lm_head`; `model.layers.7` in a transformers model): the first path
component that is a number ends a block's name, and otherwise the shortest prefix of the path that
is not a container of blocks names the unit. A stage is a run of consecutive units
(`autopar.planning.stage_cut`). Every node of the joint graph goes to one unit:

- forward ops by their module path; ops of the root module (the loss, `x = tok + pos`), and a
  container's own ops around its blocks (a transformers `*ForCausalLM`'s logits slice and loss),
  go with their latest producer, those without a producer in a unit with their first consumer;
- backward ops by their module path, which the trace copies from the forward op they
  differentiate (`fwd_nn_module_stack`); root backward ops by the forward op of their autograd
  sequence number, and those without one (gradient sums of a residual stream) with their earliest
  producer, since gradients flow from the last stage to the first;
- parameters and buffers to the unit of their first use; a tied weight read by several units
  (GPT's embedding and head) is held by each of them (`Unit.reads`).

Values computed from no parameter (position ids, rotary tables, attention masks: from the inputs,
which every rank has, and buffers) are *recomputed* by every stage that reads them rather than
sent: they cross no boundary. Their time is counted once (in their module's unit, or for the
root module's in their first reader's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core.layout import itemsize
from autopar.core.meta import has_info, info, signature
from autopar.cost.formulas import compute_time
from autopar.cost.hardware import Elementwise, Hardware, load_hardware
from autopar.cost.work import PLANNED_ATTENTION, AttentionKernel, compute_rate, global_work
from autopar.planning.memory import saved_nodes

ROOT_PATHS = ("", "<root>")


@dataclass(frozen=True)
class BoundaryTensor:
    """A forward value made before a cut and read after it: what the earlier stage sends."""

    name: str  # node name
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: float  # the whole traced batch, the full tensor
    per_batch: bool  # scales with the batch (an activation), else one copy per step


@dataclass(frozen=True)
class Unit:
    """One module call. Times are seconds for the whole traced batch on one of the `t` tensor ranks
    (work divided ideally by t). `backward_input` is the part of `backward` on the path of the
    gradient an earlier unit waits for (zero-bubble's I); the rest is weight gradients (W)."""

    name: str
    forward: float
    backward: float
    backward_input: float
    params: tuple[str, ...]  # parameters and buffers first used here
    reads: tuple[str, ...]  # tied parameters first used by an earlier unit and read here too
    nodes: int  # joint-graph nodes assigned here
    forward_elementwise: float = 0.0  # the part of `forward` that is not matmul or attention

    @property
    def time(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class SavedActivation:
    """A forward value some backward op reads, and the units whose backward reads it (each of
    their stages keeps a copy, per microbatch in flight when `per_batch`)."""

    name: str
    bytes: float  # whole batch, full tensor
    per_batch: bool
    units: tuple[int, ...]
    elementwise: bool = False  # made by an element-wise op (not a matmul or attention): selective recomputation rebuilds it


@dataclass(frozen=True)
class StageGraph:
    """A traced model as the stage cutter sees it. `crossing[k]` are the tensors that cross a cut
    before unit k (k = 1..n-1; 0 and n are empty), `valid[k]` whether a cut there is possible (no
    forward value flows from unit k or later back into an earlier unit)."""

    units: tuple[Unit, ...]
    crossing: tuple[tuple[BoundaryTensor, ...], ...]
    valid: tuple[bool, ...]
    state_bytes: dict[str, float]  # parameter or buffer -> bytes (full tensor)
    trainable: dict[str, bool]  # parameter (has a gradient and AdamW states) or buffer
    used_by: dict[str, tuple[int, ...]]  # parameter or buffer -> units reading it
    aliases: dict[str, tuple[str, ...]]  # parameter -> its tied aliases' names
    saved: tuple[SavedActivation, ...]
    hardware: Hardware
    tensor_size: int
    node_unit: dict[str, int]  # every compute node of the joint graph -> its unit
    recomputed: frozenset[str]  # forward nodes every stage that reads them makes for itself
    itemsize: dict[str, int] = field(default_factory=dict)  # parameter or buffer -> bytes per element

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    def boundary_bytes(self, k: int) -> float:
        """Bytes of the whole batch crossing the cut before unit k (full tensors)."""
        return sum(t.bytes for t in self.crossing[k])

    def candidates(self) -> tuple[int, ...]:
        """Positions where a cut is possible."""
        return tuple(k for k in range(1, len(self.units)) if self.valid[k])

    @property
    def total_time(self) -> float:
        return sum(u.time for u in self.units)


def unit_names(paths: Sequence[str]) -> dict[str, str]:
    """The unit of each module path (see the module docstring)."""
    blocks: set[str] = set()
    for path in paths:
        comps = path.split(".")
        for i, comp in enumerate(comps):
            if comp.isdigit():
                blocks.add(".".join(comps[: i + 1]))
                break
    containers = {".".join(b.split(".")[:i]) for b in blocks for i in range(1, b.count(".") + 1)}
    out: dict[str, str] = {}
    for path in paths:
        if path in containers:  # a model's own ops around its blocks (transformers' loss): glue
            out[path] = ""
            continue
        comps = path.split(".")
        name = path
        for i in range(1, len(comps) + 1):
            prefix = ".".join(comps[:i])
            if prefix in blocks or prefix not in containers:
                name = prefix
                break
        out[path] = name
    return out


def _bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    return float(val.numel() * itemsize(val.dtype)) if isinstance(val, torch.Tensor) else 0.0


def _path(node: fx.Node) -> str:
    return info(node).module_path if has_info(node) else ""


def stage_graph(
    gm: fx.GraphModule,
    hardware: str | Hardware = "h100-nvlink-ib",
    tensor_size: int = 1,
    attention: AttentionKernel = PLANNED_ATTENTION,
) -> StageGraph:
    """Units, their modeled times and memory, and the candidate cuts of a traced joint graph
    (`autopar.passes.trace.trace`). `tensor_size`: ranks of a stage's tensor sub-mesh; work and
    memory are divided by it ideally (the per-stage tensor plan is not made here). `attention`:
    how the run's kernel does a causal attention call (`cost.work.PLANNED_ATTENTION`)."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    nodes = list(gm.graph.nodes)
    computes = [n for n in nodes if n.op == "call_function" and has_info(n)]
    forward = [n for n in computes if info(n).phase == "forward"]
    backward = [n for n in computes if info(n).phase == "backward"]

    # values that depend on the batch / on a parameter (a value on neither is recomputed per stage)
    per_batch: set[fx.Node] = set()
    on_param: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder" and has_info(n):
            if info(n).role == "input":
                per_batch.add(n)
            elif info(n).role == "param":
                on_param.add(n)
        elif n.op == "call_function":
            ins = n.all_input_nodes
            if any(i in per_batch for i in ins):
                per_batch.add(n)
            if any(i in on_param for i in ins):
                on_param.add(n)
    # made again by every stage that reads them: values of no parameter (position ids, rotary
    # tables, attention masks), computed from the inputs, which every rank has, and buffers
    recomputed = {n for n in forward if n not in on_param}

    paths = sorted({_path(n) for n in computes if _path(n) not in ROOT_PATHS})
    unit_of_path = unit_names(paths)

    def unit_name(n: fx.Node) -> str:
        """The node's unit, "" for the root module's ops and a container's own (glue)."""
        path = _path(n)
        return "" if path in ROOT_PATHS else unit_of_path[path]

    order: dict[str, int] = {}
    for n in forward:  # units in forward order of their first op
        if unit_name(n):
            order.setdefault(unit_name(n), len(order))
    if not order:
        order["<root>"] = 0
    unit: dict[fx.Node, int] = {}
    for n in forward:
        if unit_name(n):
            unit[n] = order[unit_name(n)]
        else:
            made = [unit[i] for i in n.all_input_nodes if i in unit and i not in recomputed]
            if made and n not in recomputed:
                unit[n] = max(made)
    for n in reversed(forward):  # the rest: with their first consumer
        if n not in unit:
            used = [unit[u] for u in n.users if u in unit]
            unit[n] = min(used) if used else 0
    # a root backward op differentiates the forward op of its autograd sequence number (a
    # broadcast add's sum); gradient sums (`is_gradient_acc`) and copied blocks' ops have none
    of_seq: dict[int, int] = {}
    for n in forward:
        if isinstance(n.meta.get("seq_nr"), int) and n not in recomputed:
            of_seq.setdefault(n.meta["seq_nr"], unit[n])
    for n in backward:
        if unit_name(n) in order:
            unit[n] = order[unit_name(n)]
            continue
        seq = n.meta.get("seq_nr")
        if not n.meta.get("is_gradient_acc") and isinstance(seq, int) and seq in of_seq:
            unit[n] = of_seq[seq]
            continue
        grads = [unit[i] for i in n.all_input_nodes if i in unit and info(i).phase == "backward"]
        fwd = [unit[i] for i in n.all_input_nodes if i in unit and info(i).phase == "forward"]
        unit[n] = min(grads) if grads else max(fwd) if fwd else len(order) - 1

    # the input-gradient part of each unit's backward: ancestors of an earlier unit's backward.
    # A gradient sum of a tied weight over units (a final gradient) is nobody's wait.
    output = next(n for n in nodes if n.op == "output")
    tied_sum = {
        n
        for n in backward
        if set(n.users) == {output} and len({unit[i] for i in n.all_input_nodes if i in unit}) > 1
    }
    reach: dict[fx.Node, float] = {}
    for n in reversed(backward):
        low = float("inf")
        for u in n.users:
            if u in unit and info(u).phase == "backward" and u not in tied_sum:
                low = min(low, unit[u], reach.get(u, float("inf")))
        reach[n] = low

    n_units = len(order)
    t = max(1, tensor_size)
    fwd_time = [0.0] * n_units
    bwd_time = [0.0] * n_units
    inp_time = [0.0] * n_units
    cheap_time = [0.0] * n_units
    count = [0] * n_units
    for n in computes:
        rate = compute_rate(n, attention)
        seconds = compute_time(global_work(n, attention) / t, 0.0, rate, hw)
        u = unit[n]
        count[u] += 1
        if info(n).phase == "forward":
            fwd_time[u] += seconds
            if isinstance(rate, Elementwise):
                cheap_time[u] += seconds
        else:
            bwd_time[u] += seconds
            if reach[n] < u:
                inp_time[u] += seconds

    # parameters and buffers: the units that read them (through recomputed values too)
    sig = signature(gm)
    aliases: dict[str, list[str]] = {}
    for alias, canonical in sig.aliases.items():
        aliases.setdefault(canonical, []).append(alias)
    state_bytes: dict[str, float] = {}
    sizes: dict[str, int] = {}
    trainable: dict[str, bool] = {}
    used_by: dict[str, tuple[int, ...]] = {}
    for n in nodes:
        if n.op != "placeholder" or not has_info(n) or info(n).role not in ("param", "buffer", "constant"):
            continue
        name = info(n).param_name or n.name
        readers: set[int] = set()
        frontier = [u for u in n.users if u in unit]
        while frontier:
            u = frontier.pop()
            if u in recomputed:
                frontier.extend(w for w in u.users if w in unit)
            else:
                readers.add(unit[u])
        state_bytes[name] = _bytes(n)
        sizes[name] = itemsize(n.meta["val"].dtype) if isinstance(n.meta.get("val"), torch.Tensor) else 4
        trainable[name] = info(n).role == "param" and sig.requires_grad.get(name, True)
        used_by[name] = tuple(sorted(readers)) or (0,)

    first: list[list[str]] = [[] for _ in range(n_units)]
    reads: list[list[str]] = [[] for _ in range(n_units)]
    for name, units_ in used_by.items():
        first[units_[0]].append(name)
        for u in units_[1:]:
            reads[u].append(name)

    names = sorted(order, key=order.__getitem__)
    units = tuple(
        Unit(
            names[i], fwd_time[i], bwd_time[i], inp_time[i], tuple(first[i]), tuple(reads[i]), count[i],
            cheap_time[i],
        )  # fmt: skip
        for i in range(n_units)
    )

    # what crosses each cut, and where a cut is impossible
    valid = [True] * (n_units + 1)
    live: list[list[BoundaryTensor]] = [[] for _ in range(n_units + 1)]
    for n in forward:
        if n in recomputed:
            continue
        at = [unit[u] for u in n.users if u in unit]
        if not at:
            continue
        if min(at) < unit[n]:  # flows back to an earlier unit: no cut in between
            for k in range(min(at) + 1, unit[n] + 1):
                valid[k] = False
        last = max(at)
        if last > unit[n]:
            val = n.meta["val"]
            tensor = BoundaryTensor(n.name, tuple(val.shape), val.dtype, _bytes(n), n in per_batch)
            for k in range(unit[n] + 1, last + 1):
                live[k].append(tensor)

    saved: list[SavedActivation] = []
    for n in saved_nodes(gm):
        if n.op == "placeholder":
            continue
        readers = {unit[u] for u in n.users if u in unit and info(u).phase == "backward"}
        if not readers:
            readers = {unit[n]}  # a gradient output itself: kept by its own unit
        saved.append(SavedActivation(n.name, _bytes(n), n in per_batch, tuple(sorted(readers)), _elementwise(n)))

    return StageGraph(
        units=units,
        crossing=tuple(tuple(c) for c in live),
        valid=tuple(valid),
        state_bytes=state_bytes,
        trainable=trainable,
        used_by=used_by,
        aliases={k: tuple(v) for k, v in aliases.items()},
        saved=tuple(saved),
        hardware=hw,
        tensor_size=t,
        node_unit={n.name: u for n, u in unit.items()},
        recomputed=frozenset(n.name for n in recomputed),
        itemsize=sizes,
    )


def _elementwise(node: fx.Node) -> bool:
    """Whether `node` is made by an element-wise op (a view counts as what it views): what selective
    recomputation makes again from the matmul and attention outputs it keeps."""
    while node.op == "call_function":
        rate = compute_rate(node)
        if not isinstance(rate, Elementwise):
            return False
        if rate.runs or not node.all_input_nodes:
            return True
        node = node.all_input_nodes[0]
    return False


def compact(names: Sequence[str]) -> str:
    """`wte, wpe, blocks.0-3`: runs of numbered blocks of one container written as a range."""
    parts: list[str] = []
    run: tuple[str, int, int] | None = None
    for name in names:
        head, _, tail = name.rpartition(".")
        if head and tail.isdigit():
            i = int(tail)
            if run is not None and run[0] == head and run[2] == i - 1:
                run = (head, run[1], i)
                continue
            if run is not None:
                parts.append(_run(run))
            run = (head, i, i)
            continue
        if run is not None:
            parts.append(_run(run))
            run = None
        parts.append(name)
    if run is not None:
        parts.append(_run(run))
    return ", ".join(parts)


def _run(run: tuple[str, int, int]) -> str:
    head, a, b = run
    return f"{head}.{a}" if a == b else f"{head}.{a}-{b}"
