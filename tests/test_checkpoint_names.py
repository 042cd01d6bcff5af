"""`load_checkpoint` reads a `save_pretrained` directory whose tensor names transformers keeps
historical (GPT-NeoX's `lm_head.weight` saved as `embed_out.weight`, as Pythia's checkpoints have it):
the model's own conversion mapping renames the keys before matching, equal to `from_pretrained`
(found by a new-user probe: the load raised "has 1 the model does not", and `strict=False` left the
head at its random init)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from multirank import run_ranks
from safetensors import safe_open

import autopar
from autopar.runtime.checkpoint_names import checkpoint_names, transformers_renamer

CONFIG = dict(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=32,
)


def _neox() -> transformers.GPTNeoXForCausalLM:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**CONFIG))


def test_the_renamer_gives_the_models_names_for_save_pretrained_keys(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _neox()
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys  # what transformers writes
    names = checkpoint_names(keys, transformers_renamer(model))
    assert names.by_name["lm_head.weight"] == "embed_out.weight" and not names.converted
    assert set(dict(model.named_parameters())) <= set(names.by_name)
    assert transformers_renamer(torch.nn.Linear(2, 2)) is None  # not a transformers model


def _load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    serial = transformers.GPTNeoXForCausalLM.from_pretrained(root)
    torch.manual_seed(1)
    fresh = _neox()
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(3))
    pmodel = autopar.parallelize(fresh, mesh, example_inputs=(ids,), example_kwargs={"labels": ids})
    result = autopar.load_checkpoint(pmodel, root)
    params = dict(pmodel.named_parameters())
    error = max(float((params[n].full_tensor() - q).abs().max()) for n, q in serial.named_parameters())
    loss = float(pmodel(ids, labels=ids).loss)
    return {"error": error, "loaded": len(result.loaded), "loss": loss, "serial": float(serial(ids, labels=ids).loss)}


@pytest.mark.multirank
def test_a_gpt_neox_save_pretrained_directory_loads_equal_to_from_pretrained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _neox().save_pretrained(tmp_path)
    for out in run_ranks(2, _load, str(tmp_path), timeout=300):
        assert out["error"] == 0.0, out
        assert out["loss"] == pytest.approx(out["serial"], rel=1e-5), out
