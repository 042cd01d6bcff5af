"""Decisions cross between ranks as data (`autopar.runtime.wire`): the chunk count and the
collective-matmul decomposition as JSON read by validating decoders, a plan pickled and read by an
allow-listed unpickler that names only autopar's data types; a payload naming anything else is
refused before it is called, on a real 2-rank gloo job too (`decided_on_rank0`); what the ranks'
checks gather is JSON (`all_gathered`)."""

from __future__ import annotations

import collections
import json
import os
import pickle
from dataclasses import replace
from typing import Any

import pytest
import torch
from multirank import run_ranks

import autopar
from autopar.compiler.chunk_choice import OVER_DECOMPOSITION, ChunkChoice
from autopar.compiler.decompose_choice import DECOMPOSITION, DecompositionChoice
from autopar.compiler.driver import trace_for
from autopar.core.collectives import DecomposedPair
from autopar.core.errors import AutoparError, MemoryLimitError, RankFailureError
from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.planning.search import search_layouts
from autopar.planning.search_cost import TimeCost
from autopar.rules.registry import default_registry
from autopar.runtime.agreement import choice_on_rank0, decided_on_rank0
from autopar.runtime.module import ParallelModule
from autopar.runtime.wire import RefusedPayload, all_gathered, allowed_loads, broadcast_bytes
from examples.models import make_mlp

PAIR = DecomposedPair("all_gather_3", "all_gather", ("mm_1", "mm_2"), ("M", "K"), "h.0.mlp @ model.py:12", 4, 2e-5, 1.5e-5, True)
DECIDED = DecompositionChoice((PAIR, replace(PAIR, collective="reduce_scatter_7", kind="reduce_scatter", kept=False)), (("whole", 1.25e-3), ("every pair", 1.5e-3)))


def _plan() -> Any:
    """The search's plan of the examples' MLP on a (2, 2) mesh priced on the H100 table (layouts,
    strategies, placements, dtypes, the memory breakdown and the cheapest start)."""
    model, batch = make_mlp(0)
    mesh = Mesh.from_shape((2, 2))
    gm = trace_for(model, mesh, batch)
    return search_layouts(gm, mesh, default_registry(), cost=TimeCost("h100-nvlink-ib", mesh.shape))


class _Shell:
    """What a payload could name to run code on the ranks that read it."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, ("echo the payload ran",)


def test_a_plan_and_an_error_cross_as_they_were() -> None:
    plan = _plan()
    assert allowed_loads(pickle.dumps(plan)) == plan
    error = allowed_loads(pickle.dumps(MemoryLimitError("no plan fits", memory=3.0, limit=2.0, hint="raise it")))
    assert isinstance(error, MemoryLimitError) and (error.memory, error.limit, error.hint) == (3.0, 2.0, "raise it")


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (pickle.dumps(_Shell()), "system"),  # a function outside autopar
        (pickle.dumps(collections.Counter("ab")), "collections.Counter"),  # a class outside autopar
        (pickle.dumps(autopar.parallelize), "autopar.api.parallelize"),  # autopar's, but code
        (pickle.dumps(ParallelModule), "autopar.runtime.module.ParallelModule"),  # autopar's class, not data
        (b"cautopar.api\nos.system\n(S'echo the payload ran'\ntR.", "autopar.api.os.system"),  # a path out of a module
        (b"cautopar.not_a_module\nPlan\n)R.", "autopar.not_a_module.Plan"),  # nothing imported on its word
    ],
    ids=["os-system", "counter", "autopar-function", "autopar-module-class", "dotted-path", "unimported"],
)
def test_a_payload_naming_another_type_is_refused(payload: bytes, named: str) -> None:
    with pytest.raises(RefusedPayload, match="not one of autopar's data types") as refused:
        allowed_loads(payload)
    assert named in str(refused.value)


def test_a_payload_setting_a_class_attribute_is_refused() -> None:
    """`BUILD` on a class (here autopar's Plan, named legitimately) would set the class's
    attributes on every rank that reads it: refused, and the class is untouched."""
    roles = Plan.roles
    with pytest.raises(RefusedPayload, match="sets the state of <class 'autopar.core.plan.Plan'>"):
        allowed_loads(b"cautopar.core.plan\nPlan\n(N}S'roles'\nS'overwritten'\nstb.")
    assert Plan.roles == roles


def test_the_choices_cross_as_json() -> None:
    assert DECOMPOSITION.carried(DECIDED) == DECIDED
    assert DECOMPOSITION.carried(DecompositionChoice()) == DecompositionChoice()
    chunks = ChunkChoice(2, ((1, 3.5e-3), (2, 2.5e-3)))
    assert OVER_DECOMPOSITION.carried(chunks) == chunks
    assert OVER_DECOMPOSITION.dumps(chunks) == '{"chunks": 2, "steps": [[1, 0.0035], [2, 0.0025]]}'


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"chunks": 3, "steps": [[1, 0.1], [3, 0.05]]}', "not a choice of"),
        ('{"chunks": 2, "steps": [[1, 0.1]]}', "not a choice of"),  # a count not modeled
        ('{"chunks": true, "steps": [[1, 0.1]]}', "chunks is a bool"),
        ('{"chunks": 1, "steps": [[1, "fast"]]}', "not a [int, number] pair"),
        ('{"chunks": 1}', "expected the fields"),
        ('{"chunks": 1, "steps": [[1, 0.1]], "kernel": "os.system"}', "expected the fields"),
        ("[1, 2]", "expected the fields"),
        ("chunks=2", "not JSON"),
    ],
)
def test_a_chunk_count_that_auto_cannot_choose_is_refused(text: str, why: str) -> None:
    with pytest.raises(RefusedPayload, match=why.replace("[", r"\[")):
        OVER_DECOMPOSITION.loads(text)


def _pair_as(**fields: Any) -> str:
    """The JSON of a one-pair choice, with `fields` of the pair replaced."""
    data = DECOMPOSITION.encode(DecompositionChoice((PAIR,)))
    data["records"][0].update(fields)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"kind": "all_to_all"}, "not a pair the pass makes"),
        ({"chunks": 0}, "not a pair the pass makes"),
        ({"dims": ["M"]}, "not a pair the pass makes"),  # one dim for two matmuls
        ({"dims": ["M", "Q"]}, "not a pair the pass makes"),
        ({"kept": 1}, "kept is int"),
        ({"before": "1e-5"}, "before is str"),
        ({"matmuls": ["mm_1", 2]}, "matmuls holds other than strings"),
    ],
)
def test_a_decomposition_the_pass_cannot_make_is_refused(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(RefusedPayload, match=why):
        DECOMPOSITION.loads(_pair_as(**fields))


class _NotData:
    """A result of rank 0's decision that is no autopar data type (a bug, were it autopar's)."""


def _job(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    plan = decided_on_rank0(_plan if rank == 0 else lambda: pytest.fail("only rank 0 plans"), "planning")
    found["plan"] = plan == _plan()
    chosen = choice_on_rank0()(lambda: DECIDED if rank == 0 else None, DECOMPOSITION)
    found["decomposition"] = chosen == DECIDED
    try:
        decided_on_rank0(lambda: _NotData(), "a decision")
    except AutoparError as exc:
        found["not data"] = f"{type(exc).__name__}: {exc}"
    gathered = all_gathered([f"rank {rank}", (1.5, float("nan")), None], None, torch.device("cpu"))
    found["gathered"] = [[g[0], g[2], g[1][0], g[1][1] != g[1][1]] for g in gathered]
    # a rank 0 that sends what no autopar sends: the others refuse it, naming what it named
    if rank == 0:
        broadcast_bytes(pickle.dumps(("value", _Shell())), None, torch.device("cpu"))
    else:
        try:
            decided_on_rank0(lambda: None, "planning")
        except AutoparError as exc:
            found["hostile"] = str(exc)
    return found


@pytest.mark.multirank
def test_decisions_cross_a_gloo_job_as_data() -> None:
    first, second = run_ranks(2, _job, timeout=120)
    for found in (first, second):
        assert found["plan"] and found["decomposition"], found
    assert first["gathered"] == second["gathered"] == [["rank 0", None, 1.5, True], ["rank 1", None, 1.5, True]]
    assert first["not data"].startswith("AutoparError: a decision failed on rank 0: RefusedPayload")
    assert second["not data"].startswith(f"{RankFailureError.__name__}: rank 0 failed in a decision")
    assert "test_decision_wire._NotData" in second["not data"]
    assert "rank 0 sent planning in a form this rank refuses to read" in second["hostile"]
    assert "system, which is not one of autopar's data types" in second["hostile"]
