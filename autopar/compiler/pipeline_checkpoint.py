"""Checkpoints of a pipelined module, the same as the tensor-only module's
(docs/pipeline.md#checkpoints), so that a job can move between pipelined and non-pipelined meshes.

`pipelined_state_dict` is this rank's share of the model's state dict: the model's own keys (a
tied weight under each of its names, as `ParallelModule.state_dict()` gives it) and global shapes
(DTensors with tensor axes beside "pp", the user's tensors on a 1-D pipeline mesh). A tensor that
several stages read (a tied embedding and head) has a copy in each; only the copy of the lowest
stage index that reads it is written, so `torch.distributed.checkpoint.save` on every rank sees one
placement per key. `load_pipelined_checkpoint` fills every copy on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from autopar.compiler.pipeline_split import StageProgram, get_attr
from autopar.core.errors import CheckpointError
from autopar.runtime.checkpoint import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    LoadResult,
    opened_safetensors,
    safetensors_files,
)
from autopar.runtime.checkpoint_prefix import find_scope, model_prefixes
from autopar.runtime.checkpoint_safety import (
    DCP_METADATA,
    SafePlanner,
    SafeReader,
    check_dtype,
    check_tensor_entries,
    read_dcp_metadata,
    safetensors_is_floating,
    warn_non_finite,
)
from autopar.runtime.module import ParallelModule

__all__ = ["load_pipelined_checkpoint", "pipelined_buffers", "pipelined_state_dict", "unit_stage"]


class Pipelined(Protocol):
    """What this module reads of a `PipelinedModule` (not imported: pipeline.py imports this one)."""

    stages: tuple[int, ...]
    _programs: dict[Any, list[StageProgram]]

    @property
    def _model(self) -> nn.Module: ...


@dataclass(frozen=True)
class _Held:
    """One tensor this rank stores for one of its stages: `name` in the stage, `user` the id of the
    user's tensor it is a copy of, `parallel` the stage's parallel module (None on a 1-D mesh)."""

    stage: int
    name: str
    user: int
    tensor: torch.Tensor
    parallel: ParallelModule | None


def _names(model: nn.Module) -> dict[int, list[str]]:
    """Each of the model's saved tensors (by id) -> its state-dict names, in state-dict order."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    return names


def _program(pmodel: Pipelined) -> StageProgram:
    # every program reads the same attributes per stage (StageModule.add checks it with tensor axes)
    return next(iter(pmodel._programs.values()))[0]


def _owners(pmodel: Pipelined, names: dict[int, list[str]]) -> dict[int, int]:
    """Each saved tensor (by id) -> the stage whose copy is written: the lowest stage index that
    reads it, or for a tensor no stage reads (BatchNorm's `num_batches_tracked` in eval, a buffer
    the forward never touches) the stage holding its module (`unit_stage`). Every rank computes the
    same from the whole model's program."""
    program = _program(pmodel)
    owners: dict[int, int] = {}
    for stage in program.stages:
        for attr in stage.attrs:
            if attr in program.constants:
                continue
            user = id(get_attr(pmodel._model, attr))
            if user in names:
                owners.setdefault(user, stage.index)
    for user, all_names in names.items():
        owners.setdefault(user, unit_stage(program, all_names[0]))
    return owners


def unit_stage(program: StageProgram, name: str) -> int:
    """The stage that holds the module of tensor `name` (its unit, or the first unit inside it);
    stage 0 for a tensor of the root module. Where a tensor no stage reads is kept."""
    path = name.rpartition(".")[0]
    for s, units in enumerate(program.stage_units):
        if any(path == u or path.startswith(u + ".") or u.startswith(path + ".") for u in units if path):
            return s
    return 0


def _read_attrs(pmodel: Pipelined) -> set[int]:
    """The ids of the model's tensors that some stage's program reads."""
    program = _program(pmodel)
    return {
        id(get_attr(pmodel._model, a)) for st in program.stages for a in st.attrs if a not in program.constants
    }


def pipelined_buffers(pmodel: Pipelined) -> list[tuple[str, torch.Tensor]]:
    """This rank's stages' buffers under the model's names, in the model's order: the buffers its
    stages read (the parallel stage's own with tensor axes beside "pp", else the user's) and the
    model's buffers no stage reads whose module one of its stages holds (`unit_stage`). A buffer
    several stages read appears once per rank."""
    model = pmodel._model
    buffer_names: dict[int, str] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        buffer_names.setdefault(id(b), name)
    program = _program(pmodel)
    parallel: dict[int, ParallelModule] = pmodel.__dict__["stage_parallel"]
    wrappers: dict[int, nn.Module] = pmodel.__dict__["_stage_wrappers"]
    found: dict[str, torch.Tensor] = {}
    for s in pmodel.stages:
        module = parallel.get(s)
        if module is not None:
            pairs = [(id(get_attr(wrappers[s], name)), t) for name, t in module.named_buffers()]
        else:
            attrs = [a for a in program.stages[s].attrs if a not in program.constants]
            pairs = [(id(t), t) for t in (get_attr(model, a) for a in attrs)]
        for user, tensor in pairs:
            if user in buffer_names:
                found.setdefault(buffer_names[user], tensor)
    read = _read_attrs(pmodel)
    for name, b in model.named_buffers():
        if id(b) not in read and unit_stage(program, name) in pmodel.stages:
            found.setdefault(name, b)
    order = {name: i for i, name in enumerate(buffer_names.values())}
    return sorted(found.items(), key=lambda item: order[item[0]])


def _held(pmodel: Pipelined, names: dict[int, list[str]]) -> list[_Held]:
    """The saved tensors of this rank's stages: each parallel stage's DTensors, else the user's."""
    program = _program(pmodel)
    parallel: dict[int, ParallelModule] = pmodel.__dict__["stage_parallel"]
    wrappers: dict[int, nn.Module] = pmodel.__dict__["_stage_wrappers"]
    held: dict[int, _Held] = {}  # by id of the stored tensor: a tied name in a stage is one tensor
    for s in pmodel.stages:
        module = parallel.get(s)
        if module is not None:
            stored = module.state_dict(keep_vars=True).items()
            pairs = [(name, id(get_attr(wrappers[s], name)), t) for name, t in stored]
        else:
            attrs = [a for a in program.stages[s].attrs if a not in program.constants]
            pairs = [(a, id(t), t) for a in attrs for t in [get_attr(pmodel._model, a)]]
        for name, user, tensor in pairs:
            if user in names and isinstance(tensor, torch.Tensor):
                held.setdefault(id(tensor), _Held(s, name, user, tensor, module))
    read = _read_attrs(pmodel)
    for name, tensor in pmodel._model.state_dict(keep_vars=True).items():  # kept whole by its stage
        s = unit_stage(program, name)
        if id(tensor) not in read and s in pmodel.stages:
            held.setdefault(id(tensor), _Held(s, name, id(tensor), tensor, None))
    return list(held.values())


def pipelined_state_dict(pmodel: Pipelined, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """This rank's part of the model's state dict, for `dcp.save` on every rank: the checkpoint it
    writes equals the tensor-only module's, so either kind of module loads it. Each tensor is
    written by the ranks of the lowest stage that reads it; its copies elsewhere are left out
    (DCP refuses overlapping blocks of one key laid out differently). `keep_vars` as in torch."""
    model = pmodel._model
    names = _names(model)
    owners = _owners(pmodel, names)
    mine = {h.user: h.tensor for h in _held(pmodel, names) if owners.get(h.user) == h.stage}
    state: dict[str, torch.Tensor] = {}
    for name, user_tensor in model.state_dict(keep_vars=True).items():  # the model's order
        tensor = mine.get(id(user_tensor))
        if tensor is not None:
            state[name] = tensor if keep_vars else tensor.detach()
    return state


# ---- loading ------------------------------------------------------------------------------------


@dataclass
class _Found:
    """A checkpoint's format, each key's global shape and stored dtype (its name, whether
    floating), each key's file (safetensors) and the DCP metadata."""

    kind: str
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, tuple[str, bool]]
    file_of: dict[str, Path]
    metadata: Any = None


def _checkpoint(where: Path) -> _Found:
    if where.is_dir() and (where / DCP_METADATA).is_file():
        metadata = read_dcp_metadata(where)
        found = _Found("DCP", {}, {}, {}, metadata)
        for k, m in metadata.state_dict_metadata.items():
            found.shapes[k] = tuple(getattr(m, "size", ()))
            dtype = getattr(getattr(m, "properties", None), "dtype", None)
            if isinstance(dtype, torch.dtype):
                found.dtypes[k] = (str(dtype), dtype.is_floating_point or dtype.is_complex)
        return found
    if where.is_dir() and ((where / SAFETENSORS_INDEX).is_file() or (where / SAFETENSORS_FILE).is_file()):
        files = safetensors_files(where)
    elif where.is_file() and where.suffix == ".safetensors":
        files = {None: where}
    else:
        missing = "does not exist" if not where.exists() else "is no safetensors checkpoint nor a DCP directory"
        raise CheckpointError(
            f"checkpoint {where} {missing}",
            hint="pass the directory save_pretrained wrote, a .safetensors file, or a DCP directory",
        )
    by_file: dict[Path, list[str | None]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    found = _Found("safetensors", {}, {}, {})
    for file, keys in by_file.items():
        with opened_safetensors(file) as handle:
            for k in handle.keys() if keys == [None] else [k for k in keys if k is not None]:
                found.file_of[k] = file
                piece = handle.get_slice(k)
                found.shapes[k] = tuple(piece.get_shape())
                found.dtypes[k] = (piece.get_dtype(), safetensors_is_floating(piece.get_dtype()))
    return found


def load_pipelined_checkpoint(
    pmodel: Pipelined, path: str | os.PathLike[str], *, strict: bool = True, prefix: str | None = None
) -> LoadResult:
    """Load the weights at `path` (a DCP directory, e.g. a tensor-only module's or a pipelined
    one's, or a transformers safetensors checkpoint) into every rank's stages, every copy of a tied
    weight included; each rank reads only its blocks. Every rank calls it with the same path.

    Keys are matched against the whole model on every rank, so the result's `unexpected` (keys
    naming none of the model's tensors) and the strict check agree on all ranks: `strict` raises
    `CheckpointError` on every rank, before reading any tensor, when a tensor that any stage holds
    is missing or a key is unexpected. `missing` lists this rank's stages' missing tensors. A
    checkpoint of a submodule (a wrapped transformers model) loads into it, as for a tensor-only
    module (`checkpoint_prefix.find_scope`; `prefix=` chooses)."""
    where = Path(path)
    found = _checkpoint(where)
    kind, shapes = found.kind, found.shapes
    model = pmodel._model
    names = _names(model)
    every_name = [n for all_names in names.values() for n in all_names]
    scope = find_scope(list(names.values()), every_name, set(shapes), model_prefixes(model), prefix, kind)
    owners = {user: s for user, s in _owners(pmodel, names).items() if scope.inner(names[user])}
    key_of = {}
    for user in owners:
        key = next((k for k in scope.keys(names[user]) if k in shapes), None)
        if key is not None:
            key_of[user] = key
    known = {k for n in every_name for k in scope.keys([n])}
    result = LoadResult(format=kind, unexpected=sorted(k for k in shapes if k not in known), prefix=scope.path)
    absent = [names[user][0] for user in owners if user not in key_of]
    if not key_of:
        raise CheckpointError(
            f"the {kind} checkpoint holds none of the model's tensors (it has {len(shapes)}: "
            f"{', '.join(sorted(shapes)[:3])}...)",
            hint="load a checkpoint of this model's architecture",
        )
    if strict and (absent or result.unexpected):
        parts = [f"lacks {len(absent)} of the model's tensors ({', '.join(absent[:3])})"] if absent else []
        if result.unexpected:
            parts.append(
                f"has {len(result.unexpected)} the model does not ({', '.join(result.unexpected[:3])})"
            )
        raise CheckpointError(
            f"the {kind} checkpoint " + " and ".join(parts),
            hint="load a checkpoint of this model's architecture, or pass strict=False to load what matches",
        )
    if found.metadata is not None:
        check_tensor_entries(where, found.metadata, list(key_of.values()))
    user_tensor = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    shape_of = {user: tuple(t.shape) for user, t in user_tensor.items()}
    for user, key in key_of.items():  # the whole model's shapes and dtypes: every rank raises alike
        if key in found.dtypes:
            check_dtype(names[user][0], key, *found.dtypes[key], user_tensor[user])
        if tuple(shapes[key]) != shape_of[user]:
            raise CheckpointError(
                f"{key} has shape {list(shapes[key])} in the checkpoint, but the model's "
                f"{names[user][0]} is {list(shape_of[user])}",
                hint="load a checkpoint of this model's configuration (sizes, vocabulary)",
            )
    held = _held(pmodel, names)
    present = [h for h in held if h.user in key_of]
    if kind == "DCP":
        _read_dcp(where, [(key_of[h.user], h) for h in present])
    else:
        _read_safetensors(found.file_of, [(key_of[h.user], h) for h in present])
    for h in present:
        warn_non_finite(h.name, key_of[h.user], h.tensor)
    result.loaded = list(dict.fromkeys(names[h.user][0] for h in present))
    result.missing = list(dict.fromkeys(names[h.user][0] for h in held if h.user not in key_of))
    return result


def _rounds(pairs: list[tuple[str, _Held]]) -> Iterator[dict[str, torch.Tensor]]:
    """DCP requests holding each key once: a second copy of a weight (another stage's) goes in a
    second request."""
    rounds: list[dict[str, torch.Tensor]] = []
    for key, h in pairs:
        request = next((r for r in rounds if key not in r), None)
        if request is None:
            request = {}
            rounds.append(request)
        request[key] = h.tensor.detach()
    yield from rounds


def _read_dcp(where: Path, pairs: list[tuple[str, _Held]]) -> None:
    # no_dist: each rank reads its own blocks; the ranks of different stages hold different keys
    for request in _rounds(pairs):
        try:
            dcp.load(request, storage_reader=SafeReader(where), planner=SafePlanner(), no_dist=True)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # a data file missing or cut short
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            raise CheckpointError(
                f"reading the torch.distributed.checkpoint {where} failed: {lines[-1] if lines else type(exc).__name__}",
                hint="the checkpoint may be truncated (a data file missing or cut short): save it again",
            ) from exc


def _read_safetensors(file_of: dict[str, Path], pairs: list[tuple[str, _Held]]) -> None:
    for key, h in pairs:
        local = h.tensor.to_local() if isinstance(h.tensor, DTensor) else h.tensor
        with opened_safetensors(file_of[key]) as handle:
            piece = handle.get_slice(key)
            whole = h.parallel is None or not h.tensor.dim()
            block = piece[...] if whole else piece[h.parallel.stored_block(h.name)]  # type: ignore[union-attr]
            with torch.no_grad():
                local.copy_(block.to(local.dtype).reshape(local.shape))
