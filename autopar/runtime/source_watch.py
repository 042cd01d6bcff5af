"""The original model after `parallelize`: its later hooks and mode changes do not reach the
parallel module, and a call says so.

The parallel module holds its own copies of the weights and its own training flags (one per
submodule, `pmodel.drop.eval()`), and its program was traced with the hooks the model had then.
A user who, after `pmodel = parallelize(model, ...)`, calls `model.eval()` or registers a hook on
`model` (a forward hook to log activations, a gradient hook to clip) may expect it to apply to
`pmodel`; it does not, and the step would run without it, in training mode, silently. The original
model stays usable as a serial reference, so changing it is not an error: each call of the parallel
module compares the original's flags and hooks with what they were at `parallelize` and warns
(`OriginalModelWarning`, once per change) with what to do on the parallel module instead. Only weak
references are kept: the original model can be freed.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from autopar.core.errors import ForwardHookWarning, OriginalModelWarning

_MODULE_HOOKS = (
    ("_forward_hooks", "a forward hook", "forward hooks are traced into the program: register it before parallelize"),
    ("_forward_pre_hooks", "a forward pre-hook", "forward hooks are traced into the program: register it before parallelize"),
    ("_backward_hooks", "a backward hook", "hook the parallel module's parameters' gradients instead: pmodel.get_parameter(name).register_hook(fn)"),
    ("_backward_pre_hooks", "a backward pre-hook", "hook the parallel module's parameters' gradients instead: pmodel.get_parameter(name).register_hook(fn)"),
)
_PARAM_HOOKS = (("_backward_hooks", "register_hook"), ("_post_accumulate_grad_hooks", "register_post_accumulate_grad_hook"))


def _hook_ids(hooks: Any) -> tuple[int, ...]:
    return tuple(hooks) if hooks else ()


class SourceWatch:
    """What the original model's flags and hooks were at `parallelize` (see the module doc)."""

    def __init__(
        self, source: nn.Module, containers: list[tuple[str, nn.Module]] | None = None, *, pipeline: bool = False
    ) -> None:
        # pipeline: a pipelined module, which holds the source itself: a gradient hook on one of its
        # parameters may run (on a 1-D pp mesh they are pmodel's), so the module hooks, which its
        # exported stages never run, and the training flags (pmodel keeps its own, taken at
        # parallelize) count
        self._pipeline = pipeline
        self._modules = [(path, weakref.ref(m)) for path, m in source.named_modules()]
        # the parallel module's own submodule containers (`pmodel.get_submodule(path)`): their
        # training flags are the user's to set, but a hook on one never runs (the program does not
        # call them); weak references, as they belong to the parallel module that holds this watch
        self._containers = [(path, weakref.ref(m)) for path, m in containers or []]
        self._own_hooks = self._container_hooks()
        self._own_warned = self._own_hooks
        self._refs = [ref for _, ref in self._modules]
        self._params = [] if pipeline else [(name, weakref.ref(p)) for name, p in source.named_parameters()]
        self._at_parallelize = self._state()
        self._warned = self._at_parallelize
        self._flags = self._flags_now()
        self._handles = RemovableHandle.next_id

    def _flags_now(self) -> tuple[bool, ...] | None:
        modules = [ref() for ref in self._refs]
        if None in modules:
            return None  # the original model was freed: nothing to compare with
        return tuple([m.training for m in modules])  # type: ignore[union-attr]

    def _state(self) -> tuple[Any, ...] | None:
        modules = []
        for path, ref in self._modules:
            m = ref()
            if m is None:
                return None  # the original model was freed: nothing to compare with
            flag = m.training
            modules.append((path, flag, *(_hook_ids(getattr(m, attr)) for attr, _, _ in _MODULE_HOOKS)))
        params = []
        for name, pref in self._params:
            p = pref()
            if p is None:
                return None
            params.append((name, *(_hook_ids(getattr(p, attr, None)) for attr, _ in _PARAM_HOOKS)))
        return tuple(modules), tuple(params)

    def check(self) -> None:
        """Warn once per change if the original model's flags or hooks differ from `parallelize`'s.

        Every call runs this, so the hooks are compared only when torch made a hook handle since
        the last call (its global handle count; a hook only removed goes unseen), and the flags,
        one read per module, otherwise (an eighth of a `named_modules()` walk of the model)."""
        flags, handles = self._flags_now(), RemovableHandle.next_id
        if handles != self._handles and self._containers:
            self._check_containers()
        if flags is None or (flags == self._flags and handles == self._handles):
            return
        self._flags, self._handles = flags, handles
        now = self._state()
        if now is None or now == self._at_parallelize or now == self._warned:
            return
        self._warned = now
        warnings.warn(_describe(self._at_parallelize, now, self._pipeline), OriginalModelWarning, stacklevel=4)


    def _container_hooks(self) -> tuple[Any, ...]:
        found = []
        for path, ref in self._containers:
            m = ref()
            if m is not None:
                found.append((path, *(_hook_ids(getattr(m, attr)) for attr, _, _ in _MODULE_HOOKS)))
        return tuple(found)

    def _check_containers(self) -> None:
        now = self._container_hooks()
        if now == self._own_hooks or now == self._own_warned:
            return
        self._own_warned = now
        for (path, *then), (_, *hooks) in zip(self._own_hooks, now, strict=False):
            for (_, what, _), old, new in zip(_MODULE_HOOKS, then, hooks, strict=True):
                if old != new:
                    warnings.warn(
                        f"{what} was added to or removed from pmodel.get_submodule({path!r}) after "
                        "parallelize: the parallel module runs its traced program, not its submodules, so "
                        "the hook never runs. Hint: register forward hooks on the model before parallelize "
                        "(what they return is traced; Python side effects run once, at the trace), and "
                        "gradient hooks on pmodel's parameters (pmodel.get_parameter(name).register_hook(fn))",
                        ForwardHookWarning,
                        stacklevel=5,
                    )
                    return


def _describe(then: tuple[Any, ...] | None, now: tuple[Any, ...], pipeline: bool = False) -> str:
    assert then is not None
    lead = "the original model changed after parallelize, and the parallel module does not see it: "
    tail = " (use pmodel, the module parallelize returned; the original model is a serial copy)"
    for (path, was, *hooks_then), (_, is_, *hooks_now) in zip(then[0], now[0], strict=True):
        where = f"model.{path}" if path else "model"
        pwhere = f"pmodel.get_submodule({path!r})" if path else "pmodel"
        if was != is_:
            call = "train()" if is_ else "eval()"
            if pipeline:  # no submodule containers: the whole pipeline switches, as nn.Module.train does
                return (
                    f"{lead}{where}.{call} was called; this call runs as pmodel is set (each submodule's mode "
                    f"as the model had it at parallelize, or as pmodel.train()/pmodel.eval() last set them "
                    f"all): call pmodel.{call}, or set a submodule's mode on the model before parallelize{tail}"
                )
            return f"{lead}{where}.{call} was called; this call runs as pmodel is set: call {pwhere}.{call}{tail}"
        for (_, what, hint), old, new in zip(_MODULE_HOOKS, hooks_then, hooks_now, strict=True):
            if old != new:
                return f"{lead}{what} was added to or removed from {where}; it does not run in pmodel's program: {hint}{tail}"
    for (name, *hooks_then), (_, *hooks_now) in zip(then[1], now[1], strict=True):
        for (_, method), old, new in zip(_PARAM_HOOKS, hooks_then, hooks_now, strict=True):
            if old != new:
                return (
                    f"{lead}a gradient hook ({method}) was added to or removed from model's parameter {name}; "
                    f"pmodel's gradients do not run it: pmodel.get_parameter({name!r}).{method}(fn){tail}"
                )
    return f"{lead}its flags or hooks{tail}"

