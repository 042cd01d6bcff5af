"""Part of stage 1, trace: which containers of a model hold repeated blocks, from a recorded forward
run on fake tensors (`autopar.passes.repeats` copies them in the joint graph).

A container (`ModuleList` / `Sequential`) holds repeated blocks when one forward run of the whole
model shows blocks 1..N-1 making the same calls on the same constants, each reading its own
parameters, values made outside the blocks (the same objects for every block) and the previous
block's output, and nothing else reading a block's values but the next block (the last block's
output: what follows the blocks). Then torch.export of the model cut to blocks 0 and 1 is the whole
model's graph with blocks 2..N-1 left out, if the model's code outside the blocks does not depend
on how many there are: a second run, of the cut model, must make the same calls outside the blocks
as the first.

The run records torch-level calls (a `TorchFunctionMode`, as torch.export's non-strict trace sees
them), costs about a tenth of torch.export of the same model, and changes nothing in the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autopar.passes.ctc import CTCRoute
from autopar.passes.repeats import MIN_BLOCKS, RepeatedBlocks

Key = tuple[
    Any, ...
]  # where a tensor comes from: ("call", i, j), ("param", name), ("input", i), ("other", id)


@dataclass
class _Call:
    func: Any
    refs: Any  # (args, kwargs) with tensors replaced by their keys
    block: tuple[int, int] | None  # (group, block) running it, innermost; None outside the blocks


@dataclass
class _Run:
    """One forward run: every call, and each block's output key (None if it ran other than once)."""

    calls: list[_Call] = field(default_factory=list)
    outputs: dict[tuple[int, int], Key | None] = field(default_factory=dict)
    result: Any = None  # the model's return value, keyed


class _Recorder(TorchFunctionMode):
    def __init__(self, names: dict[int, str], inputs: dict[int, int]) -> None:
        super().__init__()
        self.run = _Run()
        self.running: list[tuple[int, int]] = []
        self.source: dict[int, Key] = {t: ("param", n) for t, n in names.items()}
        self.source.update({t: ("input", i) for t, i in inputs.items()})
        self.keep: list[Any] = []  # every output stays alive: ids are not reused during the run

    def key(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.source.get(id(x), ("other", id(x)))
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(self.key(v) for v in x))
        if isinstance(x, dict):
            return ("dict", tuple((k, self.key(v)) for k, v in x.items()))
        if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size, slice)):
            return ("const", x)
        return ("const", repr(x))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        refs = (self.key(args), self.key(kwargs))
        out = func(*args, **kwargs)
        index = len(self.run.calls)
        self.run.calls.append(_Call(func, refs, self.running[-1] if self.running else None))
        self.keep.append(out)
        for j, leaf in enumerate(pytree.tree_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                self.source[id(leaf)] = ("call", index, j)
        return out


def candidate_containers(
    model: nn.Module, tied: Iterable[Iterable[str]]
) -> list[tuple[RepeatedBlocks, nn.Module]]:
    """Outermost ModuleLists / Sequentials of at least MIN_BLOCKS children "0".."N-1" whose blocks
    1..N-1 are one class with the same parameters and buffers (names, shapes, dtypes, grads), none
    of them tied to another parameter."""
    tied_names = {name for group in tied for name in group}
    found: list[tuple[RepeatedBlocks, nn.Module]] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < MIN_BLOCKS:
            continue
        if any(not g.prefix or path.startswith(g.prefix + ".") for g, _ in found):
            continue  # inside blocks of a container already found
        if [name for name, _ in module.named_children()] != [str(i) for i in range(len(module))]:
            continue
        group = RepeatedBlocks(path, len(module))
        if _same_modules(module) and not any(group.block_of(n) is not None for n in tied_names):
            found.append((group, module))
    return found


def _same_modules(container: nn.Module) -> bool:
    def facts(block: nn.Module) -> tuple[Any, ...]:
        params = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()]
        buffers = [(n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()]
        return (type(block), params, buffers)

    blocks = list(container.children())[1:]
    return all(facts(b) == facts(blocks[0]) for b in blocks[1:])


def cut_to_two_blocks(containers: list[tuple[RepeatedBlocks, nn.Module]]) -> Callable[[], None]:
    """Leave blocks 0 and 1 in each container; returns what puts the others back."""
    saved = [(module, dict(module._modules)) for _, module in containers]
    for group, module in containers:
        for k in range(2, group.count):
            del module._modules[str(k)]

    def restore() -> None:
        for module, children in saved:
            module._modules.clear()
            module._modules.update(children)

    return restore


def find_repeated_blocks(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fake_mode: FakeTensorMode,
    tied: Iterable[Iterable[str]],
) -> list[tuple[RepeatedBlocks, nn.Module]]:
    """The containers of `model` (on fake tensors) whose blocks the joint graph may copy."""
    candidates = candidate_containers(model, tied)
    if not candidates:
        return []
    full = _record(model, candidates, args, kwargs, fake_mode)
    if full is None:
        return []
    kept = [g for g, (group, _) in enumerate(candidates) if _repeats(full, g, group)]
    if not kept:
        return []
    restore = cut_to_two_blocks([candidates[g] for g in kept])
    try:
        cut = _record(model, candidates, args, kwargs, fake_mode)
    finally:
        restore()
    if cut is None:
        return []
    if _skeleton(full, {g: candidates[g][0].count - 1 for g in kept}) != _skeleton(
        cut, dict.fromkeys(kept, 1)
    ):
        return []
    return [candidates[g] for g in kept]


def _record(
    model: nn.Module,
    containers: list[tuple[RepeatedBlocks, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fake_mode: FakeTensorMode,
) -> _Run | None:
    """One forward run of `model` with its calls recorded; None if it fails."""
    names: dict[int, str] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(t), name)
    flat_inputs = pytree.tree_leaves((args, kwargs))
    recorder = _Recorder(names, {id(t): i for i, t in enumerate(flat_inputs) if isinstance(t, torch.Tensor)})
    entered: dict[tuple[int, int], int] = {}
    handles = []
    for g, (_, module) in enumerate(containers):
        for k, block in enumerate(module.children()):

            def pre(mod: nn.Module, a: Any, kw: Any, key: tuple[int, int] = (g, k)) -> None:
                recorder.running.append(key)
                entered[key] = entered.get(key, 0) + 1

            def post(mod: nn.Module, a: Any, kw: Any, out: Any, key: tuple[int, int] = (g, k)) -> None:
                recorder.running.pop()
                leaves = pytree.tree_leaves(out)
                one = len(leaves) == 1 and isinstance(leaves[0], torch.Tensor) and entered[key] == 1
                recorder.run.outputs[key] = recorder.key(leaves[0]) if one else None

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        with fake_mode, CTCRoute(), recorder:  # F.ctc_loss runs on fake tensors as it is exported
            out = model(*args, **kwargs)
        recorder.run.result = recorder.key(out)
    except Exception:  # the cut model may not run (a loop over range(n_layer)): no copying
        return None
    finally:
        for handle in handles:
            handle.remove()
    return recorder.run


def _repeats(run: _Run, g: int, group: RepeatedBlocks) -> bool:
    """Blocks 1..N-1 of container `g` make the same calls, chained output to input."""
    outputs = [run.outputs.get((g, k)) for k in range(group.count)]
    if any(out is None for out in outputs):
        return False
    members: list[list[int]] = [[] for _ in range(group.count)]
    for i, call in enumerate(run.calls):
        if call.block is not None and call.block[0] == g:
            members[call.block[1]].append(i)
    block_of = {i: k for k, calls in enumerate(members) for i in calls}
    # a block's values are read only inside it, but for its output: by the next block, or (the
    # last block's) outside the blocks
    for i, call in enumerate(run.calls):
        reader = block_of.get(i)
        for key in _keys(call.refs):
            if key[0] != "call" or key[1] not in block_of or block_of[key[1]] == reader:
                continue
            k = block_of[key[1]]
            wanted = k + 1 if k < group.count - 1 else None  # None: outside this container's blocks
            if (
                key != outputs[k]
                or (reader if call.block is not None and call.block[0] == g else None) != wanted
            ):
                return False
    if any(key[0] == "call" and key[1] in block_of for key in _keys(run.result)):
        return False
    forms = [_block_form(run, members[k], outputs[k - 1], group, k) for k in range(1, group.count)]
    return forms[0] is not None and all(form == forms[0] for form in forms[1:])


def _keys(refs: Any) -> list[Key]:
    """The tensor keys in a keyed structure."""
    found: list[Key] = []

    def walk(x: Any) -> None:
        if isinstance(x, tuple) and x and x[0] in ("call", "param", "input", "other") and len(x) <= 3:
            found.append(x)
        elif isinstance(x, tuple) and x and x[0] == "const":
            return
        elif isinstance(x, tuple):
            for v in x:
                walk(v)

    walk(refs)
    return found


def _block_form(
    run: _Run, calls: list[int], previous: Key | None, group: RepeatedBlocks, k: int
) -> list[Any] | None:
    """Block k's calls with its own values by position, its parameters by name inside the block
    and the previous block's output as "in"; other blocks' parameters make it None."""
    local = {i: n for n, i in enumerate(calls)}
    own = f"{group.prefix}.{k}." if group.prefix else f"{k}."

    def relative(x: Any) -> Any:
        if not isinstance(x, tuple) or not x or x[0] == "const":
            return x
        if x[0] == "call" and len(x) == 3:
            if x == previous:
                return ("in",)
            return ("node", local[x[1]], x[2]) if x[1] in local else x
        if x[0] == "param" and len(x) == 2 and isinstance(x[1], str):
            if x[1].startswith(own):
                return ("attr", x[1][len(own) :])
            if group.block_of(x[1]) is not None:
                raise _OtherBlock
            return x
        return tuple(relative(v) for v in x)

    try:
        return [(run.calls[i].func, relative(run.calls[i].refs)) for i in calls]
    except _OtherBlock:
        return None


class _OtherBlock(Exception):
    pass


def _skeleton(run: _Run, lasts: dict[int, int]) -> list[Any]:
    """The run's calls outside blocks 2.. of every container, numbered among themselves; what
    reads the last block's output after the blocks reads "last"."""
    kept = [
        i for i, c in enumerate(run.calls) if c.block is None or c.block[0] not in lasts or c.block[1] < 2
    ]
    number = {i: n for n, i in enumerate(kept)}
    last_outputs = {run.outputs.get((g, k)): g for g, k in lasts.items()}

    def renumber(x: Any, outside: bool) -> Any:
        if not isinstance(x, tuple) or not x or x[0] == "const":
            return x
        if x[0] == "call" and len(x) == 3 and isinstance(x[1], int):
            if outside and x in last_outputs:
                return ("last", last_outputs[x])
            return ("call", number.get(x[1], -1), x[2])
        return tuple(renumber(v, outside) for v in x)

    form = []
    for i in kept:
        call = run.calls[i]
        outside = call.block is None or call.block[0] not in lasts
        form.append((call.func, call.block, renumber(call.refs, outside)))
    return [*form, renumber(run.result, True)]
