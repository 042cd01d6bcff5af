"""The user's `torch.utils.checkpoint` regions, found while torch.export runs the model (trace stage).

torch.export inlines a checkpointed function: its ops land in the graph like any other, with no
mark of the checkpoint (and `fx.traceback.annotate` does not survive the export either). What does
survive is each op's module path. So while the export runs, hooks on the fake clone's modules look
at the saved-tensor hooks that a non-reentrant checkpoint pushes for the duration of its function
(`torch.utils.checkpoint`'s `_checkpoint_hook`): a module call that starts and ends inside one
checkpoint that its caller was not inside is a region (`checkpoint(block, x)`), and so is a module
whose own forward runs under one checkpoint around all of its children (transformers'
`GradientCheckpointingLayer` checkpoints `forward` inside `__call__`). Every forward op whose module
path lies in a region is marked `NodeInfo.checkpoint`; the planner recomputes them in backward
(`autopar.planning.recompute`). A checkpointed function that calls no module leaves no mark: its
ops are planned like the rest (the memory limit still decides what is recomputed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.meta import has_info, info, is_backward, set_info
from autopar.passes.repeats import RepeatedBlocks


def _active_checkpoint() -> Any:
    """The pack hook of the innermost checkpoint running now, or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if not hooks:
        return None
    pack = hooks[0]
    return pack if getattr(pack, "__qualname__", "").startswith("_checkpoint_hook") else None


@dataclass
class _Call:
    path: str
    entered: Any  # the checkpoint active when the call started
    children: list[Any] = field(default_factory=list)  # the checkpoint active as each child started


class CheckpointWatch:
    """Hooks on every module of `model` (a fake clone, never the user's) for the export's run."""

    def __init__(self, model: nn.Module) -> None:
        self._stack: list[_Call] = []
        self._verdicts: dict[str, list[bool]] = {}
        self._handles = []
        for path, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(path)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            active = _active_checkpoint()
            if self._stack:
                self._stack[-1].children.append(active)
            self._stack.append(_Call(path, active))

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        call = self._stack.pop()
        active = _active_checkpoint()
        caller = self._stack[-1].entered if self._stack else None
        inside = call.entered is not None and call.entered is active and caller is not call.entered
        around = (  # the module's forward checkpointed inside its own __call__
            call.entered is None
            and active is None
            and bool(call.children)
            and call.children[0] is not None
            and all(c is call.children[0] for c in call.children)
        )
        self._verdicts.setdefault(call.path, []).append(inside or around)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def regions(self) -> list[str]:
        """Module paths whose every call was a checkpoint region (outermost ones only)."""
        found = sorted(p for p, verdicts in self._verdicts.items() if verdicts and all(verdicts))
        return [p for p in found if not any(p != q and _under(p, q) for q in found)]


def mark_checkpoint_regions(gm: fx.GraphModule, regions: Sequence[str], groups: Sequence[RepeatedBlocks]) -> int:
    """Mark every forward op inside one of `regions` (block 1's extend to the blocks copied from it);
    returns how many ops were marked."""
    paths = set(regions)
    for group in groups:
        for path in regions:
            if group.block_of(path) == 1:
                paths.update(group.rename(path, k) for k in range(2, group.count))
    if not paths:
        return 0
    ordered = sorted(paths, key=len, reverse=True)  # the innermost region first
    marked = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not has_info(node) or is_backward(node):
            continue
        region = next((p for p in ordered if _under(info(node).module_path, p)), None)
        if region is not None:
            set_info(node, replace(info(node), checkpoint=region))
            marked += 1
    return marked


def _under(path: str, region: str) -> bool:
    return path == region or path.startswith(region + ".") or region == ""
