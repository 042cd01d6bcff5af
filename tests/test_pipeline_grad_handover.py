"""How a pipelined step's gradients reach `.grad` (`compiler/pipeline_batch.DepositGradients`,
docs/pipeline.md#a-pipelined-ranks-memory): the loss's backward hands autograd the gradients the
step computed and autograd's own accumulation stores them, so that

- with `.grad` empty, `.grad` is the step's gradient itself, not a copy beside it (DTensor
  parameters of a stage's tensor sub-mesh as well as plain ones): the hand-over adds no memory;
- a parameter's `register_post_accumulate_grad_hook` fires once per backward, reading the
  gradient serial's would read, and a second call's backward without `zero_grad` adds into `.grad`
  as torch's does.

pp=2 x tp=2 on 4 real gloo ranks, a 2-layer GPT (tied embedding and head), against serial."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler import pipeline_batch
from examples.models import make_gpt

TOL = {"rtol": 1e-4, "atol": 1e-6}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _hooked(module: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """A post-accumulate-grad hook on every parameter: what `.grad` held each time it fired."""
    fired: dict[str, list[torch.Tensor]] = {}
    for name, p in module.named_parameters():
        fired[name] = []

        def hook(param: torch.Tensor, name: str = name) -> None:
            assert param.grad is not None
            fired[name].append(_local(param.grad).detach().clone())

        p.register_post_accumulate_grad_hook(hook)
    return fired


def _handover(rank: int, world: int) -> dict[str, Any]:
    model, batch = make_gpt(0, batch_size=4, n_layer=2)
    serial = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, pipeline=autopar.PipelineOptions(microbatches=2))
    fired, serial_fired = _hooked(pmodel), _hooked(serial)
    handed: list[int] = []  # the local blocks' addresses of the gradients the loss's backward hands over
    backward = pipeline_batch.DepositGradients.backward

    def recording(ctx: Any, grad: torch.Tensor) -> Any:
        handed.extend(_local(g).data_ptr() for g in ctx.grads if g is not None)
        return backward(ctx, grad)

    pipeline_batch.DepositGradients.backward = staticmethod(recording)  # type: ignore[method-assign]  # this rank only
    try:
        pmodel(*batch).backward()
    finally:
        pipeline_batch.DepositGradients.backward = staticmethod(backward)  # type: ignore[method-assign]
    params = dict(pmodel.named_parameters())
    assert params and all(p.grad is not None for p in params.values())
    copied = [n for n, p in params.items() if _local(p.grad).data_ptr() not in handed]
    tensor_params = sum(isinstance(p, DTensor) for p in params.values())
    first = {n: _whole(p.grad).clone() for n, p in params.items()}
    first_local = {n: _local(p.grad).clone() for n, p in params.items()}
    pmodel(*batch).backward()  # no zero_grad: the second call's gradients add into `.grad`
    serial(*batch).backward()
    serial(*batch).backward()
    ref = dict(serial.named_parameters())
    for name, p in params.items():
        assert len(fired[name]) == 2, (name, len(fired[name]))  # once per backward
        torch.testing.assert_close(_whole(p.grad), ref[name].grad, **TOL, msg=f"grad {name}")
        torch.testing.assert_close(first[name], serial_fired[name][0], **TOL, msg=f"first grad {name}")
        # what each hook read is `.grad` as it then was: the first call's gradient, then the sum
        torch.testing.assert_close(fired[name][0], first_local[name], rtol=0, atol=0, msg=f"hook {name}")
        torch.testing.assert_close(fired[name][1], _local(p.grad), rtol=0, atol=0, msg=f"hook {name}")
    return {"copied": copied, "params": len(params), "tensor_params": tensor_params}


@pytest.mark.multirank
def test_grad_takes_the_steps_gradients_without_a_copy_and_post_accumulate_hooks_fire() -> None:
    results = run_ranks(4, _handover)
    for r in results:
        assert r["copied"] == [], r
        assert r["params"] > 0 and r["tensor_params"] > 0, r  # DTensor parameters among them
