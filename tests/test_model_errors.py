"""A batch the model itself rejects raises the model's own error, as serial does, wherever the trace
happens to fail on it. BART's sequence classifier checks that every row has the same number of
end-of-sequence tokens with a check torch.export defers to run time, so on a bad batch the trace
fails later, in a view the count sizes; a user's `except ValueError` must still catch it (a user
probe found a TraceError there). An RNN on a packed sequence is named, with the padded form that
trains like serial."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pass_fixtures import train_in_lockstep
from torch.nn.utils.rnn import pack_padded_sequence

from autopar.core.errors import ModelValueError, TraceError
from autopar.passes.trace import trace


def _bart_and_ids() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import BartConfig, BartForSequenceClassification

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    ids = torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    ids[:, -1] = config.eos_token_id
    return BartForSequenceClassification(config), ids


def test_a_batch_the_model_rejects_raises_the_models_value_error() -> None:
    model, ids = _bart_and_ids()
    ids[0, 3] = model.config.eos_token_id  # row 0: two end-of-sequence tokens
    with pytest.raises(ModelValueError, match="same number of <eos> tokens") as raised:
        trace(model, (), example_kwargs={"input_ids": ids, "labels": torch.zeros(4, dtype=torch.long)})
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value.__cause__, TraceError), "the trace's own failure stays attached"


def test_a_trace_failure_the_model_does_not_raise_stays_a_trace_error() -> None:
    class Unexportable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum() + torch.tensor(x.numpy().sum())  # numpy: not traceable

    with pytest.raises(TraceError) as raised:
        trace(Unexportable(), (torch.randn(2, 4),))
    assert not isinstance(raised.value, ValueError)


class _ReadsItem(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # the value read
        return self.lin(x / scale).sum()


def test_item_in_forward_gets_the_value_read_hint() -> None:
    """A probe found `.item()` reaching the joint export with the hint "the model must be
    differentiable with a single output"; it is a value read."""
    with pytest.raises(TraceError, match="aten._local_scalar_dense") as raised:
        trace(_ReadsItem(), (torch.randn(4, 8),))
    assert raised.value.hint and raised.value.hint.startswith("Python reads a tensor's value here (.item()")
    assert raised.value.where and "test_model_errors.py" in raised.value.where


class _MaxNormEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8, max_norm=1.0)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).sum()


def test_a_parameter_written_in_place_names_the_parameter_and_what_to_do() -> None:
    """nn.Embedding(max_norm=...) renormalizes its weight's rows in place during forward: a probe
    found "unsupported graph output kind InputMutationAOTOutput" without op or line."""
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TraceError, match=r"writes into its parameter 'emb.weight' in place .*max_norm=1.0") as raised:
        trace(_MaxNormEmbedding(), (ids,))
    assert raised.value.op == "in-place update of parameter emb.weight"
    assert raised.value.where and raised.value.where.startswith("emb @ ") and "test_model_errors.py" in raised.value.where
    assert raised.value.hint and "without max_norm" in raised.value.hint


class _PackedClassifier(torch.nn.Module):
    """PyTorch's tutorial pattern: an LSTM over `pack_padded_sequence`, the last hidden state
    classified (`packed=False`: the padded batch, each sequence's last valid step read out)."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        self.emb = torch.nn.Embedding(20, 8, padding_idx=0)
        self.lstm = torch.nn.LSTM(8, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lengths = (ids != 0).sum(1)
        if self.packed:
            packed = pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
            _, (h, _) = self.lstm(packed)
            last = h[-1]
        else:
            out, _ = self.lstm(self.emb(ids))
            last = out[torch.arange(ids.shape[0]), lengths - 1]
        return F.cross_entropy(self.head(last), y)


def _padded_ids(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (8, 6), generator=g)
    for row in range(8):
        ids[row, 6 - row % 5 :] = 0
    return ids, torch.randint(3, (8,), generator=g)


def test_an_rnn_on_a_packed_sequence_is_named_with_the_padded_recipe_which_trains_like_serial() -> None:
    """An RNN on a PackedSequence failed inside torch ("zeros(): argument 'size' ... got
    FakeTensor"), naming neither the LSTM nor the packing; the error now names both, the line, and
    the padded form, which gives the packed model's loss and trains like serial on (2, 2)."""
    torch.manual_seed(0)
    model = _PackedClassifier(packed=True)
    batch = _padded_ids(0)
    with pytest.raises(TraceError) as raised:
        trace(model, batch)
    error = raised.value
    assert error.op == "LSTM on a PackedSequence" and "'lstm'" in error.message, error
    assert error.where and "test_model_errors.py" in error.where and "in forward" in error.where, error.where
    assert error.hint is not None and "lengths - 1" in error.hint
    padded = _PackedClassifier(packed=False)
    padded.load_state_dict(model.state_dict())
    torch.testing.assert_close(padded(*batch), model(*batch))  # the recipe is the packed model's loss
    batches = [_padded_ids(seed) for seed in range(2)]
    r = train_in_lockstep(padded, (2, 2), batches, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["param_err"] < 1e-5, r
