"""Measured kernel rates in a hardware table (`KernelRates`): how `compute_time` prices a matmul,
an element-wise op and a view with them, that tables without them price as before, and that
`calibrated_table` turns `benchmarks/gpu_kernels.py`'s report into a table that loads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.cost import compute_time, hardware_from_dict, load_hardware
from autopar.cost.calibrate import calibrated_table, kernel_rates
from autopar.cost.hardware import Elementwise

ROOT = Path(__file__).resolve().parents[1]
MEASURED = {
    "device": "Test GPU",
    "torch": "2.13.0",
    "launch_s": 5e-6,
    "matmul": [
        {"dtype": "bfloat16", "m": 1024, "k": 1024, "n": 1024, "of_peak": 0.1},
        {"dtype": "bfloat16", "m": 8192, "k": 8192, "n": 8192, "of_peak": 0.7},
        {"dtype": "float32", "m": 1024, "k": 1024, "n": 1024, "of_peak": 0.5},
    ],
    "elementwise": [
        {"bytes_per_s": 1e11, "seconds": 1e-5, "of_bandwidth": 0.05},  # 1 MB moved
        {"bytes_per_s": 2e12, "seconds": 5e-4, "of_bandwidth": 0.8},  # 1 GB moved
    ],
}


def _table() -> dict:
    return calibrated_table(load_hardware("h100-nvlink-ib"), MEASURED, "test-calibrated", "today")


def test_a_spec_table_prices_the_roofline_as_before() -> None:
    hw = load_hardware("h100-nvlink-ib")
    assert hw.kernels is None
    assert compute_time(1e12, 0.0, torch.bfloat16, hw) == 1e12 / 989e12
    assert compute_time(1e6, 0.0, Elementwise(torch.float32), hw) == 1e6 / 67e12  # elements at the peak
    assert compute_time(1e6, 0.0, Elementwise(torch.float32, runs=False), hw) == 1e6 / 67e12


def test_a_calibrated_table_prices_each_kind_at_its_measured_fraction() -> None:
    hw = hardware_from_dict(_table())
    assert hw.kernels is not None and hw.name == "test-calibrated"
    small, large = 2.0 * 1024**3, 2.0 * 8192**3
    assert compute_time(small, 0.0, torch.bfloat16, hw) == pytest.approx(small / (989e12 * 0.1), rel=1e-3)
    assert compute_time(large, 0.0, torch.bfloat16, hw) == pytest.approx(large / (989e12 * 0.7), rel=1e-3)
    middle = math.sqrt(small * large)  # halfway in log(flops): halfway in fraction
    assert compute_time(middle, 0.0, torch.bfloat16, hw) == pytest.approx(middle / (989e12 * 0.4), rel=1e-3)
    assert compute_time(4 * large, 0.0, torch.bfloat16, hw) == pytest.approx(4 * large / (989e12 * 0.7), rel=1e-3)
    # float16 has no curve of its own: float32's fractions at float16's peak
    assert compute_time(4 * small, 0.0, torch.float16, hw) == pytest.approx(4 * small / (989e12 * 0.5), rel=1e-3)
    # an element-wise op of N bf16 elements moves 3 N * 2 bytes (two operands, one result)
    n = 1e9 / 6
    assert compute_time(n, 0.0, Elementwise(torch.bfloat16), hw) == pytest.approx(1e9 / (3.35e12 * 0.8), rel=1e-3)
    assert compute_time(n, 0.0, Elementwise(torch.bfloat16, runs=False), hw) == 0.0  # a view
    assert compute_time(1.0, 0.0, Elementwise(torch.bfloat16), hw) == 5e-6  # the launch floor


def test_kernel_rates_bin_by_size_and_the_table_cites_them() -> None:
    rates = kernel_rates(MEASURED)
    assert [fraction for _, fraction in rates["matmul"]["bfloat16"]] == [0.1, 0.7]
    assert [size for size, _ in rates["memory"]] == [1e6, 1e9]
    table = _table()
    assert all("Test GPU" in table["source"][f"kernels.{k}"] for k in ("matmul", "memory", "launch"))
    assert hardware_from_dict(json.loads(json.dumps(table))).to_json()["kernels"] == table["kernels"]


def test_fractions_outside_zero_to_one_are_refused() -> None:
    table = _table()
    table["kernels"]["memory"] = [[1e6, 1.5]]
    with pytest.raises(ValueError, match="fractions of a peak"):
        hardware_from_dict(table)


@pytest.mark.parametrize("spec_name, measured_name", [("h100-nvlink-ib", "h100-calibrated"), ("h200-nvlink-ib", "h200-calibrated")])
def test_the_checked_in_calibrated_tables_are_slower_than_the_spec_sheet(spec_name: str, measured_name: str) -> None:
    spec, measured = load_hardware(spec_name), load_hardware(measured_name)
    assert measured.kernels is not None and measured.peak_flops == spec.peak_flops
    for flops in (1e9, 1e11, 1e13):
        assert compute_time(flops, 0.0, torch.bfloat16, measured) > compute_time(flops, 0.0, torch.bfloat16, spec)
    assert "gpu_kernels.py" in measured.source["kernels.matmul"]


def test_gpu_kernels_runs_on_the_cpu_and_writes_a_loadable_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_kernels.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "--tiny", "--device", "cpu", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["matmul"] and report["elementwise"] and report["attention"] and report["launch_s"] > 0
    rates = kernel_rates(report)  # fractions on a busy CPU may exceed the table's: clipped to 1
    assert all(0 < f <= 1 for _, f in rates["memory"])
