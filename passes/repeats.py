"""Part of stage 1, trace: repeated blocks go through torch's tracers once, and are copied after.

torch.export and AOTAutograd's joint export cost one to three milliseconds per op (fake tensors,
functionalization, autograd's own trace, stack traces): nearly all of the trace, growing with the
model's depth. A transformer is mostly N identical blocks in a `ModuleList`, and the joint graph of
block k is block 1's with block k's parameters and block k-1's output put in. So the trace exports
the model cut to its first two blocks, and copies block 1's forward and backward nodes, parameters
and gradients for blocks 2..N-1.

Nothing is assumed from the model's code. A recorded forward run of the whole model must show
blocks 1..N-1 making the same calls, chained output to input (`autopar.passes.repeats_find`). In the
cut model's joint graph, block 1's forward and backward must each be one run of nodes whose only
inputs are block 0's output (and, backward, the gradient of block 1's output), block 1's own
values and parameters, and values made before the blocks; whose only results are its output (and
the gradient of its input) and its parameters' gradients (`stamp_repeated_blocks`). Where any check
fails the model is traced whole, as before; `tests/test_pass_repeats.py` checks that the copied
graph is the whole trace up to node names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.fx as fx

from autopar.core.meta import REPEATS_KEY, SIGNATURE_KEY, JointSignature, copy_name, info, set_info

MIN_BLOCKS = 3  # with two blocks there is nothing to copy


@dataclass(frozen=True)
class RepeatedBlocks:
    """`count` identical blocks: the children "0".."count-1" of the container at `prefix`."""

    prefix: str
    count: int

    def block_of(self, path: str) -> int | None:
        """Index of the block a module path or parameter name lies in, else None."""
        if self.prefix:
            if not path.startswith(self.prefix + "."):
                return None
            path = path[len(self.prefix) + 1 :]
        head = path.split(".", 1)[0]
        if not head.isdigit() or int(head) >= self.count:
            return None
        return int(head)

    def rename(self, path: str, block: int) -> str:
        """`path` inside block 1 -> the same path inside `block`."""
        start = len(self.prefix) + 1 if self.prefix else 0
        head, dot, rest = path[start:].partition(".")
        assert head == "1", path
        return f"{path[:start]}{block}{dot}{rest}"


class NotRepeated(Exception):
    """The cut joint graph does not have the shape the copy needs; the trace exports it whole."""


# ---- the joint graph: copy block 1 ---------------------------------------------------------------


@dataclass
class _Block1:
    """Block 1 in the cut joint graph."""

    forward: list[fx.Node]
    backward: list[fx.Node]
    params: list[fx.Node]  # its parameter and buffer placeholders, in order
    input: fx.Node  # block 0's output, which it reads
    output: fx.Node  # its output, read by what follows the blocks
    grad_output: fx.Node  # the gradient of `output` its backward starts from
    grad_input: fx.Node  # the gradient of `input` its backward ends with


def stamp_repeated_blocks(gm: fx.GraphModule, groups: list[RepeatedBlocks]) -> None:
    """Copy block 1's forward and backward nodes, parameters and gradients for blocks 2..N-1 of
    each group into the joint graph of the cut model (traced and annotated). Raises NotRepeated
    (the graph unchanged) if block 1 is not a self-contained run of nodes as the copy needs."""
    found = [(group, _find_block1(gm, group)) for group in groups]
    for group, block1 in found:
        _stamp(gm, group, block1)
    gm.meta[REPEATS_KEY] = tuple(groups)


def _find_block1(gm: fx.GraphModule, group: RepeatedBlocks) -> _Block1:
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}

    def block(n: fx.Node) -> int | None:
        if n.op == "placeholder":
            name = info(n).param_name
            return group.block_of(name) if name is not None else None
        if n.op != "call_function":
            return None
        return group.block_of(info(n).module_path)

    calls = [n for n in nodes if n.op == "call_function"]
    forward = [n for n in calls if info(n).phase == "forward" and block(n) == 1]
    if not forward:
        raise NotRepeated("block 1 has no forward nodes")
    span = calls[calls.index(forward[0]) : calls.index(forward[-1]) + 1]
    if len(span) != len(forward):
        raise NotRepeated("block 1's forward nodes are not one run")
    backward_calls = [n for n in calls if info(n).phase == "backward"]
    starts = [i for i, n in enumerate(backward_calls) if block(n) == 1]
    if not starts:
        raise NotRepeated("block 1 has no backward nodes")
    end = starts[0]
    while end < len(backward_calls) and block(backward_calls[end]) in (1, None):
        end += 1
    backward = backward_calls[starts[0] : end]
    if starts[-1] >= end:
        raise NotRepeated("block 1's backward nodes are not one run")
    params = [n for n in nodes if n.op == "placeholder" and block(n) == 1]
    fwd_set, bwd_set, param_set = set(forward), set(backward), set(params)
    first_forward = order[forward[0]]

    def shared(x: fx.Node) -> bool:
        """Made before the blocks and outside them (the same value for every block)."""
        if x.op == "placeholder":
            return block(x) is None and info(x).role != "tangent"
        return (
            x.op == "call_function"
            and info(x).phase == "forward"
            and block(x) is None
            and order[x] < first_forward
        )

    inputs = {x for n in forward for x in n.all_input_nodes if x not in fwd_set and x not in param_set}
    previous = [x for x in inputs if not shared(x)]
    if len(previous) != 1 or block(previous[0]) != 0 or info(previous[0]).phase != "forward":
        raise NotRepeated("block 1 reads more than block 0's output")
    block_input = previous[0]
    leaving = [n for n in forward if any(u not in fwd_set and u not in bwd_set for u in n.users)]
    if len(leaving) != 1 or any(u.op == "output" for u in leaving[0].users):
        raise NotRepeated("block 1's forward has more than one output")
    block_output = leaving[0]
    outside = {
        x
        for n in backward
        for x in n.all_input_nodes
        if x not in bwd_set
        and x not in fwd_set
        and x not in param_set
        and x is not block_input
        and not shared(x)
    }
    if len(outside) != 1:
        raise NotRepeated("block 1's backward reads more than its output's gradient")
    grad_output = outside.pop()
    output_node = nodes[-1]
    sig: JointSignature = gm.meta[SIGNATURE_KEY]
    grads = list(output_node.args[0])[sig.num_user_outputs :]  # type: ignore[arg-type]
    own_grads = {g for g, name in zip(grads, sig.grad_of) if group.block_of(name) == 1}
    if not own_grads <= bwd_set or any(
        g in bwd_set for g, name in zip(grads, sig.grad_of) if group.block_of(name) != 1
    ):
        raise NotRepeated("block 1's parameter gradients are not made by its backward")
    read_later = {n for n in backward if any(u not in bwd_set and u is not output_node for u in n.users)}
    if len(read_later) != 1:
        raise NotRepeated("block 1's backward has more than one result besides its parameters' gradients")
    grad_input = read_later.pop()
    if grad_input in own_grads:
        raise NotRepeated("block 1's input gradient is also a parameter gradient")
    shapes = {tuple(n.meta["val"].shape) for n in (block_input, block_output, grad_output, grad_input)}
    if len(shapes) != 1:
        raise NotRepeated("block 1's input, output and their gradients differ in shape")
    return _Block1(forward, backward, params, block_input, block_output, grad_output, grad_input)


def _copy(
    graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node], group: RepeatedBlocks, k: int
) -> fx.Node:
    new = graph.create_node(
        node.op,
        node.target,
        fx.map_arg(node.args, lambda x: env.get(x, x)),  # type: ignore[arg-type]
        fx.map_arg(node.kwargs, lambda x: env.get(x, x)),  # type: ignore[arg-type]
        name=copy_name(node.name, k),
    )
    # (the op a node was decomposed from: emit puts whole layer norms back by it, `whole_norms`)
    for key in ("val", "original_aten"):
        if key in node.meta:
            new.meta[key] = node.meta[key]
    old = info(node)
    path = group.rename(old.module_path, k) if group.block_of(old.module_path) == 1 else old.module_path
    set_info(new, replace(old, module_path=path))
    env[node] = new
    return new


def _stamp(gm: fx.GraphModule, group: RepeatedBlocks, b: _Block1) -> None:
    graph = gm.graph
    sig: JointSignature = gm.meta[SIGNATURE_KEY]
    last = group.count - 1
    # parameters (and buffers) of blocks 2..N-1, each after the same role's placeholders of the block before
    params: dict[int, list[fx.Node]] = {}
    anchors = {info(p).role: p for p in b.params}  # the last of each role
    for k in range(2, group.count):
        made = []
        for p in b.params:
            with graph.inserting_after(anchors[info(p).role]):
                new = graph.placeholder(copy_name(p.name, k))
            new.meta["val"] = p.meta["val"]
            set_info(new, replace(info(p), param_name=group.rename(info(p).param_name or "", k)))
            anchors[info(p).role] = new
            made.append(new)
        params[k] = made
    # forward: block k after block k-1, reading its output
    inside = {*b.forward, *b.backward}
    after_blocks = [u for u in b.output.users if u not in inside]
    outputs = {1: b.output}
    anchor = b.forward[-1]
    env_of: dict[int, dict[fx.Node, fx.Node]] = {}
    for k in range(2, group.count):
        env = env_of[k] = dict(zip(b.params, params[k]))
        env[b.input] = outputs[k - 1]
        for node in b.forward:
            with graph.inserting_after(anchor):
                anchor = _copy(graph, node, env, group, k)
        outputs[k] = env[b.output]
    for user in after_blocks:
        user.replace_input_with(b.output, outputs[last])
    # backward: blocks N-1..2 before block 1's, each starting from the gradient the one after made
    grad_in: dict[int, fx.Node] = {}
    for k in range(last, 1, -1):
        env = env_of[k]
        env[b.grad_output] = b.grad_output if k == last else grad_in[k + 1]
        for node in b.backward:
            with graph.inserting_before(b.backward[0]):
                _copy(graph, node, env, group, k)
        grad_in[k] = env[b.grad_input]
    for node in b.backward:
        node.replace_input_with(b.grad_output, grad_in[2])
    _extend_signature(gm, group, env_of, sig)


def _extend_signature(
    gm: fx.GraphModule, group: RepeatedBlocks, env_of: dict[int, dict[fx.Node, fx.Node]], sig: JointSignature
) -> None:
    """Gradient outputs, names and parameter parts of the copied blocks, in the model's order."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(output.args[0])  # type: ignore[arg-type]
    nu = sig.num_user_outputs
    grads, grad_of = outs[nu : sig.num_param_grads_end], sig.grad_of
    input_grads = outs[sig.num_param_grads_end :]
    own = [i for i, name in enumerate(grad_of) if group.block_of(name) == 1]
    new_grads: list[Any] = []
    new_names: list[str] = []
    for i, (g, name) in enumerate(zip(grads, grad_of)):
        new_grads.append(g)
        new_names.append(name)
        if own and i == own[-1]:
            for k in range(2, group.count):
                for j in own:
                    new_grads.append(env_of[k][grads[j]])
                    new_names.append(group.rename(grad_of[j], k))
    output.args = (tuple(outs[:nu] + new_grads + input_grads),)
    sig.grad_of = new_names
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sig.param_names = [info(n).param_name or n.name for n in placeholders if info(n).role == "param"]
    sig.buffer_names = [info(n).param_name or n.name for n in placeholders if info(n).role == "buffer"]
    for name in list(sig.requires_grad):
        if group.block_of(name) == 1:
            for k in range(2, group.count):
                sig.requires_grad.setdefault(group.rename(name, k), sig.requires_grad[name])
    for name, part in list(sig.param_parts.items()):
        if group.block_of(name) == 1:
            for k in range(2, group.count):
                sig.param_parts[group.rename(name, k)] = replace(part, source=group.rename(part.source, k))
