"""Typed node metadata: the only thing passes share with each other.

Every node of the joint graph carries a `NodeInfo` under `node.meta["autopar"]`; the graph module
carries a `JointSignature` under `gm.meta["autopar_signature"]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.core.layout import Layout
from autopar.core.redistribute import CommStep
from autopar.core.strategy import Strategy, TracedKernel
from autopar.core.value_guards import ValueGuards

NODE_KEY = "autopar"
# node.meta of a random op: its input's dims from outermost to innermost in memory, as the serial
# model lays that tensor out. Random numbers fill a tensor in memory order, so a rule that draws
# the serial model's numbers needs it (a transposed view in nn.MultiheadAttention, for one).
MEMORY_ORDER_KEY = "autopar_memory_order"
SIGNATURE_KEY = "autopar_signature"
ACTIVATION_COPIES_KEY = "autopar_activation_copies"
GRADIENT_COPIES_KEY = "autopar_gradient_copies"
# gm.meta: the repeated blocks the trace copied (`passes.repeats.RepeatedBlocks`); block 1's node or
# parameter placeholder `name` is copied into block k >= 2 as `copy_name(name, k)`
REPEATS_KEY = "autopar_repeated_blocks"


def copy_name(name: str, block: int) -> str:
    """The name of block 1's node (or parameter placeholder) `name` in its copy for `block` >= 2
    (`passes.repeats`): the planner's replay of repeated blocks (`planning.greedy_replay`) pairs
    nodes by it."""
    return f"{name}_b{block}"

# "constant": a tensor the forward made from Python data (`torch.tensor([])` in a cache), lifted by
# export; its value is in `JointSignature.constants` and every rank holds it whole.
Role = Literal["param", "buffer", "constant", "input", "tangent", "compute", "comm", "output"]
Phase = Literal["forward", "backward"]


@dataclass
class NodeInfo:
    role: Role
    phase: Phase
    module_path: str = ""
    source: str = ""  # "file:line" of the user's code that created the node
    param_name: str | None = None  # params/buffers: the user's name
    input_index: int | None = None  # user inputs: position in the flattened example inputs
    strategy: Strategy | None = None  # chosen by propagate (compute nodes)
    layouts: tuple[Layout, ...] = ()  # one per flattened tensor output
    comm: CommStep | None = None  # inserted redistribution steps
    comm_group: str | None = None  # process group name the collective runs on
    note: str = ""  # why this layout (planner's reason), shown in dumps
    chunk: int | None = None  # over-decomposition: the batch chunk (in-process coordinate) it computes
    checkpoint: str | None = None  # forward ops in a user's torch.utils.checkpoint region: its module path
    traced: TracedKernel | None = None  # a custom-Function op: its trace's splits and kernel (OpCall.traced)

    @property
    def layout(self) -> Layout:
        if len(self.layouts) != 1:
            raise ValueError(f"node has {len(self.layouts)} outputs, not one")
        return self.layouts[0]

    def where(self) -> str:
        parts = [p for p in (self.module_path, self.source) if p]
        return " @ ".join(parts)


@dataclass(frozen=True)
class ParamPart:
    """A parameter the trace stage cut out of a fused one (`autopar.passes.fused`): chunk `index`
    of `count` equal chunks of the user's parameter `source` along `dim`."""

    source: str
    dim: int
    index: int
    count: int

    def of(self, full: Any) -> Any:
        """This part of the source parameter's full value (a view)."""
        return full.chunk(self.count, self.dim)[self.index]


# Output leaves kept as traced: what a forward returns besides tensors (flags, counts, names).
PLAIN_OUTPUT_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


@dataclass(frozen=True)
class OutputStructure:
    """The user's output rebuilt around the program's tensor outputs: the pytree spec of what the
    forward returned, the leaf positions the tensors fill in order, and the other leaves as traced.
    Leaves that are neither tensors nor plain values (a transformers `Cache`: state for generation,
    not a training result) come back as None; `dropped` names their types."""

    spec: Any
    tensor_positions: tuple[int, ...]
    others: tuple[Any, ...]  # every leaf: the value traced, or None (tensors and dropped leaves)
    dropped: tuple[str, ...] = ()

    def rebuild(self, tensors: Sequence[Any]) -> Any:
        leaves = list(self.others)
        for position, value in zip(self.tensor_positions, tensors, strict=True):
            leaves[position] = value
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass(frozen=True)
class IndexCheck:
    """A user input whose values index a tensor (token ids into an embedding, class targets into
    logits): every value outside `ignored` must lie in [0, bound). The module checks it at call
    time on the global input, the same on every rank, before any collective: the op that would fail
    holds only a block on most ranks, so the failure would otherwise hit some ranks and hang the
    rest."""

    input_index: int  # among the tensor inputs, as NodeInfo.input_index
    bound: int
    ignored: tuple[int, ...]  # values the model masks out before indexing (cross-entropy's ignore_index)
    op: str
    where: str


@dataclass
class JointSignature:
    """How the joint graph's placeholders and outputs map to the user's model."""

    param_names: list[str]  # placeholder order; tied aliases removed
    aliases: dict[str, str]  # tied alias name -> canonical name
    buffer_names: list[str]
    num_inputs: int
    num_tangents: int
    num_user_outputs: int  # forward outputs: the user's tensors, `input_updates`', `buffer_updates`' new values
    grad_of: list[str]  # parameter name of each gradient output, in output order
    in_spec: Any = None  # pytree spec of the user's (args, kwargs)
    outputs: OutputStructure | None = None  # how the user's output is rebuilt from the tensor outputs
    # buffers the forward updates (BatchNorm running stats), in the order of the last forward outputs
    buffer_updates: list[str] = field(default_factory=list)
    # user inputs (tensor input index) the forward writes into in place (FSMT's `labels.masked_fill_`):
    # their new values are forward outputs after the user's, before the buffers', written back
    # into the caller's tensors as serial leaves them
    input_updates: list[int] = field(default_factory=list)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    param_parts: dict[str, ParamPart] = field(default_factory=dict)  # part name -> where it comes from
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # constant placeholder -> value
    index_checks: list[IndexCheck] = field(default_factory=list)  # inputs used as indices
    value_guards: ValueGuards | None = None  # conditions on input values the trace took (passes.value_guards)
    # user inputs that require grad: the input index of each gradient output after the
    # parameters' (the last outputs of the joint graph)
    input_grads: list[int] = field(default_factory=list)

    @property
    def num_param_grads_end(self) -> int:
        """Output position after the parameters' gradients, where the inputs' gradients start."""
        return self.num_user_outputs + len(self.grad_of)


def info(node: fx.Node) -> NodeInfo:
    value = node.meta.get(NODE_KEY)
    if value is None:
        raise KeyError(f"node {node.name} has no autopar metadata")
    return value  # type: ignore[no-any-return]


def has_info(node: fx.Node) -> bool:
    return NODE_KEY in node.meta


def set_info(node: fx.Node, value: NodeInfo) -> None:
    node.meta[NODE_KEY] = value


def update_info(node: fx.Node, **changes: Any) -> NodeInfo:
    new = replace(info(node), **changes)
    set_info(node, new)
    return new


def signature(gm: fx.GraphModule) -> JointSignature:
    return gm.meta[SIGNATURE_KEY]  # type: ignore[no-any-return]


def activation_copies(gm: fx.GraphModule) -> int:
    """How many copies of what this graph's forward saves for its backward one rank holds at once:
    1, or a pipeline stage's microbatches in flight (set by the compiler before planning, so that
    the plan's memory model counts every copy, `autopar.planning.memory`)."""
    return int(gm.meta.get(ACTIVATION_COPIES_KEY, 1))


def set_activation_copies(gm: fx.GraphModule, copies: int) -> None:
    gm.meta[ACTIVATION_COPIES_KEY] = copies


def gradient_copies(gm: fx.GraphModule) -> int:
    """How many copies of its parameter gradients as the backward computes them (before any
    reduction) one rank holds through its step: 0, the stored gradient only, or 1 for a pipeline
    stage that sums its microbatches' gradients before reducing them once (set by the compiler
    before planning, `autopar.planning.memory`)."""
    return int(gm.meta.get(GRADIENT_COPIES_KEY, 0))


def set_gradient_copies(gm: fx.GraphModule, copies: int) -> None:
    gm.meta[GRADIENT_COPIES_KEY] = copies


def where_of(node: fx.Node) -> str:
    return info(node).where() if has_info(node) else node.name


def is_backward(node: fx.Node) -> bool:
    return has_info(node) and info(node).phase == "backward"


def held_bytes(value: object) -> int:
    """Bytes a tensor value holds of its own: its elements, except that a broadcast view (a stride-0
    dim: `expand`, as grouped-query attention repeats one key/value head for every query head)
    holds only the elements it spans in its storage. Counting the expanded shape counted a gathered
    key block four times over where the program kept it once (`planning.memory`)."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return 0
    whole = value.numel() * value.element_size()
    if all(st != 0 for st in value.stride()):
        return int(whole)
    span = 1 + sum((size - 1) * st for size, st in zip(value.shape, value.stride()) if st > 0)
    return int(min(whole, span * value.element_size()))
