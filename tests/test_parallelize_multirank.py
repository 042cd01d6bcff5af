"""End to end: parallelized GPT and MLP against the serial model.

On real gloo ranks, one forked job on 2x2x2 runs both models (a one-block GPT) through the runtime (DTensor
parameters, AdamW on them, names, state_dict): loss, every parameter gradient (gathered from its
DTensor) and every parameter after three AdamW steps must match the serial model run in the same
process. A 1-rank mesh must match bit for bit. The programs over-decomposed into two batch chunks
(one graph running both: nothing of the runtime changes) take the same three steps with the same
numbers checked, every rank's program run in lockstep in one process; so do the other meshes (8,
2x4, 2x2x2x1) and the search with split fused linears.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from multirank import run_ranks, run_scenarios
from pass_fixtures import assert_compiled_matches_serial, compile_every_rank, lockstep_step, train_in_lockstep
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler.driver import Compiled
from autopar.testing import assemble
from examples.models import MLP, make_gpt, make_mlp

STEPS = 3
NAMES = {1: ("x",), 2: ("x", "y"), 3: ("x", "y", "z"), 4: ("dp", "x", "y", "z")}
MAKERS = {"gpt": make_gpt, "mlp": make_mlp}
# The gloo jobs' GPT has one block: what they check (the runtime around the programs: DTensor
# parameters, optimizer steps on them, names, state_dict, outputs, clipping, checkpoints, tied
# weights) is the same at any depth, and every rank traces and compiles each GPT itself, so a
# block fewer is ~40 % of their CPU. The lockstep tests below keep the two-block GPT.
RANK_GPT = functools.partial(make_gpt, n_layer=1)
RANK_MAKERS = {**MAKERS, "gpt": RANK_GPT}



def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole: DTensors gathered; DDP's plan (every tensor whole on every
    rank, as on a one-rank mesh) stores plain tensors."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t

def _train(
    model_name: str,
    mesh: Any,
    exact: bool,
    planner: str = "greedy",
    chunks: int = 1,
    split_fused: bool = False,
) -> dict[str, Any]:
    model, batch = RANK_MAKERS[model_name](0)
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(
        model,
        mesh,
        example_inputs=batch,
        planning=autopar.PlanOptions(planner=planner, over_decompose=chunks, split_fused=split_fused),
    )
    result_parts = len(pmodel.program.param_parts)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=1e-3)
    serial_params = dict(serial.named_parameters())
    result: dict[str, Any] = {
        "losses": [],
        "grad_err": 0.0,
        "param_err": 0.0,
        "bitwise": True,
        "parts": result_parts,
    }
    for step in range(STEPS):
        batch = RANK_MAKERS[model_name](0)[1] if step == 0 else _next_batch(model_name, step)
        loss = pmodel(*batch)
        serial_loss = serial(*batch)
        loss.backward()
        serial_loss.backward()
        result["losses"].append((float(loss), float(serial_loss)))
        result["bitwise"] &= bool(torch.equal(loss.detach(), serial_loss.detach()))
        for name, p in pmodel.named_parameters():
            grad = _whole(p.grad)
            want = serial_params[name].grad
            assert grad.shape == want.shape, name
            result["grad_err"] = max(result["grad_err"], _rel_err(grad, want))
            result["bitwise"] &= bool(torch.equal(grad, want))
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    for name, p in pmodel.named_parameters():
        full = _whole(p)
        result["param_err"] = max(result["param_err"], float((full - serial_params[name]).abs().max()))
        result["bitwise"] &= bool(torch.equal(full, serial_params[name].detach()))
    names = [n for n, _ in pmodel.named_parameters()]
    result["names_match"] = names == [n for n, _ in serial.named_parameters()]
    result["state_dict_keys_match"] = list(pmodel.state_dict()) == list(serial.state_dict())
    result["local_fraction"] = sum(_local(p).numel() for p in pmodel.parameters()) / sum(
        p.numel() for p in serial.parameters()
    )
    return result


def _next_batch(model_name: str, step: int) -> tuple[torch.Tensor, ...]:
    _, batch = MAKERS[model_name](100 + step)
    return batch


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (want.abs().max() + 1e-6))


def _job(
    rank: int,
    world_size: int,
    shape: tuple[int, ...],
    models: tuple[str, ...],
    planner: str = "greedy",
    chunks: int = 1,
    split_fused: bool = False,
) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES[len(shape)])
    return {
        name: _train(
            name, mesh, exact=world_size == 1, planner=planner, chunks=chunks, split_fused=split_fused
        )
        for name in models
    }


class MLPWithLogits(MLP):
    """Returns the logits too: a non-scalar output comes back as a DTensor."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))
        return F.cross_entropy(logits, y), logits


class MLPWithDropout(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = self.drop(F.gelu(self.fc1(x)))
        return F.cross_entropy(self.head(self.drop(F.gelu(self.fc2(hidden)))), y)


def _api_job(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    """DTensor outputs, clip_grad_norm_, distributed checkpoint and tied weights, on a 2x2x2 mesh."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("x", "y", "z"))
    out: dict[str, Any] = {}

    torch.manual_seed(0)
    model = MLPWithLogits()
    serial = copy.deepcopy(model)
    _, batch = make_mlp(1)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    loss, logits = pmodel(*batch)
    serial_loss, serial_logits = serial(*batch)
    out["logits_is_dtensor"] = isinstance(logits, DTensor) and tuple(logits.shape) == tuple(
        serial_logits.shape
    )
    out["logits_err"] = float((logits.full_tensor() - serial_logits).abs().max())
    (loss + logits.full_tensor().square().mean()).backward()
    (serial_loss + serial_logits.square().mean()).backward()
    serial_params = dict(serial.named_parameters())
    out["two_output_grad_err"] = max(
        _rel_err(p.grad.full_tensor(), serial_params[n].grad) for n, p in pmodel.named_parameters()
    )
    norm = torch.nn.utils.clip_grad_norm_(pmodel.parameters(), 0.01)
    serial_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.01)
    out["norm"] = (float(norm.full_tensor() if isinstance(norm, DTensor) else norm), float(serial_norm))
    out["clipped_grad_err"] = max(
        _rel_err(p.grad.full_tensor(), serial_params[n].grad) for n, p in pmodel.named_parameters()
    )

    gpt, gpt_batch = RANK_GPT(0)
    pgpt = autopar.parallelize(gpt, mesh, example_inputs=gpt_batch)
    out["tied"] = pgpt.get_parameter("lm_head.weight") is pgpt.get_parameter("wte.weight")
    opt = torch.optim.AdamW(pgpt.parameters(), lr=1e-3)
    pgpt(*gpt_batch).backward()
    opt.step()
    out["still_tied"] = pgpt.get_parameter("lm_head.weight") is pgpt.get_parameter("wte.weight")
    dcp.save(pgpt.state_dict(), checkpoint_id=checkpoint_dir)
    fresh, _ = RANK_GPT(7)  # other weights, same shapes
    pfresh = autopar.parallelize(fresh, mesh, example_inputs=gpt_batch)
    state = pfresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    saved = pgpt.state_dict()
    out["checkpoint_err"] = max(
        float((state[k].full_tensor() - saved[k].full_tensor()).abs().max()) for k in saved
    )
    out["checkpoint_loss"] = (float(pfresh(*gpt_batch)), float(pgpt(*gpt_batch)))
    return out


@pytest.fixture(scope="module")
def on_eight_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The two gloo jobs below on 2x2x2, run in one forked job (each test checks its own)."""
    checkpoint_dir = str(tmp_path_factory.mktemp("api") / "ckpt")
    scenarios = {
        "api": functools.partial(_api_job, checkpoint_dir=checkpoint_dir),
        "train": functools.partial(_job, shape=(2, 2, 2), models=("gpt", "mlp")),
    }
    return run_scenarios(8, scenarios, timeout=1200)


@pytest.mark.multirank
def test_api_outputs_clipping_checkpoint_and_tied_weights(on_eight_ranks: dict[str, list[Any]]) -> None:
    results = on_eight_ranks["api"]
    for rank, r in enumerate(results):
        assert r["logits_is_dtensor"], rank
        assert r["logits_err"] < 1e-5, (rank, r["logits_err"])
        assert r["two_output_grad_err"] < 1e-4, (rank, r["two_output_grad_err"])
        assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-5), (rank, r["norm"])
        assert r["clipped_grad_err"] < 1e-4, (rank, r["clipped_grad_err"])
        assert r["tied"] and r["still_tied"], rank
        assert r["checkpoint_err"] == 0.0, (rank, r["checkpoint_err"])
        assert r["checkpoint_loss"][0] == r["checkpoint_loss"][1], (rank, r["checkpoint_loss"])


def test_sharded_dropout_draws_the_serial_models_masks_in_lockstep() -> None:
    """With the same seed, every rank's program on 2x2x2 draws the serial model's dropout masks:
    same loss on every rank and the same gradients. (That a call through the runtime starts the
    program at the caller's seed is checked on gloo ranks with transformers' GPT-2 at its dropout
    defaults, tests/test_hf_multirank.py.)"""
    shape = (2, 2, 2)
    torch.manual_seed(0)
    model = MLPWithDropout()
    _, batch = make_mlp(2)
    compiled = compile_every_rank(model, shape, batch)
    fwd, bwd = lockstep_step(compiled, model, shape, batch, {})  # each rank's generator at seed 0
    torch.manual_seed(0)
    serial_loss = model(*batch)
    serial_loss.backward()
    first = next(iter(compiled.values())).program
    assert not first.output_layouts[0].partial_axes(), first.output_layouts[0]  # every rank's loss whole
    for coords, outputs in fwd.items():
        assert float(outputs[0]) == pytest.approx(float(serial_loss), rel=1e-6), coords
    params = dict(model.named_parameters())
    grad_err = 0.0
    for i, (name, layout) in enumerate(zip(first.param_names, first.param_layouts, strict=True)):
        grad = assemble({c: bwd[c][i] for c in compiled}, layout, shape, atol=1e-4, rtol=1e-4)
        want = params[name].grad
        assert want is not None, name
        grad_err = max(grad_err, _rel_err(grad, want))
    assert len(first.param_names) == len(params)
    assert grad_err < 1e-5, grad_err


@pytest.mark.multirank
def test_matches_serial_on_eight_ranks(on_eight_ranks: dict[str, list[Any]]) -> None:
    """Real gloo ranks: the runtime (DTensor parameters, AdamW on them, names, state_dict) around
    the programs."""
    results = on_eight_ranks["train"]
    for rank, per_model in enumerate(results):
        for name, r in per_model.items():
            assert r["parts"] == 0, (rank, name, r["parts"])
            _assert_trained_like_serial(r, (rank, name))
            assert r["names_match"] and r["state_dict_keys_match"], (rank, name)
            # each rank stores ~1/8 of the weights (small vectors may stay replicated on an axis)
            assert r["local_fraction"] == pytest.approx(1 / 8, rel=0.02), (rank, name, r["local_fraction"])


def _assert_trained_like_serial(r: dict[str, Any], where: Any) -> None:
    """Three AdamW steps: each step's loss, the worst gradient and the parameters after, as serial."""
    for loss, serial_loss in r["losses"]:
        assert loss == pytest.approx(serial_loss, rel=1e-5, abs=1e-6), where
    assert r["grad_err"] < 1e-4, (where, r["grad_err"])
    assert r["param_err"] < 1e-5, (where, r["param_err"])


@pytest.mark.parametrize(("name", "chunks"), [("gpt", 2), ("mlp", 2)])
def test_over_decomposed_programs_train_like_serial_in_lockstep(name: str, chunks: int) -> None:
    """2x2x2 as the gloo test runs it, each rank's batch as two chunks in one program: three AdamW
    steps, every rank's loss, the worst gradient and every parameter after, with the gloo test's
    tolerances."""
    shape = (2, 2, 2)
    model, batch = MAKERS[name](0)
    batches = [batch, *(_next_batch(name, step) for step in range(1, STEPS))]
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)
    r = train_in_lockstep(model, shape, batches, adamw, planner="greedy", over_decompose=chunks)
    _assert_trained_like_serial(r, name)
    for coords, comp in r["compiled"].items():
        assert comp.chunks == chunks and len(comp.program.param_parts) == 0, coords
        # each rank stores ~1/8 of the weights (small vectors may stay replicated on an axis)
        fraction = _stored_fraction(comp, model, shape)
        assert fraction == pytest.approx(1 / 8, rel=0.02), (coords, fraction)


def _stored_fraction(compiled: Compiled, model: torch.nn.Module, shape: tuple[int, ...]) -> float:
    """The share of the model's weights the rank stores: its blocks by the program's storage
    layouts (a fused parameter's parts share one), as the runtime's DTensors hold them."""
    layouts = compiled.program.source_layouts()
    params = dict(model.named_parameters())
    assert set(params) <= set(layouts), sorted(set(params) - set(layouts))
    stored = sum(math.prod(layouts[n].local_shape(shape, compiled.program.coords)) for n in params)
    return stored / sum(p.numel() for p in params.values())


@pytest.mark.parametrize(
    ("shape", "planner", "split_fused"),
    [
        ((8,), "greedy", False),
        ((2, 4), "greedy", False),
        ((2, 2, 2, 1), "greedy", False),
        ((2, 2, 2), "search", True),
    ],
    ids=["8", "2x4", "2x2x2x1", "2x2x2-search-split-fused"],
)
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_programs_match_serial_on_other_meshes_in_lockstep(
    name: str, shape: tuple[int, ...], planner: str, split_fused: bool
) -> None:
    """Every rank's program in one process, the meshes and options the gloo test above leaves out:
    three AdamW steps, each one's loss, outputs and every gradient against serial, and what each
    rank stores."""
    model, batch = MAKERS[name](0)
    compiled = compile_every_rank(model, shape, batch, planner=planner, split_fused=split_fused)
    for coords, comp in compiled.items():
        # split_fused: the GPT's two fused qkv linears (weight and bias) run as three parts each
        parts = len(comp.program.param_parts)
        assert parts == (12 if split_fused and name == "gpt" else 0), (coords, parts)
        # each rank stores ~1/8 of the weights (small vectors may stay replicated on an axis;
        # a fused bias cut into parts keeps its one dim whole: the GPT's qkv biases replicate)
        fraction = _stored_fraction(comp, model, shape)
        assert fraction == pytest.approx(1 / 8, rel=0.06 if split_fused else 0.02), (coords, fraction)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        if step:
            batch = _next_batch(name, step)
        # the serial call inside leaves its gradients on the model: the serial update of this step
        assert_compiled_matches_serial(compiled, model, shape, batch)
        opt.step()
        opt.zero_grad()


@pytest.mark.multirank
def test_one_rank_mesh_is_bitwise_serial() -> None:
    (per_model,) = run_ranks(1, _job, (1,), ("gpt", "mlp"), timeout=300)
    for name, r in per_model.items():
        assert r["bitwise"], (name, r)
