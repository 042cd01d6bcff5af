"""nn.LSTM / nn.GRU with dropout between layers: torch.export's decomposition of the rnn op drops
that dropout (the probe found the parallel loss equal to the dropout=0 loss), so autopar refuses
it by name instead of training silently unlike serial; without dropout, or in eval, it runs and
equals serial."""

from __future__ import annotations

import pytest
import torch
from pass_fixtures import assert_call_matches_serial
from torch import nn

from autopar.core.errors import TraceError
from autopar.passes.trace import trace


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module], dropout: float) -> None:
        super().__init__()
        self.front = nn.Linear(8, 8)
        self.rnn = cell(8, 8, num_layers=2, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.front(x))[0].pow(2).mean()


def _x() -> torch.Tensor:
    return torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_inter_layer_rnn_dropout_in_training_is_refused_by_name(cell: type[nn.Module]) -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"'rnn' has dropout=0.3 between its 2 layers") as raised:
        assert_call_matches_serial(Recurrent(cell, 0.3), (2,), (_x(),))
    assert raised.value.where and "test_rnn_dropout.py" in raised.value.where, raised.value.where
    assert raised.value.hint and "nn.Dropout between them" in raised.value.hint


def test_rnn_dropout_in_eval_is_traced() -> None:
    """In eval the rnn draws nothing: the same module traces (only training is refused)."""
    torch.manual_seed(0)
    gm = trace(Recurrent(nn.LSTM, 0.3).eval(), (_x(),))
    assert any(node.target == torch.ops.aten.sigmoid.default for node in gm.graph.nodes)
