"""Folded mesh ranking (`autopar.planning.mesh_fold`, `choose_mesh(..., fold=True)`; off by default).

- On a 6-layer GPT (the fold's minimum depth forced down to 6) and two meshes of 8 ranks, the
  folded choice picks the mesh and the plan the whole graph's ranking picks, layout for layout,
  with the same sum, scheduled step and memory; the other candidate's folded sums and memory are
  the whole graph's.
- Blocks that differ (widths alternate) are not found as repeated blocks, so nothing is folded.
- Plans of the two shallow copies that differ in a middle block are not steady; the extrapolated
  line and its memory limit.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar.planning.mesh_fold as mesh_fold
from autopar.compiler.auto_mesh import SHALLOW_KEY, choose_mesh, folded_blocks, trace_for_choice
from autopar.planning.mesh_choice import MeshCandidate
from autopar.planning.mesh_fold import DEPTHS, extrapolate, steady
from examples.models import GPT, GPTConfig


def _gpt(layers: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=layers, n_head=4, n_embd=64))
    idx = torch.zeros(8, 16, dtype=torch.long)
    return model, (idx, idx)


def test_the_folded_choice_picks_the_whole_graphs_mesh_and_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh_fold, "MIN_FOLDED", 6)
    model, example = _gpt(6)
    gm = trace_for_choice(model, 8, example)
    # two of the four meshes of 8 ranks: one chosen (searched again on the whole graph), one folded
    asked = dict(hardware="a100-cluster", traced=gm, keep_plan=True, candidates=[((4, 2), ("x", "y")), ((2, 4), ("x", "y"))])
    whole = choose_mesh(model, 8, example, **asked)  # type: ignore[arg-type]
    folded = choose_mesh(model, 8, example, **asked, fold=True)  # type: ignore[arg-type]
    assert list(gm.meta[SHALLOW_KEY]) == list(DEPTHS)  # the fold ran on the two copies
    assert folded.chosen.folded == 0 and any(c.folded == 6 for c in folded.candidates)
    a, b = whole.chosen, folded.chosen
    assert (a.shape, a.roles, a.step_time, a.scheduled_time, a.memory) == (
        b.shape, b.roles, b.step_time, b.scheduled_time, b.memory,
    )  # fmt: skip
    assert whole.chosen_plan is not None and folded.chosen_plan is not None
    assert folded.chosen_plan.plan.strategies == whole.chosen_plan.plan.strategies
    assert folded.chosen_plan.plan.layouts == whole.chosen_plan.plan.layouts
    assert folded.chosen_plan.graph is gm  # compiled from the whole graph's own search
    by_mesh = {c.shape: c for c in whole.candidates}
    for c in folded.candidates:
        if c.folded and c.fits:  # each block adds what the fifth added: the whole graph's sums
            assert c.step_time == pytest.approx(by_mesh[c.shape].step_time, rel=1e-6)
            assert c.memory == pytest.approx(by_mesh[c.shape].memory, rel=1e-6)


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, hidden: list[int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(_Block(32, h) for h in hidden)
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_blocks_that_differ_are_not_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh_fold, "MIN_FOLDED", 8)
    idx = torch.zeros(8, 8, dtype=torch.long)
    same = trace_for_choice(_Stack([64] * 8), 4, (idx, idx))
    assert folded_blocks(same) is not None
    model = _Stack([64, 128] * 4)  # every other block wider
    gm = trace_for_choice(model, 4, (idx, idx))
    assert folded_blocks(gm) is None
    choice = choose_mesh(model, 4, (idx, idx), hardware="a100-cluster", traced=gm, fold=True)
    assert SHALLOW_KEY not in gm.meta and not any(c.folded for c in choice.candidates)
    assert choice.chosen.fits


def test_plans_that_differ_in_a_middle_block_are_not_steady(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh_fold, "MIN_FOLDED", 8)
    model, example = _gpt(8)
    shallow, deeper = (trace_for_choice(model, 4, example, depth=d) for d in DEPTHS)
    group = folded_blocks(trace_for_choice(model, 4, example))
    assert group is not None
    mesh = [((2, 2), ("x", "y"))]
    plans = [
        choose_mesh(model, 4, example, traced=g, candidates=mesh, fold=False, keep_plan=True).chosen_plan
        for g in (shallow, deeper)
    ]
    assert plans[0] is not None and plans[1] is not None
    near, deep = plans[0].plan, plans[1].plan
    assert steady(shallow, near, deeper, deep, group)
    # block 3 of the deeper copy (a middle block) computes one op otherwise
    node = next(n for n in deeper.graph.nodes if n.op == "call_function" and n.name.endswith("_b3"))
    other = next(s for s in deep.strategies.values() if s != deep.strategies[node.name])
    changed = copy.copy(deep)
    changed.strategies = {**deep.strategies, node.name: other}
    assert not steady(shallow, near, deeper, changed, group)


def test_a_folded_candidate_is_the_line_through_its_two_depths() -> None:
    near = MeshCandidate((2, 2), ("x", "y"), comm_time=1.0, compute_time=2.0, memory=10.0, fits=True, scheduled_time=2.5)
    deep = replace(near, comm_time=1.5, compute_time=2.25, memory=12.0, scheduled_time=3.0)
    at = extrapolate(near, deep, 32, limit=100.0)  # 27 blocks more, each as the fifth added
    assert (at.comm_time, at.compute_time, at.memory, at.scheduled_time) == (15.0, 9.0, 66.0, 16.5)
    assert at.fits and not at.error and math.isnan(extrapolate(near, replace(deep, scheduled_time=math.nan), 32, 100.0).scheduled_time)
    over = extrapolate(near, deep, 32, limit=60.0)
    assert not over.fits and over.error == "does not fit in memory (folded)"
