"""An in-process compile of every rank schedules each distinct lowered graph once
(`autopar.compiler.rank_share.RankShare`): every rank's program must be the one its own compile
makes, node for node, and the graphs that differ in more than insert_comm's constants (uneven
blocks, another op) are scheduled on their own."""

from __future__ import annotations

import torch.fx as fx
from pass_fixtures import compile_every_rank, model_case

from autopar.compiler.driver import Compiled
from autopar.compiler.rank_share import RankShare
from autopar.core.meta import NODE_KEY

SHAPE = (2, 2, 2)


def _node_forms(gm: fx.GraphModule) -> list[tuple[object, ...]]:
    """Every node's name, op, target, arguments (nodes by name) and autopar metadata, in order."""
    return [
        (
            n.name,
            n.op,
            str(n.target),
            str(fx.map_arg((n.args, n.kwargs), lambda a: a.name)),
            {k: v for k, v in n.meta.items() if k.startswith(NODE_KEY)},
        )
        for n in gm.graph.nodes
    ]


def _assert_same_programs(shared: dict[tuple[int, ...], Compiled], own: dict[tuple[int, ...], Compiled]) -> None:
    assert shared.keys() == own.keys()
    for coords in own:
        a, b = shared[coords], own[coords]
        assert _node_forms(a.graph) == _node_forms(b.graph), coords
        for part in ("forward", "backward"):
            assert getattr(a.program, part).code == getattr(b.program, part).code, (coords, part)
            assert _node_forms(getattr(a.program, part)) == _node_forms(getattr(b.program, part)), (coords, part)
        for field in ("param_layouts", "input_layouts", "output_layouts", "num_saved", "coords"):
            assert getattr(a.program, field) == getattr(b.program, field), (coords, field)
        assert a.report.collectives == b.report.collectives, coords
        assert a.graph.meta["autopar_schedule"] == b.graph.meta["autopar_schedule"], coords


def _shared_equals_own(key: str) -> tuple[int, int]:
    """Every rank of `key`'s model compiled with a `RankShare` and each on its own, compared; the
    share's (graphs scheduled, graphs made from a template)."""
    model, inputs = model_case(key)
    share = RankShare()
    shared = compile_every_rank(model, SHAPE, inputs, share=share)
    own = compile_every_rank(model, SHAPE, inputs, share=None)
    _assert_same_programs(shared, own)
    return share.scheduled, share.reused


def test_every_ranks_program_is_the_one_its_own_compile_makes() -> None:
    """GPT, one layer, with dropout: the first rank schedules its graph deciding the decomposition;
    then two templates, the ranks that keep a pending sum where it is zeroed (a clone) and those
    that zero it (zeros_like); the other five ranks are made from them."""
    assert _shared_equals_own("gpt1") == (2, 5)


def test_ranks_of_other_block_sizes_are_scheduled_on_their_own() -> None:
    """Widths no axis divides (torch.chunk blocks): every rank's local sizes differ from the
    others' somewhere, so no rank's graph is made from another's, and each is its own compile's."""
    assert _shared_equals_own("mlp_uneven") == (8, 0)
