"""The README's first command: examples/train_gpt.py trains on 8 local ranks and matches serial."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multirank


def test_train_gpt_matches_serial_training() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parallel loss" in proc.stdout and "serial loss" in proc.stdout
    steps = re.findall(r"^\s*(\d+)\s+[-\d.]+\s+[-\d.]+\s+[\d.e+-]+$", proc.stdout, flags=re.MULTILINE)
    assert steps == ["0", "1", "2"], proc.stdout
    assert "OK: parallel and serial losses agree" in proc.stdout, proc.stdout
