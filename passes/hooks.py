"""Gradient hooks the user put on the model: refused by name, before the trace drops them.

autopar traces the model's forward and backward into one graph with torch.export, which runs no
backward: a hook on a parameter's gradient (`p.register_hook`,
`p.register_post_accumulate_grad_hook`) never fires, so training would go on without it (a
clipping hook dropped: gradients 100x the serial model's), and a module's backward hooks
(`register_full_backward_hook`, `register_full_backward_pre_hook`, the old `register_backward_hook`
and torch's global module backward hooks) wrap the module's call in torch's internal
`BackwardHookFunction`, which the trace would refuse under that name. Both are refused here, naming
the user's hook and the parameter or module it is on, with what works instead: the parallel
module's parameters are leaves that autograd accumulates into, so hooks registered on them
after `parallelize` run as in serial, on the whole gradient (a DTensor).

Forward hooks and pre-hooks are part of the forward and traced like it: what they return (a changed
output or input) and what they do to tensors in place are in the program. A hook that returns None
is there for its Python side effects (keeping features, counting calls), and those happen once,
at the trace, on the trace's fake tensors: `recorded_forward_hooks` notes which hooks returned None
while tracing and `warn_side_effect_hooks` names them (`ForwardHookWarning`), since the parallel
module can only run what the program holds.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch.nn as nn
import torch.nn.modules.module as module_hooks

from autopar.core.errors import ForwardHookWarning, UsageError

PARAMETER_HINT = (
    "register it on the parallel module's parameter after parallelize, where it runs as in serial on "
    "the whole gradient (a DTensor): pmodel.get_parameter({name!r}).{method}(fn)"
)
MODULE_HINT = (
    "autopar runs the model's backward as one compiled graph, where module backward hooks have no "
    "module call to wrap: hook the gradients of the parallel module's parameters instead "
    "(pmodel.get_parameter(name).register_hook(fn), or register_post_accumulate_grad_hook), or "
    "remove the hook before parallelize"
)


def refuse_gradient_hooks(model: nn.Module) -> None:
    """Raise `UsageError` for the first gradient hook on `model` (see the module doc), naming it."""
    for name, param in model.named_parameters(remove_duplicate=False):
        for method, hooks in (
            ("register_hook", param._backward_hooks),
            ("register_post_accumulate_grad_hook", param._post_accumulate_grad_hooks),
        ):
            for hook in _hooks(hooks):
                raise UsageError(
                    f"{name} has a gradient hook, {hook_name(hook)} ({method}): the trace runs no "
                    "backward, so it would never run and training would differ from serial",
                    where=f"{name}{hook_site(hook)}",
                    hint=PARAMETER_HINT.format(name=name, method=method),
                )
    for path, module in model.named_modules():
        kind = "register_full_backward_hook" if module._is_full_backward_hook else "register_backward_hook"
        for what, hooks in ((kind, module._backward_hooks), ("register_full_backward_pre_hook", module._backward_pre_hooks)):
            for hook in _hooks(hooks):
                raise UsageError(
                    f"module {path or type(model).__name__} ({type(module).__name__}) has a backward "
                    f"hook, {hook_name(hook)} ({what})",
                    where=f"{path or type(model).__name__}{hook_site(hook)}",
                    hint=MODULE_HINT,
                )
    for what, hooks in (
        ("register_module_full_backward_hook", module_hooks._global_backward_hooks),
        ("register_module_full_backward_pre_hook", module_hooks._global_backward_pre_hooks),
    ):
        for hook in _hooks(hooks):
            raise UsageError(
                f"a global module backward hook, {hook_name(hook)} ({what}), is registered: it would "
                "run on every module of the model",
                where=f"every module{hook_site(hook)}",
                hint=MODULE_HINT.replace("remove the hook", "remove it (handle.remove())"),
            )


def hook_name(hook: Callable[..., Any]) -> str:
    """A hook as its author knows it: `module.qualname`, through functools.partial."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    qualname = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    module = getattr(hook, "__module__", None)
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def hook_site(hook: Callable[..., Any]) -> str:
    """Where the user's hook is written (` (the hook is defined at file:line)`), through
    functools.partial and callable objects: the source line a refusal names, since the hook has
    no op of its own; empty where Python keeps no code for it (a builtin)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    code = getattr(hook, "__code__", None) or getattr(type(hook).__call__, "__code__", None)
    return f" (the hook is defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def _hooks(hooks: Mapping[Any, Callable[..., Any]] | None) -> Iterator[Callable[..., Any]]:
    yield from (hooks or {}).values()


# Hooks known to return None and act on tensors only, which the trace keeps: transformers'
# `enable_input_require_grads` (which `gradient_checkpointing_enable()` and PEFT call) makes the
# embeddings' output require grad in place
TENSOR_ONLY_HOOKS = ("enable_input_require_grads.<locals>.make_inputs_require_grads",)

FORWARD_HOOK_HINT = (
    "return what the hook keeps from the model's forward (or from a wrapper module's), or run it on "
    "the values pmodel returns; a hook that changes the output (returns it) is traced and runs as in "
    "serial"
)


def recorded_forward_hooks(model: nn.Module, seen: dict[str, bool] | None = None) -> dict[str, bool]:
    """Wrap the forward hooks and pre-hooks of `model` (the trace's own copy) so that each notes, as
    the trace runs it, whether it returned None: `{description: returned None}` (`seen`, or a new
    dict), filled in place as the copy runs."""
    seen = {} if seen is None else seen
    for path, module in model.named_modules():
        where = path or type(model).__name__
        for kind, hooks in (("forward hook", module._forward_hooks), ("forward pre-hook", module._forward_pre_hooks)):
            _wrap(hooks, seen, functools.partial(_describe_hook, kind, where))
    return seen


def warn_side_effect_hooks(seen: Mapping[str, bool]) -> None:
    """One `ForwardHookWarning` per hook that returned None while traced (module doc)."""
    for described, returned_none in seen.items():
        if returned_none:
            warnings.warn(
                f"the {described} returned None when the model was traced: it ran once, then, on the "
                "trace's fake tensors; its Python side effects (values it keeps, calls it counts) do not "
                f"happen at each call of the parallel module. Hint: {FORWARD_HOOK_HINT}",
                ForwardHookWarning,
                stacklevel=4,
            )


def _describe_hook(kind: str, where: str, hook: Callable[..., Any]) -> str:
    return f"{kind} {hook_name(hook)} on {where}"


def _wrap(
    hooks: MutableMapping[int, Callable[..., Any]], seen: dict[str, bool], describe: Callable[[Any], str]
) -> None:
    for key, hook in list(hooks.items()):
        if hook_name(hook).endswith(TENSOR_ONLY_HOOKS):
            continue
        described = describe(hook)

        def run(*args: Any, _hook: Callable[..., Any] = hook, _described: str = described, **kwargs: Any) -> Any:
            result = _hook(*args, **kwargs)
            seen[_described] = seen.get(_described, False) or result is None
            return result

        hooks[key] = run  # the same key: torch's with-kwargs and always-called flags stay with it


RootHooks = Callable[[tuple[Any, ...], dict[str, Any], Any], Any]


def take_root_forward_hooks(module: nn.Module) -> tuple[RootHooks, Callable[[], None]]:
    """Take the forward hooks of `module` itself off it, for a trace that wraps its forward: returns
    a function that runs them as `Module.__call__` does (in their order, each given the module, the
    call's arguments, its keyword arguments where registered `with_kwargs`, and the output so far,
    a hook's non-None result replacing the output), and one that puts them back.

    The trace replaces the instance's forward with one that returns only the output's tensors (a
    flat tuple, `passes.trace`) or only the loss (`compiler.pipeline_export`), and `__call__` would
    hand the hooks that: a user's hook on the model itself (`model.register_forward_hook(fn)`)
    would read `out.mean()` on a tuple, or a ModelOutput's `.logits` on a loss, and the trace
    would fail in the user's hook. Run by the wrapper on the forward's own output, they see and
    return what they do in serial. Pre-hooks are left on the module: they run before the forward
    on the call's arguments, which the wrapper does not change."""
    hooks = list(module._forward_hooks.items())
    with_kwargs = dict(module._forward_hooks_with_kwargs)
    always = dict(module._forward_hooks_always_called)
    module._forward_hooks.clear()
    module._forward_hooks_with_kwargs.clear()
    module._forward_hooks_always_called.clear()

    def run(args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        for key, hook in hooks:
            result = hook(module, args, kwargs, output) if with_kwargs.get(key) else hook(module, args, output)
            if result is not None:
                output = result
        return output

    def restore() -> None:
        meanwhile = list(module._forward_hooks.items())  # registered while they were off: after them
        module._forward_hooks.clear()
        module._forward_hooks.update([*hooks, *meanwhile])
        module._forward_hooks_with_kwargs.update(with_kwargs)
        module._forward_hooks_always_called.update(always)

    return run, restore
