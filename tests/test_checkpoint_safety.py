"""Checkpoints that try to run code or leave their directory, as a hostile file would hand them:
each is refused with `CheckpointError` before anything runs (the marker files the payloads would
create stay absent), and a real save still loads. Also: values a checkpoint must not slip in
(integers into a floating weight: refused; NaN: a warning), and debug dumps that refuse to
write through a link planted in their directory."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from multirank import run_ranks
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

import autopar
from autopar.api import compile_for_rank
from autopar.core.errors import CheckpointError, UsageError
from autopar.core.mesh import Mesh
from autopar.runtime.checkpoint import unreadable_checkpoint
from examples.models import make_mlp


class RunsACommand:
    """Unpickling this calls os.system: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _state() -> dict[str, torch.Tensor]:
    model, _ = make_mlp(0)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _dcp(directory: Path, state: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def _crafted(root: Path) -> dict[str, Path]:
    """Checkpoint directories, each crafted one way: row -> directory (markers under root/markers)."""
    state = _state()
    (root / "markers").mkdir()
    rows: dict[str, Path] = {}
    _dcp(root / "real", state)
    rows["real-dcp"] = root / "real"

    def metadata(name: str, payload: bytes) -> None:
        _dcp(root / name, state)
        (root / name / ".metadata").write_bytes(payload)
        rows[name] = root / name

    metadata("metadata-runs-a-command", pickle.dumps(RunsACommand(root / "markers" / "os-system")))
    real = pickle.loads((root / "real" / ".metadata").read_bytes())  # our own file: trusted here
    real.planner_data = RunsACommand(root / "markers" / "inside-metadata")
    metadata("metadata-hides-a-command", pickle.dumps(real))
    # BUILD on a class: sets Metadata.planted = 1 for the whole process
    metadata("metadata-patches-a-class", b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x07\x00\x00\x00plantedK\x01s\x86b.")
    metadata("metadata-not-metadata", pickle.dumps({"fc1.weight": [1, 2]}))
    # a data file outside the directory (a real one: without the check it would load)
    outside = pickle.loads((root / "real" / ".metadata").read_bytes())
    for info in outside.storage_data.values():
        info.relative_path = f"../real/{info.relative_path}"
    metadata("data-file-outside", pickle.dumps(outside))
    _dcp(root / "metadata-link-out", state)
    (root / "metadata-link-out" / ".metadata").unlink()
    (root / "metadata-link-out" / ".metadata").symlink_to(root / "real" / ".metadata")
    rows["metadata-link-out"] = root / "metadata-link-out"
    # a weight stored as a pickled object: DCP would read it with torch.load(weights_only=False)
    _dcp(root / "weight-as-object", {**state, "fc1.weight": RunsACommand(root / "markers" / "bytes-entry")})
    rows["weight-as-object"] = root / "weight-as-object"
    return rows


def _safetensors(root: Path) -> dict[str, Path]:
    state = _state()
    rows: dict[str, Path] = {}
    (root / "elsewhere").mkdir()
    save_file(state, str(root / "elsewhere" / "model.safetensors"))

    def index(name: str, shard: str) -> None:
        (root / name).mkdir()
        weight_map = dict.fromkeys(state, shard)
        (root / name / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        rows[name] = root / name

    index("index-parent", "../elsewhere/model.safetensors")
    index("index-absolute", str(root / "elsewhere" / "model.safetensors"))
    index("index-symlink-out", "model-00001-of-00001.safetensors")
    (root / "index-symlink-out" / "model-00001-of-00001.safetensors").symlink_to(root / "elsewhere" / "model.safetensors")
    (root / "single-file-link-out").mkdir()
    (root / "single-file-link-out" / "model.safetensors").symlink_to(root / "elsewhere" / "model.safetensors")
    rows["single-file-link-out"] = root / "single-file-link-out"
    # a Hugging Face cache snapshot: its files link to the repository's blobs (allowed)
    snapshot = root / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (root / "models--org--tiny" / "blobs").mkdir()
    save_file(state, str(root / "models--org--tiny" / "blobs" / "f00d"))
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    rows["hf-cache-snapshot"] = snapshot
    (root / "integers").mkdir()
    save_file({**state, "fc1.weight": state["fc1.weight"].round().to(torch.int64)}, str(root / "integers" / "model.safetensors"))
    rows["integer-weight"] = root / "integers"
    (root / "nan").mkdir()
    save_file({**state, "fc2.bias": torch.full_like(state["fc2.bias"], float("nan"))}, str(root / "nan" / "model.safetensors"))
    rows["nan-weight"] = root / "nan"
    return rows


def _load_rows(rank: int, world_size: int, rows: dict[str, str]) -> dict[str, tuple[str, str]]:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    model, batch = make_mlp(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    found: dict[str, tuple[str, str]] = {}
    for name, path in rows.items():
        with torch.no_grad():
            for p in pmodel.parameters():
                p.to_local().zero_()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                autopar.load_checkpoint(pmodel, path)
            error = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), model.parameters()))
            warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "autopar" in str(w.message)]
            found[name] = ("loaded", f"error {error} warnings {warned}")
        except CheckpointError as exc:
            found[name] = ("CheckpointError", f"{exc}\nhint? {bool(exc.hint)}")
        except Exception as exc:  # a raw error reaching the user: the test fails on it
            found[name] = (f"raw {type(exc).__name__}", str(exc))
    found["class-patched"] = ("yes" if hasattr(Metadata, "planted") else "no", "")
    return found


REFUSED = {
    "metadata-runs-a-command": "asks to load posix.system",
    "metadata-hides-a-command": "asks to load posix.system",
    "metadata-patches-a-class": "sets the state of a type",
    "metadata-not-metadata": "not torch.distributed.checkpoint metadata",
    "data-file-outside": "lies outside the checkpoint directory",
    "weight-as-object": "stores fc1.weight as a pickled object, not a tensor",
    "index-parent": "'../elsewhere/model.safetensors', which lies outside",
    "index-absolute": "which lies outside the checkpoint directory",
    "index-symlink-out": "which lies outside the checkpoint directory",
    "metadata-link-out": "names '.metadata', which lies outside",
    "single-file-link-out": "names 'model.safetensors', which lies outside",
    "integer-weight": "fc1.weight is stored as I64 in the checkpoint, but the model's fc1.weight is torch.float32",
}


@pytest.mark.multirank
def test_crafted_checkpoints_are_refused_and_run_nothing(tmp_path: Path) -> None:
    rows = {**_crafted(tmp_path), **_safetensors(tmp_path)}
    assert not any((tmp_path / "markers").iterdir())  # saving ran nothing either
    for found in run_ranks(2, _load_rows, {k: str(v) for k, v in rows.items()}, timeout=180):
        assert set(found) == set(rows) | {"class-patched"}, sorted(found)
        for name, text in REFUSED.items():
            kind, message = found[name]
            assert kind == "CheckpointError" and text in message and "hint? True" in message, (name, kind, message)
        for name in ("real-dcp", "hf-cache-snapshot"):
            assert found[name] == ("loaded", "error 0.0 warnings []"), (name, found[name])
        kind, message = found["nan-weight"]
        assert kind == "loaded" and "fc2.bias holds non-finite values" in message, found["nan-weight"]
        assert found["class-patched"][0] == "no"
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == []  # no payload ran


def test_a_dump_directory_holding_a_link_is_refused(tmp_path: Path) -> None:
    model, batch = make_mlp(0)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "dumps" / "rank0").mkdir(parents=True)
    (tmp_path / "dumps" / "rank0" / "summary.txt").symlink_to(victim)
    with pytest.raises(UsageError, match="is a symbolic link") as caught:
        compile_for_rank(model, Mesh.from_shape((2,)), batch, coords=(0,), dump_dir=tmp_path / "dumps")
    assert caught.value.hint and victim.read_text() == "precious"
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "rank0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match="is a symbolic link"):
        compile_for_rank(model, Mesh.from_shape((2,)), batch, coords=(0,), dump_dir=tmp_path / "linked")
    assert not (tmp_path / "elsewhere").exists()


def test_dcp_own_load_through_the_safe_reader_and_planner_unpickles_nothing(tmp_path: Path) -> None:
    """The second line of defence: even asked for a key DCP stored as a pickled object, the
    planner autopar gives `dcp.load` refuses to unpickle it."""
    from autopar.runtime.checkpoint_safety import SafePlanner, SafeReader

    (tmp_path / "markers").mkdir()
    _dcp(tmp_path / "ckpt", {**_state(), "fc1.weight": RunsACommand(tmp_path / "markers" / "ran")})
    with pytest.raises(CheckpointException) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"fc1.weight": torch.zeros(128, 32)}, storage_reader=SafeReader(tmp_path / "ckpt"), planner=SafePlanner(), no_dist=True)
    (failure,) = caught.value.failures.values()  # DCP wraps each rank's error
    assert "stores fc1.weight as a pickled object" in str(failure), failure
    assert not (tmp_path / "markers" / "ran").exists()


def test_a_pickled_checkpoint_is_named_as_a_pickle_with_its_conversion(tmp_path: Path) -> None:
    """A `pytorch_model.bin` / `model.pt` a user got elsewhere: refused naming the pickle format and
    the one-time conversion to safetensors, never opened (its payload's marker stays absent)."""
    (tmp_path / "markers").mkdir()
    bin_dir = tmp_path / "hub-download"
    bin_dir.mkdir()
    with open(bin_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc1.weight": RunsACommand(tmp_path / "markers" / "bin")}, f)
    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    for path, named in ((bin_dir, "holds pytorch_model.bin"), (bin_dir / "pytorch_model.bin", "is pytorch_model.bin"),
                        (tmp_path / "model.pt", "is model.pt")):
        error = unreadable_checkpoint(path)
        assert isinstance(error, CheckpointError)
        assert named in str(error) and "never unpickles" in str(error), str(error)
        assert "safetensors.torch.save_file(torch.load(path, weights_only=True)" in str(error.hint), error.hint
    assert "does not exist" in str(unreadable_checkpoint(tmp_path / "absent.pt"))
    assert "without model.safetensors" in str(unreadable_checkpoint(tmp_path / "markers"))
    assert not any((tmp_path / "markers").iterdir())  # nothing was unpickled
