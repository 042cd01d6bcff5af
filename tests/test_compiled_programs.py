"""`parallelize(..., compile=True)`: every program's forward and backward graphs run compiled by
Inductor, with results equal to the eager programs and to serial training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from multirank import run_ranks

import autopar
from examples.models import make_gpt


def _train(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    serial, batch = make_gpt(0, n_layer=1)
    modules = {"serial": serial}
    for name, compiled in (("eager", False), ("compiled", True)):
        model, _ = make_gpt(0, n_layer=1)
        modules[name] = autopar.parallelize(model, mesh, example_inputs=batch, compile=compiled)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for name, m in modules.items()}
    losses: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(2):
        for name, module in modules.items():
            optimizers[name].zero_grad()
            loss = module(*batch)
            loss.backward()
            optimizers[name].step()
            losses[name].append(float(loss))
    params = {
        name: max(float((p.full_tensor() - q).abs().max()) for p, q in zip(modules[name].parameters(), serial.parameters()))
        for name in ("eager", "compiled")
    }
    with torch.no_grad():  # a forward-only program, compiled too
        evaluated = [float(modules[name](*batch)) for name in ("serial", "eager", "compiled")]
    kinds = [type(program.forward).__name__ for _, program in modules["compiled"].programs]
    return {"losses": losses, "params": params, "eval": evaluated, "kinds": kinds}


@pytest.mark.multirank
def test_programs_compiled_by_inductor_train_equal_to_eager_and_serial() -> None:
    for result in run_ranks(2, _train, timeout=600):
        losses = result["losses"]
        for serial, eager, compiled in zip(losses["serial"], losses["eager"], losses["compiled"]):
            assert abs(eager - serial) < 1e-5 and abs(compiled - eager) < 1e-5, losses
        assert result["params"]["compiled"] < 1e-5, result["params"]
        assert result["params"]["eager"] < 1e-5, result["params"]
        serial, eager, compiled = result["eval"]
        assert abs(compiled - serial) < 1e-5 and abs(compiled - eager) < 1e-5, result["eval"]
        assert result["kinds"] == ["OptimizedModule", "OptimizedModule"], result["kinds"]
