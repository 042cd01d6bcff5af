"""Random draws from the host's global generators, numpy's `np.random` and Python's `random`,
made while the model is traced.

torch's random ops (dropout, `torch.rand`) are ops of the graph: the program draws them at every
call, as serial does. A draw from numpy's or Python's generator is not: it runs once, while
torch.export traces, and its numbers are baked into the program as a constant, so every later
call reuses the trace's mask where the serial model draws a new one. No error, no warning, and
the loss, every gradient and every parameter part from serial's (transformers' Wav2Vec2 masks
time steps for SpecAugment with `np.random.choice` in training: on (2, 2) its loss differed from
the first step and a gradient by 0.6). Such a trace is refused, naming where the draw was made,
and the generators are left as they were before it.

The check compares the generators' states before and after the export: free when nothing is
drawn. Only when a draw is found is the export run once more with a profile hook, to name the
line of the first draw."""

from __future__ import annotations

import contextlib
import random
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from autopar.core.errors import TraceError
from autopar.passes.trace_errors import user_frame

T = TypeVar("T")

# the generators' state for the second export that checks whether a draw reaches the program
_OTHER_SEED = 20261130

HOST_RANDOM_HINT = (
    "a draw from numpy's or Python's global random generator in forward runs once, while the model "
    "is traced, and its numbers would be a constant of the program: every call would reuse them "
    "where the serial model draws new ones; draw with torch instead (torch.rand, torch.randint, "
    "torch.randperm, torch.bernoulli: the program draws them at every call, as serial does), or "
    "draw outside forward and pass the result as an input (transformers' Wav2Vec2-style audio "
    "models: SpecAugment's time mask, mask_time_prob=0.0 and mask_feature_prob=0.0 in the config, "
    "or a mask passed as mask_time_indices)"
)


def _state() -> tuple[Any, Any]:
    return random.getstate(), np.random.get_state()


def _same(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    (py_a, np_a), (py_b, np_b) = a, b
    return py_a == py_b and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(np_a, np_b)
    )


def _restore(state: tuple[Any, Any]) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])


@contextlib.contextmanager
def host_generators_kept() -> Iterator[None]:
    """numpy's and Python's global generators as they were before the block (a serial run of the
    model made only for an error message draws nothing the user's next call would miss)."""
    before = _state()
    try:
        yield
    finally:
        _restore(before)


def _global_draws() -> list[tuple[Any, str, Any]]:
    """(module, name, function) of every module-level draw of the two global generators:
    `np.random.choice` and the others are methods of numpy's one RandomState, `random.random` and
    the others of Python's one `random.Random`."""
    found = []
    for module, owner in ((np.random, np.random.mtrand._rand), (random, random._inst)):  # type: ignore[attr-defined]
        for name in dir(module):
            fn = getattr(module, name)
            if getattr(fn, "__self__", None) is owner and not name.startswith(("_", "get_state", "set_state", "seed", "getstate", "setstate")):
                found.append((module, name, fn))
    return found


def _first_draw(run: Callable[[], object]) -> tuple[str, str] | None:
    """(where, "numpy.random.choice") of the first module-level draw `run` makes from a global
    generator: `run` again with each such function of `numpy.random` and `random` recording its
    caller (only after a draw is known to happen, and put back after). Where is the model's line and
    the user's line that led there, as the other trace errors name them; a draw through a name
    imported before (`from random import random`) is not seen, and the error then names no line."""
    found: list[tuple[str, str]] = []

    def recording(module: Any, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            if not found:
                stack = "".join(traceback.format_stack(sys._getframe(1)))
                found.append((user_frame(stack), f"{module.__name__}.{name}"))
            return fn(*args, **kwargs)

        return draw

    draws = _global_draws()
    for module, name, fn in draws:
        setattr(module, name, recording(module, name, fn))
    try:
        run()
    except Exception:  # the draw, if any, is recorded before whatever fails later
        pass
    finally:
        for module, name, fn in draws:
            setattr(module, name, fn)
    return found[0] if found else None


def _program_key(exported: Any) -> tuple[str, list[Any]] | None:
    """What a draw could change in an ExportedProgram: its code and its constants' values (None:
    not an ExportedProgram, compared as always changed)."""
    module = getattr(exported, "graph_module", None)
    if module is None:
        return None
    constants = getattr(exported, "constants", {})
    return module.code, [(name, constants[name]) for name in sorted(constants)]


def _same_program(a: Any, b: Any) -> bool:
    key_a, key_b = _program_key(a), _program_key(b)
    if key_a is None or key_b is None or key_a[0] != key_b[0] or len(key_a[1]) != len(key_b[1]):
        return False
    for (name_a, x), (name_b, y) in zip(key_a[1], key_b[1]):
        if name_a != name_b or type(x) is not type(y):
            return False
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        if not same:
            return False
    return True


def without_host_draws(model_name: str, run: Callable[[], T]) -> T:
    """`run()` (an export of the model), refused with a TraceError if it drew from numpy's or
    Python's global generator and what it drew reaches the program: the export is run once more
    from other generator states, and a program that differs (its code or a constant) is refused.
    A draw that changes nothing (MusicGen's LayerDrop draw, `random.uniform(0, 1)` at every layer,
    with layerdrop 0) is not. Either way the generators are put back as they were before it. (A
    draw whose outcome only sometimes changes the program, LayerDrop at a small p, may take the
    same branch both times and pass, as before this check.)"""
    before = _state()
    result = run()
    if _same(before, _state()):
        return result
    random.seed(_OTHER_SEED)
    np.random.seed(_OTHER_SEED)
    try:
        again = run()
    except Exception:  # the other draw took the export elsewhere: it depends on the draw
        again = None
    _restore(before)
    if again is not None and _same_program(result, again):
        return result
    site = _first_draw(run)
    _restore(before)
    where, op = site if site is not None else ("", "numpy.random / random")
    raise TraceError(
        f"{model_name}'s forward draws from the host's global random generator ({op}) while it is "
        "traced: the numbers drawn would be fixed into the program, the same at every call, where "
        "the serial model draws new ones",
        op=op,
        where=where or None,
        hint=HOST_RANDOM_HINT,
    )
