"""Weights of a model built on the meta device, made on every rank as its own blocks only.

The model's initialization runs call by call in the order building the model ran it (`_calls`:
the constructors' `reset_parameters()`, then `_init_weights`; or the user's `init_fn`), from the
random state the user seeded, so every rank draws the serial numbers and the weights equal the
model built on a real device from the same seed. A tensor is whole only through each stretch of
calls that must see its value, then dropped, or after its last stretch cut to this rank's block:
transient memory is what one init call writes (one module's own tensors), never the model.

Which call touches which tensor, and whether it overwrites it whole (which starts a new stretch),
is found first by running the same calls on fake tensors (free: no data, no random numbers drawn);
a touch no one foresaw materializes the tensor on the spot, and a pass that finds one it could not
follow runs again, knowing it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.errors import InitError
from autopar.core.layout import Layout
from autopar.runtime.agreement import Fingerprint, fingerprint
from autopar.runtime.program import local_value

InitFn = Callable[[nn.Module], Any]


def meta_tensor_names(model: nn.Module) -> list[str]:
    """Parameters and buffers of `model` on the meta device (tied ones under every name)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [name for name, tensor in named if tensor.device.type == "meta"]


def reset_of(module: nn.Module) -> InitFn | None:
    """The module's `reset_parameters()` (or `_reset_parameters()`, which torch's
    `MultiheadAttention` and `Transformer` have instead): what its constructor ran."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return lambda _: method()
    return None


@dataclass
class _Slot:
    """One tensor of the model: where it is registered (every owner, for tied weights)."""

    name: str
    owners: list[tuple[nn.Module, str, bool]]  # (module, attribute, is a parameter)
    meta: torch.Tensor
    aliases: list[str] = field(default_factory=list)  # every qualified name (tied weights: several)
    # the init calls that touch it: call index -> whether the call's first touch overwrites it
    # whole without reading it (normal_, uniform_, fill_, zero_, copy_ into the whole tensor)
    touches: dict[int, bool] = field(default_factory=dict)

    def segments(self) -> list[tuple[int, int]]:
        """(first call, last call) of each stretch its value must live through: a call that
        overwrites it whole starts a new one, and the value before it is dead."""
        spans: list[list[int]] = []
        for index in sorted(self.touches):
            if not spans or self.touches[index]:
                spans.append([index, index])
            else:
                spans[-1][1] = index
        return [(a, b) for a, b in spans]


@dataclass
class _Call:
    path: str
    module: nn.Module
    init: InitFn
    # the call runs before the model ties its weights (a constructor's reset, transformers'
    # post_init, which ties after initializing): a tied tensor this module holds but another
    # module owns (the one holding it first) is the module's own scratch during the call, so the
    # random numbers are drawn as serially and the owner's values are kept, as tying keeps them
    before_tying: bool = False


@dataclass
class Initialized:
    """What `initialized_blocks` made on this rank."""

    blocks: dict[str, torch.Tensor]  # name -> this rank's block, for the tensors a program reads
    fingerprints: list[tuple[str, Fingerprint]]  # of every whole tensor, to check that ranks agree
    peak_whole_bytes: int  # the most bytes of whole tensors alive at once


def initialized_blocks(
    model: nn.Module,
    layouts: Mapping[str, Layout],
    mesh_shape: Sequence[int],
    coords: Sequence[int],
    init_fn: InitFn | None = None,
    device: torch.device | str = "cpu",
) -> Initialized:
    """This rank's block (layout `layouts[name]`) of every meta tensor of `model`, as the model's
    initialization makes it serially, and a fingerprint of each whole tensor.

    `init_fn(module)` is called on every module in `model.apply` order; without it, the model's
    own initialization as building it ran it (`_calls`). Raises `InitError` for a meta tensor
    that nothing writes."""
    slots = _slots(model)
    if not slots:
        return Initialized({}, [], 0)
    calls = _calls(model, init_fn)
    aborted = _find_touches(calls, slots)
    for index in aborted:  # the fake run stopped early in these (value-dependent code): their
        for slot in slots.values():  # module's own tensors are whole during them, to be safe
            if any(module is calls[index].module for module, _, _ in slot.owners):
                slot.touches.setdefault(index, False)
    rng = torch.random.get_rng_state()
    for _ in range(MAX_PASSES):
        run = _Pass(slots, calls, layouts, tuple(mesh_shape), tuple(coords), device)
        run.run()
        if not run.retouched:
            break
        for key, touches in run.touched.items():  # learned: keep these whole across their calls
            for index, fresh in touches.items():
                slots[key].touches.setdefault(index, fresh)
        torch.random.set_rng_state(rng)
    else:
        raise InitError(
            f"the initialization touched {slots[next(iter(run.retouched))].name} in a way autopar could "
            f"not follow in {MAX_PASSES} passes",
            hint="pass parallelize(..., init_fn=fn) that initializes each module's own tensors",
        )
    unwritten = [s.name for key, s in slots.items() if key not in run.written]
    if unwritten:
        raise InitError(
            f"{unwritten[0]} is on the meta device and no initialization writes it"
            + (f" ({len(unwritten) - 1} more: {', '.join(unwritten[1:4])}...)" if len(unwritten) > 1 else ""),
            hint="give its module a reset_parameters(), pass parallelize(..., init_fn=fn) that sets it, "
            "or build that tensor outside the meta device (buffers computed in __init__, such as "
            "rotary frequencies, are lost on meta)",
        )
    return Initialized(run.blocks, [(slot.name, run.prints[slot.name]) for slot in slots.values()], run.peak)


def materialize_in_place(
    model: nn.Module,
    names: Collection[str],
    init_fn: InitFn | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """Make the meta tensors of `model` named in `names` (any of a tied tensor's names) real and
    whole, held by the model under every name, as building the model on `device` from the random
    state now current would have made them; the others stay on meta. What a pipeline rank does for
    the tensors of its own stages: every init call runs, so every draw is the serial one, but a
    tensor outside `names` is whole only during the calls that write it. Returns the bytes made."""
    slots = _slots(model)
    wanted = {}
    for slot in slots.values():
        name = next((n for n in slot.aliases if n in names), None)
        if name is not None:
            wanted[name] = Layout.replicated(tuple(slot.meta.shape), 1, slot.meta.dtype)
    if not wanted:
        return 0
    made = initialized_blocks(model, wanted, (1,), (0,), init_fn, device)
    total = 0
    for slot in slots.values():
        value = next((made.blocks[n] for n in slot.aliases if n in made.blocks), None)
        if value is None:
            continue
        param = nn.Parameter(value, requires_grad=slot.meta.requires_grad)
        for module, attr, is_param in slot.owners:  # one tensor under every name: ties stay tied
            if is_param:
                module._parameters[attr] = param
            else:
                module._buffers[attr] = value
        total += value.numel() * value.element_size()
    return total


def hold_whole(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Hold `value` where `model` holds its meta tensor `name`, under every name the tensor has (a
    tied weight stays one tensor): what a pipeline rank does with a tensor of another rank's stage
    that it receives whole (`pipeline_meta.MetaHolders`)."""
    slot = next((s for s in _slots(model).values() if name in s.aliases), None)
    if slot is None:
        raise InitError(
            f"{name} is not a meta tensor of the model",
            hint="this is a bug in autopar: only tensors still on the meta device are received",
        )
    _swap(slot, value)


MAX_PASSES = 3  # a pass learns which calls touch a tensor that the fake run could not foresee


class _Pass:
    """One run of every init call on real tensors. A tensor is whole through each stretch of calls
    that must see its value (`_Slot.segments`, as known before the pass), made empty at a stretch's
    start and dropped at its end; after its last stretch it is cut to this rank's block. A call
    that touches a tensor no one expected materializes it on the spot; if that tensor had a value
    already made and dropped (`retouched`), the pass runs again, knowing that."""

    def __init__(
        self,
        slots: dict[int, _Slot],
        calls: list[_Call],
        layouts: Mapping[str, Layout],
        mesh_shape: tuple[int, ...],
        coords: tuple[int, ...],
        device: torch.device | str,
    ) -> None:
        self.slots, self.calls, self.layouts = slots, calls, layouts
        self.mesh_shape, self.coords, self.device = mesh_shape, coords, device
        self.blocks: dict[str, torch.Tensor] = {}
        self.prints: dict[str, Fingerprint] = {}
        self.peak = 0
        self.real: dict[int, torch.Tensor] = {}  # slot -> its whole tensor, while whole
        self.slot_of_real: dict[int, int] = {}  # a whole tensor's storage -> its slot
        self.made: set[int] = set()  # slots made whole at least once in this pass
        self.touched: dict[int, dict[int, bool]] = {}
        self.retouched: set[int] = set()
        self.written: set[int] = set()
        self.index = 0

    def run(self) -> None:
        starts: dict[int, list[int]] = {}
        ends: dict[int, list[int]] = {}
        last = {}
        for key, slot in self.slots.items():
            for first, final in slot.segments():
                starts.setdefault(first, []).append(key)
                ends.setdefault(final, []).append(key)
                last[key] = final
        try:
            for index, call in enumerate(self.calls):
                self.index = index
                for key in starts.get(index, []):
                    self.drop(key)  # a stretch starts: the value before it is dead
                    self.whole(key, planned=True)
                with _Touches(self), _scratch_for_tied(call, self.slots):
                    _run(call)
                self.peak = max(self.peak, sum(t.numel() * t.element_size() for t in self.real.values()))
                ending = set(ends.get(index, [])) | {k for k in self.real if k not in last}
                for key in ending:
                    if key not in self.real:
                        continue
                    if last.get(key, index) <= index:
                        self.cut(key)
                    else:
                        self.drop(key)
        finally:
            for key in list(self.real):
                self.drop(key)

    def whole(self, key: int, planned: bool = False, fresh: bool = True) -> torch.Tensor:
        """The slot's whole tensor, made (and held by the model) if it is not whole yet."""
        if not planned:
            self.touched.setdefault(key, {}).setdefault(self.index, fresh)
        if key not in self.real:
            if not planned and key in self.made and not fresh:
                self.retouched.add(key)  # its earlier value was dropped, and this call reads it
            value = _materialize(self.slots[key], self.device)
            self.real[key] = value
            self.slot_of_real[_storage_key(value)] = key
            self.made.add(key)
        return self.real[key]

    def drop(self, key: int) -> None:
        if key in self.real:
            self.real.pop(key)
            _restore(self.slots[key])

    def cut(self, key: int) -> None:
        slot, value = self.slots[key], self.real.pop(key)
        self.prints[slot.name] = fingerprint(value)
        # a tensor no program reads is not kept; a tied one under each name the program reads it by
        # (a pipeline stage may know a tied weight by its second name: the head's, not the embedding's)
        for name in slot.aliases:
            layout = self.layouts.get(name)
            if layout is not None:
                self.blocks[name] = local_value(value.detach(), layout, self.mesh_shape, self.coords).clone()
        _restore(slot)


def _slots(model: nn.Module) -> dict[int, _Slot]:
    """Every meta tensor of `model` once (keyed by its storage), with all the places it is held."""
    slots: dict[int, _Slot] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        owned = [(n, t, True) for n, t in module._parameters.items() if t is not None]
        owned += [(n, t, False) for n, t in module._buffers.items() if t is not None]
        for attr, tensor, is_param in owned:
            if tensor.device.type != "meta":
                continue
            key = _storage_key(tensor)
            slot = slots.get(key)
            name = f"{path}.{attr}" if path else attr
            if slot is None:
                slot = slots[key] = _Slot(name, [], tensor)
            if all(m is not module or a != attr for m, a, _ in slot.owners):
                slot.owners.append((module, attr, is_param))
            if name not in slot.aliases:
                slot.aliases.append(name)
    return slots


def _calls(model: nn.Module, init_fn: InitFn | None) -> list[_Call]:
    """The init calls in the order building the model ran them.

    With `init_fn`: `init_fn` on every module in `model.apply` order (children, then the module).
    Without: what the constructors ran, so the weights equal the model built on a real device from
    the same seed. Each module's `reset_parameters()` after its children's; and a module with an
    `_init_weights` (a transformers model, whose constructor ends in `post_init`; nanoGPT's
    `self.apply(self._init_weights)`) then runs it on every module below it that no inner model's
    `_init_weights` has run on yet, as transformers' `initialize_weights` skips them."""
    calls: list[_Call] = []
    seen: set[int] = set()
    post_initialized: set[int] = set()

    def subtree(path: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        found = []
        for name, child in module.named_children():
            found += subtree(f"{path}.{name}" if path else name, child)
        return [*found, (path or "<root>", module)]

    def build(path: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for name, child in module.named_children():
            build(f"{path}.{name}" if path else name, child)
        if init_fn is not None:
            calls.append(_Call(path or "<root>", module, init_fn))
            return
        reset = reset_of(module)
        if reset is not None:
            calls.append(_Call(path or "<root>", module, reset, before_tying=True))
        post = getattr(module, "_init_weights", None)
        ties_after = callable(getattr(module, "tie_weights", None))  # transformers' post_init order
        if callable(post):
            for inner_path, inner in subtree(path, module):
                if id(inner) not in post_initialized:
                    post_initialized.add(id(inner))
                    calls.append(_Call(inner_path, inner, post, before_tying=ties_after))

    build("", model)
    return calls


def _find_touches(calls: list[_Call], slots: dict[int, _Slot]) -> list[int]:
    """Run every call on fake stand-ins of the tensors (no data, no random numbers drawn) and note
    which tensors each one touches, and whether its first touch overwrites the tensor whole. Fake,
    not meta: init code may skip meta tensors (torch's `trunc_normal_` does). A call whose code
    needs values (a rejection loop) stops at that point in this run: the touches before it are
    what is known of it, and its index is returned."""
    rng = torch.random.get_rng_state()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    slot_of: dict[int, int] = {}
    aborted = []
    try:
        for key, slot in slots.items():
            with fake_mode:
                stand_in = torch.empty(slot.meta.shape, dtype=slot.meta.dtype)
            slot_of[_storage_key(stand_in)] = key
            _swap(slot, stand_in)
        for index, call in enumerate(calls):
            with _Accesses() as accesses, _scratch_for_tied(call, slots):
                try:
                    with torch.no_grad():
                        call.init(call.module)
                except Exception:  # value-dependent code: the touches before it count
                    aborted.append(index)
            for storage, fresh in accesses.first.items():
                if storage in slot_of:
                    slots[slot_of[storage]].touches.setdefault(index, fresh)
    finally:
        for slot in slots.values():
            _restore(slot)
        torch.random.set_rng_state(rng)
    return aborted


@contextmanager
def _scratch_for_tied(call: _Call, slots: Mapping[int, _Slot]) -> Iterator[None]:
    """During a call before tying, the module's hold on a tensor another module owns is scratch."""
    swapped: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    if call.before_tying:
        for slot in slots.values():
            for module, attr, is_param in slot.owners[1:]:
                if module is call.module:
                    held = (module._parameters if is_param else module._buffers)[attr]
                    assert held is not None
                    if isinstance(held, FakeTensor):  # the fake run: a fake scratch
                        with held.fake_mode:
                            scratch = torch.empty(held.shape, dtype=held.dtype)
                    else:
                        scratch = torch.empty(held.shape, dtype=held.dtype, device="cpu" if held.is_meta else held.device)
                    _hold(module, attr, is_param, scratch, slot.meta.requires_grad)
                    swapped.append((module, attr, is_param, held))
    try:
        yield
    finally:
        for module, attr, is_param, held in swapped:
            (module._parameters if is_param else module._buffers)[attr] = held  # type: ignore[index,assignment]


def _hold(module: nn.Module, attr: str, is_param: bool, value: torch.Tensor, requires_grad: bool) -> None:
    if is_param:
        module._parameters[attr] = nn.Parameter(value, requires_grad=requires_grad)
    else:
        module._buffers[attr] = value


def _run(call: _Call) -> None:
    try:
        with torch.no_grad():
            call.init(call.module)
    except InitError:
        raise
    except Exception as exc:  # the user's or the library's init code: name the module it ran on
        raise InitError(
            f"initializing {call.path} ({type(call.module).__name__}) on the meta-device model failed: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            hint="the init must write the module's tensors in place (nn.init.*, copy_, fill_); "
            "pass parallelize(..., init_fn=fn) to initialize it another way",
        ) from exc


def _materialize(slot: _Slot, device: torch.device | str) -> torch.Tensor:
    value = torch.empty(slot.meta.shape, dtype=slot.meta.dtype, device=device)
    _swap(slot, value)
    return value


def _swap(slot: _Slot, value: torch.Tensor) -> None:
    """Hold `value` where the model holds the slot's meta tensor (under every tied name)."""
    for module, attr, is_param in slot.owners:
        _hold(module, attr, is_param, value, slot.meta.requires_grad)


def _restore(slot: _Slot) -> None:
    for module, attr, is_param in slot.owners:
        if is_param:
            module._parameters[attr] = slot.meta  # type: ignore[assignment]
        else:
            module._buffers[attr] = slot.meta


def _storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


# In-place ops whose result does not depend on the tensor's values before them.
OVERWRITES = {
    torch.ops.aten.uniform_.default,
    torch.ops.aten.normal_.default,
    torch.ops.aten.fill_.Scalar,
    torch.ops.aten.fill_.Tensor,
    torch.ops.aten.zero_.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.random_.default,
    getattr(torch.ops.aten.random_, "from"),
    torch.ops.aten.random_.to,
    torch.ops.aten.exponential_.default,
    torch.ops.aten.bernoulli_.float,
    torch.ops.aten.bernoulli_.Tensor,
    torch.ops.aten.log_normal_.default,
    torch.ops.aten.cauchy_.default,
    torch.ops.aten.geometric_.default,
}


def _accesses(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Iterator[tuple[torch.Tensor, bool]]:
    """Every tensor an op touches, and whether the op overwrites it whole without reading it."""
    for position, value in enumerate(pytree.tree_leaves((args, kwargs))):
        if isinstance(value, torch.Tensor):
            whole = value.storage_offset() == 0 and value.is_contiguous() and (
                value.numel() * value.element_size() == value.untyped_storage().nbytes()
            )
            yield value, position == 0 and func in OVERWRITES and whole


class _Accesses(TorchDispatchMode):
    """Records the storages ops touch, each with whether its first touch overwrote it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[int, bool] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for value, fresh in _accesses(func, args, kwargs):
            self.first.setdefault(_storage_key(value), fresh)
        return func(*args, **kwargs)


class _Touches(TorchDispatchMode):
    """In a real pass: an op on a slot's meta tensor gets the slot's whole tensor instead (made
    then), and every write to a whole tensor is noted."""

    def __init__(self, run: _Pass) -> None:
        super().__init__()
        self.run = run
        self.meta_keys = {_storage_key(slot.meta): key for key, slot in run.slots.items()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fresh = {id(value): is_fresh for value, is_fresh in _accesses(func, args, kwargs)}
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: self._real(t, fresh.get(id(t), False)), (args, kwargs))
        for value in _written(func, args, kwargs):
            key = self.run.slot_of_real.get(_storage_key(value))
            if key is not None:
                self.run.written.add(key)
        return func(*args, **kwargs)

    def _real(self, tensor: torch.Tensor, fresh: bool) -> torch.Tensor:
        if tensor.device.type != "meta":
            return tensor
        key = self.meta_keys.get(_storage_key(tensor))
        if key is None:
            return tensor
        whole = self.run.whole(key, fresh=fresh)
        if tensor.shape == whole.shape and tensor.stride() == whole.stride() and tensor.storage_offset() == 0:
            return whole
        return whole.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _written(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    schema = func._schema
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only else (
            args[position] if position < len(args) else kwargs.get(argument.name)
        )
        if isinstance(value, torch.Tensor):
            yield value
