"""A pipelined model called without a loss (inference): the model's outputs, microbatched through
the stages and put back together on every rank, equal to serial (docs/pipeline.md#inference), on
2 ranks run in this process (`autopar.testing.pipeline_lockstep`) and, with tensor axes in each
stage, on 4 gloo ranks; what such outputs refuse (a backward through them in eval(), unless an
input requires grad: a saliency map, whose input gradient equals serial's)."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import pipelined, run_ranks, run_scenarios_in_lockstep, train_side_by_side
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler.pipeline_split import PipelineLossError, split_stages
from autopar.testing.pipeline_lockstep import LockstepTransport

TOL = {"rtol": 1e-4, "atol": 1e-5}


class Classifier(nn.Module):
    """Logits without labels, the loss with them (as a transformers model)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = self.head(h)
        return logits if y is None else F.cross_entropy(logits, y)


def _classifier(rank: int, world: int, schedule: str, transport: LockstepTransport | None = None) -> None:
    torch.manual_seed(0)
    model = Classifier()
    serial = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
    options = autopar.PipelineOptions(microbatches=3, schedule=schedule, stage_boundaries=["layers.1"])
    if world == 4:  # tensor axes inside each stage: its parallel module's outputs made whole
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pmodel = autopar.parallelize(model, mesh, example_inputs=(x, y), pipeline=options)
    else:
        pmodel = pipelined(model, world, transport, example_inputs=(x, y), pipeline=options)
    losses = train_side_by_side([(pmodel, (x, y)), (serial, (x, y))], steps=1)
    torch.testing.assert_close(losses[0], losses[1], **TOL)
    with torch.no_grad():  # logits of the trained weights, every microbatch's rows in order
        logits = pmodel(x)
        assert isinstance(logits, torch.Tensor) and not logits.requires_grad
        torch.testing.assert_close(logits, serial(x), **TOL)
    pmodel.eval()
    serial.eval()
    odd = torch.randn(5, 8)  # microbatches of 2, 2 and 1 rows
    torch.testing.assert_close(pmodel(odd).detach(), serial(odd).detach(), **TOL)
    with torch.no_grad():  # a loss call still returns the loss
        torch.testing.assert_close(pmodel(x, y), serial(x, y), **TOL)
    out = pmodel(x)  # grad mode: a backward through the outputs says what to do
    assert out.requires_grad
    with pytest.raises(PipelineLossError, match="forwards only") as info:
        out.sum().backward()
    assert "loss inside forward" in (info.value.hint or "")
    # an input that requires grad (a saliency map in eval()): the forwards keep what its backward
    # needs, and the input gets serial's gradient
    given = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a named schedule runs GPipe's order then: warned once)
        pmodel(given[0])[:, 1].sum().backward()
    serial(given[1])[:, 1].sum().backward()
    torch.testing.assert_close(given[0].grad, given[1].grad, **TOL)


class LogitsOnly(nn.Module):
    """A plain model whose forward returns logits and a hidden state (a tuple), never a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.inp(x))
        return self.head(torch.relu(self.mid(h))), h


def _logits_only(rank: int, world: int, transport: LockstepTransport | None = None) -> None:
    torch.manual_seed(1)
    model = LogitsOnly().eval()
    serial = copy.deepcopy(model)
    x = torch.randn(8, 8)
    options = autopar.PipelineOptions(microbatches=4, stage_boundaries=["mid"])
    pmodel = pipelined(model, world, transport, example_inputs=(x,), pipeline=options)
    with torch.no_grad():
        got, hidden = pmodel(x)
        want, want_hidden = serial(x)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(hidden, want_hidden, **TOL)  # made in stage 0, passed to the last


def _llama(rank: int, world: int, transport: LockstepTransport | None = None) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    serial = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=["model.layers.1"])
    pmodel = pipelined(
        model, world, transport, example_kwargs={"input_ids": ids, "labels": ids}, pipeline=options
    )
    pmodel.eval()
    serial.eval()
    with torch.no_grad():
        out = pmodel(input_ids=ids)
        ref = serial(input_ids=ids)
    assert type(out) is type(ref) and out.loss is None and out.past_key_values is None
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    with torch.no_grad():
        labelled = pmodel(input_ids=ids, labels=ids)
    torch.testing.assert_close(labelled.loss, serial(input_ids=ids, labels=ids).loss, **TOL)


@pytest.fixture(scope="module")
def on_two_ranks() -> dict[str, list[None]]:
    """This file's pp=2 jobs, each one's ranks run in this process: each scenario asserts on its
    ranks (each test below checks that its own ran)."""
    scenarios = {
        "1f1b": functools.partial(_classifier, schedule="1f1b"),
        "gpipe": functools.partial(_classifier, schedule="gpipe"),
        "logits_only": _logits_only,
        "llama": _llama,
    }
    return run_scenarios_in_lockstep(2, scenarios)


ON_TWO_RANKS = pytest.mark.xdist_group("pipeline_inference_on_two_ranks")  # one worker runs the fixture once


@ON_TWO_RANKS
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_logits_without_labels_equal_serial(schedule: str, on_two_ranks: dict[str, list[None]]) -> None:
    assert on_two_ranks[schedule] == [None, None]


@pytest.mark.multirank
def test_logits_with_tensor_axes_in_each_stage() -> None:
    """pp=2 x tp=2 with zero-bubble: each stage a parallel module on its sub-mesh."""
    run_ranks(4, _classifier, "zero-bubble", timeout=180)


@ON_TWO_RANKS
def test_a_model_without_a_loss_pipelines_its_outputs(on_two_ranks: dict[str, list[None]]) -> None:
    assert on_two_ranks["logits_only"] == [None, None]


@ON_TWO_RANKS
def test_transformers_model_without_labels_returns_its_model_output(on_two_ranks: dict[str, list[None]]) -> None:
    assert on_two_ranks["llama"] == [None, None]


def test_outputs_without_the_batch_on_dim_0_are_refused() -> None:
    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).t()

    x = torch.randn(6, 4)
    with pytest.raises(PipelineLossError, match="cannot be put back") as info:
        split_stages(Pooled(), [x], (x,), [], 1)
    assert "dim 0" in (info.value.hint or "")
