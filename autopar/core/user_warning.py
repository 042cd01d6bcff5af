"""What reaches the user: warnings located at the user's line, and torch notices about autopar's
own internals kept from the user's console.

A warning raised inside a module's forward reaches the user through torch's `Module.__call__`
frames and autopar's own, whose depth differs between paths (a plain call, a hook, a compiled
program); a fixed `stacklevel` then points into torch. `warn_at_caller` walks the stack to the
first frame outside torch and autopar, so the warning names the line the user wrote.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

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


GLOO_ALLTOALL_NOTICE = "CPU process group does not support alltoall yet, falling back with allgather + chunk!"


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != GLOO_ALLTOALL_NOTICE


@contextlib.contextmanager
def without_gloo_alltoall_notice() -> Iterator[None]:
    """Inside: DTensor's notice that a CPU mesh moves a split from one dim to another by an
    all-gather is dropped. autopar meets it when a new program (eval, no_grad, another batch
    size) reads a parameter in another split than it is stored in: a layout change of its own,
    not something the user can act on. Only that exact message, only from torch's logger that
    prints it, and only while autopar's own redistribution runs: every other record passes."""
    logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    dropping = _DropNotice()
    logger.addFilter(dropping)
    try:
        yield
    finally:
        logger.removeFilter(dropping)
