"""Mixed precision decided at call time: `torch.autocast` around the call, as every
mixed-precision training loop is written, and weights cast with `.to(dtype)` before or after
`parallelize`. Each precision state selects (and compiles once) its own program."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from multirank import run_ranks

import autopar
from autopar.core.precision import Autocast, autocast_now, describe
from autopar.passes.trace import trace
from examples.models import make_gpt

BF16 = Autocast("cpu", torch.bfloat16)


def _matmul_dtypes(gm: fx.GraphModule) -> set[torch.dtype]:
    """The dtypes the graph's matmuls compute in (of their first operand: emitted graphs keep no
    fake values, but every input's chain of casts is in the graph)."""
    return {
        _dtype_of(node.args[-2] if node.target == torch.ops.aten.addmm.default else node.args[0])
        for node in gm.graph.nodes
        if node.op == "call_function"
        and node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    }


def _dtype_of(node: Any) -> torch.dtype:
    val = node.meta.get("val")
    if val is not None:
        return val.dtype  # type: ignore[no-any-return]
    if node.target == torch.ops.aten._to_copy.default and "dtype" in node.kwargs:
        return node.kwargs["dtype"]  # type: ignore[no-any-return]
    return _dtype_of(node.args[0])


def test_a_trace_under_autocast_holds_the_casts_and_runs_its_matmuls_in_bfloat16() -> None:
    model, batch = make_gpt(0)
    gm = trace(model, batch, autocast=(BF16,))
    assert _matmul_dtypes(gm) == {torch.bfloat16}
    casts = [n for n in gm.graph.nodes if n.target == torch.ops.aten._to_copy.default]
    assert any(n.kwargs.get("dtype") == torch.bfloat16 for n in casts)
    assert any(n.kwargs.get("dtype") == torch.float32 for n in casts)  # gradients back to the weights' dtype


def test_autocast_around_the_trace_itself_is_not_traced() -> None:
    model, batch = make_gpt(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = trace(model, batch)  # the regions to trace are an argument, never the ambient state
        assert autocast_now() == (BF16,)  # and the caller's region is as it was
    assert _matmul_dtypes(gm) == {torch.float32}
    assert describe((BF16,)) == "autocast(cpu, bfloat16)"


def _scale_diff(parallel: Any, serial: torch.Tensor) -> float:
    full = parallel.full_tensor() if hasattr(parallel, "full_tensor") else parallel
    return float((full.float() - serial.float()).abs().max() / serial.float().abs().max().clamp_min(1e-12))


def _train_with_autocast(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    model, batch = make_gpt(0)
    serial, _ = make_gpt(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)  # compiled outside autocast
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    result: dict[str, Any] = {"losses": [], "grads": []}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pmodel(*batch)  # compiles the autocast program
    with torch.no_grad():  # outside autocast again: a float32 program, as serial runs then
        result["plain"] = (float(pmodel(*batch)), float(serial(*batch)))
    for _ in range(3):  # the loop of torch's automatic mixed precision recipe (CPU, bfloat16)
        for module, optimizer in ((pmodel, opt), (serial, serial_opt)):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module(*batch)
            loss.backward()
            if module is serial:
                result["grads"].append(
                    max(_scale_diff(p.grad, q.grad) for p, q in zip(pmodel.parameters(), serial.parameters()))
                )
            optimizer.step()
            result["losses"].append(float(loss))
    result["params"] = max(_scale_diff(p, q) for p, q in zip(pmodel.parameters(), serial.parameters()))
    result["why"] = [why for why, _ in pmodel.programs]
    result["matmuls"] = [sorted(map(str, _matmul_dtypes(program.forward))) for _, program in pmodel.programs]
    return result


@pytest.mark.multirank
def test_autocast_around_each_call_trains_equal_to_serial_autocast() -> None:
    for result in run_ranks(4, _train_with_autocast, timeout=300):
        losses = result["losses"]
        for parallel, serial in zip(losses[0::2], losses[1::2]):
            assert abs(parallel - serial) <= 1e-2 * abs(serial), losses  # bfloat16 keeps 8 bits
        assert max(result["grads"]) < 5e-2, result["grads"]
        assert result["params"] < 1e-2, result["params"]
        parallel, serial = result["plain"]
        assert abs(parallel - serial) < 1e-6, result["plain"]
        # three programs, least recently used first: the example's, no_grad's, autocast's
        assert result["why"] == ["example inputs", "torch.no_grad(): forward only; no autocast", "autocast(cpu, bfloat16)"]
        assert result["matmuls"] == [["torch.float32"], ["torch.float32"], ["torch.bfloat16"]], result["matmuls"]


def _train_cast(rank: int, world_size: int, when: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    model, batch = make_gpt(0)
    serial, _ = make_gpt(0)
    serial.to(torch.bfloat16)
    if when == "before":
        model.to(torch.bfloat16)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    if when == "after":
        pmodel.to(torch.bfloat16)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(2):
        for module, optimizer in ((pmodel, opt), (serial, serial_opt)):
            optimizer.zero_grad()
            loss = module(*batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    dtypes = {str(p.dtype) for p in pmodel.parameters()} | {str(p.grad.dtype) for p in pmodel.parameters()}
    params = max(_scale_diff(p, q) for p, q in zip(pmodel.parameters(), serial.parameters()))
    return {"losses": losses, "dtypes": dtypes, "params": params, "why": [why for why, _ in pmodel.programs]}


@pytest.mark.multirank
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_model_cast_to_bfloat16_before_or_after_parallelize_trains_equal_to_serial(when: str) -> None:
    for result in run_ranks(4, _train_cast, when, timeout=300):
        losses = result["losses"]
        for parallel, serial in zip(losses[0::2], losses[1::2]):
            assert abs(parallel - serial) <= 2e-2 * abs(serial), losses  # all arithmetic in bfloat16
        assert result["dtypes"] == {"torch.bfloat16"}, result["dtypes"]
        assert result["params"] < 2e-2, result["params"]
        if when == "after":  # the float32 program no longer fits the weights: one for bfloat16
            assert "is bfloat16 (and" in result["why"][-1], result["why"]


def test_an_op_is_priced_at_the_peak_of_the_dtype_it_computes_in() -> None:
    from autopar.planning.search_cost import TimeCost

    cost = TimeCost("h100-nvlink-ib", (8,))
    assert cost.compute(1e12, 1, torch.bfloat16) == pytest.approx(1e12 / 989e12)
    assert cost.compute(1e12, 1, torch.float32) == pytest.approx(1e12 / 67e12)
    assert cost.compute(1e12, 4) == pytest.approx(1e12 / 4 / 67e12)


def test_a_plan_for_autocast_is_priced_at_bfloat16_rates_and_bytes() -> None:
    model, batch = make_gpt(0, batch_size=16, n_embd=256, n_head=8)
    fp32 = autopar.plan(model, (2, 2, 2), batch, hardware="h100-nvlink-ib")
    bf16 = autopar.plan(model, (2, 2, 2), batch, hardware="h100-nvlink-ib", autocast=torch.bfloat16)
    assert _matmul_dtypes(bf16.compiled.graph) == {torch.bfloat16}
    # the table's bfloat16 peak is ~15x its float32 one: the matmuls' share of compute shrinks
    assert bf16.compute_time < 0.5 * fp32.compute_time, (bf16.compute_time, fp32.compute_time)
    assert bf16.memory.activations < fp32.memory.activations  # saved in bfloat16
    # the weights stay float32 (master weights for the optimizer): autocast casts them at use
    assert {layout.dtype for layout in bf16.compiled.program.param_layouts} == {torch.float32}
