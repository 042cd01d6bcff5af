"""Sizes the inputs' values decide (issue 34 item 1; docs/debugging.md#value-guards): `nonzero`
of an input mask, boolean indexing by it (BART-family classifiers' end-of-sequence states), the
count of labelled rows DeBERTa's loss branches on. The trace makes each size static at the
example's count and guards the count: a batch with another count gets its own program. Branches
and the `Eq` guard flipping between calls: tests/test_value_guards.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pass_fixtures import assert_call_matches_serial
from torch import nn

from examples import hf_zoo


class _PicksEndOfSequence(nn.Module):
    """A BART-family sequence classifier's head: the hidden state at each row's end-of-sequence
    token, picked by a boolean mask of the input ids (a size the inputs decide)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        eos = ids.eq(2)
        torch._check(torch.unique_consecutive(eos.sum(1)).numel() == 1, lambda: "same number of <eos>")
        picked = h[eos, :].view(h.size(0), -1, h.size(-1))[:, -1, :]
        return F.cross_entropy(self.head(picked), y)


def _eos_batch(per_row: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (4, 8), generator=gen)
    ids[:, 8 - per_row :] = 2  # per_row end-of-sequence tokens at the end of every row
    return ids, torch.randint(3, (4,), generator=gen)


@pytest.mark.parametrize("per_row", [1, 2])
def test_boolean_indexing_by_an_input_mask_is_static_at_the_examples_count(per_row: int) -> None:
    torch.manual_seed(0)
    model = _PicksEndOfSequence()
    compiled = assert_call_matches_serial(model, (2, 2), _eos_batch(per_row))
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None
    assert guards.hold(list(_eos_batch(per_row, seed=1)))
    assert not guards.hold(list(_eos_batch(3 - per_row, seed=1)))  # another count: another program
    for run in compiled.values():
        targets = {n.target for n in run.program.forward.graph.nodes}
        assert torch.ops.aten.nonzero.default not in targets and torch.ops.aten.nonzero_static.default in targets


class _GlobalRows(nn.Module):
    """Longformer's global-attention indices: the (row, column) pairs an input mask flags, in
    `nonzero(as_tuple=True)`'s tuple form, behind a branch on whether any is flagged."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, flags: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if flags.flatten().any().item():
            rows, cols = flags.nonzero(as_tuple=True)
            h = h + (h[rows] * cols[:, None]).sum(0) / 8
        return F.cross_entropy(h, y)


def _flagged_batch(flagged: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    flags = torch.zeros(8, 16, dtype=torch.long)
    flags[:flagged, 3] = 1
    return torch.rand(8, 16, generator=gen), flags, torch.randint(4, (8,), generator=gen)


@pytest.mark.parametrize("flagged", [2, 5])
def test_the_tuple_form_of_nonzero_on_an_input_mask_is_a_count_guard(flagged: int) -> None:
    """torch.export on real values loses the row count of `nonzero(as_tuple=True)` ("Pending
    unbacked symbols"); the trace takes it as the columns of `nonzero()`, which the count guard
    pins: equal to serial, and a batch with another count fails the guards."""
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(_GlobalRows(), (2, 2), _flagged_batch(flagged))
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None
    assert guards.hold(list(_flagged_batch(flagged, seed=1)))
    assert not guards.hold(list(_flagged_batch(7 - flagged, seed=1)))


class _LabelledRows(nn.Module):
    """DeBERTa's classifier loss as transformers writes it: the rows whose label is set (>= 0),
    found by `nonzero`, and a Python branch on how many there are (a size the inputs decide)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        index = (labels >= 0).nonzero()
        if index.size(0) > 0:
            picked = torch.gather(logits, 0, index.expand(index.size(0), logits.size(1)))
            return F.cross_entropy(picked, torch.gather(labels, 0, index.view(-1)))
        return logits.sum() * 0.0


def _labelled_batch(unset: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(3, (8,), generator=gen)
    labels[torch.randperm(8, generator=gen)[:unset]] = -1
    return torch.randn(8, 8, generator=gen), labels


@pytest.mark.parametrize("unset", [0, 3])
def test_a_branch_on_a_count_the_inputs_decide_takes_the_examples_count_as_a_guard(unset: int) -> None:
    """torch.export refuses Python branching on a size-like symbol (`u0 > 0`); the trace on the
    example's values takes the branch, makes the size static at the example's count and guards
    the count: a batch with as many labelled rows runs this program, another count gets its own."""
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(_LabelledRows(), (2, 2), _labelled_batch(unset))
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None
    assert guards.hold(list(_labelled_batch(unset, seed=1)))
    assert not guards.hold(list(_labelled_batch(unset + 1, seed=1)))
    for run in compiled.values():
        targets = {n.target for n in run.program.forward.graph.nodes}
        assert torch.ops.aten.nonzero.default not in targets and torch.ops.aten.nonzero_static.default in targets


def test_deberta_v2_classifier_with_unlabelled_rows_equals_serial() -> None:
    """transformers' DebertaV2ForSequenceClassification at its defaults (sizes shrunk), labels
    with unset rows (-1, which its loss skips by counting the set ones)."""
    model, kwargs, _ = hf_zoo.build_working(hf_zoo.find("DebertaV2ForSequenceClassification"))
    kwargs["labels"][:2] = -1
    compiled = assert_call_matches_serial(model, (2,), (), kwargs)
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None and any(guards.counts)
