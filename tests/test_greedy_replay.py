"""The greedy pass replays runs of copied blocks (planning/greedy_replay.py): on many-layer models
traced with their blocks copied, the replayed pass gives the plain walk's plan field for field (same
dicts in the same order), under every axis-role assignment and for every fixed scheme's forced
seed, and the search from those seeds finds the same plan."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch.fx as fx

import autopar.planning.greedy_replay as greedy_replay
import autopar.planning.search_problem as search_problem
import autopar.planning.search_seeds as search_seeds
from autopar.core.mesh import Mesh
from autopar.core.meta import REPEATS_KEY
from autopar.core.plan import Plan
from autopar.passes.trace import trace
from autopar.planning.greedy import greedy_plan
from autopar.planning.greedy_replay import blocks_of
from autopar.planning.greedy_scores import GreedyMemo
from autopar.planning.search import role_assignments, search_layouts
from autopar.rules.registry import default_registry
from examples.models import make_gpt
from examples.zoo import make_llama

MESHES = [(2, 2, 2), (4, 2), (2, 4)]


def _traced(name: str) -> fx.GraphModule:
    if name == "gpt":
        model, inputs = make_gpt(0, n_layer=8)
    else:
        model, inputs = make_llama(0, batch_size=8, n_layer=8)
    gm = trace(model, inputs)
    assert len(gm.meta[REPEATS_KEY]) == 1 and gm.meta[REPEATS_KEY][0].count == 8
    return gm


def _difference(a: Plan | Exception, b: Plan | Exception) -> str | None:
    """The first field where two plans differ (dicts also in their order), or None."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return None if type(a) is type(b) and str(a) == str(b) else f"{a!r} / {b!r}"
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x != y or (isinstance(x, dict) and list(x) != list(y)):
            return f.name
    return None


def _plain(*args: Any, **kwargs: Any) -> Plan:
    return greedy_plan(*args, **kwargs, replay=False)


def _pass(*args: Any, **kwargs: Any) -> Plan | Exception:
    try:
        return greedy_plan(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a role assignment that cannot split the batch
        return exc


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_replayed_pass_is_the_plain_walk(model: str, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    gm = _traced(model)
    mesh = Mesh.from_shape(shape, tuple("xyz"[: len(shape)]))
    registry = default_registry()
    blocks = blocks_of(gm)
    assert blocks is not None and blocks.count == 8
    plain_memo, replay_memo, plain_cache, replay_cache = GreedyMemo(), GreedyMemo(), {}, {}  # type: ignore[var-annotated]
    for roles in role_assignments(mesh):
        want = _pass(gm, mesh, registry, roles=roles, memo=plain_memo, expand_cache=plain_cache, replay=False)
        got = _pass(gm, mesh, registry, roles=roles, memo=replay_memo, expand_cache=replay_cache)
        assert _difference(want, got) is None, (roles, _difference(want, got))
    assert plain_memo.replayed == 0
    # blocks 3..6 forward and 1..5 backward replayed in every pass that ran
    assert replay_memo.replayed >= 4
    got_fixed = list(search_seeds.fixed_seeds(gm, mesh, registry, replay_cache, replay_memo))
    monkeypatch.setattr(search_seeds, "greedy_plan", _plain)
    want_fixed = list(search_seeds.fixed_seeds(gm, mesh, registry, plain_cache, plain_memo))
    assert [n for n, _ in got_fixed] == [n for n, _ in want_fixed]
    for (name, want_plan), (_, got_plan) in zip(want_fixed, got_fixed):
        assert _difference(want_plan, got_plan) is None, (name, _difference(want_plan, got_plan))
    assert plain_memo.replayed == 0


def test_search_from_replayed_seeds_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    gm = _traced("llama")
    mesh = Mesh.from_shape((2, 2, 2), ("x", "y", "z"))
    registry = default_registry()
    got = search_layouts(gm, mesh, registry, memory_limit=float("inf"))
    monkeypatch.setattr(search_seeds, "greedy_plan", _plain)
    monkeypatch.setattr(search_problem, "greedy_plan", _plain)
    want = search_layouts(gm, mesh, registry, memory_limit=float("inf"))
    assert _difference(want, got) is None, _difference(want, got)
    assert want.notes["__search__"] == got.notes["__search__"]


def test_a_graph_traced_whole_is_walked_plainly() -> None:
    model, inputs = make_gpt(0, n_layer=4)
    gm = trace(model, inputs, repeats=False)
    assert blocks_of(gm) is None
    memo = GreedyMemo()
    greedy_plan(gm, Mesh.from_shape((2, 2), ("x", "y")), default_registry(), memo=memo)
    assert memo.replayed == 0


def test_a_records_shifts_are_those_that_rename_every_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Compiled.shifts` (worked out once per record) holds exactly the shifts under which every
    name the record reads or writes, and every name a `resolved_by` value holds, renames into
    blocks 1..N-1: the check `matches` made name by name before."""
    gm = _traced("llama")
    blocks = blocks_of(gm)
    assert blocks is not None
    made: list[greedy_replay.Compiled] = []
    original = greedy_replay.compiled

    def keep(record: greedy_replay.Record, where: greedy_replay.Blocks) -> greedy_replay.Compiled:
        made.append(original(record, where))
        return made[-1]

    monkeypatch.setattr(greedy_replay, "compiled", keep)
    greedy_plan(gm, Mesh.from_shape((2, 2, 2), ("x", "y", "z")), default_registry(), memo=GreedyMemo())
    assert made

    def renames(record: greedy_replay.Compiled, shift: int) -> bool:
        moved = greedy_replay._moved
        for _, at, name, was, named in record.before:
            if moved(at, name, at[1] + shift) is None:
                return False
            if named is not None and moved(named, was[0], named[1] + shift) is None:
                return False
        for _, _, at, name, value, named in record.writes:
            if moved(at, name, at[1] + shift) is None:
                return False
            if named is not None and moved(named, value[0], named[1] + shift) is None:
                return False
        return True

    for record in made:
        for shift in range(-blocks.count, blocks.count + 1):
            assert (shift in record.shifts) == renames(record, shift), (record.block, shift)
