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

from autopar.compiler.driver import compile_for_rank
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from examples.models import make_gpt

ROOT = Path(__file__).resolve().parents[1]


def plan_text() -> str:
    """The plan of one GPT block on 2x2x2 as text (the report and every node's layouts), ~1000
    lines; where Python's hash seed could reach it (set and dict orders over names) is the same
    code at any depth, so a second block would only repeat it."""
    model, batch = make_gpt(0, n_layer=1)
    compiled = compile_for_rank(model, Mesh.from_shape((2, 2, 2)), batch, coords=(1, 0, 1))
    nodes = [f"{node.name} {info(node).layouts}" for node in compiled.graph.graph.nodes if has_info(node)]
    return "\n".join([str(compiled.report), *nodes])


# `plan_text` and a string's hash, printed by a fresh process
IN_A_PROCESS = 'import test_determinism as t; print(t.plan_text()); print("hash", hash("autopar"))'


def _other_hash_seed() -> str:
    """A hash seed other than this process's: its own plus one if it was set, else a fixed one
    (this process's is then drawn at random; the test checks that the two differ)."""
    mine = os.environ.get("PYTHONHASHSEED", "")
    return str(int(mine) + 1) if mine.isdigit() else "4242"


def _in_a_process(hash_seed: str) -> tuple[str, int]:
    """`plan_text()` and `hash("autopar")` in a fresh process with that hash seed."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(
        [sys.executable, "-c", IN_A_PROCESS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text, hashed = done.stdout.rstrip("\n").rsplit("\nhash ", 1)
    return text, int(hashed)


def test_the_plan_is_the_same_text_in_processes_with_different_hash_seeds() -> None:
    """This process and a fresh one with another hash seed (each string hashes differently in the
    two) print the same plan."""
    plan_here = plan_text()
    plan_there, hash_there = _in_a_process(_other_hash_seed())
    assert hash("autopar") != hash_there, "the two processes hash alike: the test would show nothing"
    assert plan_here.count("\n") > 100 and "collectives per step" in plan_here
    assert plan_here == plan_there


def _layouts(graph: torch.fx.GraphModule) -> list[str]:
    """Each node's global layouts, in graph order: the plan. (Node names and local ops differ by
    rank where they should: going from replicated to a pending sum, rank 0 keeps the value and
    the others make zeros.)"""
    return [str(info(n).layouts) for n in graph.graph.nodes if has_info(n)]


def test_every_rank_reports_the_same_plan_and_two_runs_are_bit_identical() -> None:
    """On one GPT block (as `plan_text`: a second block only repeats the same ops and plan)."""
    model, batch = make_gpt(0, n_layer=1)
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
