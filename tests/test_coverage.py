"""`python -m autopar coverage`: every op of a joint graph with its rule family, or "missing".

Also the regression test of the rule library against real architectures: every op in the joint
graph of every zoo model (and of the two transformers models when installed), with and without
the multi-rank decompositions, has a rule.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.__main__ import main
from autopar.compiler.coverage import load_factory, model_coverage, op_coverage
from autopar.reporting.coverage import MISSING, format_rows
from autopar.rules.base import RuleRegistry
from autopar.rules.registry import default_registry

aten = torch.ops.aten


class MatrixExp(nn.Module):
    """`torch.linalg.matrix_exp` has no sharding rule (yet): the tool must say so."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.matrix_exp(self.fc(x)).square().mean()


def make_matrix_exp(seed: int) -> tuple[MatrixExp, tuple[torch.Tensor]]:
    torch.manual_seed(seed)
    return MatrixExp(), (torch.randn(8, 8),)


def test_missing_op_is_reported_with_its_count() -> None:
    rows = op_coverage(*make_matrix_exp(0), mesh_shape=(2,))
    by_op = {r.op: r for r in rows}
    matrix_exp = by_op[str(aten.linalg_matrix_exp.default)]
    assert matrix_exp.missing and matrix_exp.family == MISSING
    assert matrix_exp.count == 2  # forward, and in its backward (the exponential of a block matrix)
    assert rows[0] is matrix_exp  # missing ops come first
    assert by_op[str(aten.addmm.default)].family == "matmul"
    assert not any(r.missing for r in rows if r is not matrix_exp)
    assert "1 missing" in format_rows(rows)


def test_rows_count_every_node_and_say_what_can_be_split() -> None:
    model, batch = make_matrix_exp(0)
    rows = op_coverage(model, batch, mesh_shape=(2,))
    mm = next(r for r in rows if r.op == str(aten.mm.default))
    assert mm.splittable == mm.count > 0
    registry = default_registry()
    registry.register(aten.linalg_matrix_exp.default, lambda call: [], family="mine")
    rows = op_coverage(model, batch, mesh_shape=(2,), registry=registry)
    matrix_exp = next(r for r in rows if r.op == str(aten.linalg_matrix_exp.default))
    assert matrix_exp.family == "mine" and matrix_exp.splittable == 0  # no strategy at all: nothing to split


def test_command_exit_status_and_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["coverage", "test_coverage:make_matrix_exp", "--mesh", "2,2"]) == 1
    out = capsys.readouterr().out
    assert "aten.linalg_matrix_exp.default" in out and MISSING in out
    assert main(["coverage", "examples.models:make_mlp", "--mesh", "8"]) == 0
    out = capsys.readouterr().out
    assert "aten.addmm.default" in out and "0 missing" in out


def test_factory_specs() -> None:
    model, batch = load_factory("examples.zoo:make_vit")()
    assert isinstance(model, nn.Module) and len(batch) == 2
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        load_factory("examples.zoo.make_vit")


ZOO = [
    "examples.zoo:make_llama",
    "examples.zoo:make_bert",
    "examples.zoo:make_vit",
    "examples.zoo:make_mixer",
]
HF = ["examples.hf_models:make_hf_gpt2", "examples.hf_models:make_hf_llama"]
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1,)], ids=["decomposed", "fused"])
@pytest.mark.parametrize("spec", ZOO + HF)
def test_every_op_of_the_zoo_has_a_rule(spec: str, mesh: tuple[int, ...]) -> None:
    if spec in HF and not HAVE_TRANSFORMERS:
        pytest.skip("transformers is not installed (pip install -e '.[test]')")
    rows = model_coverage(spec, mesh)
    assert not [r.op for r in rows if r.missing]
    if max(mesh) > 1:  # the rules split these models' matmuls, not just replicate them
        assert all(r.splittable == r.count for r in rows if r.family == "matmul")


def matrix_exp_registry() -> RuleRegistry:
    """A user's registry: the built-in rules plus one for matrix_exp (for `--registry`)."""
    registry = default_registry()
    registry.register(aten.linalg_matrix_exp.default, lambda call: [], family="mine")
    return registry


def test_command_takes_the_users_registry(capsys: pytest.CaptureFixture[str]) -> None:
    spec = "test_coverage:make_matrix_exp"
    assert main(["coverage", spec, "--mesh", "2", "--registry", "test_coverage:matrix_exp_registry"]) == 0
    out = capsys.readouterr().out
    assert "mine" in out and "0 missing" in out
    with pytest.raises(TypeError, match="not a RuleRegistry"):
        main(["coverage", spec, "--registry", "examples.models:GPTConfig"])


def test_the_command_finds_a_module_in_the_directory_it_runs_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`autopar coverage mymodel:make` from the user's own folder (the console script, whose
    sys.path does not start with the current directory), and a clear error for a missing one:
    `main` prints it, no traceback, and returns 2, the console script's exit status (`main` is the
    script's entry point; asked in this process, as a second console-script process cost ~2.5 CPU s
    of starting Python, torch and autopar again)."""
    (tmp_path / "mymodel.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make():\n"
        "    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), (torch.randn(8, 16),)\n"
    )
    script = shutil.which("autopar")
    command = [script] if script is not None else [sys.executable, "-m", "autopar"]
    done = subprocess.run([*command, "coverage", "mymodel:make", "--mesh", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0 missing" in done.stdout and "aten.relu.default" in done.stdout
    capsys.readouterr()
    assert main(["coverage", "nomodule:make"]) == 2
    err = capsys.readouterr().err
    assert "autopar coverage: cannot import nomodule" in err and "Traceback" not in err, err
