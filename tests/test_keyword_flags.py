"""Flags as keywords (`CLIPModel(..., return_loss=True)`) and as positions: bool, int, float, str,
None and enum values are constants of the program they select; another value compiles another
program, each equal to serial."""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks

import autopar


class Pool(enum.Enum):
    MEAN = "mean"
    MAX = "max"


class Flagged(nn.Module):
    """Each flag changes what the forward computes, as `return_loss`, `output_hidden_states` or
    a pooling choice do in model libraries."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.head = nn.Linear(16, 5)

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        return_loss: bool = False,
        repeats: int = 1,
        scale: float = 1.0,
        act: str = "relu",
        pool: Pool = Pool.MEAN,
    ) -> Any:
        h = self.embed(x) * scale
        for _ in range(repeats):
            h = F.relu(h) if act == "relu" else F.gelu(h)
        h = h.mean(1) if pool is Pool.MEAN else h.amax(1)
        logits = self.head(h)
        if return_loss:
            assert labels is not None
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}
        return {"logits": logits}


def test_a_flag_in_example_kwargs_plans() -> None:
    # was InternalError: KeyError: 'val' from the plan stage
    x, labels = torch.randn(4, 3, 12), torch.randint(0, 5, (4,))
    kwargs = {
        "labels": labels,
        "return_loss": True,
        "act": "gelu",
        "scale": 0.5,
        "pool": Pool.MAX,
        "repeats": 2,
    }
    assert "memory per rank" in str(autopar.plan(Flagged(), (2,), (x,), example_kwargs=kwargs))


CALLS: list[dict[str, Any]] = [
    {"return_loss": True},
    {"return_loss": True, "scale": 0.5, "act": "gelu"},
    {"return_loss": True, "pool": Pool.MAX, "repeats": 2},
    {"return_loss": True, "repeats": 3},
    {"return_loss": False},
    {"return_loss": None},
]


def _flags(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model, serial = Flagged(), Flagged()
    serial.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    x, labels = torch.randn(8, 3, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=(x,), example_kwargs={"labels": labels, **CALLS[0]}
    )
    popt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for flags in CALLS:
        for module, opt in ((pmodel, popt), (serial, sopt)):
            opt.zero_grad()
            out = module(x, labels=labels, **flags)
            loss = out["loss"] if "loss" in out else F.cross_entropy(out["logits"], labels)
            loss.backward()
            opt.step()
            if module is pmodel:
                parallel = float(loss)
        worst["loss"] = max(worst["loss"], abs(parallel - float(loss)))
        for p, q in zip(pmodel.parameters(), serial.parameters()):
            assert p.grad is not None and q.grad is not None
            worst["grad"] = max(worst["grad"], float((p.grad.full_tensor() - q.grad).abs().max()))
            worst["param"] = max(worst["param"], float((p.full_tensor() - q).abs().max()))
    out = pmodel(x, labels, True)  # the positional form: another structure, another program
    return {"worst": worst, "programs": len(pmodel.programs), "keys": sorted(out), "clip": _clip(mesh)}


def _clip(mesh: Any) -> float:
    """transformers' CLIPModel(..., return_loss=True), as the issue found it: the largest loss or
    gradient difference from serial."""
    from transformers import CLIPConfig, CLIPModel

    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    text |= {"num_attention_heads": 2, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 16, "patch_size": 8}
    torch.manual_seed(0)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model, serial = CLIPModel(config), CLIPModel(config)
    serial.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(2)
    ids, pixels = torch.randint(2, 64, (4, 8), generator=gen), torch.randn(4, 3, 16, 16, generator=gen)
    batch = {"input_ids": ids, "pixel_values": pixels}
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=(), example_kwargs={**batch, "return_loss": True}
    )
    loss = pmodel(**batch, return_loss=True).loss
    expected = serial(**batch, return_loss=True).loss
    loss.backward()
    expected.backward()
    worst = abs(float(loss) - float(expected))
    for (name, p), q in zip(pmodel.named_parameters(), serial.parameters()):
        if q.grad is not None:
            assert p.grad is not None, name
            worst = max(worst, float((p.grad.full_tensor() - q.grad).abs().max()))
    return worst


@pytest.mark.multirank
def test_flags_select_programs_equal_to_serial_on_gloo() -> None:
    for result in run_ranks(2, _flags, timeout=300):
        worst = result["worst"]
        assert worst["loss"] < 1e-5 and worst["grad"] < 1e-5 and worst["param"] < 1e-5, worst
        assert result["programs"] == 7, result  # one per distinct call (return_loss None != False)
        assert result["keys"] == ["logits", "loss"], result
        assert result["clip"] < 1e-5, result
