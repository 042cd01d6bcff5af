"""Warnings located at the user's line.

A warning raised inside a module's forward reaches the user through torch's `Module.__call__`
frames and autopar's own, whose depth differs between paths (a plain call, a hook, a compiled
program); a fixed `stacklevel` then points into torch. `warn_at_caller` walks the stack to the
first frame outside torch and autopar, so the warning names the line the user wrote.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_AUTOPAR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIPPED = tuple(
    directory + os.sep for directory in (_AUTOPAR, os.path.dirname(os.path.abspath(torch.__file__ or "")))
)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the innermost frame whose file lies outside torch and autopar (the user's call),
    honouring the warnings filters and the once-per-location registry as `warnings.warn` does."""
    frame = sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        frame = frame.f_back
    module_globals = frame.f_globals
    registry = module_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<unknown>"),
        registry=registry,
        module_globals=module_globals,
    )
