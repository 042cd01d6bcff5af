"""Checkpoints of a pipelined module (docs/pipeline.md#checkpoints) on 4 real gloo ranks: what a
pp=2 x tp=2 module saves is the tensor-only module's checkpoint (same keys, global shapes and
values) and loads into it; a tensor-only module's checkpoint, and a safetensors file, load into
pp=2 x 2 and 1-D pp=4 modules (every copy of the tied embedding/head included), whose next loss
is the serial model's; a strict load of a checkpoint lacking a tensor raises on every rank."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from multirank import run_ranks, train_side_by_side
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler.pipeline import PipelinedModule
from autopar.compiler.pipeline_checkpoint import load_pipelined_checkpoint, pipelined_state_dict
from autopar.runtime.module import ParallelModule
from examples.models import make_gpt

TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-6}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _zero(module: torch.nn.Module) -> None:
    """Every tensor this rank stores set to zero: a load must fill each."""
    with torch.no_grad():
        for p in module.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()


def _same_as(module: torch.nn.Module, reference: torch.nn.Module) -> None:
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in module.named_parameters():
        torch.testing.assert_close(_whole(p), ref[name].detach(), **TOL, msg=name)


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, batch = make_gpt(0, batch_size=8, n_layer=2)
    serial = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch, pipeline=autopar.PipelineOptions(microbatches=2))
    assert isinstance(pmodel, PipelinedModule)
    first, _ = train_side_by_side([(pmodel, batch), (serial, batch)], steps=1)
    _same_as(pmodel, serial)

    # pipelined -> tensor-only: the pipelined checkpoint loads into a (2, 2) module
    state = pipelined_state_dict(pmodel)
    out["keys"] = list(state)
    out["dtensors"] = all(isinstance(t, DTensor) for t in state.values())
    autopar.save_checkpoint(pmodel, f"{root}/pp")  # what dcp.save(state) writes, atomically
    other, _ = make_gpt(1, batch_size=8, n_layer=2)
    tensor_only = autopar.parallelize(
        other, init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y")), example_inputs=batch
    )
    assert isinstance(tensor_only, ParallelModule)
    loaded = autopar.load_checkpoint(tensor_only, f"{root}/pp")
    assert (loaded.missing, loaded.unexpected) == ([], []), loaded
    _same_as(tensor_only, serial)
    stored = tensor_only.state_dict()
    full = {name: t.full_tensor() for name, t in stored.items()}  # every rank, in one order
    for name, p in pmodel.named_parameters():  # every copy of the tied weight, bit for bit
        assert torch.equal(_whole(p), full[name]), name
    autopar.save_checkpoint(tensor_only, f"{root}/tp")

    # tensor-only -> pipelined: the next step's loss is the serial one's
    _zero(pmodel)
    result = load_pipelined_checkpoint(pmodel, f"{root}/tp")
    out["pp2x2"] = (result.format, sorted(result.loaded), result.missing, result.unexpected)
    _same_as(pmodel, serial)
    second, second_serial = float(pmodel(*batch)), float(serial(*batch))
    torch.testing.assert_close(second, second_serial, **TOL)
    out["losses"] = (first, second, second_serial)

    # strict: a tensor missing (and a key the model lacks) fails on every rank alike
    partial = {k: v for k, v in stored.items() if k != "wpe.weight"}
    dcp.save({**partial, "extra.weight": torch.zeros(3)}, checkpoint_id=f"{root}/partial")
    try:
        load_pipelined_checkpoint(pmodel, f"{root}/partial")
        out["strict"] = "no error"
    except autopar.CheckpointError as exc:
        out["strict"] = str(exc)
    lenient = load_pipelined_checkpoint(pmodel, f"{root}/partial", strict=False)
    out["lenient"] = (lenient.missing, lenient.unexpected)
    with pytest.raises(autopar.CheckpointError, match="does not exist"):
        load_pipelined_checkpoint(pmodel, f"{root}/nowhere")

    # a safetensors file (one name of the tied weight, as save_pretrained writes it)
    _zero(pmodel)
    load_pipelined_checkpoint(pmodel, f"{root}/initial.safetensors")
    _same_as(pmodel, initial)

    # 1-D pp=4: the user's own tensors, the tied weight on ranks 0 and 3
    fresh, _ = make_gpt(2, batch_size=8, n_layer=2)
    pp4 = autopar.parallelize(
        fresh,
        init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)),
        example_inputs=batch,
        pipeline=autopar.PipelineOptions(microbatches=4, stage_boundaries=["blocks.0", "blocks.1", "ln_f"]),
    )
    assert isinstance(pp4, PipelinedModule)
    result = load_pipelined_checkpoint(pp4, f"{root}/tp")
    out["pp4"] = sorted(result.loaded)
    _same_as(pp4, serial)
    torch.testing.assert_close(float(pp4(*batch)), second_serial, **TOL)
    state = pipelined_state_dict(pp4)
    out["pp4_plain"] = not any(isinstance(t, DTensor) for t in state.values())
    out["pp4_keys"] = list(state)
    dcp.save(state, checkpoint_id=f"{root}/pp4")
    _zero(pp4)
    load_pipelined_checkpoint(pp4, f"{root}/initial.safetensors")
    _same_as(pp4, initial)
    return out


def _read(directory: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint read whole in this process."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    state = {k: torch.empty(tuple(m.size)) for k, m in metadata.state_dict_metadata.items()}  # type: ignore[union-attr]
    with warnings.catch_warnings():  # "no process group: loading in a single process", as asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state


@pytest.mark.multirank
def test_pipelined_and_tensor_only_checkpoints_are_one_format(tmp_path: Path) -> None:
    model, _ = make_gpt(0, batch_size=8, n_layer=2)
    whole = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(whole, str(tmp_path / "initial.safetensors"))
    results = run_ranks(4, _job, str(tmp_path), timeout=400)

    names = list(model.state_dict())
    for keys in ("keys", "pp4_keys"):
        held = [k for r in results for k in r[keys]]
        assert sorted(set(held)) == sorted(names)  # every key, the tied one under both names
        assert len(held) == len(set(held)) * (2 if keys == "keys" else 1)  # once per tp rank
    assert all(r["dtensors"] and r["pp4_plain"] for r in results)
    assert "wte.weight" in results[0]["keys"] and "wte.weight" not in results[2]["keys"]
    for rank, r in enumerate(results):
        fmt, loaded, missing, unexpected = r["pp2x2"]
        assert (fmt, missing, unexpected) == ("DCP", [], [])
        # every rank loads its stages' tensors, the tied weight on both stages
        assert "wte.weight" in loaded and ("wpe.weight" in loaded) == (rank < 2)
        assert "lacks 1 of the model's tensors (wpe.weight)" in r["strict"], r["strict"]
        assert "has 1 the model does not (extra.weight)" in r["strict"], r["strict"]
        assert r["lenient"] == ((["wpe.weight"] if rank < 2 else []), ["extra.weight"])
        assert ("wte.weight" in r["pp4"]) == (rank in (0, 3))
    first, second, second_serial = results[0]["losses"]
    assert second < first and abs(second - second_serial) < 1e-5

    pp, tp, pp4 = (_read(tmp_path / d) for d in ("pp", "tp", "pp4"))
    assert list(pp) and sorted(pp) == sorted(tp) == sorted(pp4) == sorted(names)
    for key in names:
        assert pp[key].shape == tp[key].shape == model.state_dict()[key].shape, key
        assert torch.equal(pp[key], tp[key]) and torch.equal(tp[key], pp4[key]), key
