"""Batches padded each to its own length compile a program per length; past MAX_PROGRAMS the
least recently used is dropped, and a second epoch over the same lengths compiles at every step
(seconds each). A probe found that silent: the module now warns once, naming the cause and what
to do (pad to a few bucket lengths)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks
from torch import nn

import autopar
from autopar.runtime.module import MAX_PROGRAMS
from autopar.runtime.program_cache import CacheThrash, ProgramCacheWarning


def test_the_notice_warns_once_when_a_dropped_signature_comes_back() -> None:
    thrash = CacheThrash(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for key in ("a", "b", "c"):
            thrash.compiling(key)
        thrash.dropping("a")
        assert not caught, "a first epoch over new signatures is not thrashing"
        thrash.compiling("a")
        thrash.dropping("b")
        thrash.compiling("b")
    assert [w.category for w in caught] == [ProgramCacheWarning]
    assert "3 distinct input signatures" in str(caught[0].message)
    assert "pad batches to a few fixed lengths" in str(caught[0].message)


def _two_epochs(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    g = torch.Generator().manual_seed(1)
    lengths = range(2, 3 + MAX_PROGRAMS)  # one length more than the cache keeps
    batches = [torch.randint(0, 16, (2, t), generator=g) for t in lengths]
    pmodel = autopar.parallelize(model, mesh, example_inputs=(batches[0],))
    found: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            for ids in batches:
                F.cross_entropy(pmodel(ids).flatten(0, 1), ids.flatten()).backward()
            found[f"epoch {epoch}"] = [str(w.message) for w in caught if w.category is ProgramCacheWarning]
    found["filename"] = [w.filename for w in caught if w.category is ProgramCacheWarning]
    return found


@pytest.mark.multirank
def test_a_second_epoch_over_more_lengths_than_kept_warns_once() -> None:
    (found,) = run_ranks(1, _two_epochs, timeout=300)
    assert found["epoch 0"] == [], found
    (message,) = found["epoch 1"]
    assert f"{MAX_PROGRAMS + 1} distinct input signatures" in message and "bucket lengths" in message
    assert found["filename"][0].endswith("test_program_cache.py"), found["filename"]
