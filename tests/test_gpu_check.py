"""benchmarks/gpu_check.py in its CPU configuration, so the one-call GPU check never rots: every
variant trains the same tiny LLaMA from one seed to the same loss, and the step model's prediction
comes with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_the_cpu_and_its_variants_agree(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--device", "cpu",
        "--variants", "torch eager", "autopar eager", "--warmup", "1", "--steps", "2", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert set(rows) == {"torch eager", "autopar eager"}
    assert all("error" not in row for row in rows.values()), rows
    assert abs(rows["autopar eager"]["loss"] - rows["torch eager"]["loss"]) < 1e-5
    assert [m["hardware"] for m in report["modeled"]] == ["cpu-gloo"] and report["modeled"][0]["step_ms"] > 0
    assert max(report["attention_pair_max_error"].values()) < 1e-1  # bf16 on the CPU kernel
    assert "| autopar eager |" in run.stdout
