"""`autopar.save_checkpoint` on real gloo ranks: each rank writes its own blocks, and a save killed
part-way (every rank dying while writing its data files, or rank 0 dying right after writing the
metadata) leaves the previous checkpoint loadable and complete: the next load gives the earlier
step's values exactly, never a mix. A completed save replaces it; the serial model loads it with
`torch.distributed.checkpoint.load`; a directory that is not a checkpoint is never replaced."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from multirank import run_ranks, run_ranks_with_faults, train_side_by_side
from torch.distributed.checkpoint import FileSystemWriter

import autopar
from examples.models import make_mlp


def _pmodel(world_size: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    model, batch = make_mlp(seed)
    return autopar.parallelize(model, mesh, example_inputs=batch, timeout=20), batch


def _step(pmodel: Any, batch: Any) -> None:
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.5)
    pmodel(*batch).backward()
    opt.step()


def _values(pmodel: Any) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in pmodel.state_dict().items()}


def _die_after(method: str, ranks: tuple[int, ...]) -> None:
    """The save of this rank ends here, the process killed (as by SIGKILL: no cleanup runs)."""
    original = getattr(FileSystemWriter, method)

    def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if method == "write_data":
            result.wait()  # this rank's data files are on disk
        if int(os.environ["RANK"]) in ranks:
            os._exit(9)
        return result

    setattr(FileSystemWriter, method, dying)


def _save_then_die(rank: int, world_size: int, root: str, method: str, ranks: tuple[int, ...]) -> None:
    pmodel, batch = _pmodel(world_size, 0)
    if not Path(root, "ckpt").exists():  # the first job: step 1 is the checkpoint to keep
        _step(pmodel, batch)
        autopar.save_checkpoint(pmodel, f"{root}/ckpt")
        kept = _values(pmodel)  # a collective: on every rank
        if rank == 0:
            torch.save(kept, f"{root}/kept.pt")
    autopar.load_checkpoint(pmodel, f"{root}/ckpt")
    _step(pmodel, batch)  # the step whose save is killed
    _die_after(method, ranks)
    autopar.save_checkpoint(pmodel, f"{root}/ckpt")


def _load(rank: int, world_size: int, root: str, save: bool) -> dict[str, Any]:
    pmodel, batch = _pmodel(world_size, 1)  # other initial values: the load must replace them all
    autopar.load_checkpoint(pmodel, f"{root}/ckpt")
    kept = torch.load(f"{root}/kept.pt", weights_only=True)
    loaded = _values(pmodel)
    found: dict[str, Any] = {"kept": max(float((loaded[k] - kept[k]).abs().max()) for k in kept)}
    if save:
        _step(pmodel, batch)
        autopar.save_checkpoint(pmodel, f"{root}/ckpt")
        stepped = _values(pmodel)
        again, _ = _pmodel(world_size, 2)
        autopar.load_checkpoint(again, f"{root}/ckpt")
        found["new"] = max(float((v - stepped[k]).abs().max()) for k, v in _values(again).items())
        found["moved"] = max(float((stepped[k] - kept[k]).abs().max()) for k in kept)
        if rank == 0:
            torch.save(stepped, f"{root}/stepped.pt")
        (Path(root) / "mine").mkdir(exist_ok=True)
        (Path(root) / "mine" / "notes.txt").write_text("keep me")
        try:
            autopar.save_checkpoint(pmodel, f"{root}/mine")
            found["over-user-dir"] = "saved"
        except autopar.CheckpointError as exc:
            found["over-user-dir"] = str(exc)
        Path(root, "a-file").write_text("")
        try:  # rank 0 cannot make the directory: every rank raises, none waits
            autopar.save_checkpoint(pmodel, f"{root}/a-file/ckpt")
            found["under-a-file"] = "saved"
        except autopar.CheckpointError as exc:
            found["under-a-file"] = str(exc)
    return found


@pytest.mark.multirank
def test_a_killed_save_leaves_the_previous_checkpoint_and_a_completed_one_replaces_it(tmp_path: Path) -> None:
    root = str(tmp_path)
    for method, ranks in (("write_data", (0, 1)), ("finish", (0,))):  # data files written; metadata too
        ended = run_ranks_with_faults(2, _save_then_die, root, method, ranks, timeout=120)
        assert ended[0][0] == "died", ended
        assert (tmp_path / ".ckpt.saving").is_dir()  # the killed save's files, never published
        for found in run_ranks(2, _load, root, False, timeout=120):
            assert found == {"kept": 0.0}, (method, found)
    for found in run_ranks(2, _load, root, True, timeout=120):
        assert found["kept"] == 0.0 and found["new"] == 0.0 and found["moved"] > 1e-3, found
        assert "it is a directory that holds other files" in found["over-user-dir"], found
        assert "failed: rank 0: cannot create" in found["under-a-file"], found  # on every rank
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    serial, _ = make_mlp(3)
    state = serial.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)  # the serial model loads it
    stepped = torch.load(tmp_path / "stepped.pt", weights_only=True)
    assert max(float((state[k] - stepped[k]).abs().max()) for k in stepped) == 0.0


def test_save_checkpoint_is_a_public_name() -> None:
    assert autopar.save_checkpoint.__module__ == "autopar.api"
    with pytest.raises(autopar.CheckpointError, match="takes the module autopar.parallelize returned"):
        autopar.save_checkpoint(torch.nn.Linear(2, 2), "unused")  # type: ignore[arg-type]


def _state_moves(rank: int, world_size: int) -> dict[str, Any]:
    import copy
    import io
    import pickle

    from torch.distributed.tensor import Shard

    pmodel, batch = _pmodel(world_size, 0)
    serial, _ = make_mlp(5)  # other values: the load must replace every block
    found: dict[str, Any] = {
        "sharded": sorted(k for k, v in pmodel.state_dict().items() if any(isinstance(p, Shard) for p in v.placements)),
    }
    for name, move in (
        ("pickle", lambda: pickle.dumps(pmodel)),
        ("torch.save", lambda: torch.save(pmodel, io.BytesIO())),
        ("deepcopy", lambda: copy.deepcopy(pmodel)),
        ("assign", lambda: pmodel.load_state_dict(serial.state_dict(), assign=True)),
        ("wrong-shape", lambda: pmodel.load_state_dict({**serial.state_dict(), "fc1.weight": torch.zeros(3, 3)})),
        ("missing-key", lambda: pmodel.load_state_dict({k: v for k, v in serial.state_dict().items() if k != "fc2.bias"})),
    ):
        try:
            move()
            found[name] = "no error"
        except autopar.AutoparError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a raw error reaching the user: the test fails on it
            found[name] = f"raw {type(exc).__name__}: {exc}"
    result = pmodel.load_state_dict(serial.state_dict())
    found["keys"] = (list(result.missing_keys), list(result.unexpected_keys))
    found["loaded"] = max(float((v - serial.state_dict()[k]).abs().max()) for k, v in _values(pmodel).items())
    losses = train_side_by_side([(pmodel, batch), (serial, batch)], steps=2)
    found["losses"] = losses
    found["params"] = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters()))
    pmodel.load_state_dict(pmodel.state_dict())  # its own state dict still loads
    fresh, _ = make_mlp(9)  # the serial model takes the parallel one's trained state, made whole
    try:  # ... not the DTensors: torch raises inside the serial model, which the docs name (full_state_dict)
        fresh.load_state_dict(pmodel.state_dict())
        found["serial from blocks"] = "no error"
    except RuntimeError as exc:
        found["serial from blocks"] = str(exc)
    found["full before"] = max(float((p - q).abs().max()) for p, q in zip(fresh.parameters(), serial.parameters()))
    fresh.load_state_dict(pmodel.full_state_dict())
    found["full"] = max(float((p - q).abs().max()) for p, q in zip(fresh.parameters(), serial.parameters()))
    found["rank0_only"] = len(pmodel.full_state_dict(rank0_only=True))
    return found


@pytest.mark.multirank
def test_a_serial_state_dict_loads_and_copies_are_refused_with_what_to_do() -> None:
    results = run_ranks(2, _state_moves, timeout=120)
    for found in results:
        assert found["sharded"], "the test needs a sharded parameter"
        for name in ("pickle", "torch.save", "deepcopy"):
            assert found[name].startswith("UsageError") and "autopar.save_checkpoint" in found[name], found[name]
        assert found["assign"].startswith("UsageError: load_state_dict(assign=True)"), found["assign"]
        assert found["wrong-shape"].startswith("CheckpointError: load_state_dict: fc1.weight has shape [3, 3]"), found["wrong-shape"]
        assert found["missing-key"].startswith("CheckpointError") and "fc2.bias" in found["missing-key"], found["missing-key"]
        assert found["keys"] == ([], []) and found["loaded"] == 0.0, found
        first, first_serial, second, second_serial = found["losses"]
        assert abs(first - first_serial) < 1e-6 and abs(second - second_serial) < 1e-5, found["losses"]
        assert found["params"] < 1e-5, found["params"]
        assert found["full before"] > 0.01 and found["full"] < 1e-5, found
        assert "mixed torch.Tensor and DTensor" in found["serial from blocks"], found["serial from blocks"]
    assert [found["rank0_only"] > 0 for found in results] == [True, False]


GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)


def _export(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    pmodel = autopar.parallelize(model, mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids})
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.5)
    pmodel(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    autopar.save_checkpoint(pmodel, f"{root}/hf", format="safetensors")
    values = _values(pmodel)
    if rank == 0:
        torch.save(values, f"{root}/exported.pt")
    with torch.no_grad():
        for p in pmodel.parameters():
            p.to_local().zero_()  # the load must fill every tensor
    loaded = autopar.load_checkpoint(pmodel, f"{root}/hf")
    return {
        "sharded": any(v.placements[0].is_shard() for v in pmodel.state_dict().values()),
        "reloaded": (loaded.missing, loaded.unexpected, max(float((v - values[k]).abs().max()) for k, v in _values(pmodel).items())),
    }


@pytest.mark.multirank
def test_a_safetensors_export_loads_with_from_pretrained(tmp_path: Path) -> None:
    import transformers
    from safetensors import safe_open

    for found in run_ranks(2, _export, str(tmp_path), timeout=180):
        assert found["sharded"] and found["reloaded"] == ([], [], 0.0), found
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
    per_file = []
    for name in files:
        with safe_open(str(tmp_path / "hf" / name), framework="pt") as handle:
            per_file.append(len(list(handle.keys())))
    assert all(0 < n < len(index["weight_map"]) for n in per_file), per_file  # no rank wrote it all
    serial, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    exported = torch.load(tmp_path / "exported.pt", weights_only=True)
    state = serial.state_dict()
    assert max(float((state[k] - v).abs().max()) for k, v in exported.items()) == 0.0
    assert serial.lm_head.weight is serial.transformer.wte.weight  # tied again
