"""Mixed precision decided at call time: `torch.autocast` around the call, as every
mixed-precision training loop is written, and weights cast with `.to(dtype)` before or after
`parallelize`. Each precision state selects (and compiles once) its own program."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.fx as fx
from multirank import run_ranks, run_scenarios, train_side_by_side

import autopar
from autopar.core.errors import UsageError
from autopar.core.precision import Autocast, autocast_now, describe
from autopar.passes.trace import trace
from examples.models import make_gpt

BF16 = Autocast("cpu", torch.bfloat16)
# The GPT the autocast and cast jobs train: one block. What they check (the program each precision
# state selects, the casts, the dtypes kept, the numbers against serial) does not depend on the
# depth, and each rank traces and compiles every program itself. (The policy job keeps two blocks:
# its one-rank test's bounds on bfloat16 rounding were measured on them.)
RANK_LAYERS = 1


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
    model, batch = make_gpt(0, n_layer=RANK_LAYERS)
    serial, _ = make_gpt(0, n_layer=RANK_LAYERS)
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


@pytest.fixture(scope="module")
def on_four_ranks() -> dict[str, list[dict[str, Any]]]:
    """This file's jobs on a (2, 2) mesh, run in one forked job (each test checks its own)."""
    scenarios = {
        "autocast": _train_with_autocast,
        "before": functools.partial(_train_cast, when="before"),
        "after": functools.partial(_train_cast, when="after"),
        "policy": _train_with_policy,
    }
    return run_scenarios(4, scenarios, timeout=900)


@pytest.mark.multirank
def test_autocast_around_each_call_trains_equal_to_serial_autocast(on_four_ranks: dict[str, list[Any]]) -> None:
    for result in on_four_ranks["autocast"]:
        losses = result["losses"]
        for parallel, serial in zip(losses[0::2], losses[1::2]):
            assert abs(parallel - serial) <= 1e-2 * abs(serial), losses  # bfloat16 keeps 8 bits
        assert max(result["grads"]) < 5e-2, result["grads"]
        assert result["params"] < 1e-2, (result["params"], result["precision_gap"], result["parallel_vs_float32"])
        parallel, serial = result["plain"]
        assert abs(parallel - serial) < 1e-6, result["plain"]
        # three programs, least recently used first: the example's, no_grad's, autocast's
        assert result["why"] == ["example inputs", "torch.no_grad(): forward only; no autocast", "autocast(cpu, bfloat16)"]
        assert result["matmuls"] == [["torch.float32"], ["torch.float32"], ["torch.bfloat16"]], result["matmuls"]


def _train_cast(rank: int, world_size: int, when: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    model, batch = make_gpt(0, n_layer=RANK_LAYERS)
    serial, _ = make_gpt(0, n_layer=RANK_LAYERS)
    serial.to(torch.bfloat16)
    if when == "before":
        model.to(torch.bfloat16)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    if when == "after":
        pmodel.to(torch.bfloat16)
    losses = train_side_by_side([(pmodel, batch), (serial, batch)])
    dtypes = {str(p.dtype) for p in pmodel.parameters()} | {str(p.grad.dtype) for p in pmodel.parameters()}
    params = max(_scale_diff(p, q) for p, q in zip(pmodel.parameters(), serial.parameters()))
    return {"losses": losses, "dtypes": dtypes, "params": params, "why": [why for why, _ in pmodel.programs]}


@pytest.mark.multirank
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_model_cast_to_bfloat16_before_or_after_parallelize_trains_equal_to_serial(
    when: str, on_four_ranks: dict[str, list[Any]]
) -> None:
    for result in on_four_ranks[when]:
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
    h100 = autopar.PlanOptions(hardware="h100-nvlink-ib")
    # 20 MB per rank: under what this model needs with its weight state whole on every rank, so
    # both plans store weights ~1/p and their activations compare like for like (under the default
    # limit replicated storage may win one of them: planning.md, "Weight storage")
    fp32 = autopar.plan(model, (2, 2, 2), batch, planning=h100, memory_limit=20e6)
    bf16 = autopar.plan(model, (2, 2, 2), batch, planning=h100, autocast=torch.bfloat16, memory_limit=20e6)
    assert bf16.memory.params == pytest.approx(fp32.memory.params, rel=0.05)  # float32 weights, ~1/p both
    assert _matmul_dtypes(bf16.compiled.graph) == {torch.bfloat16}
    # the table's bfloat16 peak is ~15x its float32 one: the matmuls' share of compute shrinks
    assert bf16.compute_time < 0.5 * fp32.compute_time, (bf16.compute_time, fp32.compute_time)
    assert bf16.memory.activations < fp32.memory.activations  # saved in bfloat16
    # the weights stay float32 (master weights for the optimizer): autocast casts them at use
    assert {layout.dtype for layout in bf16.compiled.program.param_layouts} == {torch.float32}


def test_a_policy_traces_every_parameter_read_as_a_bfloat16_copy_and_keeps_repeated_blocks() -> None:
    from autopar.core.meta import signature
    from autopar.core.precision import MixedPrecision

    model, batch = make_gpt(0, n_layer=4)
    gm = trace(model, batch, mixed_precision=MixedPrecision(torch.bfloat16))
    assert _matmul_dtypes(gm) == {torch.bfloat16}
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.float32]
    assert len(params) >= len(list(model.parameters()))  # the stored weights stay float32
    assert gm.meta.get("autopar_repeated_blocks"), "the casts sit inside the blocks: still copied"
    assert len(signature(gm).grad_of) == len(list(model.parameters()))


def test_a_policy_that_cannot_be_honoured_is_refused_by_name() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autopar.core.precision import MixedPrecision

    assert MixedPrecision.of(MixedPrecisionPolicy()) is None  # casts nothing
    assert MixedPrecision.of(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)) == MixedPrecision(
        torch.bfloat16
    )
    model, batch = make_gpt(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(UsageError, match="reduce_dtype=torch.float32 differs from param_dtype") as err:
        autopar.parallelize(model, None, example_inputs=batch, mp_policy=policy)  # type: ignore[arg-type]
    assert err.value.hint
    with pytest.raises(UsageError, match="mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy"):
        autopar.parallelize(model, None, example_inputs=batch, mp_policy=torch.bfloat16)  # type: ignore[arg-type]


def _serial_step_with_bfloat16_copies(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The policy's meaning, written independently: the forward reads bfloat16 copies of every
    parameter (tied ones are one parameter, so one copy), gradients reach the float32 masters."""
    copies = {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}
    return torch.func.functional_call(model, copies, batch, tie_weights=True)  # type: ignore[no-any-return]


def _train_with_policy(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (2, 2) if world_size == 4 else (world_size,))
    model, batch = make_gpt(0)
    serial, _ = make_gpt(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, mp_policy=policy)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    result: dict[str, Any] = {"losses": [], "grads": [], "dtypes": set()}
    for _ in range(2):
        opt.zero_grad()
        serial_opt.zero_grad()
        loss = pmodel(*batch)
        loss.backward()
        want = _serial_step_with_bfloat16_copies(serial, batch)
        want.backward()
        result["losses"].append((float(loss.detach()), float(want.detach()), str(loss.dtype), str(want.dtype)))
        result["grads"].append(max(_scale_diff(p.grad, q.grad) for p, q in zip(pmodel.parameters(), serial.parameters())))
        result["dtypes"] |= {str(p.dtype) for p in pmodel.parameters()} | {str(p.grad.dtype) for p in pmodel.parameters()}
        opt.step()
        serial_opt.step()
    result["params"] = max(_scale_diff(p, q) for p, q in zip(pmodel.parameters(), serial.parameters()))
    return result


@pytest.mark.multirank
def test_a_bfloat16_parameter_policy_on_one_rank_is_the_serial_model_reading_bfloat16_copies() -> None:
    (result,) = run_ranks(1, _train_with_policy, timeout=300)
    for parallel, serial, dtype, serial_dtype in result["losses"]:
        assert dtype == serial_dtype == "torch.bfloat16" and parallel == serial, result["losses"]
    assert result["dtypes"] == {"torch.float32"}, result["dtypes"]  # masters and their gradients
    # the joint graph's backward kernels round bfloat16 differently from eager autograd's: the
    # first gradients stay within one bfloat16 step (2**-8 of their scale), and so the parameters
    assert result["grads"][0] < 2.0**-8 and result["params"] < 5e-3, (result["grads"], result["params"])


@pytest.mark.multirank
def test_a_bfloat16_parameter_policy_trains_equal_to_serial_to_bfloat16_rounding(
    on_four_ranks: dict[str, list[Any]],
) -> None:
    # bfloat16 partial sums meet in another order on 4 ranks: the loss may move by one bfloat16
    # step (1/32 at 4.0), the parameters by as much as bfloat16 and float32 training differ
    for result in on_four_ranks["policy"]:
        for parallel, serial, dtype, serial_dtype in result["losses"]:
            assert dtype == serial_dtype == "torch.bfloat16", result["losses"]
            assert abs(parallel - serial) <= 1.01 * 2.0**-8 * 2 * abs(serial), result["losses"]
        assert result["dtypes"] == {"torch.float32"}, result["dtypes"]
        assert max(result["grads"]) < 5e-2, result["grads"]
        assert result["params"] < 3e-2, result["params"]
