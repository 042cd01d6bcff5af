"""A CPU rank's default memory limit leaves out what the process holds beside its model.

On the 1B pipelined row the plan fitted 2.7 GB a rank while torch, gloo and the interpreter held
0.15-0.3 GB of every rank outside any plan (docs/pipeline.md#a-pipelined-ranks-memory). The
default limit is now the rank's share of the machine less that footprint; the model's own tensors
are not subtracted (the plan counts their blocks)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from autopar.api import default_memory_limit
from autopar.planning.memory import MEMORY_HEADROOM
from autopar.runtime.device_memory import process_footprint, rank_memory

MiB = 2**20
BLOCK = 64 * MiB  # one float32 tensor of this many bytes, its pages written
NOISE = 12 * MiB  # what the interpreter allocates between two readings


def _block() -> torch.Tensor:
    return torch.ones(BLOCK // 4)  # ones, not empty: the pages must be resident


def test_the_footprint_counts_the_process_but_not_the_models_tensors() -> None:
    before = process_footprint()
    assert before > 50 * MiB  # torch alone holds more than this
    held = _block()
    grown = process_footprint()
    assert grown - before == pytest.approx(BLOCK, abs=NOISE)
    assert process_footprint([held, held.view(-1, 4)]) == pytest.approx(before, abs=NOISE)  # one storage once
    assert process_footprint([torch.empty(3, device="meta")]) == pytest.approx(grown, abs=NOISE)


def test_the_default_cpu_limit_is_the_share_less_the_footprint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = nn.Linear(4096, 4096, bias=False)  # 64 MiB of weights, written by its initialization
    limit = default_memory_limit("cpu", model)
    assert limit is not None
    assert limit == pytest.approx(MEMORY_HEADROOM * (machine / 8 - process_footprint(model.parameters())), abs=NOISE)
    assert machine / 8 - process_footprint() < rank_memory("cpu", model.parameters())  # type: ignore[operator]
    # memory the process keeps beside the model is not the plan's; the model's own weights are
    other = _block()
    after = default_memory_limit("cpu", model)
    assert after is not None
    assert limit - after == pytest.approx(MEMORY_HEADROOM * BLOCK, abs=NOISE)
    del other
