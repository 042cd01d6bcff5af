"""A pipeline axis beside tensor axes (docs/pipeline.md#tensor-axes-inside-each-stage): each stage
planned by the tensor search on its sub-mesh, boundary tensors moved as 1/t chunks per rank. Loss,
every gradient and the parameters after two SGD-with-momentum steps equal the serial model's on 8
real gloo ranks; each rank stores its stages' blocks only and sends only its chunk."""

from __future__ import annotations

import copy
import functools
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks, run_scenarios, train_side_by_side
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline_runtime import BoundaryScatter, TensorSpec
from examples.models import make_gpt

TOL = {"rtol": 1e-4, "atol": 1e-6}


def _gpt(n_layer: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A GPT (tied embedding and head) whose ignored targets differ per microbatch: part of sample
    0, all of sample 5, one token of sample 2."""
    model, (idx, targets) = make_gpt(0, batch_size=8, n_layer=n_layer)
    targets = targets.clone()
    targets[0, :5] = -100
    targets[5, :] = -100
    targets[2, 3] = -100
    return model, (idx, targets)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One configuration against serial; what this rank stored and sent."""
    model, batch = _gpt(case["layers"])
    serial = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", case["shape"], mesh_dim_names=case["names"])
    pmodel = autopar.parallelize(
        model,
        mesh,
        example_inputs=batch,
        pipeline=autopar.PipelineOptions(
            microbatches=case["M"],
            schedule=case.get("schedule", "1f1b"),
            stage_boundaries=case.get("boundaries"),
            virtual_stages=case.get("v", 1),
        ),
        # rank 0's dump is what is checked; each other rank would import matplotlib and draw its
        # stages' timelines too, CPU that no check reads (tests/test_dump.py covers a stage's dump)
        debug=autopar.DebugOptions(dump_dir=case.get("dump_dir") if rank == 0 else None),
    )
    if rank == 0 and case.get("dump_dir"):  # the modeled pipeline timeline, beside the stages' dumps
        written = {p.name for p in (Path(case["dump_dir"]) / "rank0").iterdir()}
        assert {"pipeline.json", "pipeline.png", "pipeline.txt"} <= written, written
        trace = json.loads((Path(case["dump_dir"]) / "rank0" / "pipeline.json").read_text())
        rows = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
        assert len(rows) == case["shape"][0], rows  # one row per pipeline rank
    sent: list[int] = []
    deferred: list[int] = []
    isend, weight_gradients = dist.isend, ParallelModule.weight_gradients

    def counting_isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(tensor.numel())
        return isend(tensor, *args, **kwargs)

    def counting_weights(module: ParallelModule, deferral: Any, params: Any) -> Any:
        deferred.append(len(deferral.pending))  # weight parts kept since their input parts ran
        return weight_gradients(module, deferral, params)

    dist.isend = counting_isend  # type: ignore[assignment]  # this rank's process only
    ParallelModule.weight_gradients = counting_weights  # type: ignore[method-assign]
    try:
        losses = train_side_by_side([(pmodel, batch), (serial, batch)], steps=2)
    finally:
        dist.isend = isend  # type: ignore[assignment]
        ParallelModule.weight_gradients = weight_gradients  # type: ignore[method-assign]
    if pmodel.schedule.split_backward:  # every backward ran as I, then W from what I kept
        assert deferred == [1] * (2 * case["M"] * len(pmodel.stages)), deferred
    else:
        assert not deferred
    for step in range(2):
        torch.testing.assert_close(losses[2 * step], losses[2 * step + 1], **TOL)
    ref = dict(serial.named_parameters())
    stored = 0
    names = []
    for name, p in pmodel.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(_whole(p.grad), ref[name].grad, **TOL, msg=f"{case} grad {name}")
        torch.testing.assert_close(_whole(p.detach()), ref[name].detach(), **TOL, msg=f"{case} param {name}")
        stored += p.to_local().numel()
        names.append(name)
    total = pmodel.clip_grad_norm_(1e9)  # the serial model's norm, a tied weight counted once
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(serial.parameters(), 1e9), **TOL)
    width = dict(model.named_parameters())["wte.weight"].shape[1]
    hidden = batch[0].shape[1] * width  # one sample's activation, whole
    return {"names": names, "stored": stored, "sent": sent, "hidden": hidden}


def _job(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_compare(rank, world, case) for case in cases]


def _check_storage_and_messages(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    for i, case in enumerate(cases):
        model, _ = _gpt(case["layers"])
        total = sum(p.numel() for p in model.parameters())
        held = {name for rank in results for name in rank[i]["names"]}
        assert held == {n for n, _ in model.named_parameters()}
        stored = sum(rank[i]["stored"] for rank in results)
        # every weight is stored once per slice-coordinate at most: about total, far below world * total
        assert stored < 2 * total, (stored, total)
        t = math.prod(case["shape"]) // case["shape"][case["names"].index("pp")]
        for rank in results:
            microbatch = 8 // case["M"]
            whole = microbatch * rank[i]["hidden"]
            # a boundary message is one rank's chunk of an activation: 1/t of it, never the whole
            assert rank[i]["sent"], "a pipeline rank sends"
            assert max(rank[i]["sent"]) <= -(-(whole + (8 % case["M"] > 0) * rank[i]["hidden"]) // t)


FOUR = ["blocks.1", "blocks.2", "blocks.3"]


# pp=2 x (2,2): 1F1B on 3 layers with the cost model's cut (uneven depth) and M = 6 (microbatches of
# 2 and 1 samples: each stage's second program reads some weights in another layout than the first,
# relaid from the stored ones, and its backward returns no weight gradient, left to the step's
# reduction); interleaved 1F1B with two virtual stages per rank and M = p; zero-bubble ZB-V (v=2:
# the first and last stage on rank 0, so the tied embedding and head are two copies on one rank).
_PP2 = {"shape": (2, 2, 2), "names": ("pp", "x", "y")}
PP2_BY_2X2: list[dict[str, Any]] = [
    {**_PP2, "layers": 3, "M": 6},
    {**_PP2, "layers": 4, "M": 2, "schedule": "interleaved-1f1b", "v": 2, "boundaries": FOUR},
    {**_PP2, "layers": 4, "M": 4, "schedule": "zero-bubble", "v": 2, "boundaries": FOUR},
]
# pp=4 x 2: zero-bubble ZB-H1 with M = 6 (not a multiple of p; microbatches of 2 and 1 samples, one
# with every target ignored: two microbatch shapes, so every stage compiles a second program, and
# splits each backward into its input and weight parts). One case on 8 ranks: 1F1B at pp=4 with
# M = 6 runs in this process (test_pipeline_runtime's `test_pp4_microbatch_counts`), 1F1B with
# tensor axes in each stage is PP2_BY_2X2's first case, and ZB-H1 at pp=4 also runs on 1-rank stage
# meshes (test_pipeline_runtime's `test_pp4_zero_bubble_on_gloo_ranks`).
_PP4 = {"shape": (4, 2), "names": ("pp", "tp")}
PP4_BY_2: list[dict[str, Any]] = [
    {**_PP4, "layers": 4, "M": 6, "schedule": "zero-bubble", "boundaries": FOUR},
]


@pytest.fixture(scope="module")
def on_eight_ranks() -> dict[str, list[Any]]:
    """The two 8-rank meshes' cases, run in one forked job (each test checks its own)."""
    first = [{**PP2_BY_2X2[0], "dump_dir": tempfile.mkdtemp()}, *PP2_BY_2X2[1:]]
    scenarios = {"pp2x2x2": functools.partial(_job, cases=first), "pp4x2": functools.partial(_job, cases=PP4_BY_2)}
    return run_scenarios(8, scenarios, timeout=1000)


@pytest.mark.multirank
def test_pp2_by_2x2_chosen_cut_interleaved_and_zero_bubble_v(on_eight_ranks: dict[str, list[Any]]) -> None:
    """pp=2 x (2,2): the cases of PP2_BY_2X2."""
    _check_storage_and_messages(on_eight_ranks["pp2x2x2"], PP2_BY_2X2)


@pytest.mark.multirank
def test_pp4_by_2_uneven_microbatches_and_zero_bubble(on_eight_ranks: dict[str, list[Any]]) -> None:
    """pp=4 x 2: the cases of PP4_BY_2."""
    _check_storage_and_messages(on_eight_ranks["pp4x2"], PP4_BY_2)


def test_boundary_chunks_cover_the_tensor() -> None:
    """In process: the chunks of every rank, concatenated, are the flattened tensor (zero-padded to a
    multiple of the slice size), for sizes that do and do not divide."""
    for numel, size in [(12, 4), (13, 4), (3, 4), (7, 1)]:
        t = torch.arange(float(numel)).reshape(-1, 1)
        spec = TensorSpec(tuple(t.shape), t.dtype)
        pieces = [BoundaryScatter(None, size, i).chunk(t) for i in range(size)]  # type: ignore[arg-type]
        assert all(p.numel() == BoundaryScatter(None, size, 0).chunk_numel(spec) for p in pieces)  # type: ignore[arg-type]
        joined = torch.cat(pieces)
        assert torch.equal(joined[:numel], t.reshape(-1))
        assert torch.equal(joined[numel:], torch.zeros(joined.numel() - numel))


def _auto_depth(rank: int, world: int) -> dict[str, Any]:
    """mesh_shape="auto" with microbatches: pipeline depths compete with the tensor-only meshes."""
    model, batch = _gpt(4)
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(
        model,
        world,
        example_inputs=batch,
        mesh_shape="auto",
        planning=autopar.PlanOptions(hardware="h100-nvlink-ib"),
        pipeline=autopar.PipelineOptions(microbatches=4),
    )
    choice = pmodel.mesh_choice
    losses = train_side_by_side([(pmodel, batch), (serial, batch)], steps=2)
    for step in range(2):
        torch.testing.assert_close(losses[2 * step], losses[2 * step + 1], **TOL)
    ref = dict(serial.named_parameters())
    for name, p in pmodel.named_parameters():
        torch.testing.assert_close(_whole(p.grad), ref[name].grad, **TOL, msg=f"grad {name}")
    return {
        "pipelined": isinstance(pmodel, autopar.api.PipelinedModule),
        "schedule": getattr(pmodel, "schedule", None) and pmodel.schedule.name,
        "choice": choice,
    }


@pytest.mark.multirank
def test_mesh_shape_auto_weighs_pipeline_depths() -> None:
    """The chosen candidate is the fastest modeled one that fits (a toy GPT on the H100 table: a
    pipeline of one rank per stage, whose sends cost less than the tensor mesh's collectives), every
    depth dividing the world and every schedule is in the table, and the module built on the chosen
    mesh trains equal to serial."""
    results = run_ranks(4, _auto_depth, timeout=500)
    choice = results[0]["choice"]
    priced = [c for c in choice.candidates if not c.error]
    assert {c.pp for c in priced} == {1, 2, 4}
    assert choice.chosen.step_time == min(c.step_time for c in priced if c.fits)
    assert {(c.schedule, c.v) for c in priced if c.pp == 2} >= {("1f1b", 1), ("zero-bubble", 1), ("gpipe", 1)}
    best = choice.chosen
    assert all(r["pipelined"] == (best.pp > 1) for r in results)
    if best.pp > 1:
        assert all(r["schedule"].startswith(best.schedule) for r in results)
    print(choice.table())


def _hf(rank: int, world: int, which: str, shape: tuple[int, ...], names: tuple[str, ...]) -> list[float]:
    """A transformers model called as its docs call it: `out = model(input_ids=..., attention_mask=...,
    labels=...)`, `out.loss.backward()`, with its default config (caches on)."""
    from examples.hf_models import MAKERS

    wrapped, (ids, labels) = MAKERS[which](0, n_layer=2)
    model = wrapped.model  # the *ForCausalLM itself
    serial = copy.deepcopy(model)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(), example_kwargs=batch, pipeline=autopar.PipelineOptions(microbatches=2)
    )  # fmt: skip
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pmodel, serial)]
    losses = []
    for _ in range(2):
        for module, opt in zip((pmodel, serial), optimizers, strict=True):
            out = module(**batch)
            assert type(out).__name__.startswith("CausalLMOutput"), type(out)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss.detach()))
    ref = dict(serial.named_parameters())
    for name, p in pmodel.named_parameters():
        torch.testing.assert_close(_whole(p.detach()), ref[name].detach(), **TOL, msg=f"{which} param {name}")
    return losses


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("which", "shape", "names"),
    [("hf_gpt2", (2, 2), ("pp", "tp")), ("hf_llama", (2,), ("pp",))],
)
def test_transformers_models_in_a_pipeline(which: str, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    """GPT2LMHeadModel (tied head; its own ops around the blocks: the logits slice and the loss)
    and LlamaForCausalLM (rotary tables and causal mask at the model level, recomputed per stage),
    with keyword inputs, returning their `ModelOutput` (its loss set: the logits and the cache stay
    on the last stage); parameters after two SGD steps equal serial."""
    pytest.importorskip("transformers")
    for losses in run_ranks(math.prod(shape), _hf, which, shape, names, timeout=300):
        for step in range(2):
            torch.testing.assert_close(losses[2 * step], losses[2 * step + 1], **TOL)


class OptionalShift(torch.nn.Module):
    """Reads its `default_shift` buffer only when the `shift` argument is missing (as BERT reads its
    `token_type_ids` buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("default_shift", torch.ones(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        h = self.layers[0](x + (self.default_shift if shift is None else shift))
        return torch.nn.functional.mse_loss(self.layers[1](torch.tanh(h)), y)


def _other_arguments(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = OptionalShift()
    x, y, shift = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=(x, y), example_kwargs={"shift": shift},
        pipeline=autopar.PipelineOptions(microbatches=2, stage_boundaries=["layers.1"]),
    )  # fmt: skip
    pmodel(x, y, shift=shift).backward()
    try:
        pmodel(x, y)  # now stage 0 reads the buffer its parallel module does not hold
    except autopar.AutoparError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.multirank
def test_a_call_reading_other_tensors_is_refused_on_every_rank() -> None:
    """Every rank raises the same `PipelineSplitError` before any message (none waits for another),
    naming the stage and the tensor."""
    results = run_ranks(4, _other_arguments, timeout=200)
    assert all(r.startswith("PipelineSplitError: stage 0 reads ['default_shift']") for r in results), results
