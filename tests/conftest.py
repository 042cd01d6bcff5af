"""Suite-wide collection hooks.

The suite runs on two pytest-xdist workers (pyproject's addopts: `-n 2 --dist loadgroup`): most
tests are single-threaded Python (tracing, planning, lockstep runs of every rank's program), so two
workers use both cores of the CI machine. Tests that fork real gloo ranks (marked `multirank`) all
go to one worker's group, so that at most one set of rank processes competes with the other
worker's test for the cores and no rendezvous waits on a starved rank. A test that forks ranks
without the mark fails (`multirank.run_ranks` checks what `_note_multirank_marker` sets).

Every other test is its own unit of work under `loadgroup`, and two workers pulling units in
collection order split a module's consecutive tests between them: a module-scoped fixture (a
compiled plan, a mesh choice) was then computed on both workers, once each. A test that reads a
fixture wider than a function is grouped with its module's other such tests instead, so the
fixture is computed once. xdist starts the biggest groups first (`--loadscope-reorder`, its
default): the rank-forking group, then these modules, then single tests, which balance the tail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import multirank
import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one intra-op thread each, or their OpenMP pools oversubscribe them.
    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the rank-forking tests for one xdist group. First among the hooks: an xdist worker
    names each test by its group in its own `pytest_collection_modifyitems` (remote.py), which,
    registered after this initial conftest, pluggy would otherwise call first, before any test
    carries the group: the gloo tests would then spread over both workers, each worker computing
    the module fixtures its share of them needs (twice the forked jobs) and two rank sets
    competing for the cores."""
    for item in items:
        if item.get_closest_marker("multirank") is not None:
            item.add_marker(pytest.mark.xdist_group("gloo_ranks"))
        elif item.get_closest_marker("xdist_group") is None and _reads_a_shared_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _reads_a_shared_fixture(item: pytest.Item) -> bool:
    """Whether the test requests a fixture set up once per module (or wider) from its own module:
    the conftest's and pytest's own fixtures are not shared work."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return False
    return any(
        d.scope != "function" and getattr(d.func, "__module__", None) == module.__name__
        for defs in info.name2fixturedefs.values()
        for d in defs
    )


@pytest.fixture(autouse=True)
def _note_multirank_marker(request: pytest.FixtureRequest) -> Iterator[None]:
    multirank.CURRENT_TEST_MARKED = request.node.get_closest_marker("multirank") is not None
    yield
    multirank.CURRENT_TEST_MARKED = None
