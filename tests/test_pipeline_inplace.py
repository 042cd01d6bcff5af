"""In-place writes into values the inputs alone make (transformers' `shift_tokens_right`: a zeros
tensor filled through a slice with `copy_`, then `masked_fill_`) run in every pipeline stage that
reads the value. Such a write has no users of its own, and the stage split once dropped it: BART's
decoder read all-zero decoder input ids, and training on a pipeline differed from serial with no
error (found by a user probe). Pass test on the cut graphs, BART at its defaults on 2 ranks run
in this process (`autopar.testing.pipeline_lockstep`) against serial, and the refusal where a stage's weights are written into such a value."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from multirank import assert_parameters_equal_serial, pipelined, run_in_lockstep

import autopar
from autopar.compiler.pipeline_split import PipelineSplitError, split_stages
from autopar.testing.pipeline_lockstep import LockstepTransport

TOL = {"rtol": 1e-5, "atol": 1e-6}


class ShiftRight(nn.Module):
    """A decoder-style model whose second stage reads its inputs shifted right in place."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Embedding(16, 8)
        self.dec = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        memory = self.enc(ids).mean(1, keepdim=True)
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 1
        shifted.masked_fill_(shifted == -100, 0)
        h = self.dec(shifted) + memory
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class WritesWeights(nn.Module):
    """Writes a first stage's activation into a zeros tensor that the second stage also reads."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(x.shape)
        h = self.first(x)
        buf[:, :2] = h[:, :2]
        return (self.second(h) + buf).sum()


def _writes(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if str(n.target) in ("aten.copy_.default", "aten.fill_.Scalar")]


def test_the_stage_reading_a_value_written_in_place_runs_the_writes() -> None:
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    model = ShiftRight()
    program = split_stages(model, [ids, targets], (ids, targets), ["dec"], 2)
    first, second = (stage.module for stage in program.stages)
    assert _writes(second), "the decoder's stage writes the shifted ids"
    assert not _writes(first), "the encoder's stage does not read them"
    values: dict[str, torch.Tensor] = {}

    def attr(name: str) -> torch.Tensor:  # a weight, or a constant the export made (the fill value)
        return program.constants[name] if name in program.constants else model.get_parameter(name)

    for stage in program.stages:  # the cut graphs run in turn give the serial loss (x2: a sum rule)
        args = [
            (ids, targets)[v] if kind == "input" else values[v] if kind == "value" else attr(v)
            for kind, v in stage.sources
        ]
        out = stage.module(*args)
        values.update(zip(stage.outputs, out if isinstance(out, (tuple, list)) else [out]))
    (loss_term,) = (values[n] for n in program.stages[-1].outputs)
    per_row = F.cross_entropy(
        model.head(model.dec(torch.cat([torch.ones(4, 1, dtype=ids.dtype), ids[:, :-1]], 1))
                   + model.enc(ids).mean(1, keepdim=True)).flatten(0, 1),
        targets.flatten(), reduction="sum",
    )  # fmt: skip
    torch.testing.assert_close(loss_term, per_row, **TOL)


def test_weights_written_into_a_value_other_stages_make_are_refused() -> None:
    x = torch.randn(4, 4)
    with pytest.raises(PipelineSplitError, match="writes a value computed from the weights in place"):
        split_stages(WritesWeights(), [x], (x,), ["second"], 2)


def _bart(rank: int, world: int, transport: LockstepTransport | None = None) -> None:
    from transformers import BartConfig, BartForSequenceClassification

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    model = BartForSequenceClassification(config)
    serial = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(3, 96, (4, 12), generator=g)
        ids[:, -1] = config.eos_token_id
        batches.append({"input_ids": ids, "labels": torch.randint(0, config.num_labels, (4,), generator=g)})
    options = autopar.PipelineOptions(microbatches=2)
    pmodel = pipelined(model, world, transport, example_kwargs=batches[0], pipeline=options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pmodel, serial)]
    for step, batch in enumerate(batches):
        losses = []
        for module, optimizer in zip((pmodel, serial), optimizers):
            torch.manual_seed(100 + step)  # dropout 0.1 at the defaults: the same draws
            optimizer.zero_grad()
            loss = module(**batch).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], **TOL, msg=f"step {step}")
    assert_parameters_equal_serial(pmodel, serial, TOL)


def test_bart_classifier_at_its_defaults_trains_equal_to_serial_on_pp2() -> None:
    run_in_lockstep(2, _bart)
