"""Per-rank time and memory formulas, as plain floats (the search calls them per candidate).

`symbolic.py` holds the same formulas as sympy expressions; tests check that the two agree.

Collective sizes. `collective_time` takes N in the form each collective's API sees it:

| kind           | N                                   | time                                        |
|----------------|-------------------------------------|---------------------------------------------|
| all_reduce     | the tensor (same size in and out)   | 2(g-1)/g * N*b / bw + 2(g-1) * alpha        |
| all_gather     | the FULL gathered output (g x input) | (g-1)/g * N*b / bw + (g-1) * alpha          |
| reduce_scatter | the FULL input (g x output)         | (g-1)/g * N*b / bw + (g-1) * alpha          |
| all_to_all     | the local tensor (same size in/out) | (g-1)/g * N*b / bw + (g-1) * alpha          |

(b = bytes per element, g = group size; a size-1 group costs 0.) The bandwidth term is exactly
`CommStep.elements_sent * b / bw` for the step doing that collective, which is what `step_time`
uses, so the two entry points agree (tested).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autopar.core.layout import Layout, itemsize
from autopar.core.redistribute import CommStep, plan_redistribute
from autopar.cost.hardware import Attention, Elementwise, Hardware, Link, Rate, axis_links, dtype_key

# Message steps of a ring algorithm over g ranks, each paying the link latency alpha once.
LATENCY_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "forbidden": 1, "ring_shift": 1}
# Elements sent per rank per element of N (above), times (g-1)/g.
VOLUME_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}

ADAMW_STATE_FACTOR = 2.0  # exp_avg and exp_avg_sq
SGD_MOMENTUM_STATE_FACTOR = 1.0


def _bytes_per_element(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else itemsize(dtype)


def compute_time(flops: float, bytes_moved: float, rate: Rate, hw: Hardware) -> float:
    """Time of one op on one rank. `rate` is the op's dtype for matmuls and attention, or
    `Elementwise(dtype)` for an op whose `flops` counts the elements it produces.

    A table without measured kernel rates prices the roofline at the spec sheet: the larger of
    flops at peak and bytes at full bandwidth. With `hw.kernels` (a calibrated table), a matmul
    runs at the fraction of the peak its size reaches, an element-wise op moves its bytes (when
    not given: two operands read and one result written) at the fraction of the bandwidth its
    size reaches, a fused attention call (`Attention`) at the fraction its kernel's published curve
    gives for its head dimension, sequence length, pass and mask (on the matmul curve where the
    table has none), and no kernel takes less than a launch."""
    kernels = hw.kernels
    if isinstance(rate, Elementwise):
        if kernels is None:
            return max(flops / hw.peak(rate.dtype), bytes_moved / hw.memory_bandwidth)
        if not rate.runs:
            return 0.0
        moved = bytes_moved if bytes_moved > 0 else 3.0 * flops * _bytes_per_element(rate.dtype)
        return max(moved / (hw.memory_bandwidth * kernels.memory_fraction(moved)), kernels.launch)
    dtype = rate.dtype if isinstance(rate, Attention) else rate
    if kernels is None:
        return max(flops / hw.peak(dtype), bytes_moved / hw.memory_bandwidth)
    key = dtype_key(dtype)
    fraction = kernels.attention_fraction(rate) if isinstance(rate, Attention) else None
    if fraction is None:
        fraction = kernels.matmul_fraction(key, flops)
    seconds = flops / (hw.peak(dtype) * fraction)
    return max(seconds, bytes_moved / (hw.memory_bandwidth * kernels.memory_fraction(bytes_moved)), kernels.launch)


def latency_steps(kind: str, group_size: int) -> int:
    """Ring message steps: 2(g-1) for all_reduce (reduce-scatter + all-gather), g-1 for the rest."""
    if kind not in LATENCY_STEPS:
        raise ValueError(f"not a collective: {kind!r} (expected one of {', '.join(LATENCY_STEPS)})")
    if kind == "ring_shift":  # one message, to the next rank
        return 1
    return LATENCY_STEPS[kind] * (group_size - 1)


def collective_time(
    kind: str, elements: float, dtype: torch.dtype | int, group_size: int, link: Link
) -> float:
    """Alpha-beta ring time of one collective; `elements` is N as in the module table above.

    `dtype` may be a torch dtype or a byte count per element.
    """
    if group_size <= 1:
        return 0.0
    g = group_size
    steps = latency_steps(kind, g)
    sent = VOLUME_FACTOR[kind] * (g - 1) / g * elements * _bytes_per_element(dtype)
    return sent / link.bandwidth + steps * link.alpha + link.call


def step_time(step: CommStep, mesh_shape: Sequence[int], links: Sequence[Link]) -> float:
    """Time of one redistribution step on the link of its mesh axis (`links = axis_links(...)`).

    Uses `step.bytes_sent` (elements sent per rank, ring convention of comm_volumes.md) for the
    bandwidth term. Local steps (`slice`, `zero_partial`) cost 0 here: they send nothing, and their
    memory traffic is a small copy that the compute roofline of the consumer dominates.
    """
    if not step.is_collective and step.kind != "forbidden":
        return 0.0
    g = mesh_shape[step.axis]
    if g <= 1:
        return 0.0
    link = links[step.axis]
    return step.bytes_sent(mesh_shape) / link.bandwidth + latency_steps(step.kind, g) * link.alpha + link.call


def redistribute_time(src: Layout, dst: Layout, mesh_shape: Sequence[int], links: Sequence[Link]) -> float:
    """Seconds to move a tensor from layout `src` to `dst` (0 when they agree).

    Memoized: a search prices the same layout pairs over and over.
    """
    if src == dst:
        return 0.0
    return _redistribute_time(src, dst, tuple(mesh_shape), tuple(links))


@functools.lru_cache(maxsize=1 << 18)
def _redistribute_time(
    src: Layout, dst: Layout, mesh_shape: tuple[int, ...], links: tuple[Link, ...]
) -> float:
    return sum(step_time(s, mesh_shape, links) for s in plan_redistribute(src, dst, mesh_shape))


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds at the peak of a training step, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    # the working memory at the step's peak op beyond the saved activations (`planning.working`)
    working: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.working

    def fits(self, hw: Hardware, headroom: float = 0.9) -> bool:
        """Whether the total stays under `headroom` of device memory (allocator slack, workspaces)."""
        return self.total <= headroom * hw.memory_capacity

    def __str__(self) -> str:
        gib = 2.0**30
        return (
            f"params {self.params / gib:.2f} GiB + grads {self.grads / gib:.2f} GiB + optimizer "
            f"{self.optimizer / gib:.2f} GiB + activations {self.activations / gib:.2f} GiB"
            + (f" + working {self.working / gib:.2f} GiB" if self.working else "")
            + f" = {self.total / gib:.2f} GiB"
        )


def memory_per_rank(
    param_bytes_local: float,
    grad_bytes_local: float,
    optimizer_state_factor: float = ADAMW_STATE_FACTOR,
    activation_bytes: float = 0.0,
    param_itemsize: int = 4,
    state_itemsize: int = 4,
) -> MemoryBreakdown:
    """Memory of one rank: stored shards of parameters and gradients, optimizer states, activations.

    Optimizer states: `optimizer_state_factor` values of `state_itemsize` bytes per local parameter
    element (AdamW: 2, SGD with momentum: 1, plain SGD: 0); the element count is
    `param_bytes_local / param_itemsize`. torch allocates states in the parameter's dtype, so pass
    `state_itemsize=2` for pure-bf16 parameters; the default is fp32 (fp32 or mixed-precision masters).
    `activation_bytes` is what the forward keeps for backward plus the largest live temporary.
    """
    states = optimizer_state_factor * (param_bytes_local / param_itemsize) * state_itemsize
    return MemoryBreakdown(
        params=float(param_bytes_local),
        grads=float(grad_bytes_local),
        optimizer=float(states),
        activations=float(activation_bytes),
    )


@dataclass(frozen=True)
class MeshCost:
    """A hardware table bound to one mesh shape, so a search prices candidates without re-deriving
    the per-axis links each time."""

    hw: Hardware
    mesh_shape: tuple[int, ...]
    links: tuple[Link, ...]

    @staticmethod
    def build(hw: Hardware, mesh_shape: Sequence[int], in_process: int = 0) -> MeshCost:
        """`in_process` trailing axes are batch chunks inside one process (over-decomposition):
        the device axes' links are as without them, and theirs is a copy through memory."""
        devices = tuple(mesh_shape)[: len(mesh_shape) - in_process]
        local = Link(alpha=0.0, bandwidth=hw.memory_bandwidth / 2, name="in_process")
        return MeshCost(hw, tuple(mesh_shape), axis_links(devices, hw) + (local,) * in_process)

    def compute(self, flops: float, bytes_moved: float, rate: Rate) -> float:
        return compute_time(flops, bytes_moved, rate, self.hw)

    def collective(self, kind: str, elements: float, dtype: torch.dtype | int, axis: int) -> float:
        """`collective_time` over mesh axis `axis` (its size and link)."""
        return collective_time(kind, elements, dtype, self.mesh_shape[axis], self.links[axis])

    def step(self, step: CommStep) -> float:
        return step_time(step, self.mesh_shape, self.links)

    @property
    def counts_calls(self) -> bool:
        """Whether a link of this mesh prices a collective's own time on its rank (`Link.call`):
        then how many collectives a plan issues matters, which bucketing changes."""
        return any(link.call > 0 for link in self.links)

    def redistribute(self, src: Layout, dst: Layout) -> float:
        return redistribute_time(src, dst, self.mesh_shape, self.links)


def format_bytes(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (small test models)."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"
