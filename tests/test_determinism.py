"""Determinism: the same training gives bit-identical losses and gradients run after run, and the
plan (every node's layouts and the report) is the same text on every rank and in every process,
whatever Python's hash seed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from pass_fixtures import compile_every_rank, lockstep_step

from autopar.core.meta import has_info, info
from examples.models import make_gpt

ROOT = Path(__file__).resolve().parents[1]

PLAN_TEXT = """
import torch
from autopar.compiler.driver import compile_for_rank
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from examples.models import make_gpt
model, batch = make_gpt(0)
compiled = compile_for_rank(model, Mesh.from_shape((2, 2, 2)), batch, coords=(1, 0, 1))
print(compiled.report)
for node in compiled.graph.graph.nodes:
    if has_info(node):
        print(node.name, info(node).layouts)
"""


def _plan_text(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PLAN_TEXT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_plan_is_the_same_text_in_processes_with_different_hash_seeds() -> None:
    first, second = _plan_text("0"), _plan_text("4242")
    assert first.count("\n") > 100 and "collectives per step" in first
    assert first == second


def _layouts(graph: torch.fx.GraphModule) -> list[str]:
    """Each node's global layouts, in graph order: the plan. (Node names and local ops differ by
    rank where they should: going from replicated to a pending sum, rank 0 keeps the value and
    the others make zeros.)"""
    return [str(info(n).layouts) for n in graph.graph.nodes if has_info(n)]


def test_every_rank_reports_the_same_plan_and_two_runs_are_bit_identical() -> None:
    model, batch = make_gpt(0)
    runs = []
    for _ in range(2):
        compiled = compile_every_rank(model, (2, 2, 2), batch)
        assert len({str(c.report) for c in compiled.values()}) == 1
        assert len({tuple(_layouts(c.graph)) for c in compiled.values()}) == 1
        runs.append((_layouts(next(iter(compiled.values())).graph), *lockstep_step(compiled, model, (2, 2, 2), batch, {})))
    (plan_a, fwd_a, bwd_a), (plan_b, fwd_b, bwd_b) = runs
    assert plan_a == plan_b
    for coords in fwd_a:
        assert all(torch.equal(x, y) for x, y in zip(fwd_a[coords], fwd_b[coords], strict=True))
        assert all(torch.equal(x, y) for x, y in zip(bwd_a[coords], bwd_b[coords], strict=True))
