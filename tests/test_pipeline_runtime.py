"""The pipeline axis alone (autopar.compiler.pipeline): loss, every gradient and the parameters after
two SGD-with-momentum steps equal the serial model's, every rank run in one process round-robin
(`autopar.testing.pipeline_lockstep`), and on real gloo ranks for one schedule of each family
(1F1B, interleaved, zero-bubble) and what only processes show (gloo's tag matching); the loss
weights and the schedules the runtime refuses, in process. See
docs/pipeline.md#runtime-pipeline-axis-alone."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multirank import run_ranks, run_scenarios, train_side_by_side
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler.pipeline import split_microbatches
from autopar.compiler.pipeline_entry import pipeline_parallelize
from autopar.compiler.pipeline_split import PipelineLossError, loss_weights, split_stages
from autopar.core.pipeline_schedule import ActionKind, schedule_by_name
from autopar.runtime.pipeline_runtime import UnsupportedScheduleError, check_supported, message_tag
from autopar.testing.pipeline_lockstep import LockstepTransport, parallelize_in_lockstep, run_round_robin
from examples.models import make_gpt, make_mlp

TOL = {"rtol": 1e-4, "atol": 1e-6}


def _gpt(n_layer: int, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A GPT (tied embedding and head) whose targets ignore some tokens, unevenly: part of sample
    0, all of sample 5 (a microbatch of its own when M = 6 on 8 samples: its count is 0)."""
    model, (idx, targets) = make_gpt(0, batch_size=batch, n_layer=n_layer)
    targets = targets.clone()
    targets[0, :5] = -100
    targets[5, :] = -100
    targets[2, 3] = -100
    return model, (idx, targets)


class SkipNet(torch.nn.Module):
    """A value made by the first stage and read by the last (it passes through the stages between)
    and a mask made from the input alone, read by every layer (each stage computes it itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = (x.sum(-1, keepdim=True) > 0).float()
        h0 = self.inp(x)
        h = h0
        for layer in self.layers:
            h = torch.tanh(layer(h)) * mask + h
        return F.mse_loss(self.head(h + h0), y)


def _model(case: dict[str, Any]) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    if case.get("model") == "skip":
        torch.manual_seed(0)
        return SkipNet(), (torch.randn(8, 8), torch.randn(8, 4))
    return _gpt(case["layers"], 8)


def _on_gloo(world: int) -> Any:
    """How a gloo rank parallelizes: the public entry (a ("pp",) mesh is a pipeline)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))

    def make(model: torch.nn.Module, batch: tuple[Any, ...], **pipeline: Any) -> Any:
        return autopar.parallelize(model, mesh, example_inputs=batch, pipeline=autopar.PipelineOptions(**pipeline))

    return make


def _compare(rank: int, world: int, case: dict[str, Any], make: Any = None) -> list[str]:
    """One configuration against serial: 2 steps, losses, last gradients, parameters. `make`:
    how this rank parallelizes (default: on its gloo mesh)."""
    model, batch = _model(case)
    serial = copy.deepcopy(model)
    pmodel = (make or _on_gloo(world))(
        model,
        batch,
        microbatches=case["M"],
        schedule=case.get("schedule", "1f1b"),
        stage_boundaries=case.get("boundaries"),
        virtual_stages=case.get("v", 1),
    )
    if case.get("boundaries") is None:  # the cost model's cut, the same on every rank
        assert pmodel.stage_cut is not None and pmodel.boundaries == pmodel.stage_cut.boundaries
    losses = train_side_by_side([(pmodel, batch), (serial, batch)], steps=2)
    assert len(set(pmodel.stages)) == pmodel.schedule.v
    if case.get("schedule") == "auto":  # the fastest modeled candidate that fits was run
        choice = pmodel.schedule_choice
        assert choice is not None and len(choice.candidates) == 5, choice
        fitting = [c.step_time for c in choice.candidates if c.fits and not c.skipped]
        assert choice.chosen.step_time == min(fitting)
        assert (choice.chosen.v, pmodel.stage_cut.step_time) == (pmodel.schedule.v, choice.chosen.step_time)
        assert pmodel.schedule.name.startswith(choice.chosen.schedule)
    else:
        assert pmodel.schedule_choice is None
    report = pmodel.timeline_report  # the modeled step: the cut's when chosen, else unit times
    assert (report.pp, report.virtual_stages, report.microbatches) == (world, case.get("v", 1), case["M"])
    assert report.ideal_ratio == pytest.approx((world - 1) / (case.get("v", 1) * case["M"]))
    if pmodel.stage_cut is not None:
        assert report.step_time == pytest.approx(pmodel.stage_cut.makespan)
        assert report.bubble_fraction == pytest.approx(pmodel.stage_cut.bubble)
    for step in range(2):
        torch.testing.assert_close(losses[2 * step], losses[2 * step + 1], **TOL)
    ref = dict(serial.named_parameters())
    names = []
    for name, p in pmodel.named_parameters():
        assert p.grad is not None, name
        # zero-bubble compiles every stage (on a 1-rank sub-mesh): its parameters are DTensors
        assert isinstance(p, DTensor) == pmodel.schedule.split_backward, name
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        value = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        torch.testing.assert_close(grad, ref[name].grad, **TOL, msg=f"{case} grad {name}")
        torch.testing.assert_close(value, ref[name].detach(), **TOL, msg=f"{case} param {name}")
        names.append(name)
    with torch.no_grad():  # forwards only, on every schedule (zero-bubble's split has no backward here)
        torch.testing.assert_close(pmodel(*batch), serial(*batch), **TOL, msg=f"{case} no_grad")
    # the whole model's gradient norm (torch's own would clip each stage by its stage's norm)
    total = pmodel.clip_grad_norm_(0.01)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.01), **TOL)
    for name, p in pmodel.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, ref[name].grad, **TOL, msg=f"{case} clipped grad {name}")
    return names


def _job(rank: int, world: int, cases: list[dict[str, Any]]) -> list[list[str]]:
    return [_compare(rank, world, case) for case in cases]


def _in_lockstep(world: int, cases: list[dict[str, Any]]) -> list[list[list[str]]]:
    """`_job` for every rank of a `world`-rank pipeline, in this process (`run_round_robin`)."""

    def body(rank: int, transport: LockstepTransport) -> list[list[str]]:
        def make(model: torch.nn.Module, batch: tuple[Any, ...], **pipeline: Any) -> Any:
            return parallelize_in_lockstep(model, transport, batch, pipeline=autopar.PipelineOptions(**pipeline))

        return [_compare(rank, world, case, make) for case in cases]

    return run_round_robin(world, body)


def _every_param_somewhere(results: list[list[list[str]]], cases: list[dict[str, Any]]) -> None:
    for i, case in enumerate(cases):
        held = {name for rank in results for name in rank[i]}
        model, _ = _model(case)
        assert held == {n for n, _ in model.named_parameters()}


# one schedule of each family on gloo ranks; "auto" picks zero-bubble, whose stages are modules
# compiled on process groups (as test_pp4_zero_bubble_on_gloo_ranks's)
PP2_GLOO_CASES: list[dict[str, Any]] = [
    {"layers": 3, "M": 4, "schedule": "1f1b", "boundaries": ["blocks.2"]},
    {
        "layers": 4,
        "M": 4,
        "schedule": "interleaved-1f1b",
        "v": 2,
        "boundaries": ["blocks.1", "blocks.2", "blocks.3"],
    },
    {"layers": 4, "M": 4, "schedule": "auto"},
]
PP2_CASES: list[dict[str, Any]] = [
    {"layers": 3, "M": 3, "schedule": "gpipe", "boundaries": ["blocks.1"]},
    {"layers": 4, "M": 2, "schedule": "1f1b"},
]


@pytest.fixture(scope="module")
def on_two_ranks() -> dict[str, list[Any]]:
    """This file's pp=2 jobs on gloo ranks, run in one forked job (each test checks its own)."""
    scenarios = {"cases": functools.partial(_job, cases=PP2_GLOO_CASES), "accumulate": _accumulate}
    return run_scenarios(2, scenarios, timeout=420)


@pytest.mark.multirank
def test_pp2_1f1b_interleaved_and_auto_on_gloo_ranks(on_two_ranks: dict[str, list[Any]]) -> None:
    """pp=2 on gloo ranks: 1F1B on 3 layers (an uneven cut), interleaved 1F1B (4 stages on 2
    ranks) and schedule="auto" (which runs the fastest modeled candidate, zero-bubble)."""
    results = on_two_ranks["cases"]
    _every_param_somewhere(results, PP2_GLOO_CASES)
    # GPT's tied embedding/head weight: on the first and the last stage's rank
    assert all("wte.weight" in rank[0] for rank in results)


def test_pp2_gpipe_and_the_chosen_cut() -> None:
    """pp=2, every rank in this process: GPipe on 3 layers (an uneven cut), and the cut chosen by
    the cost model (no stage_boundaries)."""
    results = _in_lockstep(2, PP2_CASES)
    _every_param_somewhere(results, PP2_CASES)
    assert all("wte.weight" in rank[0] for rank in results)


def test_pp4_microbatch_counts() -> None:
    """pp=4 on a 4-layer GPT: M = pp, M = 6 (not a multiple: microbatches of 2 and 1 samples, one
    with every target ignored) and M = 2 < pp; a model whose first stage's output skips to the last
    stage, with a mask every stage recomputes from the input (mean-squared error)."""
    bounds = ["blocks.1", "blocks.2", "blocks.3"]
    cases: list[dict[str, Any]] = [{"layers": 4, "M": m, "boundaries": bounds} for m in (4, 6, 2)]
    cases.append({"model": "skip", "M": 4, "boundaries": ["layers.0", "layers.1", "layers.2"]})
    _every_param_somewhere(_in_lockstep(4, cases), cases)


@pytest.mark.multirank
def test_pp4_zero_bubble_on_gloo_ranks() -> None:
    """pp=4, zero-bubble ZB-H1 with M = 6 on gloo ranks: each stage a module compiled on a 1-rank
    sub-mesh, whose backward the runtime splits."""
    cases: list[dict[str, Any]] = [
        {"layers": 4, "M": 6, "boundaries": ["blocks.1", "blocks.2", "blocks.3"], "schedule": "zero-bubble"}
    ]
    _every_param_somewhere(run_ranks(4, _job, cases, timeout=300), cases)


def test_pp8_alone_cost_model_cut() -> None:
    """pp=8 on a 6-layer GPT: eight stages cut by the cost model over its eight units (embeddings,
    blocks, final norm and head priced like the blocks), M = 8."""
    case = {"layers": 6, "M": 8}
    _every_param_somewhere(_in_lockstep(8, [case]), [case])


def test_two_stages_on_one_rank_pass_locally() -> None:
    """pp=1, v=2: adjacent stages on one rank hand activations and gradients over without a
    message, and the tied weight's two uses add up on the rank."""
    case = {"layers": 3, "M": 3, "schedule": "interleaved-1f1b", "v": 2, "boundaries": ["blocks.1"]}
    (names,) = _in_lockstep(1, [case])
    _every_param_somewhere([names], [case])


def _accumulate(rank: int, world: int) -> None:
    """gloo matches a receive to the send with its tag (what the runtime's messages rely on);
    gradient accumulation over two calls, a scaled loss, and a forward under no_grad."""
    if rank == 0:
        works = [dist.isend(torch.tensor([float(tag)]), 1, tag=tag) for tag in (5, 7)]
        for work in works:
            work.wait()
    else:
        got = {tag: torch.zeros(1) for tag in (7, 5)}
        for tag, buf in got.items():  # the opposite order to the sends
            dist.irecv(buf, 0, tag=tag).wait()
        assert {tag: buf.item() for tag, buf in got.items()} == {7: 7.0, 5: 5.0}
    model, batch = _gpt(2, 8)
    serial = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    pmodel = pipeline_parallelize(model, mesh, batch, microbatches=2, stage_boundaries=["blocks.1"])
    half = tuple(t[:4] for t in batch)
    for module in (pmodel, serial):
        (module(*batch) * 2).backward()
        module(*half).backward()  # another microbatch shape: exported once more
    ref = dict(serial.named_parameters())
    for name, p in pmodel.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=name)
    with torch.no_grad():
        loss = pmodel(*batch)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, serial(*batch).detach(), **TOL)


@pytest.mark.multirank
def test_gradient_accumulation_scaling_and_no_grad(on_two_ranks: dict[str, list[Any]]) -> None:
    assert on_two_ranks["accumulate"] == [None, None]


def test_loss_weights_and_sum_rewrite() -> None:
    """In process: per-microbatch counts of non-ignored targets, their weights, and the rewritten
    (summed) loss terms that add up to the serial mean over microbatches of unequal counts."""
    assert loss_weights([3, 0, 5]) == [3 / 8, 0.0, 5 / 8]
    model, (x, y) = make_mlp(0, batch_size=6)
    y = y.clone()
    y[[0, 1, 2]] = -100  # microbatch 0 (samples 0-1): all ignored; microbatch 1: one of two
    pieces = split_microbatches((x, y), 3)
    terms, counts, means = [], [], []
    for mb in pieces:
        program = split_stages(model, list(mb), mb, [], 1)
        counts.append(program.loss.count(list(mb)))
        (stage,) = program.stages
        params = [dict(model.named_parameters(remove_duplicate=False))[a] for a in stage.attrs]
        args = [mb[v] if kind == "input" else params[stage.attrs.index(v)] for kind, v in stage.sources]
        (term,) = stage.module(*args)
        terms.append(term)
        means.append(model(*mb))
    assert counts == [0, 1, 2]
    serial = model(x, y)
    torch.testing.assert_close(sum(terms) / sum(counts), serial)
    weighted = sum(w * m for w, m in zip(loss_weights(counts), means) if w)  # naive mean of means is wrong
    torch.testing.assert_close(weighted, serial)
    assert not torch.allclose(torch.stack(means[1:]).mean(), serial)


def test_message_tags_match_and_are_unique() -> None:
    """Both ends of every message compute its tag alike; no two messages of a step share one."""
    for name, v, m in [("1f1b", 1, 5), ("interleaved-1f1b", 2, 3), ("gpipe", 1, 2)]:
        schedule = schedule_by_name(name, 3, v, m)
        sends: dict[tuple[int, int, int], int] = {}
        recvs: dict[tuple[int, int, int], int] = {}
        for actions in schedule.actions:
            for a in actions:
                for i in range(3):
                    if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                        back = a.kind == ActionKind.SEND_B
                        sends[(back, a.stage, a.microbatch, i)] = message_tag(
                            a.kind, a.stage, a.microbatch, i, schedule
                        )
                    elif a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                        back = a.kind == ActionKind.RECV_B
                        sender = a.stage + 1 if back else a.stage - 1
                        recvs[(back, sender, a.microbatch, i)] = message_tag(
                            a.kind, a.stage, a.microbatch, i, schedule
                        )
        assert sends == recvs and len(set(sends.values())) == len(sends)


def test_refused_schedules_and_losses() -> None:
    with pytest.raises(UnsupportedScheduleError, match="zero-bubble"):
        check_supported(schedule_by_name("zero-bubble", 2, 1, 4))

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.cross_entropy(self.fc(x), y, reduction="none")}

    x, y = torch.randn(4, 4), torch.randint(3, (4,))
    with pytest.raises(PipelineLossError, match="not reduced"):  # named the loss, but per sample
        split_stages(Logits(), [x, y], (x, y), [], 1)
    head = torch.nn.Linear(4, 3)  # logits only: inference, the last stage returns them
    program = split_stages(head, [x], (x,), [], 1)
    assert program.loss is None and program.outputs is not None
    assert [spec.shape for spec in program.outputs.specs] == [(4, 3)]

    class Largest(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).max()

    with pytest.raises(PipelineLossError, match="not a loss") as info:  # 0-d, but no loss to split
        split_stages(Largest(), [x], (x,), [], 1)
    assert "for inference return the outputs" in (info.value.hint or "")
