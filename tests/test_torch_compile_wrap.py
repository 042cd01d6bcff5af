"""`torch.compile(pmodel)`, what a user tries next after `parallelize`: dynamo must not trace into
the parallel module's runtime. A probe (probe/loop15.py) found that it did: the first training call
drew other dropout masks than serial under the same seed, and the first call needing a new program
(eval() under no_grad, a smaller batch) stopped with an `InternalError` from dynamo rewriting the
trace stage's bytecode. The runtime is now opaque to dynamo, so the wrapped module runs as
`pmodel` does (`compile=True` is how its programs go through Inductor). The same probe passed the
parallel module to `parallelize` again: DTensor's "mixed torch.Tensor and DTensor" RuntimeError
reached the user; it is a `UsageError` naming what to parallelize instead."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks
from torch import nn

import autopar
from autopar.core.errors import UsageError


def _wrapped(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))
    serial = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,))
    compiled = torch.compile(pmodel)
    errors: dict[str, float] = {}
    for m in (serial, compiled):
        torch.manual_seed(5)
        F.cross_entropy(m(x), y).backward()
    for (name, p), q in zip(serial.named_parameters(), pmodel.parameters()):
        grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        errors[f"grad {name}"] = float((grad - p.grad).abs().max())
    serial.eval()
    pmodel.eval()
    with torch.no_grad():  # a forward-only program, compiled at this call
        errors["eval"] = float((compiled(x[:5]).full_tensor() - serial(x[:5])).abs().max())
    try:
        autopar.parallelize(pmodel, mesh, example_inputs=(x,))
    except UsageError as e:
        errors["refused"] = 0.0 if "parallelize the original model" in str(e) else 1.0
    return errors


@pytest.mark.multirank
def test_torch_compile_of_the_parallel_module_trains_as_serial_and_parallelizing_it_is_refused() -> None:
    for errors in run_ranks(2, _wrapped, timeout=300):
        assert "refused" in errors and max(errors.values()) < 1e-6, errors
