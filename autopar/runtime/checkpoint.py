"""`load_checkpoint`: real weights into a parallel module, each rank reading only its own blocks.

Two formats: a transformers `save_pretrained` directory (`model.safetensors`, or shards listed in
`model.safetensors.index.json`), read slice by slice with safetensors, and a
torch.distributed.checkpoint directory (`.metadata`), whose reader reshards into the stored
DTensors. Names are the model's own state-dict keys; a tied weight is read once, under whichever
of its names the checkpoint has; a checkpoint of the base model (without the task model's
`base_model_prefix`, or with it) maps too, as transformers maps it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from autopar.core.errors import CheckpointError
from autopar.runtime.checkpoint_names import checkpoint_names
from autopar.runtime.checkpoint_prefix import find_scope
from autopar.runtime.checkpoint_safety import (
    DCP_METADATA,
    SafePlanner,
    SafeReader,
    check_dtype,
    check_tensor_entries,
    inside,
    read_dcp_metadata,
    safetensors_is_floating,
    warn_non_finite,
)
from autopar.runtime.module import ParallelModule

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
SAMPLE_BYTES = 1 << 16  # read from each end of each file to compare checkpoints across ranks


@dataclass
class LoadResult:
    """What `load_checkpoint` did: tensors loaded (by the module's name), the module's tensors the
    checkpoint lacks, and the checkpoint's keys that name none of the module's tensors."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    format: str = ""
    prefix: str = ""  # the submodule the checkpoint was loaded into ("" the whole module)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # torch.save's files: pickles


def unreadable_checkpoint(where: Path) -> CheckpointError:
    """Why `where` is no checkpoint load_checkpoint reads. A `torch.save` file (`pytorch_model.bin`,
    `model.pt`), or a directory holding only such files, is named as a pickle, which loading never
    unpickles (unpickling can run any code the file names), with the conversion a user runs where
    they trust the file; the file itself is not opened."""
    pickles = (
        sorted(p.name for p in where.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if where.is_dir()
        else [where.name] if where.suffix in PICKLE_SUFFIXES else []
    )
    if where.exists() and pickles:
        return CheckpointError(
            f"checkpoint {where} {'holds' if where.is_dir() else 'is'} {', '.join(pickles[:3])}: torch.save's "
            "pickle format, which load_checkpoint never unpickles (unpickling runs whatever code the file names)",
            hint="where you trust the file, convert it once: safetensors.torch.save_file(torch.load(path, "
            "weights_only=True), 'model.safetensors'), then load that file (or its directory)",
        )
    found = "does not exist" if not where.exists() else (
        "is a directory without model.safetensors, its index or a .metadata file"
        if where.is_dir()
        else "is not a .safetensors file"
    )
    return CheckpointError(
        f"checkpoint {where} {found}",
        hint="pass the directory save_pretrained wrote, a .safetensors file, or a torch.distributed.checkpoint directory",
    )


def load_checkpoint(
    pmodel: ParallelModule, path: str | os.PathLike[str], *, strict: bool = True, prefix: str | None = None
) -> LoadResult:
    """Load the weights at `path` into `pmodel`; every rank calls it with the same path.

    `path`: a directory written by transformers' `save_pretrained` (safetensors, one file or
    sharded), a `.safetensors` file, or a torch.distributed.checkpoint directory. Each rank reads
    only the blocks it stores, so no rank holds a whole model. `strict` (default) raises
    `CheckpointError` when a tensor of the module is missing from the checkpoint or the
    checkpoint has tensors the module does not; with `strict=False` the result lists them.

    The checkpoint may be of a model inside `pmodel`'s module (a transformers model the user's
    module holds as `self.m`): loading finds the one submodule whose names match it
    (`checkpoint_prefix.find_scope`) and raises naming the candidates when several do;
    `prefix="m"` chooses. Then only that submodule's tensors are loaded and checked."""
    if not isinstance(pmodel, ParallelModule):
        raise CheckpointError(
            f"load_checkpoint takes the module autopar.parallelize returned, got {type(pmodel).__name__}",
            hint="call pmodel = autopar.parallelize(model, mesh, ...) first, then load_checkpoint(pmodel, path)",
        )
    where = Path(path)
    if where.is_dir() and (where / DCP_METADATA).is_file():
        result = _load_dcp(pmodel, where, strict, prefix)
    elif where.is_dir() and ((where / SAFETENSORS_INDEX).is_file() or (where / SAFETENSORS_FILE).is_file()):
        result = _load_safetensors(pmodel, safetensors_files(where), strict, prefix)
    elif where.is_file() and where.suffix == ".safetensors":
        result = _load_safetensors(pmodel, {None: where}, strict, prefix)
    else:
        raise unreadable_checkpoint(where)
    # ranks that read different files (another step's, a path that differs) would train a mixture
    pmodel.check_stored_agree("load_checkpoint", [("a sample of the checkpoint's files", files_sample(where))])
    return result


def files_sample(where: Path) -> torch.Tensor:
    """Bytes that differ between two checkpoints of one model (another step's weights): each
    checkpoint file's name and size, its first and its last `SAMPLE_BYTES`. Every rank reads the
    same sample of the same files, so ranks compare it whole, whatever blocks they load; a few
    hundred KiB per file, against the blocks a rank reads."""
    files = [where] if where.is_file() else sorted(p for p in where.iterdir() if p.is_file() and _is_checkpoint_file(p))
    parts = []
    for file in files:
        size = file.stat().st_size
        parts.append(file.name.encode() + size.to_bytes(8, "little"))
        with file.open("rb") as handle:
            parts.append(handle.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                handle.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                parts.append(handle.read(SAMPLE_BYTES))
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def _is_checkpoint_file(path: Path) -> bool:
    return path.name in (DCP_METADATA, SAFETENSORS_INDEX) or path.suffix in (".safetensors", ".distcp")


# ---- names ---------------------------------------------------------------------------------------


def _stored(pmodel: ParallelModule) -> dict[str, list[str]]:
    """Each tensor the module stores and saves (by its stored name) -> all its names, stored first."""
    names: dict[str, list[str]] = {}
    saved = pmodel.state_dict(keep_vars=True)
    for name in saved:
        canonical = pmodel.aliases.get(name, name)
        names.setdefault(canonical, [canonical])
        if name != canonical:
            names[canonical].append(name)
    return names


def _match(
    pmodel: ParallelModule,
    keys: set[str],
    strict: bool,
    kind: str,
    prefix: str | None,
    converted: list[str] | None = None,
) -> tuple[dict[str, str], LoadResult]:
    """Stored name -> checkpoint key; what is missing and unexpected (raised when `strict`). The
    checkpoint may be of a submodule (`find_scope`): then only that submodule's tensors count."""
    stored = _stored(pmodel)
    known = [n for names in stored.values() for n in names] + pmodel.not_stored
    scope = find_scope(list(stored.values()), known, keys, pmodel.model_prefixes, prefix, kind)
    result = LoadResult(format=kind, prefix=scope.path)
    chosen: dict[str, str] = {}
    for canonical, names in stored.items():
        if not scope.inner(names):
            continue  # outside the submodule the checkpoint is of
        key = next((k for k in scope.keys(names) if k in keys), None)
        if key is None:
            result.missing.append(canonical)
        else:
            chosen[canonical] = key
    used = set(chosen.values())
    explained = {k for n in known for k in scope.keys([n])}
    result.unexpected = sorted(k for k in keys if k not in used and k not in explained)
    if not chosen:
        raise CheckpointError(
            f"the {kind} checkpoint holds none of the tensors of {scope.path or 'the model'} (it has "
            f"{len(keys)}: {', '.join(sorted(keys)[:3])}...; the model wants {', '.join(list(stored)[:3])}...)",
            hint="load a checkpoint of this model's architecture, or pass prefix= naming the submodule it is of",
        )
    if strict and (result.missing or result.unexpected):
        parts = []
        if result.missing:
            parts.append(f"lacks {len(result.missing)} of the model's tensors ({', '.join(result.missing[:3])})")
        if result.unexpected:
            parts.append(f"has {len(result.unexpected)} the model does not ({', '.join(result.unexpected[:3])})")
        hint = "load a checkpoint of this model's architecture, or pass strict=False to load what matches"
        if converted and result.missing:
            parts.append(
                f"its {len(converted)} tensors in transformers' converted format ({', '.join(converted[:3])}) "
                "are made into the model's by a conversion on load (stacked, split or fused), not read as "
                "stored"
            )
            hint = (
                "load the model with from_pretrained before parallelize, or write the checkpoint in the "
                "model's own names (autopar.save_checkpoint(pmodel, path, format='safetensors'))"
            )
        raise CheckpointError(
            f"the {kind} checkpoint " + " and ".join(parts)
            + (f" (loading it into the submodule {scope.path!r})" if scope.path else ""),
            hint=hint,
        )
    return chosen, result


# ---- safetensors --------------------------------------------------------------------------------


def safetensors_files(directory: Path) -> dict[str | None, Path]:
    """Key -> file for a sharded checkpoint (from its index); {None: file} for a single file."""
    index = directory / SAFETENSORS_INDEX
    if not index.is_file():
        return {None: inside(directory, SAFETENSORS_FILE, str(directory))}
    inside(directory, SAFETENSORS_INDEX, str(directory))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index} is not a safetensors index (a JSON object with a weight_map): {exc}",
            hint="write the checkpoint again with save_pretrained",
        ) from exc
    if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
        raise CheckpointError(
            f"{index}'s weight_map is not a mapping of tensor names to file names",
            hint="write the checkpoint again with save_pretrained",
        )
    files = {key: inside(directory, name, str(index)) for key, name in weight_map.items()}
    absent = sorted({str(f) for f in files.values() if not f.is_file()})
    if absent:
        raise CheckpointError(
            f"{index} lists {absent[0]}, which does not exist ({len(absent)} shard(s) absent)",
            hint="the checkpoint was copied only in part: copy every shard the index lists",
        )
    return files


def _load_safetensors(
    pmodel: ParallelModule, files: dict[str | None, Path], strict: bool, prefix: str | None
) -> LoadResult:
    single = files.get(None)
    if single is not None:
        with opened_safetensors(single) as handle:
            keys = set(handle.keys())
        file_of = dict.fromkeys(keys, single)
    else:
        file_of = {k: f for k, f in files.items() if k is not None}
        keys = set(file_of)
    # transformers saves some tensors under their checkpoints' historical names (checkpoint_names)
    names = checkpoint_names(keys, pmodel.checkpoint_renamer)
    chosen, result = _match(pmodel, set(names.by_name), strict, "safetensors", prefix, names.converted)
    chosen = {name: names.by_name[key] for name, key in chosen.items()}
    state = pmodel.state_dict(keep_vars=True)
    for name, key in chosen.items():
        target = state[name]
        local = target.to_local() if isinstance(target, DTensor) else target
        # opened per tensor: the file is memory-mapped, and the pages a slice touches (a column
        # block touches every row) stay in this process's RSS until it is closed
        with opened_safetensors(file_of[key]) as handle:
            piece = handle.get_slice(key)
            shape = tuple(piece.get_shape())
            if shape != tuple(target.shape):
                raise CheckpointError(
                    f"{key} has shape {list(shape)} in the checkpoint, but the model's {name} is {list(target.shape)}",
                    hint="load a checkpoint of this model's configuration (sizes, vocabulary)",
                )
            stored = piece.get_dtype()
            check_dtype(name, key, stored, safetensors_is_floating(stored), target)
            block = piece[pmodel.stored_block(name)] if shape else piece[...]
            with torch.no_grad():
                local.copy_(block.to(local.dtype).reshape(local.shape))
            warn_non_finite(name, key, block)
        result.loaded.append(name)
    return result


@contextmanager
def opened_safetensors(file: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{file} is not a readable safetensors file: {exc}",
            hint="the file may be truncated: write or copy the checkpoint again",
        ) from exc
    with handle:
        yield handle


# ---- torch.distributed.checkpoint ---------------------------------------------------------------


def _load_dcp(pmodel: ParallelModule, directory: Path, strict: bool, prefix: str | None) -> LoadResult:
    metadata = read_dcp_metadata(directory)
    keys = set(metadata.state_dict_metadata)
    chosen, result = _match(pmodel, keys, strict, "DCP", prefix)
    check_tensor_entries(directory, metadata, list(chosen.values()))
    state = pmodel.state_dict(keep_vars=True)
    for name, key in chosen.items():
        entry = metadata.state_dict_metadata[key]
        stored = entry.properties.dtype  # type: ignore[union-attr]
        check_dtype(name, key, str(stored), stored.is_floating_point or stored.is_complex, state[name])
        want = tuple(state[name].shape)
        have = tuple(entry.size)  # type: ignore[union-attr]
        if have != want:
            raise CheckpointError(
                f"{key} has shape {list(have)} in the checkpoint, but the model's {name} is {list(want)}",
                hint="load a checkpoint of this model's configuration (sizes, vocabulary)",
            )
    request = {key: state[name].detach() for name, key in chosen.items()}
    try:
        dcp.load(request, storage_reader=SafeReader(directory), planner=SafePlanner(), process_group=pmodel.world_group)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # a data file missing or cut short
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        cause = lines[-1] if lines else type(exc).__name__  # the innermost error of the ranks' tracebacks
        raise CheckpointError(
            f"reading the torch.distributed.checkpoint {directory} failed: {cause}",
            hint="the checkpoint may be truncated (a data file missing or cut short): save it again",
        ) from exc
    for name, key in chosen.items():
        warn_non_finite(name, key, state[name])
    result.loaded = list(chosen)
    return result
