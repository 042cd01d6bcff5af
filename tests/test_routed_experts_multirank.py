"""The all-to-all token dispatcher on real gloo ranks: `parallelize(..., planning=PlanOptions(
token_dispatch="alltoall"))` on transformers' MixtralForCausalLM at its defaults (8 experts, top 2),
2 processes. The op's local call resolves its axis's process group by name and exchanges with
`torch.distributed.all_to_all_single` (the in-process tests run it on thread ranks instead):
loss, every gradient and every parameter after 2 SGD-momentum steps equal serial."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from multirank import run_ranks
from test_routed_experts import experts_placed
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.rules import routed_experts

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH, STEPS = 64, 16, 2, 2


def _job(rank: int, world_size: int) -> dict[str, Any]:
    """On 2 ranks a (2,) mesh at the defaults; on 4 a (2, 2) mesh with the experts forced over both
    axes (each rank 2 of the 8), the tokens exchanged over both axes' groups."""
    shape, names = ((2, 2), ("x", "y")) if world_size == 4 else ((world_size,), ("x",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    registry = experts_placed((0, 1), all_to_all=True) if len(shape) == 2 else None
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.MixtralForCausalLM(config)
    serial = copy.deepcopy(model)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids},
        planning=autopar.PlanOptions(token_dispatch="alltoall", registry=registry),
    )
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    serial_params = dict(serial.named_parameters())
    result: dict[str, Any] = {"losses": [], "grad_err": 0.0, "param_err": 0.0}
    for step in range(STEPS):
        batch = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 + step))
        out = pmodel(input_ids=batch, labels=batch)
        want = serial(input_ids=batch, labels=batch)
        out.loss.backward()
        want.loss.backward()
        result["losses"].append((float(out.loss), float(want.loss)))
        for name, p in pmodel.named_parameters():
            err = float((p.grad.full_tensor() - serial_params[name].grad).abs().max())
            result["grad_err"] = max(result["grad_err"], err)
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    for name, p in pmodel.named_parameters():
        result["param_err"] = max(result["param_err"], float((p.full_tensor() - serial_params[name]).abs().max()))
    program = pmodel.programs[0][1]
    result["routed"] = [
        routed_experts.exchange_axes(n.args)
        for graph in (program.forward, program.backward)
        for n in graph.graph.nodes
        if n.target in routed_experts.ROUTED_OPS
    ]
    return result


@pytest.mark.parametrize("world", [2, 4], ids=["2", "2x2-experts-over-both-axes"])
def test_mixtral_with_the_all_to_all_dispatcher_on_gloo_ranks_trains_like_serial(world: int) -> None:
    """On 4 ranks the experts span both axes of (2, 2): each op's local call resolves both axes'
    process groups and exchanges through a `TwoAxisExchange` of two `GroupExchange`s."""
    axes = (0, 1) if world == 4 else (0,)
    for rank, r in enumerate(run_ranks(world, _job, timeout=600)):
        assert r["routed"] == [axes] * 4, (rank, "two layers' forward and backward ops exchange over the groups")
        for loss, serial_loss in r["losses"]:
            assert loss == pytest.approx(serial_loss, rel=1e-5, abs=1e-6), (rank, r["losses"])
        assert r["grad_err"] < 1e-4, (rank, r["grad_err"])
        assert r["param_err"] < 1e-4, (rank, r["param_err"])


def _pipelined_job(rank: int, world_size: int) -> dict[str, Any]:
    """(pp, x) = (2, 2): each stage (one Mixtral layer) is exported with its experts module as the
    routed-experts op and planned on its 2-rank sub-mesh with token_dispatch="alltoall"."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "x"))
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.MixtralForCausalLM(config)
    serial = copy.deepcopy(model)
    ids = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids},
        planning=autopar.PlanOptions(token_dispatch="alltoall"), pipeline=autopar.PipelineOptions(microbatches=2),
    )
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    serial_params = dict(serial.named_parameters())
    result: dict[str, Any] = {"losses": [], "grad_err": 0.0, "param_err": 0.0}
    for step in range(STEPS):
        batch = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(10 + step))
        out = pmodel(input_ids=batch, labels=batch)
        loss = out.loss if hasattr(out, "loss") else out
        want = serial(input_ids=batch, labels=batch).loss
        loss.backward()
        want.backward()
        result["losses"].append((float(loss), float(want)))
        for name, p in pmodel.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            result["grad_err"] = max(result["grad_err"], float((grad - serial_params[name].grad).abs().max()))
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    for name, p in pmodel.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        result["param_err"] = max(result["param_err"], float((whole - serial_params[name]).abs().max()))
    result["routed"] = sum(
        1
        for stage in pmodel.stage_parallel.values()
        for _, program in stage.programs
        for graph in (program.forward, program.backward)
        for n in graph.graph.nodes
        if n.target in routed_experts.ROUTED_OPS and routed_experts.exchange_axes(n.args)
    )
    return result


def test_pipeline_stages_plan_the_all_to_all_dispatcher_and_train_like_serial() -> None:
    """parallelize on a ("pp", "x") mesh with token_dispatch="alltoall": each pipeline rank's stage
    exchanges its layer's tokens over its x group inside the op (forward and backward), and loss,
    every gradient and every parameter after 2 SGD-momentum steps equal serial."""
    for rank, r in enumerate(run_ranks(4, _pipelined_job, timeout=900)):
        assert r["routed"] >= 2, (rank, "this rank's stage's layer exchanges tokens forward and backward")
        for loss, serial_loss in r["losses"]:
            assert loss == pytest.approx(serial_loss, rel=1e-5, abs=1e-6), (rank, r["losses"])
        assert r["grad_err"] < 1e-4, (rank, r["grad_err"])
        assert r["param_err"] < 1e-4, (rank, r["param_err"])
