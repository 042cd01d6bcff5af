"""Which cases of a model x strategy x mesh product the suite runs.

Every (model, mesh, strategy) combination compiles every rank and trains two steps in lockstep:
10-20 CPU s a case, so the whole product of the issues' lists (27 and 9 cases per test) would take
the suite past its 20 minutes on 2 cores. By default a test over three factors runs the cases of a
Latin square: every pair of values of two factors (model and strategy, model and mesh, strategy and
mesh) is met exactly once, which is where a rule that depends on two of them goes wrong; a test over
two factors (model and mesh) runs a diagonal: every model once, every mesh once. `AUTOPAR_FULL_MATRIX=1` runs the
whole product (what a change to those rules should be checked against before it is merged).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

FULL = os.environ.get("AUTOPAR_FULL_MATRIX") == "1"


def pairwise(*factors: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The whole product under AUTOPAR_FULL_MATRIX=1. Otherwise, for factors of one length n: two
    factors, the n cases of a diagonal (each value of each factor once); three factors, the n * n
    cases of a Latin square (each pair of values of any two factors exactly once)."""
    if FULL:
        return list(itertools.product(*factors))
    n = len(factors[0])
    assert all(len(f) == n for f in factors), "pairwise cover needs factors of one length"
    if len(factors) == 2:
        first, second = factors
        return [(first[i], second[i]) for i in range(n)]
    if len(factors) == 3:
        first, second, third = factors
        return [(first[i], second[j], third[(i + j) % n]) for i in range(n) for j in range(n)]
    raise ValueError("pairwise covers two or three factors")
