"""A value whose readers want different layouts is priced once per wanted layout (`search_polish`).

The GPT of benchmarks/plan_quality.py (h = 4096, 32 heads, s = 2048, b = 8, built on the meta
device) on the 1x2x4 planning mesh: heads over y, tokens over z, weights stored split over z too
and gathered per use. attn.proj's forward gathers its input (split by heads) over y and computes
its output split over y. In backward three ops read the output gradient: the weight gradient and
the bias gradient where it lies, the input gradient (gradient @ weight). The search's second round
priced gathering it over y for the input gradient at a third (three readers), so its plan gathered
it (8.39 M elements) and exchanged the gathered weight (4.19 M) to get the input gradient split by
heads; a pending input gradient reduce-scattered into heads moves 8.39 M and nothing else.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from autopar.compiler.driver import compile_for_rank
from autopar.core.layout import Layout
from autopar.core.mesh import Mesh
from autopar.passes.trace import trace
from autopar.planning.greedy import greedy_plan
from autopar.planning.search_cost import TimeCost
from autopar.planning.search_polish import POLISH_SWEEPS, polish
from autopar.planning.search_problem import Problem, Shared
from autopar.planning.search_vars import Edge
from autopar.rules.registry import default_registry
from examples.models import GPT, GPTConfig

H, HEADS, SEQ, BATCH, VOCAB = 4096, 32, 2048, 8, 512
MESH = (1, 2, 4)  # x, y (heads), z (tokens; weights stored split over it)
T = BATCH * SEQ


def test_attention_projection_moves_the_floor_of_its_layout() -> None:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=HEADS, n_embd=H)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    compiled = compile_for_rank(model, Mesh.from_shape(MESH), (idx, idx), coords=(0, 0, 0))
    proj = [c for c in compiled.report.collectives if c.module_path == "blocks.1.attn.proj"]
    y, z = MESH[1], MESH[2]
    weight = (z - 1) / z * H * H / y  # the weight's block over y gathered over z (and its gradient reduced)
    activation = (y - 1) / y * T / z * H  # the input gathered over y (and its gradient reduced)
    bias = (z - 1) / z * H / y
    kinds = sorted((c.phase, c.kind, c.axis) for c in proj)
    assert kinds == sorted(
        [
            ("forward", "all_gather", "z"),  # weight
            ("forward", "all_gather", "z"),  # bias
            ("forward", "all_gather", "y"),  # input, split by heads
            ("backward", "reduce_scatter", "y"),  # input gradient, into heads
            ("backward", "reduce_scatter", "z"),  # weight gradient
            ("backward", "reduce_scatter", "z"),  # bias gradient
        ]
    ), kinds
    # 29.4 M per rank per layer (33.6 M before: the output gradient gathered, the weight exchanged)
    assert sum(c.elements for c in proj) == 2 * (weight + activation + bias)


def _polish_reference(problem: Problem, max_sweeps: int = POLISH_SWEEPS) -> bool:
    """`search_polish.polish` as first written: every candidate of every op priced in full, each
    group's wanted layouts compared as layouts (the oracle of the shared-work version)."""
    groups: dict[tuple[int, int], list[Edge]] = {}
    for edge in problem.edges:
        groups.setdefault((edge.u, id(edge.out_index)), []).append(edge)
    touching: list[list[list[Edge]]] = [[] for _ in problem.vars]
    for edges in groups.values():
        for op in {edges[0].u, *(e.v for e in edges)}:
            touching[op].append(edges)

    def group_cost(edges: list[Edge], trial: dict[int, int]) -> float:
        cu = trial.get(edges[0].u, problem.vars[edges[0].u].current)
        made: dict[Layout, float] = {}
        for edge in edges:
            col = int(edge.in_index[trial.get(edge.v, problem.vars[edge.v].current)])
            assert edge.pairs is not None
            want = edge.pairs.wanted(col)
            if want not in made:
                cell = float(edge.table[edge.out_index[cu], col])
                made[want] = math.inf if np.isnan(cell) else cell * edge.pairs.share
        return sum(made.values())

    moved = False
    for _ in range(max_sweeps):
        moves = 0
        for v, var in enumerate(problem.vars):
            if len(var.cands) < 2 or not touching[v]:
                continue
            now = float(var.unary[var.current]) + sum(group_cost(edges, {}) for edges in touching[v])
            best, best_value = var.current, now
            for c in range(len(var.cands)):
                value = float(var.unary[c])
                if c == var.current or value >= best_value:
                    continue
                value += sum(group_cost(edges, {v: c}) for edges in touching[v])
                if value < best_value:
                    best, best_value = c, value
            if best != var.current and best_value < now - 1e-9 * max(1.0, abs(now)):
                var.current, moves = best, moves + 1
        if not moves:
            break
        moved = True
    return moved


@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2)])
def test_polish_moves_every_op_as_pricing_every_candidate_in_full(shape: tuple[int, ...]) -> None:
    """The polish prices each group once per distinct row and columns of the op moved and stops
    summing a candidate that cannot win: it moves every op where pricing every candidate in full
    moves it (same sums, same order, same ties), from the search's second-round optimum."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(8, 16, dtype=torch.long)
    gm = trace(model, (idx, idx), decompose=True)
    mesh = Mesh.from_shape(shape)
    registry, cost, shared = default_registry(), TimeCost("a100-cluster", mesh.shape), Shared()
    seed = greedy_plan(gm, mesh, registry, expand_cache=shared.expand, memo=shared.greedy)
    problems = []
    for _ in range(2):
        problem = Problem(gm, mesh, registry, seed, cost, shared.expand, shared, share_readers=True)
        problem.optimize(8)
        problems.append(problem)
    assert problems[0].snapshot() == problems[1].snapshot()
    assert _polish_reference(problems[0]) == polish(problems[1])
    assert problems[0].snapshot() == problems[1].snapshot()
    assert [v.current for v in problems[0].vars] == [v.current for v in problems[1].vars]


@pytest.mark.parametrize("layers", [2, 6])
def test_polish_prices_again_only_ops_whose_neighbours_moved(layers: int) -> None:
    """After the first sweep the polish prices an op again only where an op its objective reads
    moved: from seeds it moves (the second round's optimum of a searched GPT, and the greedy seed
    itself), it ends where pricing every op in every sweep ends, and skips most of them."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=4, n_embd=32)
    with torch.device("meta"):
        model = GPT(cfg)
    gm = trace(model, (torch.zeros(8, 16, dtype=torch.long),) * 2, decompose=True)
    mesh = Mesh.from_shape((2, 2, 2))
    registry, cost, shared = default_registry(), TimeCost("a100-cluster", mesh.shape), Shared()
    skipped = 0
    for roles in [("tensor", "token", "tensor"), ("token", "tensor", "tensor")]:
        seed = greedy_plan(gm, mesh, registry, roles=roles, expand_cache=shared.expand, memo=shared.greedy)
        for optimize in (False, True):
            problems = [
                Problem(gm, mesh, registry, seed, cost, shared.expand, shared, share_readers=True)
                for _ in range(2)
            ]
            for problem in problems:
                if optimize:
                    problem.optimize(8)
            assert _polish_reference(problems[0]) == polish(problems[1])
            assert problems[0].snapshot() == problems[1].snapshot()
            tally = problems[1].tally
            assert tally.polished > 0
            skipped += tally.polish_skipped
    assert skipped > 0
