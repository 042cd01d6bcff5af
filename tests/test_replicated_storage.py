"""Replicated weights (DDP's pattern) as a storage choice of the plan search.

`planning.storage`: a plan stores its weights sharded (~1/p per rank, gathered where used,
gradients reduce-scattered) or replicated (as they compute: nothing gathered, gradients
all-reduced). The search prices both where the weights fit replicated and keeps the cheaper, the
leaner on a tie. These tests check the rewrite, the choice and its memory, and that a replicated
plan trains as the serial model does: in lockstep (loss and every gradient) and on gloo ranks
(loss, gradients, parameters after SGD-with-momentum steps, state_dict and a checkpoint).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.fx as fx
from multirank import run_ranks
from pass_fixtures import _compare_with_serial, lockstep_step
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_

import autopar
from autopar.compiler.driver import compile_for_rank, trace_for
from autopar.core.host_memory import RUNTIME_RESERVE
from autopar.core.layout import Partial, Replicate
from autopar.core.meta import info, signature
from autopar.cost.formulas import ADAMW_STATE_FACTOR, memory_per_rank
from autopar.passes.trace import trace
from autopar.planning.greedy import greedy_plan
from autopar.planning.memory import plan_memory
from autopar.planning.search import ElementCost, TimeCost, plan_cost, replicated_fits, search_layouts
from autopar.planning.storage import REPLICATED, SHARDED, compute_layouts, replicate_storage
from autopar.rules.registry import default_registry
from autopar.testing import all_coords
from examples.models import make_gpt

SHAPE = (4,)
MODEL = {"n_embd": 64, "n_layer": 2, "n_head": 4, "block_size": 16, "vocab_size": 64}


def _case() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return make_gpt(0, 8, **MODEL)


@pytest.fixture(scope="module")
def traced() -> tuple[fx.GraphModule, autopar.Mesh]:
    model, batch = _case()
    return trace(model, batch, decompose=True), autopar.Mesh.from_shape(SHAPE)


def _params(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "param"]


def test_replicate_storage_stores_each_weight_as_it_computes(traced: Any) -> None:
    gm, mesh = traced
    sharded = greedy_plan(gm, mesh, default_registry(), roles=("token",))  # every op split by the batch
    computes = compute_layouts(gm, sharded, SHAPE)
    assert set(computes) == {n.name for n in _params(gm)}  # every weight's compute layout is found
    replicated = replicate_storage(gm, sharded, SHAPE)
    sig = signature(gm)
    for node in _params(gm):
        (stored,) = replicated.layouts[node.name]
        assert not any(isinstance(p, Partial) for p in stored.placements)
        assert stored.placements == tuple(
            Replicate() if isinstance(p, Partial) else p for p in computes[node.name].placements
        )
        grad_at = sig.num_user_outputs + sig.grad_of.index(info(node).param_name)
        assert replicated.output_layouts[grad_at] == stored  # the gradient is reduced into it
    assert replicated.strategies == sharded.strategies  # the compute layouts do not move
    # the all-token plan of one axis: every weight whole on every rank, 4x the sharded state
    before = plan_memory(gm, sharded, SHAPE).param_bytes
    after = plan_memory(gm, replicated, SHAPE).param_bytes
    assert after > 3 * before


def test_search_prices_both_and_keeps_the_cheaper(traced: Any) -> None:
    gm, mesh = traced
    registry = default_registry()
    cost = TimeCost("cpu-gloo", SHAPE)
    both = search_layouts(gm, mesh, registry, cost=cost)
    one = {mode: search_layouts(gm, mesh, registry, cost=cost, storage=mode) for mode in (SHARDED, REPLICATED)}
    priced = {mode: plan_cost(gm, plan, mesh, cost) for mode, plan in one.items()}
    assert both.storage == min(priced, key=lambda m: (priced[m], m != SHARDED))
    assert plan_cost(gm, both, mesh, cost) == pytest.approx(min(priced.values()))
    assert one[REPLICATED].storage == REPLICATED and one[SHARDED].storage == SHARDED
    assert gm.meta["autopar_search"].storage == REPLICATED  # (the last search's report)
    # on gloo a collective's own time makes the gathers of sharded weights dearer than one
    # all-reduce per gradient bucket: the replicated plan models cheaper here
    assert priced[REPLICATED] < priced[SHARDED]


def test_replicated_needs_the_weights_to_fit(traced: Any) -> None:
    gm, mesh = traced
    params = sum(n.meta["val"].numel() * 4 for n in _params(gm))
    whole = memory_per_rank(params, params, ADAMW_STATE_FACTOR).total
    assert replicated_fits(gm, math.inf) and replicated_fits(gm, whole)
    assert not replicated_fits(gm, whole * 0.99)
    cost = TimeCost("cpu-gloo", SHAPE)
    free = search_layouts(gm, mesh, default_registry(), cost=cost)
    assert free.storage == REPLICATED
    tight = search_layouts(gm, mesh, default_registry(), cost=cost, memory_limit=whole * 0.99)
    assert tight.storage == SHARDED and tight.memory is not None and tight.memory.total <= whole * 0.99


def test_element_counts_keep_weights_sharded(traced: Any) -> None:
    """In element counts a weight's gather plus its gradient's reduce-scatter moves what one
    all-reduce moves and memory has no price: explicit meshes planned without a table keep ~1/p
    per rank unless replicated storage is asked for."""
    gm, mesh = traced
    cost = ElementCost(SHAPE)
    assert search_layouts(gm, mesh, default_registry(), cost=cost).storage == SHARDED
    forced = search_layouts(gm, mesh, default_registry(), cost=cost, storage=REPLICATED)
    assert forced.storage == REPLICATED


def test_cpu_table_memory_is_the_machines_over_its_ranks() -> None:
    # each rank's share of the machine, less the runtime's fixed memory every process holds
    one, eight = TimeCost("cpu-gloo", (1,)), TimeCost("cpu-gloo", (2, 4))
    assert one.memory_capacity + RUNTIME_RESERVE == pytest.approx(8 * (eight.memory_capacity + RUNTIME_RESERVE))
    assert eight.memory_capacity < one.memory_capacity / 8
    h100 = TimeCost("h100-nvlink-ib", (2, 4))
    assert h100.memory_capacity == TimeCost("h100-nvlink-ib", (1,)).memory_capacity  # a device's own


def _every_rank(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...], storage: str, chosen: list[Any]
) -> dict[Any, Any]:
    """Every rank's program of `model` on SHAPE with the search's plan under `storage` (kept in
    `chosen`)."""
    mesh = autopar.Mesh.from_shape(SHAPE)
    traced = trace_for(model, mesh, batch, None, "search", None)

    def plan_once(gm: fx.GraphModule, make_plan: Callable[[], Any]) -> Any:
        if not chosen:
            cost = TimeCost("cpu-gloo", SHAPE)  # (the all-token plan: DDP's)
            chosen.append(search_layouts(gm, mesh, default_registry(), cost=cost, storage=storage))
        return chosen[0]

    return {
        c: compile_for_rank(model, mesh, batch, coords=c, agree=plan_once, traced=traced) for c in all_coords(SHAPE)
    }


def test_replicated_plan_matches_serial_in_lockstep() -> None:
    model, batch = _case()
    chosen: list[Any] = []
    compiled = _every_rank(model, batch, REPLICATED, chosen)
    first = next(iter(compiled.values()))
    program = first.program
    fwd, bwd = lockstep_step(compiled, model, SHAPE, batch, {})
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    _compare_with_serial(model, program, fwd, bwd, [loss.detach()], SHAPE, 2e-5, 1e-4)
    (plan,) = chosen
    assert plan.storage == REPLICATED
    # each rank holds every weight as it computes, not split further: well over 1/p of them
    local = sum(lay.local_numel(SHAPE) for lay in program.param_layouts)
    total = sum(math.prod(lay.shape) for lay in program.param_layouts)
    assert local > 2 * total / SHAPE[0]


# ---------------------------------------------------------------------------------------------
# on gloo ranks

STEPS = 3


def _gloo_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, batch = _case()
    serial = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=batch, planning=autopar.PlanOptions(hardware="cpu-gloo")
    )
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    want = dict(serial.named_parameters())
    out: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "param_err": 0.0, "norm_err": 0.0}
    # every weight whole on every rank: plain tensors, as under DDP (no DTensor dispatch in the optimizer)
    out["replicated"] = pmodel.plain_storage and not any(
        isinstance(t, DTensor) for t in [*pmodel.parameters(), *pmodel.buffers()]
    )
    out["note"] = pmodel.plan_summary() if rank == 0 else ""
    for step in range(STEPS):
        if step == 1:  # bad batches between two steps: refused on every rank, nothing computed
            out["refused"] = _bad_batches(pmodel, batch, rank)
            out["untouched"] = all(p.grad is None for p in pmodel.parameters())
            out["gated"] = _gated_collectives(pmodel.program.forward)
        loss, serial_loss = pmodel(*batch), serial(*batch)
        loss.backward()
        serial_loss.backward()
        out["loss_err"] = max(out["loss_err"], abs(float(loss) - float(serial_loss)) / abs(float(serial_loss)))
        for name, p in pmodel.named_parameters():
            g, w = p.grad, want[name].grad
            out["grad_err"] = max(out["grad_err"], float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)))
        out["norm_err"] = max(
            out["norm_err"],
            abs(float(clip_grad_norm_(pmodel.parameters(), 0.05)) - float(clip_grad_norm_(serial.parameters(), 0.05))),
        )
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    for name, p in pmodel.named_parameters():
        out["param_err"] = max(out["param_err"], float((p - want[name]).abs().max()))
    # other programs over the same plain tensors: forward only, and half the batch (each planned
    # anew: a layout other than whole is cut from the plain tensor, its gradient gathered back)
    with torch.no_grad():
        out["no_grad_err"] = abs(float(pmodel(*batch)) - float(serial(*batch)))
    half = tuple(t[: len(t) // 2] for t in batch)
    loss, serial_loss = pmodel(*half), serial(*half)
    loss.backward()
    serial_loss.backward()
    out["half_err"] = max(
        abs(float(loss) - float(serial_loss)),
        *(float((p.grad - want[name].grad).abs().max()) for name, p in pmodel.named_parameters()),
    )
    out["programs"] = len(pmodel.programs)
    state = pmodel.state_dict()
    out["state_keys"] = list(state) == list(serial.state_dict())
    out["state_err"] = max(
        float(v.sub(serial.state_dict()[k]).abs().max())
        for k, v in state.items()
    )
    # checkpoints: DCP loads into the serial model's state dict; safetensors holds each weight once
    autopar.save_checkpoint(pmodel, f"{root}/dcp")
    loaded = {k: torch.zeros_like(v) for k, v in serial.state_dict().items()}
    dcp.load(loaded, checkpoint_id=f"{root}/dcp")
    out["dcp_err"] = max(float((loaded[k] - v).abs().max()) for k, v in serial.state_dict().items())
    autopar.save_checkpoint(pmodel, f"{root}/st", format="safetensors")
    dist.barrier()
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(Path(f"{root}/st").glob("*.safetensors")):
        saved.update(load_file(str(file)))
    out["st_elements"] = sum(t.numel() for t in saved.values())
    out["st_err"] = max(float((saved[k] - want[k]).abs().max()) for k in saved if k in want)
    out["serial_elements"] = sum(p.numel() for p in serial.parameters())
    return out


def _gated_collectives(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The forward's collectives, each with the call before it (the input check's gate, or not)."""
    nodes = list(gm.graph.nodes)
    return [
        (str(n.target), getattr(before.target, "__name__", str(before.target)))
        for before, n in zip(nodes, nodes[1:])
        if n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait" not in str(n.target)
    ]


def _bad_batches(pmodel: torch.nn.Module, batch: tuple[torch.Tensor, ...], rank: int) -> list[str]:
    """Rank 1 passes, in turn, a batch with one token changed (the same program: every rank
    settles the check where the forward's first collective is, the loss's all-reduce) and a batch
    of another length (it compiles: it settles before the compile's collectives, the others in
    their forward). Each call's refusal on this rank."""
    ids, labels = batch
    changed = ids.clone()
    changed[1, 2] = (changed[1, 2] + 1) % MODEL["vocab_size"]
    calls = [(changed, labels), (ids[:, :-1], labels[:, :-1])]
    refused = []
    for bad in calls:
        try:
            pmodel(*(bad if rank == 1 else batch)).backward()
            refused.append("no error")
        except autopar.InputMismatchError as exc:
            refused.append(str(exc))  # (the same batch at every step: named a call ahead)
    return refused


@pytest.mark.multirank
def test_replicated_plan_trains_as_serial_on_gloo(tmp_path: Path) -> None:
    results = run_ranks(SHAPE[0], _gloo_job, str(tmp_path), timeout=600)
    for r in results:
        assert r["replicated"], results[0]["note"]
        # a bad batch on one rank is refused on every rank before any result or gradient, and
        # the steps after it still equal serial's
        changed, shorter = r["refused"]
        assert "differs between rank 0 and rank 1" in changed, r
        assert "rank 1 calls the module differently from rank 0" in shorter, r
        assert r["untouched"], r
        # the check's all-reduce no longer blocks at the start of the forward: it is settled right
        # before the forward's one collective (the loss's [sum, count]), the whole forward later
        ((collective, before),) = r["gated"]
        assert collective == "_c10d_functional.all_reduce.default" and before == "settle_gate", r
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["param_err"] < 1e-5, r
        assert r["norm_err"] < 1e-5, r  # clip_grad_norm_ over the plain tensors: the serial norm
        assert r["no_grad_err"] < 1e-5 and r["half_err"] < 1e-5 and r["programs"] == 3, r
        assert r["state_keys"] and r["state_err"] < 1e-5, r
        assert r["dcp_err"] < 1e-6 and r["st_err"] < 1e-6, r
        # a replicated weight is saved once, whatever the number of ranks holding it (the tied
        # embedding and head: once)
        assert r["st_elements"] == r["serial_elements"], r
