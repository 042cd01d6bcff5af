"""The live heap of this process, as the memory model's tests and `benchmarks/long_context.py`
hold it against the modeled memory: malloc's bytes in use (glibc's `mallinfo2`: allocated heap
chunks and mmapped ones, what the tensors and the rest really occupy; the RSS adds what malloc
keeps free, which no plan models), and its most after any ATen op run under `LivePeak`."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def malloc_in_use() -> Callable[[], int] | None:
    """A function returning malloc's bytes in use now, or None where glibc's `mallinfo2` is
    missing (another libc, glibc before 2.33)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallInfo2

    def in_use() -> int:
        now = info()
        return int(now.uordblks + now.hblkhd)

    return in_use


def settle() -> None:
    """Collect garbage and give malloc's free memory back (so a step's high-water marks are its own)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class LivePeak(TorchDispatchMode):
    """The most bytes `live` returned after any ATen op run under it (and at its start)."""

    def __init__(self, live: Callable[[], int]) -> None:
        super().__init__()
        self.live = live
        self.peak = live()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.live())
        return out
