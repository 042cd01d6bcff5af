"""Reading a checkpoint without running what it hands us and without leaving its directory.

torch.distributed.checkpoint (DCP) stores its `.metadata` as a plain pickle, and its reader
unpickles it with `pickle.load`: a crafted file runs code on every rank that loads it. Here the
metadata is read by an unpickler that resolves only the classes DCP itself writes into it (its
metadata dataclasses, `torch.Size`, dtypes, layouts, paths), as `torch.load(weights_only=True)`
does for tensors, and refuses an instance's state set on a class (which would patch torch's
classes for the whole process). DCP's load path goes through `SafeReader` (the same metadata
reader) and `SafePlanner` (no non-tensor entry is unpickled: DCP reads those with
`torch.load(weights_only=False)`); its tensors are read with `torch.load(weights_only=True)`.
Every file a checkpoint names (DCP's data files, a safetensors index's shards) must lie inside
its directory, symlinks resolved.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from autopar.core.errors import CheckpointError

DCP_METADATA = ".metadata"

_DCP = "torch.distributed.checkpoint.metadata"
# what DCP's writer puts into .metadata, by the (module, name) the pickle names; nothing else resolves
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(_DCP, c.__name__): c for c in (
        Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
        BytesStorageMetadata, ChunkStorageMetadata, _MEM_FORMAT_ENCODING,
    )},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("pathlib", c.__name__): c for c in (
        pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath
    )},
    ("collections", "OrderedDict"): OrderedDict,
}
# the classes whose instances' state the pickle may set (BUILD); never a class itself
_BUILDABLE: frozenset[type] = frozenset(v for v in _ALLOWED.values() if isinstance(v, type))

_UNSAFE_HINT = (
    "this file was not written by torch.distributed.checkpoint (or was altered): do not load "
    "checkpoints from untrusted sources; save it again with autopar.save_checkpoint"
)


class _AllowListUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked
    """Resolves only allow-listed globals; `BUILD` only on instances of them (never on a class,
    which would set attributes on torch's own classes)."""

    def __init__(self, file: io.BufferedIOBase, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.source} asks to load {module}.{name}, which a torch.distributed.checkpoint "
            "metadata file never holds: refused (unpickling it could run code)",
            hint=_UNSAFE_HINT,
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent id, which DCP metadata never holds: refused", hint=_UNSAFE_HINT)

    def _checked_build(self) -> None:
        inst = self.stack[-2]  # type: ignore[attr-defined]  # below the state BUILD sets
        if isinstance(inst, type) or type(inst) not in _BUILDABLE:
            raise CheckpointError(
                f"{self.source} sets the state of a {type(inst).__name__}, which DCP metadata never does: refused",
                hint=_UNSAFE_HINT,
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _checked_build}  # type: ignore[attr-defined,dict-item]


def read_dcp_metadata(directory: Path, rank: int | None = None) -> Metadata:
    """The `.metadata` of a DCP directory, unpickled through the allow-list; a file that asks for
    anything else, or is not DCP metadata, raises `CheckpointError`."""
    name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
    path = inside(directory, name, str(directory))
    try:
        with open(path, "rb") as handle:
            metadata = _AllowListUnpickler(handle, path).load()  # type: ignore[arg-type]
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or foreign: the unpickler raises several kinds
        raise CheckpointError(
            f"{path} is not readable checkpoint metadata: {type(exc).__name__}: {exc}",
            hint="the checkpoint may be truncated: save it again with autopar.save_checkpoint",
        ) from exc
    entries = getattr(metadata, "state_dict_metadata", None)
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(entries, dict)
        or not all(isinstance(k, str) for k in entries)
        or not all(isinstance(e, (TensorStorageMetadata, BytesStorageMetadata)) for e in entries.values())
        or not isinstance(metadata.storage_data, dict)
    ):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__} that is not torch.distributed.checkpoint metadata "
            "(a Metadata of tensor and object entries by name)",
            hint="pass the directory torch.distributed.checkpoint or autopar.save_checkpoint wrote",
        )
    _check_files(directory, metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _check_files(directory: Path, metadata: Metadata) -> None:
    """Every data file the metadata names lies inside `directory` (no `..`, absolute path or link out)."""
    names: set[str] = set()  # one entry per block, but a few files
    for info in metadata.storage_data.values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str):
            raise CheckpointError(
                f"{directory / DCP_METADATA} names a data file that is not a path ({relative!r})", hint=_UNSAFE_HINT
            )
        names.add(relative)
    for relative in sorted(names):
        inside(directory, relative, f"{directory / DCP_METADATA}")


def inside(directory: Path, name: str, named_by: str) -> Path:
    """`directory / name` when `name` is a relative path that stays in `directory` and, symlinks
    resolved, lies inside it; else `CheckpointError` naming the file that named it. A Hugging
    Face cache snapshot (`.../snapshots/<revision>/`) links its files to the repository's
    `blobs/`: there the repository folder bounds the links instead."""
    parts = Path(name).parts
    lexical_out = os.path.isabs(name) or ".." in parts or not parts
    root = directory.resolve()
    hub = root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--", "spaces--"))
    bound = root.parent.parent if hub else root
    target = (directory / name).resolve()
    if lexical_out or not target.is_relative_to(bound):
        raise CheckpointError(
            f"{named_by} names {name!r}, which lies outside the checkpoint directory {directory} "
            f"(it resolves to {target}): refused",
            hint="a checkpoint names only files in its own directory: copy the shards in, or "
            "do not load this checkpoint (it may have been crafted to read other files)",
        )
    return directory / name


def check_tensor_entries(directory: Path, metadata: Metadata, keys: list[str]) -> None:
    """The keys a model loads are tensors in the checkpoint: a non-tensor entry would be read by
    DCP with `torch.load(weights_only=False)`, which can run code."""
    for key in keys:
        entry = metadata.state_dict_metadata[key]
        if not isinstance(entry, TensorStorageMetadata):
            what = "a pickled object" if isinstance(entry, BytesStorageMetadata) else type(entry).__name__
            raise CheckpointError(
                f"{directory} stores {key} as {what}, not a tensor: refused (reading it would unpickle it)",
                hint="the model's tensors must be saved as tensors: save it again with autopar.save_checkpoint",
            )


class SafeReader(FileSystemReader):
    """DCP's file reader with the allow-listed metadata reader; data files checked to lie inside."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.directory = Path(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.directory = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.directory, kwargs.get("rank"))
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner that refuses to unpickle a non-tensor entry (DCP's own does it with
    `torch.load(weights_only=False)`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"the checkpoint stores {read_item.dest_index.fqn} as a pickled object, not a tensor: refused",
            hint="the model's tensors must be saved as tensors: save it again with autopar.save_checkpoint",
        )


def safetensors_is_floating(dtype: str) -> bool:
    """Whether a safetensors dtype name (F32, BF16, F8_E4M3, I64, BOOL, ...) holds floating values."""
    return dtype.startswith(("F", "BF", "C"))


def check_dtype(name: str, key: str, stored: str, stored_floating: bool, target: torch.Tensor) -> None:
    """A floating tensor of the model loads only floating values: integers or booleans there are
    not this model's weights (a quantized or foreign checkpoint), and casting them is silent."""
    if target.is_floating_point() and not stored_floating:
        raise CheckpointError(
            f"{key} is stored as {stored} in the checkpoint, but the model's {name} is {target.dtype}: refused",
            hint="the checkpoint is not of this model (or was quantized): load a floating-point checkpoint of it",
        )


def warn_non_finite(name: str, key: str, values: torch.Tensor) -> None:
    """Non-finite values load, with a warning: serial `load_state_dict` takes them too, and a
    buffer may hold inf on purpose (a mask); a parameter with NaN trains to NaN. `values`: what
    this rank read (a DTensor: its local block)."""
    with torch.no_grad():
        values = values.to_local() if isinstance(values, DTensor) else values.detach()
    if values.is_floating_point() and values.numel() and not bool(torch.isfinite(values).all()):
        warnings.warn(
            f"autopar.load_checkpoint: {key} holds non-finite values (NaN or inf) in this rank's block "
            f"of the model's {name}",
            RuntimeWarning,
            stacklevel=4,
        )
