"""Golden plans: where the closed forms name a winner, the search (element-count objective) picks it.

Model: two residual MLP blocks x + fc2(gelu(fc1(x))), hidden h = 64, width 4h, no biases, T tokens,
loss sum((y - t)^2). Per block the closed forms of comm_volumes.md (elements per rank, fwd + bwd):

- 1-D Megatron on t ranks: two all-reduces of T*h, `4 (t-1)/t * T*h`;
- token split (ZeRO-3, gathered weights kept): `2 (p-1)/p * 8 h^2` (weights gathered, gradients
  reduce-scattered);
- AxoNN / Tensor3D grid (Gx, Gy, Gz), kept weights: `symbolic.axonn_linear` for fc1 + swapped fc2.

So 1-D wins when T is small next to h (activations cheaper than weights), the token split when T
is large, and a 3-D grid in between at p = 64. The cube (q, q, q) (= the AxoNN grid (q, q, q) with
kept weights) never wins alone on this block: it ties with a two-axis grid ((4, 4, 4) and (1, 16, 4)
at T = 2h), so the 3-D case here is the grid (2, 8, 4). Each test first checks its premise on the
closed forms, then the per-axis letters (T tokens, k inputs, n outputs) the search gives every
linear's products (forward, input gradient, weight gradient).
"""

from __future__ import annotations

import functools
from itertools import product

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autopar.core.mesh import Mesh
from autopar.core.plan import Plan
from autopar.cost import symbolic
from autopar.passes.trace import trace
from autopar.planning.fixed import find_linears, split_letters
from autopar.planning.search import search_layouts
from autopar.rules.registry import default_registry

HIDDEN = 64


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h, bias=False)
        self.fc2 = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ResidualMLP(nn.Module):
    def __init__(self, h: int = HIDDEN, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(blocks))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return ((x - t) ** 2).sum()


@functools.cache
def _traced(tokens: int) -> fx.GraphModule:
    with torch.device("meta"):
        model = ResidualMLP()
    x = torch.zeros(tokens, HIDDEN)
    return trace(model, (x, x), decompose=True)


@functools.cache
def _searched(tokens: int, mesh_shape: tuple[int, ...]) -> Plan:
    return search_layouts(_traced(tokens), Mesh.from_shape(mesh_shape), default_registry())


def _letters(tokens: int, mesh_shape: tuple[int, ...]) -> dict[str, list[tuple[str, ...]]]:
    """Per linear (module path), per product, the letter each mesh axis splits."""
    gm = _traced(tokens)
    plan = _searched(tokens, mesh_shape)
    nodes = {n.name: n for n in gm.graph.nodes}
    return {
        lin.module: [split_letters(plan.strategies[p.node], p, nodes[p.node].target) for p in lin.products]
        for lin in find_linears(gm)
    }


def _axonn(tokens: int, grid: tuple[int, int, int]) -> float:
    h = HIDDEN
    fc1 = symbolic.axonn_linear(tokens, h, 4 * h, grid, swapped=False, keep_weights=True)
    fc2 = symbolic.axonn_linear(tokens, 4 * h, h, grid, swapped=True, keep_weights=True)
    return float(fc1 + fc2)


def _grids(p: int) -> list[tuple[int, int, int]]:
    divisors = [d for d in range(1, p + 1) if p % d == 0]
    return [(a, b, p // (a * b)) for a, b in product(divisors, repeat=2) if p % (a * b) == 0]


def _megatron(tokens: int, p: int) -> float:
    return 4 * (p - 1) / p * tokens * HIDDEN


def _zero3(p: int) -> float:
    return 2 * (p - 1) / p * 8 * HIDDEN**2


def test_premise_closed_forms() -> None:
    # 8 ranks: 1-D at T = h/4, the token split at T = 16 h
    assert _megatron(16, 8) < _zero3(8) / 10
    assert _zero3(8) < _megatron(1024, 8) / 3
    # 64 ranks, T = 2h: the best grid is the 3-D (2, 8, 4), > 15 % below any grid with a unit axis
    values = {g: _axonn(128, g) for g in _grids(64)}
    best = min(values, key=values.__getitem__)
    assert best == (2, 8, 4)
    flat = min(v for g, v in values.items() if 1 in g)
    assert values[best] < 0.85 * flat
    assert values[best] < _megatron(128, 64) / 3
    # the cube ties with a two-axis grid: no cube-only regime on this block
    assert values[(4, 4, 4)] == values[(1, 16, 4)]


def test_few_tokens_one_axis_gives_1d_megatron() -> None:
    letters = _letters(16, (8,))
    for block in ("blocks.0", "blocks.1"):
        # column-parallel fc1 (every product splits fc1's outputs), row-parallel fc2 (its inputs)
        assert set(letters[f"{block}.fc1"]) == {("n",)}
        assert set(letters[f"{block}.fc2"]) == {("k",)}
    assert len(letters["blocks.1.fc1"]) == 3 and len(letters["blocks.0.fc1"]) == 2  # no input grad


def test_many_tokens_one_axis_splits_tokens() -> None:
    letters = _letters(1024, (8,))
    assert all(set(products) == {("T",)} for products in letters.values())


def test_grid_regime_gives_the_3d_grid() -> None:
    letters = _letters(128, (2, 8, 4))
    # AxoNN / Tensor3D on (x, y, z) = (2, 8, 4): fc1 contracts over x, splits outputs over y and
    # tokens over z; fc2 swaps x and y. Every product of the linear follows the same axes.
    assert set(letters["blocks.1.fc1"]) == {("k", "n", "T")}
    assert set(letters["blocks.0.fc2"]) == {("n", "k", "T")}
    assert set(letters["blocks.1.fc2"]) == {("n", "k", "T")}
    # the first linear's input is the replicated user input, sliced for free: its forward keeps n
    # on y and may split n on z too (then its output moves to tokens on z by an all-to-all, cheaper
    # than gathering the weight's z blocks)
    assert letters["blocks.0.fc1"][0][1] == "n" and letters["blocks.0.fc1"][0][2] in ("n", "T")
    plan = _searched(128, (2, 8, 4))
    assert "roles" in plan.notes["__search__"]
