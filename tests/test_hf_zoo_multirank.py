"""transformers models of five families on 8 real gloo ranks, each built by the zoo's toy-config code
(`examples/hf_zoo.py`: library defaults with only the sizes shrunk) and called as its docs call it,
`model(**batch)` with labels: LLaMA (rotary, GQA), Mixtral (top-k experts through transformers'
grouped matmul), BERT (masked LM), ViT (image classification) and T5 (encoder-decoder, dropout on
in training mode). Two steps of SGD with momentum against the serial model on loss, every gradient
and the parameters; LLaMA on a 1-D mesh of 8 as well."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh

import autopar
from examples import hf_zoo

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

STEPS = 2
CASES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("LlamaForCausalLM", (2, 2, 2)),
    ("MixtralForCausalLM", (2, 2, 2)),
    ("BertForMaskedLM", (2, 2, 2)),
    ("ViTForImageClassification", (2, 2, 2)),
    ("T5ForConditionalGeneration", (2, 2, 2)),
    ("LlamaForCausalLM", (8,)),
)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the tensor's scale (float32 sums round with their terms' size)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    return float((got - want).abs().max()) / max(scale, 1e-6) if want.numel() else 0.0


def _job(rank: int, world_size: int) -> list[dict[str, Any]]:
    results = []
    for name, shape in CASES:
        names = ("x", "y", "z")[: len(shape)]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model, batch, _ = hf_zoo.build_working(hf_zoo.find(name), seed=0)  # alike on every rank
        serial = copy.deepcopy(model)
        pmodel = autopar.parallelize(model, mesh, example_inputs=(), example_kwargs=batch)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
        serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
        serial_params = dict(serial.named_parameters())
        result: dict[str, Any] = {"case": (name, shape), "losses": [], "grad_err": 0.0, "param_err": 0.0}
        for step in range(STEPS):
            step_batch = hf_zoo.batch(hf_zoo.find(name), model.config, seed=step)
            torch.manual_seed(step)
            out = pmodel(**step_batch)
            torch.manual_seed(step)
            want = serial(**step_batch)
            out.loss.backward()
            want.loss.backward()
            result["losses"].append((float(out.loss), float(want.loss)))
            for pname, p in pmodel.named_parameters():
                expected = serial_params[pname].grad
                if expected is None:
                    assert p.grad is None, pname
                    continue
                result["grad_err"] = max(result["grad_err"], _rel_err(p.grad.full_tensor(), expected))
            opt.step()
            serial_opt.step()
            opt.zero_grad()
            serial_opt.zero_grad()
        for pname, p in pmodel.named_parameters():
            result["param_err"] = max(result["param_err"], _rel_err(p.full_tensor(), serial_params[pname]))
        results.append(result)
    return results


def test_zoo_families_train_like_serial_on_8_ranks() -> None:
    for rank, results in enumerate(run_ranks(8, _job, timeout=900)):
        assert [r["case"] for r in results] == list(CASES), rank
        for r in results:
            for loss, serial_loss in r["losses"]:
                assert loss == pytest.approx(serial_loss, rel=1e-5, abs=1e-6), (rank, r)
            assert r["grad_err"] < 1e-4, (rank, r)
            assert r["param_err"] < 1e-4, (rank, r)
