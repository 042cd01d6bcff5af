"""Hardware tables load, cite their sources, and each mesh axis gets the right link."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cost import (
    Hardware,
    available_hardware,
    axis_intra_node,
    axis_links,
    hardware_from_dict,
    load_hardware,
)

GPU_TABLES = ("h100-nvlink-ib", "h200-nvlink-ib", "a100-cluster", "v100-cluster")


def test_all_tables_present_and_valid() -> None:
    names = available_hardware()
    for name in (*GPU_TABLES, "cpu-gloo"):
        assert name in names
        hw = load_hardware(name)
        assert isinstance(hw, Hardware) and hw.name == name
        assert hw.devices_per_node >= 1
        assert hw.peak("float32") > 0 and hw.memory_bandwidth > 0 and hw.memory_capacity > 0
        for link in (hw.intra_node, hw.inter_node):
            assert link.alpha >= 0 and link.bandwidth > 0


@pytest.mark.parametrize("name", GPU_TABLES)
def test_gpu_tables_cite_every_number(name: str) -> None:
    source = load_hardware(name).source
    for key in ("peak_flops", "memory_bandwidth", "memory_capacity"):
        assert "vendor spec" in source[key]
    for link in ("intra_node", "inter_node"):
        assert "vendor spec" in source[f"{link}.bandwidth"]
        assert "estimate" in source[f"{link}.alpha"]


def test_spec_values() -> None:
    h100, h200, a100 = (load_hardware(n) for n in ("h100-nvlink-ib", "h200-nvlink-ib", "a100-cluster"))
    assert h100.peak("bfloat16") == 989e12 and h100.peak("float32") == 67e12
    assert (h100.memory_bandwidth, h100.memory_capacity) == (3.35e12, 80e9)
    assert (h200.memory_bandwidth, h200.memory_capacity) == (4.8e12, 141e9)
    assert h200.intra_node == h100.intra_node and h200.inter_node == h100.inter_node
    assert h100.inter_node.bandwidth == 400e9 / 8  # NDR 400 Gb/s per GPU
    assert a100.peak("bfloat16") == 312e12 and a100.peak("float32") == 19.5e12
    assert a100.intra_node.bandwidth == 300e9 and a100.inter_node.bandwidth == 200e9 / 8


def test_cpu_gloo_is_measured() -> None:
    hw = load_hardware("cpu-gloo")
    assert "measured" in hw.source["all"]
    assert hw.inter_node == hw.intra_node  # one machine: nothing crosses nodes


def test_load_by_path_and_errors(tmp_path: Path) -> None:
    data = load_hardware("a100-cluster").to_json()
    data["name"] = "custom"
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(data))
    assert load_hardware(path).name == "custom"
    assert load_hardware(str(path)) == load_hardware(path)
    with pytest.raises(FileNotFoundError, match="known: a100-calibrated, a100-cluster"):
        load_hardware("no-such-machine")
    del data["inter_node"]
    with pytest.raises(ValueError, match="lacks inter_node"):
        hardware_from_dict(data)


@pytest.mark.parametrize(
    ("mesh", "intra"),
    [
        ((8,), (True,)),
        ((2, 4), (True, True)),
        ((8, 8), (False, True)),
        ((4, 16, 8), (False, False, True)),
        ((16,), (False,)),
        ((2, 2, 2), (True, True, True)),
        ((4, 2, 8), (False, False, True)),
        ((16, 1, 8), (False, True, True)),  # a size-1 axis has nothing to cross
        ((2, 4, 1), (True, True, True)),
    ],
)
def test_axis_links_8_per_node(mesh: tuple[int, ...], intra: tuple[bool, ...]) -> None:
    hw = load_hardware("h100-nvlink-ib")
    assert axis_intra_node(mesh, 8) == intra
    assert axis_links(mesh, hw) == tuple(hw.intra_node if i else hw.inter_node for i in intra)


@pytest.mark.parametrize(
    ("mesh", "intra"),
    [
        ((4, 2), (False, True)),  # pairs {0,1},{2,3},{4,5} fit in 6-GPU nodes, groups of 4 do not
        ((2, 3), (True, True)),  # 2 x 3 = 6 ranks: one node
        ((2, 4), (False, False)),  # {4,5,6,7} straddles node 0 and node 1
        ((3, 2), (True, True)),
    ],
)
def test_axis_links_6_per_node(mesh: tuple[int, ...], intra: tuple[bool, ...]) -> None:
    assert axis_intra_node(mesh, 6) == intra
