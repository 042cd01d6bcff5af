"""What a rule sees of a graph node: its `OpCall`, its tensor inputs, and candidate lists by call.

The planners build an `OpCall` for every node, and emit builds it again to localize the op, so both
take it from here rather than from each other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

from autopar.core.meta import has_info, info
from autopar.core.strategy import OpCall, Strategy, TensorSpec
from autopar.rules.base import expand, expand_signature, spec_of


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Flattened tensor-valued node arguments, in the order rules see them: pytree's leaves of
    `(args, kwargs)`, walked here without pytree for the containers fx arguments are made of (the
    planners ask this tens of thousands of times per mesh at 96 layers, where pytree's generic
    walk was a tenth of a search; the equivalence is tested)."""
    leaves: list[Any] = []
    _leaves((node.args, node.kwargs), leaves)
    return [x for x in leaves if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]


_SEQUENCES = (tuple, list, immutable_list)
_MAPPINGS = (dict, immutable_dict)
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _leaves(x: Any, out: list[Any]) -> None:
    """`out += pytree.tree_leaves(x)`: plain tuples, lists and dicts (fx's immutable ones too)
    walked here in pytree's order (a dict by its values in insertion order); any other type
    (a leaf, or a container pytree knows, such as a named tuple) handed to pytree."""
    kind = type(x)
    if kind in _SEQUENCES:
        for y in x:
            _leaves(y, out)
    elif kind in _MAPPINGS:
        for y in x.values():
            _leaves(y, out)
    elif kind is fx.Node or kind in _SCALARS:
        out.append(x)
    else:
        out.extend(pytree.tree_leaves(x))


def op_call(node: fx.Node) -> OpCall:
    """`make_call` on the node's argument and result values, without pytree (it runs once per
    node in the planner and again in emit; the equivalence is tested)."""
    inputs: list[TensorSpec] = []
    weights: list[bool] = []

    def to_spec(x: Any, weight: bool = False) -> Any:
        spec = spec_of(x)
        if spec is None:
            return x
        inputs.append(spec)
        weights.append(weight)
        return spec

    def leaf(x: Any) -> Any:
        value = x.meta["val"] if isinstance(x, fx.Node) else x
        if isinstance(value, (tuple, list, dict)):  # a node holding several values
            return pytree.tree_map(to_spec, value)
        return to_spec(value, isinstance(x, fx.Node) and is_weight(x))

    args = fx.node.map_aggregate(node.args, leaf)
    kwargs = fx.node.map_aggregate(node.kwargs, leaf)
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor):
        outputs: tuple[TensorSpec, ...] = (spec_of(out),)  # type: ignore[assignment]
    else:
        outputs = tuple(s for s in (spec_of(x) for x in pytree.tree_leaves(out)) if s is not None)
    traced = info(node).traced if has_info(node) else None
    return OpCall(node.target, tuple(args), dict(kwargs), tuple(inputs), outputs, traced, tuple(weights))


def is_weight(node: fx.Node) -> bool:
    """Whether `node` is a parameter, or a chain of one-input ops on one (a transpose, a cast, a
    view): a weight as the op that reads it sees it."""
    for _ in range(16):  # such chains are a few ops long
        if node.op == "placeholder":
            return has_info(node) and info(node).role == "param"
        if node.op != "call_function" or len(node.all_input_nodes) != 1:
            return False
        node = node.all_input_nodes[0]
    return False


def output_index(node: fx.Node) -> int:
    """Flattened tensor index of a getitem on a multi-output op."""
    parent, index = node.args[0], node.args[1]
    assert isinstance(parent, fx.Node) and isinstance(index, int)
    values = parent.meta["val"]
    return sum(1 for v in list(values)[:index] if isinstance(v, torch.Tensor))


class ExpandCache(dict[Any, list[Strategy]]):
    """One mesh's candidate lists (`expand_cached`'s cache) backed by `library`, a cache shared by
    meshes of any sizes: there a list is keyed by the mesh's `expand_signature` too, so meshes that
    differ only in axis sizes that divide the same dims reuse one list. The mesh choice's screen
    expands every op on hundreds of meshes; most of them share their lists."""

    def __init__(self, library: dict[Any, list[Strategy]] | None = None) -> None:
        super().__init__()
        self.library: dict[Any, list[Strategy]] = library if library is not None else {}


def expand_cached(
    node: fx.Node,
    rule: Any,
    call: OpCall,
    shape: tuple[int, ...],
    cache: dict[Any, list[Strategy]],
    key_of_call: tuple[Any, ...] | None = None,
) -> list[Strategy]:
    """`expand` memoized by op and argument specs: repeated layers share their candidate lists.
    `cache` holds one mesh's lists (an `ExpandCache`: backed by lists shared across meshes).
    `key_of_call`: `call_key(call)`, if known."""
    # the rule's functions too: registries transformed for a mesh ("cp": `rules.balanced`) may
    # share a cache with others and must not be handed their lists
    call_of = call_key(call) if key_of_call is None else key_of_call
    key = (node.target, call_of, rule.requirement, rule.strategies, rule.admits)
    found = cache.get(key)
    if found is None:
        if isinstance(cache, ExpandCache):
            wide = (key, expand_signature(call, shape, rule.uneven))
            found = cache.library.get(wide)
            if found is None:
                found = cache.library[wide] = _expanded(rule, call, shape)
        else:
            found = _expanded(rule, call, shape)
        cache[key] = found
    return found


def _expanded(rule: Any, call: OpCall, shape: tuple[int, ...]) -> list[Strategy]:
    found = expand(call, rule.strategies(call), shape, rule.uneven)
    if rule.admits is not None:
        found = [s for s in found if rule.admits(call, s, shape)]
    if rule.requirement is not None:
        found = [s for s in found if rule.requirement.admits(call, s)]
    return found


def call_key(call: OpCall) -> tuple[Any, ...]:
    """What a rule sees of a call (argument specs and constants), as a dictionary key."""
    return (repr(call.args), repr(sorted(call.kwargs.items())), call.inputs, call.outputs, call.weights)
