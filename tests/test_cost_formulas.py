"""Cost formulas against hand-computed values, and step_time against collective_time."""

from __future__ import annotations

import pytest
import torch

from autopar.core.layout import Layout, P, R, Shard
from autopar.core.redistribute import plan_redistribute
from autopar.cost import (
    ADAMW_STATE_FACTOR,
    Link,
    MemoryBreakdown,
    MeshCost,
    axis_links,
    collective_time,
    compute_time,
    latency_steps,
    load_hardware,
    memory_per_rank,
    redistribute_time,
    step_time,
)

H100 = load_hardware("h100-nvlink-ib")
NVLINK = H100.intra_node
MiB = 2**20


def test_all_reduce_1mib_fp32_over_8_nvlink() -> None:
    # 1 MiB of fp32 = 262144 elements; ring: 2*7/8 of the bytes at 450 GB/s plus 14 steps of 1 us.
    expected = 2 * 7 / 8 * MiB / 450e9 + 14 * 1e-6
    assert collective_time("all_reduce", MiB // 4, torch.float32, 8, NVLINK) == pytest.approx(
        expected, rel=1e-12
    )
    assert expected == pytest.approx(18.0778e-6, rel=1e-5)


@pytest.mark.parametrize(
    ("kind", "elements", "g", "expected"),
    [
        # all_gather, N = full gathered size: 3/4 * 4 MiB at 50 GB/s + 3 * 5 us (IB link)
        ("all_gather", MiB, 4, 3 / 4 * 4 * MiB / 50e9 + 3 * 5e-6),
        ("reduce_scatter", MiB, 4, 3 / 4 * 4 * MiB / 50e9 + 3 * 5e-6),
        # all_to_all, N = local size: same ring volume and latency
        ("all_to_all", MiB, 4, 3 / 4 * 4 * MiB / 50e9 + 3 * 5e-6),
        ("all_reduce", MiB, 2, 2 * 1 / 2 * 4 * MiB / 50e9 + 2 * 5e-6),
        ("all_reduce", MiB, 1, 0.0),
        ("all_gather", 10, 1, 0.0),
    ],
)
def test_collective_time_hand_cases(kind: str, elements: int, g: int, expected: float) -> None:
    assert collective_time(kind, elements, torch.float32, g, H100.inter_node) == pytest.approx(expected)
    # a byte count per element works as well as a dtype
    assert collective_time(kind, elements, 4, g, H100.inter_node) == pytest.approx(expected)


def test_bf16_halves_the_bandwidth_term() -> None:
    link = Link(alpha=0.0, bandwidth=1e9)
    f32 = collective_time("all_gather", 1000, torch.float32, 4, link)
    bf16 = collective_time("all_gather", 1000, torch.bfloat16, 4, link)
    assert bf16 == pytest.approx(f32 / 2)


def test_latency_steps_and_unknown_kind() -> None:
    assert latency_steps("all_reduce", 8) == 14
    assert latency_steps("all_gather", 8) == 7
    with pytest.raises(ValueError, match="not a collective"):
        latency_steps("slice", 8)


def _single_step(src: Layout, dst: Layout, mesh: tuple[int, ...]):
    (step,) = plan_redistribute(src, dst, mesh)
    return step


@pytest.mark.parametrize(
    ("src", "dst", "kind", "n_convention"),
    [
        ((P,), (R,), "all_reduce", 64 * 32),  # the tensor
        ((Shard(0),), (R,), "all_gather", 64 * 32),  # full gathered size
        ((P,), (Shard(0),), "reduce_scatter", 64 * 32),  # full input size
        ((Shard(0),), (Shard(1),), "all_to_all", 64 * 32 // 8),  # local size
    ],
)
def test_step_time_agrees_with_collective_time(src, dst, kind, n_convention) -> None:
    mesh = (8,)
    step = _single_step(Layout(src, (64, 32)), Layout(dst, (64, 32)), mesh)
    assert step.kind == kind
    links = axis_links(mesh, H100)
    expected = collective_time(kind, n_convention, torch.float32, 8, NVLINK)
    assert step_time(step, mesh, links) == pytest.approx(expected, rel=1e-12)


def test_local_steps_cost_nothing() -> None:
    mesh = (4,)
    step = _single_step(Layout((R,), (8, 8)), Layout((Shard(0),), (8, 8)), mesh)
    assert step.kind == "slice"
    assert step_time(step, mesh, axis_links(mesh, H100)) == 0.0


def test_redistribute_time_uses_each_axis_link() -> None:
    # (2, 8) with 8 GPUs per node: axis 1 is NVLink, axis 0 crosses nodes.
    mesh = (2, 8)
    links = axis_links(mesh, H100)
    src = Layout((Shard(0), Shard(0)), (1024, 1024))
    dst = Layout((R, R), (1024, 1024))
    steps = plan_redistribute(src, dst, mesh)
    assert [(s.kind, s.axis) for s in steps] == [("all_gather", 1), ("all_gather", 0)]
    inner = collective_time("all_gather", 1024 * 1024 // 2, torch.float32, 8, H100.intra_node)
    outer = collective_time("all_gather", 1024 * 1024, torch.float32, 2, H100.inter_node)
    assert redistribute_time(src, dst, mesh, links) == pytest.approx(inner + outer)
    assert redistribute_time(src, src, mesh, links) == 0.0


def test_roofline_regimes() -> None:
    # 4096^3 bf16 matmul: 2*4096^3 flops at 989 TFLOP/s beat 3*4096^2*2 bytes at 3.35 TB/s.
    n = 4096
    flops, nbytes = 2.0 * n**3, 3.0 * n * n * 2
    assert compute_time(flops, nbytes, torch.bfloat16, H100) == pytest.approx(flops / 989e12)
    # elementwise add of 1 Mi bf16 elements: memory bound
    flops, nbytes = float(MiB), 3.0 * MiB * 2
    assert compute_time(flops, nbytes, torch.bfloat16, H100) == pytest.approx(nbytes / 3.35e12)
    # the same matmul in fp32 uses the (much lower) fp32 peak
    assert compute_time(2.0 * n**3, 0.0, torch.float32, H100) == pytest.approx(2.0 * n**3 / 67e12)
    # a dtype without a table entry is priced at the float32 rate
    assert compute_time(1e12, 0.0, torch.int64, H100) == pytest.approx(1e12 / 67e12)
    assert compute_time(1e12, 0.0, torch.bfloat16, load_hardware("v100-cluster")) == pytest.approx(
        1e12 / 15.7e12
    )


def test_memory_breakdown_adamw() -> None:
    gib = 2.0**30
    m = memory_per_rank(1 * gib, 1 * gib, ADAMW_STATE_FACTOR, activation_bytes=3 * gib)
    assert m == MemoryBreakdown(params=gib, grads=gib, optimizer=2 * gib, activations=3 * gib)
    assert m.total == 7 * gib
    assert m.fits(H100)  # 7 GiB < 0.9 * 80 GB
    assert "= 7.00 GiB" in str(m)
    # bf16 parameters with fp32 states: states are 2 * 4 bytes per 2-byte element = 4x the params
    m = memory_per_rank(gib, gib, param_itemsize=2)
    assert m.optimizer == 4 * gib
    # plain SGD keeps no state
    assert memory_per_rank(gib, gib, 0.0).optimizer == 0.0
    assert not memory_per_rank(40e9, 40e9).fits(H100)


def test_mesh_cost_binds_links() -> None:
    mesh = (2, 8)
    cost = MeshCost.build(H100, mesh)
    assert cost.links == axis_links(mesh, H100)
    src, dst = Layout((Shard(0), P), (64, 64)), Layout((R, R), (64, 64))
    assert cost.redistribute(src, dst) == redistribute_time(src, dst, mesh, cost.links)
    assert cost.collective("all_reduce", 100, torch.float32, 0) == collective_time(
        "all_reduce", 100, torch.float32, 2, H100.inter_node
    )
    assert cost.compute(1e9, 0.0, torch.float32) == compute_time(1e9, 0.0, torch.float32, H100)
    (step, *_) = plan_redistribute(src, dst, mesh)
    assert cost.step(step) == step_time(step, mesh, cost.links)
