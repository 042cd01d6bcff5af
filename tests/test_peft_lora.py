"""PEFT LoRA on a transformers LLaMA, as PEFT's docs set it up (`get_peft_model` with a
`LoraConfig`), called with the model's defaults: only the adapters get gradients, the frozen base
weights are still stored 1/p per rank, and training equals serial. Every rank of (2,2,2) in lockstep
checks the numbers and the layouts; two gloo ranks check the runtime around them (the frozen
weights' DTensors get no gradient and take no step, the adapters do)."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
import torch
from multirank import run_ranks
from pass_fixtures import train_in_lockstep
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.testing import all_coords

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05)
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(64, (8, 16), generator=torch.Generator().manual_seed(seed))


def test_three_steps_train_like_serial_on_2x2x2() -> None:
    """SGD with momentum on the adapters (lora_dropout on), three steps: loss, every trainable
    gradient and every parameter after the steps equal serial's; each rank stores under 0.3 of the
    model's weights (the frozen base weights are sharded too)."""
    shape = (2, 2, 2)
    model = _model()
    before = copy.deepcopy(model.state_dict())
    batches = [{"input_ids": _ids(step), "labels": _ids(step)} for step in range(3)]
    r = train_in_lockstep(model, shape, batches, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4 and r["param_err"] < 1e-5, r
    program = next(iter(r["compiled"].values())).program
    assert sum("lora_" in name for name in program.param_names) == 8  # A and B of q, v in 2 layers
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert torch.equal(p, before[name]) != p.requires_grad, name  # the adapters moved, only they
    layouts = {n: lay for n, lay in zip(program.param_names, program.param_layouts) if n in params}
    assert set(layouts) == set(params)
    total = sum(p.numel() for p in params.values())
    for c in all_coords(shape):
        stored = sum(math.prod(lay.local_shape(shape, c)) for lay in layouts.values())
        assert stored / total < 0.3, (c, stored / total)


def _job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    model = _model()
    serial = copy.deepcopy(model)
    ids = _ids(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids})
    trainable = [p for p in pmodel.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5, momentum=0.9)
    serial_opt = torch.optim.SGD([p for p in serial.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    losses = []
    for step in range(3):
        ids = _ids(step)
        torch.manual_seed(step)
        out = pmodel(input_ids=ids, labels=ids)
        torch.manual_seed(step)
        want = serial(input_ids=ids, labels=ids)
        out.loss.backward()
        want.loss.backward()
        losses.append((float(out.loss), float(want.loss)))
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    serial_params = dict(serial.named_parameters())
    params = dict(pmodel.named_parameters())
    return {
        "losses": losses,
        "param_err": max(float((p.full_tensor() - serial_params[n]).abs().max()) for n, p in params.items()),
        "frozen_without_grad": all(p.grad is None for p in params.values() if not p.requires_grad),
        "trainable": sorted(n for n, p in params.items() if p.requires_grad)
        == sorted(n for n, p in serial_params.items() if p.requires_grad),
        "adapters_moved": all(
            not torch.equal(p.full_tensor(), _model().state_dict()[n]) for n, p in params.items() if "lora_B" in n
        ),
        "stored_fraction": sum(p.to_local().numel() for p in params.values())
        / sum(p.numel() for p in serial_params.values()),
    }


@pytest.mark.multirank
def test_lora_trains_like_serial_on_two_ranks() -> None:
    for rank, r in enumerate(run_ranks(2, _job, timeout=600)):
        for loss, want in r["losses"]:
            assert loss == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, r["losses"])
        assert r["param_err"] < 1e-5, (rank, r["param_err"])
        assert r["frozen_without_grad"] and r["trainable"] and r["adapters_moved"], (rank, r)
        assert r["stored_fraction"] < 0.6, (rank, r["stored_fraction"])
