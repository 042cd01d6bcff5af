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
            if type(container) is nn.Module:
                mirror_class(container, module)
            found.append((path, container))
    return found


def mirror_class(container: nn.Module, module: nn.Module) -> None:
    """Give `container` the class of the `module` it stands for, with its plain attributes (sizes,
    eps, momentum) and its absent tensors (a Linear's `bias=None`), so the idioms users apply to a
    model's modules work on the parallel module alike: `isinstance(m, nn.BatchNorm2d)` to freeze
    batch norm, `repr`, a module's own `train()`. The container is never called: its tensors are
    the parallel module's blocks and its program runs from the root."""
    try:
        container.__class__ = type(module)
    except TypeError:  # a class whose instance layout differs (slots): keep the plain container
        return
    own = vars(container)
    for key, value in vars(module).items():
        if not key.startswith("_") and key not in own and key != "training":
            own[key] = value
    for kind in ("_parameters", "_buffers"):
        for name, value in getattr(module, kind).items():
            if value is None and name not in getattr(container, kind):
                getattr(container, kind)[name] = None


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
