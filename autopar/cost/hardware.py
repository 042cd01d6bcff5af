"""Machine constants as data: one JSON table per hardware kind, and the link each mesh axis uses.

The numbers live in `autopar/cost/tables/<name>.json` (vendor spec values, or measured values
written by `python -m autopar calibrate`), never in code, so that a new cluster is a new file.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from autopar.core.errors import UnknownHardwareError
from autopar.core.host_memory import cpu_rank_memory

TABLES_DIR = Path(__file__).parent / "tables"

# Keys of a table; "source" explains every number, "calibration" (optional) holds raw measurements.
_REQUIRED = (
    "name",
    "description",
    "devices_per_node",
    "peak_flops",
    "memory_bandwidth",
    "memory_capacity",
    "intra_node",
    "inter_node",
    "source",
)


@dataclass(frozen=True)
class Link:
    """Alpha-beta constants of one kind of link: `alpha` s per message step, `bandwidth` bytes/s,
    and `call` s per collective that the issuing rank spends itself (gloo on a CPU: copying and
    queueing on the rank's own cores, which compute cannot overlap; 0 where not measured)."""

    alpha: float
    bandwidth: float
    name: str = field(default="", compare=False)  # "intra_node" / "inter_node", for explanations
    call: float = 0.0

    @property
    def beta(self) -> float:
        """Seconds per byte (1 / bandwidth), the beta of the alpha-beta model."""
        return 1.0 / self.bandwidth


@dataclass(frozen=True)
class Elementwise:
    """The rate key of an op priced by the bytes it moves rather than its flops: its `work`
    counts the elements it produces (`autopar.cost.work.global_work`). Matmuls and attention are
    keyed by their plain dtype."""

    dtype: torch.dtype
    runs: bool = True  # False: a view (no kernel, no bytes), free where kernel rates are measured


@dataclass(frozen=True)
class Attention:
    """The rate key of a fused attention call (flash attention and its kin): priced by its flops at
    the rate its kernel reaches for its head dimension and sequence length, forward or backward,
    causal or not (`KernelRates.attention_fraction`), which is well below a matmul of the same
    flops (FlashAttention-2 on an H100 reaches a third of the bf16 peak). `seq` is the call's
    traced sequence length (a context-parallel split of it is priced at the whole sequence's rate)."""

    dtype: torch.dtype
    head_dim: int
    seq: int
    backward: bool = False
    causal: bool = False


Rate = torch.dtype | str | Elementwise | Attention

# the four curves of one attention kernel in a table: pass and mask
ATTENTION_CURVES = ("forward", "forward_causal", "backward", "backward_causal")


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise linear in log(x) through `points` (sorted by x), flat beyond both ends."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]


@dataclass(frozen=True)
class KernelRates:
    """What a device's kernels reach, measured (`benchmarks/gpu_kernels.py`): the fraction of the
    peak a matmul of a given size reaches per dtype, the fraction of the memory bandwidth an
    element-wise op of a given size reaches, and the least time any kernel takes (its launch).
    Small kernels are far below the spec sheet: a 2048 x 2048 x 512 bf16 product reaches 12 % of
    an H100's peak, a 1 MiB add 8 % of its bandwidth."""

    matmul: Mapping[str, tuple[tuple[float, float], ...]]  # dtype -> ((flops, fraction of peak), ...)
    memory: tuple[tuple[float, float], ...]  # ((bytes moved, fraction of bandwidth), ...)
    launch: float  # seconds, the floor of every kernel
    # fitted on published runs (`benchmarks/published.py --fit`): the share of the microbenchmarked
    # matmul rate a training step sustains (clocks under a full node's power, shapes between the
    # measured ones), and per framework the share of the unfused element-wise time left after its
    # fused kernels; a framework without an entry (autopar's own runtime) pays all of it
    sustained_matmul: float = 1.0
    elementwise_factor: Mapping[str, float] = field(default_factory=dict)
    # published microbenchmarks of fused attention kernels: kernel name -> curve (ATTENTION_CURVES)
    # -> head dim -> ((sequence length, fraction of the bf16 peak), ...); `attention_kernel` is the
    # one torch's SDPA runs here (autopar's runtime), `attention_by_framework` a framework's own
    attention: Mapping[str, Mapping[str, Mapping[int, tuple[tuple[float, float], ...]]]] = field(default_factory=dict)
    attention_kernel: str = ""
    attention_by_framework: Mapping[str, str] = field(default_factory=dict)

    def attention_fraction(self, key: Attention) -> float | None:
        """The fraction of the peak the table's attention kernel (`attention_kernel`) reaches on a
        call like `key`, times `sustained_matmul`: the published curve of its pass and mask,
        piecewise linear in log(sequence) and, between two measured head dims, in log(head dim).
        None when the table has no such curve (the call is then priced as a matmul)."""
        curves = self.attention.get(self.attention_kernel, {})
        name = ("backward" if key.backward else "forward") + ("_causal" if key.causal else "")
        by_dim = curves.get(name)
        if not by_dim:
            return None
        dims = sorted(by_dim)
        below = [d for d in dims if d <= key.head_dim] or dims[:1]
        above = [d for d in dims if d >= key.head_dim] or dims[-1:]
        lo, hi = below[-1], above[0]
        f_lo = _interpolate(by_dim[lo], key.seq)
        if hi == lo:
            return f_lo * self.sustained_matmul
        f_hi = _interpolate(by_dim[hi], key.seq)
        return _interpolate(((lo, f_lo), (hi, f_hi)), key.head_dim) * self.sustained_matmul

    def for_framework(self, framework: str) -> KernelRates:
        """These rates with the attention kernel `framework` runs (`attention_by_framework`;
        the table's default, torch's SDPA, for any other)."""
        kernel = self.attention_by_framework.get(framework, self.attention_kernel)
        return self if kernel == self.attention_kernel else replace(self, attention_kernel=kernel)

    def matmul_fraction(self, dtype: str, flops: float) -> float:
        """The fraction of the peak a matmul of `flops` reaches in a training step: the measured
        curve times `sustained_matmul`."""
        points = self.matmul.get(dtype) or self.matmul.get("float32")
        return (_interpolate(points, flops) if points else 1.0) * self.sustained_matmul

    def elementwise(self, framework: str) -> float:
        """The factor on unfused element-wise time under `framework` (1 when not fitted)."""
        return self.elementwise_factor.get(framework, 1.0)

    def memory_fraction(self, nbytes: float) -> float:
        return _interpolate(self.memory, nbytes) if self.memory else 1.0


@dataclass(frozen=True)
class Hardware:
    """One device kind and its node: peak rates per dtype, memory, and intra/inter-node links.

    `peak_flops` is keyed by torch dtype name without the `torch.` prefix ("float32", "bfloat16").
    A dtype without an entry (integer index math, or bf16 on a V100) is priced at the float32 rate.
    """

    name: str
    description: str
    devices_per_node: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float  # bytes/s of device memory (HBM, or DRAM for cpu-gloo)
    memory_capacity: float  # bytes per device
    intra_node: Link
    inter_node: Link
    source: Mapping[str, str] = field(default_factory=dict, compare=False)
    kernels: KernelRates | None = None  # measured kernel rates; None: every op at the peaks above
    # `memory_capacity` is the machine's, shared by its local ranks (a CPU table: gloo ranks are
    # processes of one machine), not each device's own
    memory_shared: bool = False

    def rank_memory(self, ranks: int) -> float:
        """Bytes of memory one of `ranks` ranks has for a plan's tensors: a device's own, or on a
        table whose memory the local ranks share (CPU processes), the machine's over the ranks on
        it (at most `devices_per_node`) less the runtime's fixed reserve per process
        (`core.host_memory.cpu_rank_memory`, as `parallelize`'s default limit on CPU counts it)."""
        if not self.memory_shared:
            return self.memory_capacity
        return cpu_rank_memory(self.memory_capacity, min(ranks, self.devices_per_node))

    def peak(self, dtype: torch.dtype | str) -> float:
        """FLOP/s for `dtype`; the float32 rate when the table has no entry for it."""
        key = dtype_key(dtype)
        rate = self.peak_flops.get(key)
        if rate is None:
            rate = self.peak_flops["float32"]
        return rate

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "devices_per_node": self.devices_per_node,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "memory_capacity": self.memory_capacity,
            "intra_node": _link_json(self.intra_node),
            "inter_node": _link_json(self.inter_node),
            "source": dict(self.source),
            **({"memory_shared": True} if self.memory_shared else {}),
            **({"kernels": _kernels_json(self.kernels)} if self.kernels is not None else {}),
        }


def _kernels_json(kernels: KernelRates) -> dict[str, Any]:
    return {
        "matmul": {k: [list(p) for p in v] for k, v in kernels.matmul.items()},
        "memory": [list(p) for p in kernels.memory],
        "launch": kernels.launch,
        **({"sustained_matmul": kernels.sustained_matmul} if kernels.sustained_matmul != 1.0 else {}),
        **({"elementwise_factor": dict(kernels.elementwise_factor)} if kernels.elementwise_factor else {}),
        **({"attention": _attention_json(kernels)} if kernels.attention else {}),
    }


def _attention_json(kernels: KernelRates) -> dict[str, Any]:
    return {
        "default": kernels.attention_kernel,
        "by_framework": dict(kernels.attention_by_framework),
        **{
            name: {curve: {str(d): [list(p) for p in pts] for d, pts in dims.items()} for curve, dims in curves.items()}
            for name, curves in kernels.attention.items()
        },
    }


def _attention(entry: Mapping[str, Any], points: Any) -> dict[str, Any]:
    """The `attention` entry of a table's `kernels`: {"default": kernel, "by_framework": {...},
    kernel: {curve: {head dim: [[sequence, fraction of peak], ...]}}}; curves are ATTENTION_CURVES."""
    kernels: dict[str, dict[str, dict[int, tuple[tuple[float, float], ...]]]] = {}
    for name, curves in entry.items():
        if name in ("default", "by_framework"):
            continue
        unknown = set(curves) - set(ATTENTION_CURVES)
        if unknown:
            raise ValueError(f"attention kernel {name!r}: unknown curves {sorted(unknown)}; known: {ATTENTION_CURVES}")
        kernels[str(name)] = {c: {int(d): points(p) for d, p in dims.items()} for c, dims in curves.items()}
    default = str(entry.get("default", ""))
    by_framework = {str(k): str(v) for k, v in entry.get("by_framework", {}).items()}
    missing = [k for k in (default, *by_framework.values()) if k and k not in kernels]
    if missing:
        raise ValueError(f"attention kernels {missing} are named but have no curves")
    return {"attention": kernels, "attention_kernel": default, "attention_by_framework": by_framework}


def _kernels(entry: Mapping[str, Any] | None) -> KernelRates | None:
    if entry is None:
        return None

    def points(rows: Sequence[Sequence[float]]) -> tuple[tuple[float, float], ...]:
        pairs = sorted((float(x), float(y)) for x, y in rows)
        if any(not 0.0 < y <= 1.0 for _, y in pairs):
            raise ValueError("kernel rates are fractions of a peak, in (0, 1]")
        return tuple(pairs)

    return KernelRates(
        matmul={str(k): points(v) for k, v in entry.get("matmul", {}).items()},
        memory=points(entry.get("memory", [])),
        launch=float(entry.get("launch", 0.0)),
        sustained_matmul=float(entry.get("sustained_matmul", 1.0)),
        elementwise_factor={str(k): float(v) for k, v in entry.get("elementwise_factor", {}).items()},
        **_attention(entry.get("attention", {}), points),
    )


def _link_json(link: Link) -> dict[str, float]:
    return {"alpha": link.alpha, "bandwidth": link.bandwidth, **({"call": link.call} if link.call else {})}


def dtype_key(dtype: torch.dtype | str) -> str:
    """`torch.bfloat16` -> "bfloat16"; strings pass through (so tables stay plain JSON)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def available_hardware() -> list[str]:
    """Names of the checked-in tables."""
    return sorted(p.stem for p in TABLES_DIR.glob("*.json"))


def hardware_from_dict(data: Mapping[str, Any]) -> Hardware:
    """Build a `Hardware` from a parsed table, naming any missing key."""
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"hardware table {data.get('name', '?')!r} lacks {', '.join(missing)}")
    if "float32" not in data["peak_flops"]:
        raise ValueError(f"hardware table {data['name']!r}: peak_flops needs a float32 entry")

    def link(key: str) -> Link:
        entry = data[key]
        return Link(float(entry["alpha"]), float(entry["bandwidth"]), key, float(entry.get("call", 0.0)))

    return Hardware(
        name=str(data["name"]),
        description=str(data["description"]),
        devices_per_node=int(data["devices_per_node"]),
        peak_flops={str(k): float(v) for k, v in data["peak_flops"].items()},
        memory_bandwidth=float(data["memory_bandwidth"]),
        memory_capacity=float(data["memory_capacity"]),
        intra_node=link("intra_node"),
        inter_node=link("inter_node"),
        source={str(k): str(v) for k, v in data["source"].items()},
        kernels=_kernels(data.get("kernels")),
        memory_shared=bool(data.get("memory_shared", False)),
    )


@functools.lru_cache(maxsize=32)
def _load(path: str, mtime: float) -> Hardware:
    with open(path) as f:
        return hardware_from_dict(json.load(f))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A checked-in table by name (`"h100-nvlink-ib"`), or any table file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = TABLES_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise UnknownHardwareError(
            f"no hardware table {str(name_or_path)!r}; known: {', '.join(available_hardware())}",
            hint="name a table above, or give the path of a JSON table (python -m autopar calibrate writes one)",
        )
    return _load(str(path.resolve()), path.stat().st_mtime)


def axis_strides(mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Rank distance between neighbours along each axis (row-major: the last axis varies fastest)."""
    return tuple(math.prod(mesh_shape[a + 1 :]) for a in range(len(mesh_shape)))


@functools.lru_cache(maxsize=1024)
def _intra_node(mesh_shape: tuple[int, ...], devices_per_node: int) -> tuple[bool, ...]:
    strides = axis_strides(mesh_shape)
    world = math.prod(mesh_shape)
    result = []
    for a, (size, stride) in enumerate(zip(mesh_shape, strides)):
        span = stride * size
        if span <= devices_per_node and devices_per_node % span == 0:
            result.append(True)  # groups tile whole nodes: the common (power-of-two) case
        elif span > devices_per_node:
            result.append(size == 1)
        else:  # small groups that may straddle a node boundary (e.g. 6 devices per node): check each
            bases = [r for r in range(world) if (r // stride) % mesh_shape[a] == 0]
            last = (size - 1) * stride
            result.append(all(b // devices_per_node == (b + last) // devices_per_node for b in bases))
    return tuple(result)


def axis_intra_node(mesh_shape: Sequence[int], devices_per_node: int) -> tuple[bool, ...]:
    """Whether every process group of each axis lies inside one node.

    Ranks are numbered row-major and nodes hold consecutive ranks. An axis of size `g` and stride
    `s` (product of the later axes' sizes) is intra-node when `s * g <= devices_per_node` and its
    groups do not straddle a node boundary; size-1 axes are trivially intra-node.
    """
    return _intra_node(tuple(mesh_shape), devices_per_node)


def axis_links(mesh_shape: Sequence[int], hw: Hardware) -> tuple[Link, ...]:
    """The link each mesh axis's collectives run over.

    An axis whose groups span nodes uses the inter-node link at its per-GPU bandwidth, whatever
    number k of group members share a node: every ring step waits for its slowest hop, and a ring
    over such a group has inter-node hops, so the k - 1 faster intra-node hops per node earn no
    credit. Two-level (hierarchical) algorithms can do better; this model does not assume them.
    """
    return tuple(
        hw.intra_node if intra else hw.inter_node
        for intra in axis_intra_node(mesh_shape, hw.devices_per_node)
    )


def span_link(hw: Hardware, group_size: int, stride: int) -> Link:
    """The link a collective over `group_size` ranks `stride` apart runs at, by how its group spans
    nodes (ranks numbered node by node, `devices_per_node` to a node):

    - inside one node: the intra-node link (NVLink bus bandwidth);
    - rail-aligned (`stride` a multiple of `devices_per_node`: one member per node, each on its
      own NIC): the inter-node link at one NIC's bandwidth per rank;
    - k > 1 members per node: NCCL runs k rings side by side, one per member and NIC, and the
      intra-node hops join them, so a rank gets min(intra-node, k x inter-node) bandwidth at the
      inter-node latency.

    `axis_links` keeps the plain choice (inter-node at one NIC whatever k is) that the planner's
    tables were fitted against; this is the calibrated step model's."""
    if group_size <= 1 or stride * group_size <= hw.devices_per_node:
        return hw.intra_node
    members = max(1, hw.devices_per_node // stride) if stride < hw.devices_per_node else 1
    bandwidth = min(hw.intra_node.bandwidth, members * hw.inter_node.bandwidth)
    return Link(hw.inter_node.alpha, bandwidth, "inter_node", hw.inter_node.call)
