"""Writes through a boolean mask become `torch.where` (`autopar.passes.masked_writes`), and
outputs that view one intermediate are returned as copies (`outputs_as_copies_of_views`): two
shapes of model code the joint export could not take (a size the mask's count decides; an extra
output torch adds for the hidden base of the views), each a pattern from the transformers zoo."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pass_fixtures import assert_call_matches_serial, assert_compiled_matches_serial
from torch import nn


class _MarksItsSpecialToken(nn.Module):
    """T5Gemma2's embedding: every end-of-image token's embedding overwritten in place by a
    learned vector, `embeds[input_ids == eoi] = eoi_embedding`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.special = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        embeds = self.embed(ids) * 2.0
        embeds[ids == 5] = self.special
        return F.cross_entropy(self.head(embeds.mean(1)), y)


def _batch(marks: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 16, (4, 8), generator=gen)
    ids.view(-1)[torch.randperm(32, generator=gen)[:marks]] = 5
    return ids, torch.randint(3, (4,), generator=gen)


def test_a_masked_write_is_one_program_for_every_count_of_marked_tokens() -> None:
    """The program compiled on a batch with 3 marked tokens runs one with 7, and one with none,
    equal to serial (the weight's gradient included): the write's size is no longer the count."""
    torch.manual_seed(0)
    model = _MarksItsSpecialToken()
    compiled = assert_call_matches_serial(model, (2,), _batch(3))
    run = next(iter(compiled.values()))
    assert run.program.value_guards is None  # nothing to guard: every count takes this program
    targets = {n.target for n in run.program.forward.graph.nodes}
    assert torch.ops.aten.where.self in targets
    assert not targets & {torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}
    for marks in (7, 0):
        assert_compiled_matches_serial(compiled, model, (2,), _batch(marks, seed=1))


class _TwoViewsOfOneStream(nn.Module):
    """ProphetNet's causal LM: the main stream's logits and the n-gram stream's logits, two
    slices of one tensor, both returned."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 2 * 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        streams = self.proj(x).view(x.size(0), x.size(1), 2, 6).transpose(1, 2)
        logits, ngram = streams[:, 0], streams[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits, ngram


def test_two_outputs_viewing_one_intermediate_equal_serial() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 5, 8, generator=gen), torch.randint(6, (4, 5), generator=gen)
    compiled = assert_call_matches_serial(_TwoViewsOfOneStream(), (2,), (x, y))
    forward = next(iter(compiled.values())).program.forward
    assert torch.ops.aten.clone.default in {n.target for n in forward.graph.nodes}
