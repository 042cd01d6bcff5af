"""Paths in a module tree: the parallel module holds the model's tensors and flags under the
model's own names, creating empty containers along the way."""

from __future__ import annotations

from typing import Any

import torch.nn as nn


def flag_containers(root: nn.Module, source: nn.Module) -> list[tuple[str, nn.Module]]:
    """For every submodule path of `source`: the module under `root` at that path (made empty
    where no tensor made one), holding the source module's training flag. A path whose name the
    parallel module uses for something else keeps no container and its flag is fixed."""
    found = []
    for path, module in source.named_modules():
        if not path:
            continue
        parent, _, leaf = path.rpartition(".")
        holder: Any = root
        for part in parent.split(".") if parent else ():
            holder = getattr(holder, part, None)
        if not isinstance(holder, nn.Module):
            continue
        if not hasattr(holder, leaf):
            holder.add_module(leaf, nn.Module())
        container = getattr(holder, leaf)
        if isinstance(container, nn.Module):
            container.training = module.training
            found.append((path, container))
    return found


def register_at(root: nn.Module, name: str, value: Any, buffer: bool = False, persistent: bool = True) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part) or not isinstance(getattr(module, part), nn.Module):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if buffer:
        module.register_buffer(leaf, value, persistent=persistent)
    else:
        module.register_parameter(leaf, value)


def lookup(root: nn.Module, name: str) -> Any:
    module: Any = root
    for part in name.split("."):
        module = getattr(module, part)
    return module
