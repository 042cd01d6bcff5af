"""The code's shape (docs/architecture.md): layers import only downward, with no import hidden in a
function body or a TYPE_CHECKING block to dodge a cycle."""

from __future__ import annotations

import ast
import shutil
import subprocess
import tomllib
from pathlib import Path

import autopar.passes.trace

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autopar"
# The compiler passes: a top-level folder imported as autopar.passes (pyproject.toml package-dir; the
# symlink autopar/passes -> ../passes for source trees). rglob does not follow that symlink.
PASSES = ROOT / "passes"
# `import autopar` stays cheap: the public names that need the compiler load on first use, and
# their TYPE_CHECKING imports are what type checkers see. That is start-up cost, not a cycle.
LAZY_PUBLIC_NAMES = PACKAGE / "__init__.py"


def _hidden_autopar_imports(source: str, name: str) -> list[str]:
    """`autopar` imports anywhere but at module level, unconditionally."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if id(node) in top_level:
            continue
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("autopar")):
            found.append(f"{name}:{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import) and any(a.name.startswith("autopar") for a in node.names):
            found.append(f"{name}:{node.lineno} import")
    return found


def test_no_autopar_import_is_deferred_or_conditional() -> None:
    hidden = [
        where
        for path in sorted([*PACKAGE.rglob("*.py"), *PASSES.rglob("*.py")])
        if path != LAZY_PUBLIC_NAMES
        for where in _hidden_autopar_imports(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert hidden == []


def test_the_checker_sees_deferred_and_conditional_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from autopar.core import mesh\n"
        "if TYPE_CHECKING:\n"
        "    from autopar.core.plan import Plan\n"
        "def f():\n"
        "    import autopar.api\n"
        "    from . import layout\n"
    )
    assert _hidden_autopar_imports(source, "m.py") == [
        "m.py:4 from autopar.core.plan",
        "m.py:6 import",
        "m.py:7 from None",
    ]


def test_import_linter_contracts_are_kept() -> None:
    """The layers, the stages' independence and acyclic packages of pyproject.toml."""
    linter = shutil.which("lint-imports")
    assert linter is not None, "install the test extra: pip install -e '.[test]'"
    done = subprocess.run(
        [linter, "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 kept, 0 broken" in done.stdout


def test_the_passes_folder_is_the_autopar_passes_package() -> None:
    """The design card's layout: the passes live in the top-level passes/ folder, and the name every
    module imports, autopar.passes, is that folder (not a stale copy inside autopar/)."""
    assert Path(autopar.passes.trace.__file__).resolve() == PASSES / "trace.py"
    assert {p.name for p in PASSES.glob("*.py")} >= {"trace.py", "propagate.py", "insert_comm.py", "schedule.py", "emit.py"}


def test_nothing_imports_a_top_level_passes_module() -> None:
    """pytest's pythonpath puts the repository root on sys.path, where `import passes` would load the
    stages a second time under another name, with metadata classes of their own."""
    found = []
    for folder in ("autopar", "passes", "tests", "examples", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "passes"]
    assert found == []


def test_packaging_lists_every_package_and_maps_the_passes_folder() -> None:
    """pyproject.toml lists the packages (a search of the tree would see autopar.passes only through
    the symlink): a package left out of the list would be left out of every wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"autopar.passes": "passes"}
    on_disk = {"autopar.passes"} | {
        ".".join(init.parent.relative_to(ROOT).parts) for init in PACKAGE.rglob("__init__.py")
    }
    assert sorted(setuptools["packages"]) == sorted(on_disk)
