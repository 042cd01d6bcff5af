"""A loss computed outside a pipelined model (docs/pipeline.md#a-loss-outside-the-model), the loop
of timm, torchvision and diffusers: `loss = F.cross_entropy(pmodel(x), y); loss.backward()`. Losses,
every gradient and the parameters after SGD-momentum steps equal serial's on pp=2 (every rank run
in this process, `autopar.testing.pipeline_lockstep`) and on pp=2 x tp=2 gloo ranks, dropout
included; gradient accumulation over two calls; two calls' outputs under one backward; an input
that requires grad; a second backward through one call's outputs refused."""

from __future__ import annotations

import copy
import functools
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import pipelined, run_ranks, run_scenarios_in_lockstep
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.core.pipeline_schedule import Placement, forwards_then_backwards, one_f_one_b
from autopar.runtime.pipeline_runtime import PipelineRuntimeError, StageRunner, TensorSpec, start_step
from autopar.testing.pipeline_lockstep import LockstepTransport
from examples.models import GPT, GPTConfig

TOL = {"rtol": 1e-4, "atol": 1e-6}
ORDER_WARNING = "GPipe's order"


class SmallConvNet(nn.Module):
    """A torchvision-style classifier: convolutions with residuals, pooling, dropout, a linear head
    returning logits (the loss is the training loop's)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        for block in self.blocks:
            h = h + F.relu(block(h))
        return self.head(self.drop(h.mean(dim=(2, 3))))


class Denoiser(nn.Module):
    """A diffusers-style noise predictor: the noisy sample and its timestep in, the predicted noise
    out; the training loop computes `F.mse_loss(pred, noise)`."""

    def __init__(self) -> None:
        super().__init__()
        self.time = nn.Linear(1, 16)
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 8)

    def forward(self, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.inp(noisy) + F.silu(self.time(t[:, None]))
        for layer in self.layers:
            h = h + F.silu(layer(h))
        return self.out(h)


class GPTLogits(GPT):
    """The example GPT (embedding and head tied, on the first and the last stage) returning its
    logits; the loop computes the cross entropy."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _token_batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 64, (8, 8), generator=g),), torch.randint(0, 64, (8, 8), generator=g)


def _conv_batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(8, 3, 6, 6, generator=g),), torch.randint(0, 5, (8,), generator=g)


def _noise_batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(8, 8, generator=g), torch.rand(8, generator=g)), torch.randn(8, 8, generator=g)


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def _assert_grads_equal_serial(pmodel: nn.Module, serial: nn.Module) -> None:
    """Every parameter of this rank (at least one) has serial's `.grad`."""
    ref = dict(serial.named_parameters())
    names = [name for name, _ in pmodel.named_parameters()]
    assert names
    for name, p in pmodel.named_parameters():
        torch.testing.assert_close(_grad(p), ref[name].grad, **TOL, msg=name)


def _value(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _train(
    module: nn.Module,
    batch: Callable[[int], tuple[tuple[torch.Tensor, ...], torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    calls: int,
    input_grad: bool,
) -> tuple[list[float], list[dict[str, torch.Tensor]], list[torch.Tensor | None]]:
    """SGD with momentum; each step's batch in `calls` calls, each with its own backward (gradient
    accumulation), the generator seeded alike before each call (dropout's masks are serial's).
    Returns each call's loss, each step's gradients by name and, with `input_grad`, the first
    input's gradient of each step's first call."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    input_grads: list[torch.Tensor | None] = []
    for step in range(steps):
        opt.zero_grad()
        inputs, target = batch(step)
        for call in range(calls):
            rows = slice(call * 8 // calls, (call + 1) * 8 // calls)
            given = [x[rows].clone() for x in inputs]
            if input_grad and call == 0:
                given[0].requires_grad_(True)
            torch.manual_seed(1000 * step + call)
            loss = loss_fn(module(*given), target[rows]) / calls
            loss.backward()
            losses.append(float(loss.detach()))
            if call == 0:
                input_grads.append(given[0].grad)
        grads.append({name: _grad(p).clone() for name, p in module.named_parameters()})
        opt.step()
    return losses, grads, input_grads


def _job(rank: int, world: int, cases: list[dict[str, Any]], transport: LockstepTransport | None = None) -> None:
    for case in cases:
        torch.manual_seed(0)
        make, batch, loss_fn = {
            "conv": (SmallConvNet, _conv_batch, F.cross_entropy),
            "noise": (Denoiser, _noise_batch, F.mse_loss),
            "gpt": (lambda: GPTLogits(GPTConfig(n_layer=3)), _token_batch, _gpt_loss),
        }[case["model"]]
        model: nn.Module = make()
        serial = copy.deepcopy(model)
        options = autopar.PipelineOptions(
            microbatches=case["M"], schedule=case.get("schedule"), stage_boundaries=case["boundaries"],
            virtual_stages=case.get("v", 1),
        )  # fmt: skip
        if world == 4:  # tensor axes beside pp: each stage a parallel module on its sub-mesh
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
            pmodel = autopar.parallelize(model, mesh, example_inputs=batch(0)[0], pipeline=options)
        else:
            pmodel = pipelined(model, world, transport, example_inputs=batch(0)[0], pipeline=options)
        kwargs = {"steps": case.get("steps", 2), "calls": case.get("calls", 1), "input_grad": case.get("input_grad", False)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _train(pmodel, batch, loss_fn, **kwargs)
        order_warnings = [w for w in caught if ORDER_WARNING in str(w.message)]
        assert len(order_warnings) == (1 if case.get("schedule") not in (None, "gpipe") else 0), (case, caught)
        want = _train(serial, batch, loss_fn, **kwargs)
        torch.testing.assert_close(got[0], want[0], **TOL, msg=f"{case} losses")
        for step, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
            assert g.keys() <= w.keys() and g, (case, sorted(g))
            for name, value in g.items():
                torch.testing.assert_close(value, w[name], **TOL, msg=f"{case} step {step} {name}.grad")
        if kwargs["input_grad"]:
            for g_in, w_in in zip(got[2], want[2], strict=True):
                assert g_in is not None and w_in is not None
                torch.testing.assert_close(g_in, w_in, **TOL, msg=f"{case} input grad")
        ref = dict(serial.named_parameters())
        for name, p in pmodel.named_parameters():
            torch.testing.assert_close(_value(p).detach(), ref[name].detach(), **TOL, msg=f"{case} {name}")
        # the module's reports still describe its own schedule (the calls ran GPipe's order)
        assert pmodel.plan_summary().startswith(f"{pmodel.schedule.name}: pp=2")
        where = Path(tempfile.mkdtemp())
        pmodel.write_pipeline_timeline(where)
        assert {p.name for p in where.iterdir()} == {"pipeline.json", "pipeline.png", "pipeline.txt"}
        # one call's outputs take one backward: a second is refused on every rank, before any message
        out = pmodel(*batch(9)[0])
        assert out.requires_grad
        out.sum().backward()
        with pytest.raises(PipelineRuntimeError, match="backward already ran") as info:
            out.sum().backward()
        assert "call the pipelined model again" in (info.value.hint or "")


PP2_CASES: list[dict[str, Any]] = [
    {"model": "conv", "M": 4, "boundaries": ["blocks.1"], "steps": 3, "input_grad": True},
    {"model": "conv", "M": 2, "schedule": "interleaved-1f1b", "v": 2, "calls": 2,
     "boundaries": ["blocks.0", "blocks.1", "blocks.2"]},
    {"model": "noise", "M": 3, "schedule": "gpipe", "boundaries": ["layers.1"]},
    {"model": "gpt", "M": 2, "boundaries": ["blocks.2"]},
]  # fmt: skip


@pytest.fixture(scope="module")
def on_two_ranks() -> dict[str, list[Any]]:
    """This file's pp=2 jobs, each one's ranks run in this process (each test checks its own)."""
    scenarios = {
        "cases": functools.partial(_job, cases=PP2_CASES),
        "llama": _llama_outside,
        "two calls": _two_calls_one_backward,
    }
    return run_scenarios_in_lockstep(2, scenarios)


ON_TWO_RANKS = pytest.mark.xdist_group("pipeline_loss_outside_on_two_ranks")  # one worker runs the fixture once


@ON_TWO_RANKS
def test_loss_outside_the_model_equals_serial(on_two_ranks: dict[str, list[Any]]) -> None:
    """pp=2: the conv net with dropout on the default schedule (1F1B, run in GPipe's order) and an
    input that requires grad, three steps; the same net accumulating two calls per step on
    interleaved 1F1B (4 stages, warned once); the denoiser's mean-squared error on GPipe; the GPT
    whose tied embedding and head sit on the first and the last stage."""
    assert on_two_ranks["cases"] == [None, None]  # each rank asserted every case


@pytest.mark.multirank
def test_loss_outside_the_model_with_tensor_axes_in_each_stage() -> None:
    """pp=2 x tp=2: the denoiser on zero-bubble (run in GPipe's order, whole backwards, gradients
    reduced once per step) accumulating two calls per step."""
    cases = [{"model": "noise", "M": 2, "schedule": "zero-bubble", "boundaries": ["layers.1"], "calls": 2}]
    run_ranks(4, _job, cases, timeout=300)


def _two_calls_one_backward(rank: int, world: int, transport: LockstepTransport | None = None) -> None:
    """Two calls' outputs, one backward of their losses' sum: `.grad` is the sum of both calls'
    gradients, as serial's (each call's pending step runs its backwards from its own outputs')."""
    torch.manual_seed(0)
    model = Denoiser()
    serial = copy.deepcopy(model)
    (x1, t1), n1 = _noise_batch(0)
    (x2, t2), n2 = _noise_batch(1)
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=["layers.1"])
    pmodel = pipelined(model, world, transport, example_inputs=(x1, t1), pipeline=options)
    for module in (pmodel, serial):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the default 1F1B runs GPipe's order: warned once)
            (F.mse_loss(module(x1, t1), n1) + F.mse_loss(module(x2, t2), n2)).backward()
    _assert_grads_equal_serial(pmodel, serial)


@ON_TWO_RANKS
def test_two_calls_outputs_take_one_backward(on_two_ranks: dict[str, list[Any]]) -> None:
    assert on_two_ranks["two calls"] == [None, None]


def _llama_outside(rank: int, world: int, transport: LockstepTransport | None = None) -> None:
    """A transformers causal LM called without labels in training: its `ModelOutput`'s logits carry
    the backward; the loop's own shifted cross entropy trains it equal to serial."""
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
    pmodel = pipelined(model, world, transport, example_kwargs={"input_ids": ids}, pipeline=options)

    def loss_of(module: nn.Module) -> torch.Tensor:
        out = module(input_ids=ids)
        assert type(out).__name__ == "CausalLMOutputWithPast" and out.loss is None
        return F.cross_entropy(out.logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))

    losses = [loss_of(m) for m in (pmodel, serial)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0].detach(), losses[1].detach(), **TOL)
    _assert_grads_equal_serial(pmodel, serial)


@ON_TWO_RANKS
def test_transformers_model_without_labels_trains_from_its_logits(on_two_ranks: dict[str, list[Any]]) -> None:
    assert on_two_ranks["llama"] == [None, None]


def _runners(layers: nn.ModuleList, x: torch.Tensor, microbatches: int) -> dict[int, StageRunner]:
    """Each layer a stage of one rank (adjacent stages pass their values locally, no process)."""
    pieces = torch.tensor_split(x, microbatches)

    def stage(s: int) -> StageRunner:
        def forward(m: int, received: Any) -> list[torch.Tensor]:
            return [torch.tanh(layers[s](pieces[m] if s == 0 else received[0]))]

        def specs(m: int) -> tuple[TensorSpec, ...]:
            return (TensorSpec((pieces[m].shape[0], 4), torch.float32),)

        return StageRunner(index=s, forward=forward, params=tuple(layers[s].parameters()), input_specs=specs, output_specs=specs)

    return {s: stage(s) for s in range(len(layers))}


def test_a_pending_step_runs_its_backwards_from_the_outputs_gradient() -> None:
    """In process, two stages on one rank: the forwards keep what the backwards need; the backwards
    from a loss on the outputs give serial's gradients summed over microbatches (3, 3 and 2 rows),
    once; an order that interleaves forwards and backwards is refused."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    schedule = forwards_then_backwards(Placement(1, 2), 3)
    pending = start_step(schedule, 0, _runners(layers, x, 3), None)
    out = torch.cat([pending.outputs[m][0] for m in range(3)])
    assert not out.requires_grad and not pending.finished
    leaf = out.clone().requires_grad_(True)
    F.mse_loss(leaf, target).backward()
    assert leaf.grad is not None
    result = pending.finish({m: [g] for m, g in enumerate(torch.split(leaf.grad, [3, 3, 2]))})
    serial = copy.deepcopy(layers)
    F.mse_loss(torch.tanh(serial[1](torch.tanh(serial[0](x)))), target).backward()
    torch.testing.assert_close(out, torch.tanh(serial[1](torch.tanh(serial[0](x)))).detach())
    for s in range(2):
        for got, p in zip(result.grads[s], serial[s].parameters(), strict=True):
            torch.testing.assert_close(got, p.grad)
    with pytest.raises(PipelineRuntimeError, match="already ran"):
        pending.finish({})
    with pytest.raises(PipelineRuntimeError, match="interleaves forwards and backwards"):
        start_step(one_f_one_b(1, 3), 0, _runners(layers[:1], x, 3), None)
