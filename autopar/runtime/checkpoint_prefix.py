"""Where a checkpoint sits inside the user's module: the submodule whose names match it.

A user often wraps a transformers model (`self.m = LlamaForCausalLM(cfg)` with a forward of their
own) and wants to load that model's `save_pretrained` directory. Its keys then lack the wrapper's
`m.` (and maybe the transformers model's own `base_model_prefix`, `model.`). `find_scope` tries
every submodule and picks the one under which the checkpoint's names match, the way a user would
call `wrapper.m.load_state_dict(...)`; when two unrelated submodules match equally, or none does,
it names the candidates and asks for `prefix=` instead of guessing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from autopar.core.errors import CheckpointError


def checkpoint_names(names: Sequence[str], prefix: str) -> Iterator[str]:
    """Keys a checkpoint may hold a tensor under: its names, then with the base-model prefix
    dropped or added (a base model's checkpoint for a task model, or the other way round)."""
    yield from names
    if not prefix:
        return
    for name in names:
        if name.startswith(prefix + "."):
            yield name[len(prefix) + 1 :]
        else:
            yield f"{prefix}.{name}"


@dataclass(frozen=True)
class Scope:
    """The submodule a checkpoint is loaded into (`path`, "" for the whole module) and that
    submodule's transformers `base_model_prefix` (`base`, "" when it has none)."""

    path: str = ""
    base: str = ""

    def inner(self, names: Sequence[str]) -> list[str]:
        """`names` relative to the submodule; those outside it dropped."""
        if not self.path:
            return list(names)
        head = self.path + "."
        return [n[len(head) :] for n in names if n.startswith(head)]

    def keys(self, names: Sequence[str]) -> Iterator[str]:
        """Checkpoint keys that may hold the tensor known by `names` (none outside the submodule)."""
        return checkpoint_names(self.inner(names), self.base)


def model_prefixes(module: nn.Module) -> dict[str, str]:
    """Each submodule's path -> its `base_model_prefix` ("" when it has none): kept when a module
    is parallelized, so that loading can look for the checkpoint's model inside it."""
    prefixes: dict[str, str] = {}
    for path, sub in module.named_modules():
        base = getattr(sub, "base_model_prefix", "")
        prefixes[path] = base if isinstance(base, str) else ""
    return prefixes


@dataclass
class _Fit:
    scope: Scope
    matched: int  # the submodule's tensors the checkpoint has
    complete: bool  # every tensor of the submodule found, every key explained


def _fit(scope: Scope, required: Sequence[Sequence[str]], known: Sequence[str], keys: set[str]) -> _Fit | None:
    inside = [names for names in required if scope.inner(names)]
    if not inside:
        return None
    matched = sum(1 for names in inside if any(k in keys for k in scope.keys(names)))
    if not matched:
        return None
    explained = {k for n in known for k in scope.keys([n])}
    return _Fit(scope, matched, matched == len(inside) and keys <= explained)


def _outermost(fits: list[_Fit]) -> list[_Fit]:
    """The fits not inside another one's submodule (a wrapper's only child matches as it does)."""
    paths = [f.scope.path for f in fits]
    return [
        f for f in fits
        if not any(p != f.scope.path and (not p or f.scope.path.startswith(p + ".")) for p in paths)
    ]


def find_scope(
    required: Sequence[Sequence[str]],
    known: Sequence[str],
    keys: set[str],
    prefixes: dict[str, str],
    prefix: str | None = None,
    kind: str = "",
) -> Scope:
    """The submodule to load a checkpoint with `keys` into. `required`: each tensor the module
    stores, by all its names; `known`: every name the module has (tied aliases, tensors no program
    reads); `prefixes`: `model_prefixes` of the source module; `prefix`: the user's choice.

    The whole module when its names match, even in part (as before: a task model and its base
    model's checkpoint, the strict check naming what is missing); else the submodule matching the
    most of the checkpoint's tensors: of equal ones, the outermost of nested ones (a task model,
    not its base model inside, so that a base model's checkpoint loads into a wrapped task model
    as it would into the task model itself), then the one matching completely (every tensor
    found, every key explained). Raises `CheckpointError` naming the candidates when that is not
    one submodule, or when none matches."""
    if prefix is not None:
        path = prefix.strip(".")
        if path not in prefixes:
            models = [p for p, b in prefixes.items() if b and p] or [p for p in prefixes if p and "." not in p]
            raise CheckpointError(
                f"load_checkpoint(prefix={prefix!r}): the model has no submodule {path!r}",
                hint=f"pass the path of the submodule the checkpoint is of, e.g. {', '.join(models[:4]) or '(none)'}",
            )
        return Scope(path, prefixes[path])
    root = _fit(Scope("", prefixes.get("", "")), required, known, keys)
    if root is not None:  # the whole module's names match (in part: the strict check says what differs)
        return root.scope
    fits = [f for path, base in prefixes.items() if path for f in [_fit(Scope(path, base), required, known, keys)] if f]
    if fits:
        best = max(f.matched for f in fits)
        top = _outermost([f for f in fits if f.matched == best])
        top = [f for f in top if f.complete] if sum(f.complete for f in top) == 1 else top
        if len(top) == 1:
            return top[0].scope
        raise _ambiguous(kind, top)
    models = [p for p, b in prefixes.items() if b and p]
    raise CheckpointError(
        f"the {kind} checkpoint holds none of the model's tensors, under the whole model or any of its "
        f"submodules (it has {len(keys)}: {', '.join(sorted(keys)[:3])}...; the model wants "
        f"{', '.join(n[0] for n in required[:3])}...)",
        hint="load a checkpoint of this model's architecture"
        + (f"; transformers models inside it: {', '.join(models[:6])} (pass prefix= to choose one)" if models else ""),
    )


def _ambiguous(kind: str, fits: list[_Fit]) -> CheckpointError:
    where = ", ".join(f"{f.scope.path!r} ({f.matched} tensors)" for f in fits)
    return CheckpointError(
        f"the {kind} checkpoint matches several submodules of the model: {where}",
        hint=f"pass prefix= naming the one to load it into, e.g. load_checkpoint(pmodel, path, prefix={fits[0].scope.path!r})",
    )
