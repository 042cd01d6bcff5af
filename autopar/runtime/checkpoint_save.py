"""`save_checkpoint`: a torch.distributed.checkpoint directory, every rank writing its own blocks,
or a transformers `save_pretrained` directory (safetensors shards), replaced atomically.

DCP writes its data files first and `.metadata` last, into the directory it is given: saving over
an existing checkpoint and being killed half-way leaves the old `.metadata` beside some new data
files, which then loads "successfully" as a mix of two steps. Here the save goes into a sibling
`.<name>.saving`; once every rank has written (a barrier) rank 0 swaps it into place with one
`renameat2(RENAME_EXCHANGE)` and deletes what was there. A save killed at any point leaves the
previous checkpoint at `path`, complete. Where the kernel or filesystem cannot exchange (not
Linux, some network filesystems) it falls back to two renames: killed between them, the
previous checkpoint is at `.<name>.previous` and the new one at `.<name>.saving`, both complete.

The safetensors export gives each tensor to one rank (the least loaded so far, by bytes, the same
choice on every rank); tensors are made whole one at a time and each rank keeps only its own
until it writes its shard, so no rank holds more than its share of the model plus one tensor.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from autopar.core.errors import CheckpointError
from autopar.runtime.agreement import collective_device
from autopar.runtime.checkpoint import SAFETENSORS_FILE, SAFETENSORS_INDEX
from autopar.runtime.checkpoint_safety import DCP_METADATA
from autopar.runtime.wire import all_gathered

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def saving_dir(path: Path) -> Path:
    """Where a save of `path` is written before it replaces `path`."""
    return path.parent / f".{path.name}.saving"


def previous_dir(path: Path) -> Path:
    """Where the two-rename fallback parks the previous checkpoint for a moment."""
    return path.parent / f".{path.name}.previous"


def _check_target(path: Path) -> None:
    """`path` may be replaced only when it is absent, an empty directory or a DCP checkpoint:
    anything else is the user's, and replacing it would delete it."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: it exists and is not a directory",
            hint="give a path that does not exist yet, or a checkpoint directory to replace",
        )
    marks = (DCP_METADATA, SAFETENSORS_INDEX, SAFETENSORS_FILE)
    if any(path.iterdir()) and not any((path / mark).is_file() for mark in marks):
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: it is a directory that holds other files, not a "
            "checkpoint (no .metadata, model.safetensors or its index); saving would replace them",
            hint="give a path that does not exist yet, or a checkpoint directory to replace",
        )


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a))


def publish(written: Path, path: Path) -> None:
    """Put the checkpoint in `written` at `path`, atomically where the system allows; remove what
    `path` held."""
    if not path.exists():
        os.rename(written, path)
        return
    if _exchange(written, path):
        shutil.rmtree(written, ignore_errors=True)  # now the previous one; else the next save removes it
        return
    old = previous_dir(path)
    os.rename(path, old)
    os.rename(written, path)
    shutil.rmtree(old, ignore_errors=True)


def _agreed(failure: str, group: dist.ProcessGroup | None) -> str:
    """Every rank's failure so far ('' for none), met in place of a barrier, so that one rank's
    failure raises on every rank instead of leaving the others waiting: the first, by rank."""
    failures = all_gathered(failure, group, collective_device(group))
    return next((f"rank {r}: {f}" for r, f in enumerate(failures) if f), "")


def save_atomically(path: Path, group: dist.ProcessGroup | None, write: Any) -> None:
    """`write(directory)` on every rank into a fresh sibling of `path`, which then replaces `path`.
    Every rank calls it; a failure on any rank raises `CheckpointError` on all of them and leaves
    `path` as it was."""
    _check_target(path)
    rank = dist.get_rank()
    written = saving_dir(path)
    failure = ""
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for stale in (written, previous_dir(path)):  # a save killed before: never published
                if stale.exists():
                    shutil.rmtree(stale)
            written.mkdir()
        except OSError as exc:
            failure = f"cannot create {written}: {exc.strerror or exc}"
    failure = _agreed(failure, group)
    if not failure:
        try:
            write(written)
        except (Exception, CheckpointException) as exc:
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            failure = lines[-1] if lines else type(exc).__name__
        failure = _agreed(failure, group)  # every rank's files are written, or none publishes
    if not failure:  # the same on every rank, once agreed
        moved = ""
        if rank == 0:
            try:
                publish(written, path)
            except OSError as exc:
                moved = f"cannot move {written} to {path}: {exc.strerror or exc}"
        failure = _agreed(moved, group)  # no rank returns before the checkpoint is at `path`
    if failure:
        raise CheckpointError(
            f"saving the checkpoint {path} failed: {failure}; the previous checkpoint there is untouched",
            hint="free disk space or fix the permission, then save again",
        )


def save_dcp(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """Every rank of `group` writes its blocks of `state` (DTensors: each block once); DCP's
    coordinator writes the metadata."""

    def write(directory: Path) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), process_group=group)

    save_atomically(path, group, write)


def owners(sizes: list[tuple[str, int]], world: int) -> dict[str, int]:
    """Each key -> the rank that writes it: the least loaded so far (by bytes), lowest rank on a
    tie; the same answer on every rank."""
    load = [0] * world
    owner: dict[str, int] = {}
    for key, size in sizes:
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += size
    return owner


def save_safetensors(
    state: dict[str, Any], aliases: dict[str, str], config: Any, path: Path, group: dist.ProcessGroup | None
) -> None:
    """A `save_pretrained` directory: safetensors shards (one per rank that owns a tensor), their
    index, and the model's `config.json` when it has one. A tied weight is written once, under
    its stored name, as `save_pretrained` does; `from_pretrained` ties it again."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = [k for k in state if k not in aliases]  # the same order on every rank
    owner = owners([(k, state[k].numel() * state[k].element_size()) for k in keys], world)
    holders = sorted(set(owner.values()))
    names = {
        r: SAFETENSORS_FILE if len(holders) == 1 else f"model-{i + 1:05d}-of-{len(holders):05d}.safetensors"
        for i, r in enumerate(holders)
    }

    def write(directory: Path) -> None:
        mine: dict[str, torch.Tensor] = {}
        for key in keys:
            value = state[key]
            whole = value.full_tensor() if isinstance(value, DTensor) else value  # a collective
            if owner[key] == rank:
                mine[key] = whole.detach().contiguous()
        if mine:
            save_file(mine, str(directory / names[rank]), metadata={"format": "pt"})
        if rank == 0:
            if len(holders) > 1:
                total = sum(state[k].numel() * state[k].element_size() for k in keys)
                index = {"metadata": {"total_size": total}, "weight_map": {k: names[owner[k]] for k in keys}}
                (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            if config is not None and hasattr(config, "to_json_file"):
                config.to_json_file(str(directory / "config.json"))

    save_atomically(path, group, write)
