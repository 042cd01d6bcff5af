"""Property tests: the CTC loss op F.ctc_loss is traced to, and torch's backward of it
(autopar/rules/ctc.py), against the in-process oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.rules.ctc import CTC_LOSS, CTC_LOSS_BACKWARD
from autopar.rules.registry import default_registry
from autopar.testing.strategies import check_random_strategies, dim_sizes, mesh_shapes, random_tensor, seeds

REGISTRY = default_registry()
COVERED_OPS = [CTC_LOSS, CTC_LOSS_BACKWARD]


def test_padded_alignment_table_gives_torchs_values() -> None:
    """Hand-checkable case: one sample, target "1", two frames, two classes (blank 0). The paths
    that emit "1" are (1, 1), (0, 1), (1, 0): p = .5*.5 + .5*.5 + .5*.5 = .75, nll = -log .75."""
    log_probs = torch.full((2, 1, 2), 0.5, dtype=torch.float64).log()
    targets = torch.tensor([[1, 1, 1]])  # padded to S = 3: the table has 7 positions, 3 are used
    nll, log_alpha = CTC_LOSS(log_probs, targets, torch.tensor([2]), torch.tensor([1]), 0, False)
    torch.testing.assert_close(nll, -torch.tensor([0.75], dtype=torch.float64).log())
    assert log_alpha.shape == (1, 2, 7)
    assert torch.isinf(log_alpha[..., 3:]).all()


@pytest.mark.parametrize("backward", [False, True])
@settings(max_examples=8, deadline=None)  # per op
@given(data=st.data(), mesh=mesh_shapes(max_axes=2), zero_infinity=st.booleans())
def test_ctc_loss(data: st.DataObject, mesh: tuple[int, ...], zero_infinity: bool, backward: bool) -> None:
    """The batch is split on every tensor; lengths differ per sample (padding past them is noise);
    the loss is infinite where a sample's frames cannot hold its target (zeroed by zero_infinity)."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    n = data.draw(dim_sizes(mesh))
    s = data.draw(st.integers(1, 3))
    c = data.draw(st.integers(2, 5))
    t = data.draw(st.integers(1, 2 * s + 2))
    log_probs = random_tensor((t, n, c), generator=g).log_softmax(-1)
    targets = random_tensor((n, s), torch.int64, generator=g, low=1, high=c)
    target_lengths = random_tensor((n,), torch.int64, generator=g, low=0, high=s + 1)
    input_lengths = random_tensor((n,), torch.int64, generator=g, low=0, high=t + 1)
    args: tuple = (log_probs, targets, input_lengths, target_lengths, 0, zero_infinity)
    if not backward:
        assert check_random_strategies(data, CTC_LOSS, args, {}, mesh, REGISTRY)
        return
    nll, log_alpha = CTC_LOSS(*args)
    grad = random_tensor((n,), generator=g)
    args = (grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, 0, zero_infinity)
    assume(zero_infinity or not torch.isinf(nll).any())  # NaN gradients, in torch's kernel too
    assert check_random_strategies(data, CTC_LOSS_BACKWARD, args, {}, mesh, REGISTRY)
