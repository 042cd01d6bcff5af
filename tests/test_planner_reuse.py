"""The greedy planner answers a repeated question (same op call, same input layouts) once.

Repeated blocks ask the same questions; the memoized plan must be the plan the planner makes when
it works every node out afresh. `op_call` (what rules see of a node) must be `make_call`'s, and
`tensor_inputs` pytree's leaves.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.passes.trace import trace
from autopar.planning.greedy import _Greedy
from autopar.rules.base import TensorSpec, make_call
from autopar.rules.calls import op_call, tensor_inputs
from autopar.rules.registry import default_registry
from examples.models import make_gpt
from examples.zoo import make_llama


class _Forgetful(dict):  # type: ignore[type-arg]
    """A choice memo that never remembers: every node is worked out afresh."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


@functools.cache
def _traced(name: str) -> tuple[fx.GraphModule, nn.Module]:
    model, inputs = (make_gpt if name == "gpt" else make_llama)(0, n_layer=3)
    return trace(model, inputs), model


def _plan(gm: fx.GraphModule, shape: tuple[int, ...], memo: bool) -> tuple[Plan, _Greedy]:
    greedy = _Greedy(gm, Mesh.from_shape(shape), default_registry())
    if not memo:
        greedy.choices = _Forgetful()
    return greedy.run(), greedy


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("shape", [(2, 2, 2), (4, 2), (8,)])
def test_memoized_choices_give_the_plan_worked_out_node_by_node(name: str, shape: tuple[int, ...]) -> None:
    gm, _ = _traced(name)
    fast, greedy = _plan(gm, shape, memo=True)
    slow, _ = _plan(gm, shape, memo=False)
    assert fast.strategies == slow.strategies
    assert fast.layouts == slow.layouts
    assert fast.notes == slow.notes
    assert fast.output_layouts == slow.output_layouts
    assert (fast.decided, fast.deferred_inputs, fast.resolved_by) == (
        slow.decided,
        slow.deferred_inputs,
        slow.resolved_by,
    )
    # three identical blocks: most decided nodes repeat an earlier question
    assert len(greedy.choices) < 0.6 * len(fast.decided)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_op_call_is_make_call_on_the_node_values(name: str) -> None:
    gm, _ = _traced(name)
    checked = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue

        def val(x: object) -> object:
            return x.meta["val"] if isinstance(x, fx.Node) else x

        args = pytree.tree_map(val, node.args)
        kwargs = pytree.tree_map(val, node.kwargs)
        want = make_call(node.target, tuple(args), dict(kwargs), node.meta.get("val"))
        got = op_call(node)
        assert got == want, node.name
        assert repr(got.args) == repr(want.args) and repr(got.kwargs) == repr(want.kwargs), node.name
        checked += bool(got.inputs)
    assert checked > 100
    # an op taking a list of tensors (cat, stack) gets one spec per element, in order
    cat = next(n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.args[0], (list, tuple)))
    assert len(op_call(cat).inputs) == len(cat.args[0]) and all(
        isinstance(s, TensorSpec) for s in op_call(cat).args[0]
    )


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_tensor_inputs_are_pytrees_leaves(name: str) -> None:
    """`tensor_inputs` walks fx's containers itself: the same nodes in the same order as
    pytree's leaves of (args, kwargs), on every node, and on nested and named-tuple arguments."""
    gm, _ = _traced(name)

    def by_pytree(node: fx.Node) -> list[fx.Node]:
        leaves = pytree.tree_leaves((node.args, node.kwargs))
        return [x for x in leaves if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]

    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    assert sum(len(tensor_inputs(n)) > 1 for n in nodes) > 20
    for node in nodes:
        assert tensor_inputs(node) == by_pytree(node), node.name
    Pair = collections.namedtuple("Pair", "a b")
    first, second, third = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)][:3]
    graph = fx.Graph()
    made = graph.call_function(
        torch.add, ((first, [second, {"k": third, "j": first}]), Pair(third, slice(0, 1)), 2.0, None), {"x": [second]}
    )
    assert tensor_inputs(made) == by_pytree(made) == [first, second, third, first, third, second]
