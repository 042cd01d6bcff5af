"""`autopar.load_checkpoint`: a transformers model built on the meta device, parallelized, then
loaded from what a serial model saved (`save_pretrained` safetensors, one file or sharded, a base
model's checkpoint, a torch.distributed.checkpoint directory), each rank reading only its blocks,
trains equal to the serial model loaded from the same files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from multirank import run_ranks

import autopar

CONFIG = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)


def _model() -> transformers.GPT2LMHeadModel:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def _batch() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(3))


def _load_and_train(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    ids = _batch()
    with torch.device("meta"):
        model = _model()
    pmodel = autopar.parallelize(model, mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids})
    serial = transformers.GPT2LMHeadModel.from_pretrained(f"{root}/single")
    serial.train()  # from_pretrained returns a model in eval mode; training turns dropout back on
    result: dict[str, Any] = {}
    for kind in ("single", "sharded", "base", "dcp"):
        with torch.no_grad():
            for p in pmodel.parameters():
                p.to_local().zero_()  # each load must fill every tensor
        loaded = autopar.load_checkpoint(pmodel, f"{root}/{kind}")
        result[kind] = {
            "format": loaded.format,
            "missing": loaded.missing,
            "unexpected": loaded.unexpected,
            "error": max(
                float((p.full_tensor() - q).abs().max())
                for p, q in zip(pmodel.parameters(), serial.parameters())
            ),
        }
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(2):
        for module, optimizer in ((pmodel, opt), (serial, serial_opt)):
            optimizer.zero_grad()
            torch.manual_seed(step)  # the same dropout masks for both
            loss = module(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    result["losses"] = losses
    result["params"] = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters()))
    return result


@pytest.mark.multirank
def test_checkpoints_a_serial_model_saved_load_into_a_meta_built_model_and_train_equal(tmp_path: Path) -> None:
    torch.manual_seed(0)
    serial = _model()
    serial.save_pretrained(tmp_path / "single")
    serial.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    serial.transformer.save_pretrained(tmp_path / "base")  # the base model: keys without "transformer."
    dcp.save(serial.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    shards = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1
    for result in run_ranks(4, _load_and_train, str(tmp_path), timeout=300):
        for kind, fmt in (("single", "safetensors"), ("sharded", "safetensors"), ("base", "safetensors"), ("dcp", "DCP")):
            assert result[kind] == {"format": fmt, "missing": [], "unexpected": [], "error": 0.0}, (kind, result[kind])
        first, first_serial, second, second_serial = result["losses"]
        assert abs(first - first_serial) < 1e-6 and abs(second - second_serial) < 1e-5, result["losses"]
        assert result["params"] < 1e-5, result["params"]


def test_load_checkpoint_is_a_public_name() -> None:
    assert autopar.load_checkpoint.__module__ == "autopar.api"  # pipelined modules too
    assert issubclass(autopar.CheckpointError, autopar.AutoparError)
