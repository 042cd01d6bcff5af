"""The option groups: `plan` makes the plan `parallelize` compiles from the same objects, and the
keywords the groups replaced still work for one release, warning with the new spelling."""

from __future__ import annotations

import ast
import dataclasses
import pydoc
import warnings
from pathlib import Path
from typing import Any

import pytest
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler.driver import compile_for_rank
from autopar.core.errors import UsageError
from autopar.core.mesh import Mesh
from autopar.options import OLD_KEYWORDS, default_tables, from_keywords
from autopar.rules.registry import default_registry
from examples.models import make_gpt

MESH = (2,)
PLANNING = autopar.PlanOptions(planner="search", hardware="cpu-gloo", over_decompose=1, overlap=True)


def _collectives(report: Any) -> list[dict[str, Any]]:
    """Each collective as planned; the process group's name is the job's (a placeholder in `plan`)."""
    return [{k: v for k, v in dataclasses.asdict(c).items() if k != "group"} for c in report.collectives]


def _parallelize_job(rank: int, world_size: int, old: bool, dump: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("x",))
    model, batch = make_gpt(0, n_layer=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if old:  # the pre-groups spelling of the same call
            pmodel = autopar.parallelize(
                model, mesh, example_inputs=batch, planner="search", hardware="cpu-gloo",
                schedule=True, dump_dir=dump, check_inputs=True,
            )  # fmt: skip
        else:
            pmodel = autopar.parallelize(
                model, mesh, example_inputs=batch, planning=PLANNING, debug=autopar.DebugOptions(dump_dir=dump)
            )
    loss = pmodel(*batch)
    got = {
        "collectives": _collectives(pmodel.report),
        "summary": pmodel.plan_summary(),
        # DDP's plan stores plain whole tensors (ParallelModule.plain_storage)
        "placements": {n: str(getattr(p, "placements", "whole")) for n, p in pmodel.named_parameters()},
        "loss": float(loss),
        "warned": sorted(str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)),
    }
    if not old:  # the default call, no options at all: the CPU mesh's table
        default = autopar.parallelize(model, mesh, example_inputs=batch)
        got["default"] = {"collectives": _collectives(default.report), "summary": default.plan_summary()}
    return got


@pytest.mark.multirank
def test_plan_is_the_plan_parallelize_compiles_and_old_keywords_compile_the_same(tmp_path: Path) -> None:
    new = run_ranks(2, _parallelize_job, False, str(tmp_path / "new"))
    old = run_ranks(2, _parallelize_job, True, str(tmp_path / "old"))
    model, batch = make_gpt(0, n_layer=1)
    planned = autopar.plan(model, MESH, batch, mesh_names=("x",), planning=PLANNING)
    # the plan made without a cluster is rank 0's compiled plan: the same collectives, layouts and all
    assert new[0]["collectives"] == _collectives(planned.compiled.report) != []
    assert new[0]["summary"] == str(planned.compiled.report)
    # the default call: parallelize on a CPU mesh plans what plan(device_type="cpu") plans
    planned_default = autopar.plan(model, MESH, batch, mesh_names=("x",), device_type="cpu")
    assert new[0]["default"]["collectives"] == _collectives(planned_default.compiled.report) != []
    assert new[0]["default"]["summary"] == str(planned_default.compiled.report)
    for key in ("collectives", "summary", "placements", "loss"):
        assert old[0][key] == new[0][key], key
    assert new[0]["warned"] == []
    assert any("pass planning=PlanOptions(planner=...)" in m for m in old[0]["warned"])
    assert any("pass debug=DebugOptions(dump_dir=...)" in m for m in old[0]["warned"])
    assert (tmp_path / "old" / "rank0").is_dir() and (tmp_path / "new" / "rank0").is_dir()


OLD_VALUES: dict[str, tuple[Any, str, str, Any]] = {
    # old keyword: (value, group, field, value in the group)
    "planner": ("greedy", "planning", "planner", "greedy"),
    "hardware": ("cpu-gloo", "planning", "hardware", "cpu-gloo"),
    "over_decompose": ("auto", "planning", "over_decompose", "auto"),
    "split_fused": (False, "planning", "split_fused", False),
    "in_flight_bytes": (1 << 20, "planning", "in_flight_bytes", 1 << 20),
    "registry": (default_registry(), "planning", "registry", None),  # compared by identity below
    "microbatches": (4, "pipeline", "microbatches", 4),
    "stage_boundaries": (["h.1"], "pipeline", "stage_boundaries", ["h.1"]),
    "virtual_stages": (2, "pipeline", "virtual_stages", 2),
    "dump_dir": ("/tmp/x", "debug", "dump_dir", "/tmp/x"),
    "check_inputs": (False, "debug", "check_inputs", False),
}


@pytest.mark.parametrize("name", sorted(OLD_VALUES))
def test_each_old_keyword_moves_into_its_group_and_warns(name: str) -> None:
    value, group, field, want = OLD_VALUES[name]
    with pytest.warns(DeprecationWarning, match=rf"parallelize\({name}=\.\.\.\) is deprecated: pass {group}="):
        planning, pipeline, debug = from_keywords("parallelize", {name: value}, None, None, None)
    got = getattr({"planning": planning, "pipeline": pipeline, "debug": debug}[group], field)
    assert got is value if name == "registry" else got == want
    # nothing else moved: every other field keeps its default
    for obj in (planning, pipeline, debug):
        for f in dataclasses.fields(obj):
            if (obj is {"planning": planning, "pipeline": pipeline, "debug": debug}[group]) and f.name == field:
                continue
            assert getattr(obj, f.name) == f.default, (name, f.name)


@pytest.mark.parametrize(
    ("value", "group", "field"),
    [(True, "planning", "overlap"), (False, "planning", "overlap"), ("gpipe", "pipeline", "schedule")],
)
def test_old_schedule_is_the_overlap_switch_or_the_pipeline_schedule_by_its_type(
    value: Any, group: str, field: str
) -> None:
    with pytest.warns(DeprecationWarning, match=rf"pass {group}=\w+\({field}=\.\.\.\)"):
        planning, pipeline, _ = from_keywords("parallelize", {"schedule": value}, None, None, None)
    assert getattr(planning if group == "planning" else pipeline, field) == value
    assert set(OLD_KEYWORDS) == {*OLD_VALUES, "schedule"}


def test_plan_old_keywords_plan_the_same_and_warn() -> None:
    model, batch = make_gpt(0, n_layer=1)
    new = autopar.plan(model, MESH, batch, mesh_names=("x",), planning=dataclasses.replace(PLANNING, planner="greedy"))
    with pytest.warns(DeprecationWarning, match=r"plan\(planner=\.\.\.\) is deprecated"):
        old = autopar.plan(model, MESH, batch, mesh_names=("x",), planner="greedy", hardware="cpu-gloo")
    assert _collectives(old.compiled.report) == _collectives(new.compiled.report)
    assert old.step_time == new.step_time


def test_plan_default_table_is_the_device_types_as_in_parallelize() -> None:
    """hardware=None means what `default_tables` says for the device type, in plan as in
    parallelize: "cuda" (plan's default) plans and prices on h100-nvlink-ib; "cpu" plans the
    layouts by element counts and prices on cpu-gloo."""
    assert default_tables(None, "cuda") == ("h100-nvlink-ib", "h100-nvlink-ib")
    assert default_tables(None, "cpu") == ("cpu-gloo", None)
    assert default_tables("a100-cluster", "cpu") == ("a100-cluster", "a100-cluster")
    model, batch = make_gpt(0, n_layer=1)
    default = autopar.plan(model, MESH, batch, mesh_names=("x",))
    named = autopar.plan(model, MESH, batch, mesh_names=("x",), planning=autopar.PlanOptions(hardware="h100-nvlink-ib"))
    assert _collectives(default.compiled.report) == _collectives(named.compiled.report)
    assert default.hardware == "h100-nvlink-ib" and default.step_time == named.step_time > 0
    on_cpu = autopar.plan(model, MESH, batch, mesh_names=("x",), device_type="cpu")
    by_elements = compile_for_rank(model, Mesh.from_shape(MESH, ("x",)), batch, coords=(0,))
    assert on_cpu.hardware == "cpu-gloo" and on_cpu.step_time > 0
    assert _collectives(on_cpu.compiled.report) == _collectives(by_elements.report)


def test_misspelt_mixed_or_mistyped_options_are_refused() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'shedule'"):
        from_keywords("parallelize", {"shedule": True}, None, None, None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dump_dir'"):
        from_keywords("plan", {"dump_dir": "x"}, None, None, None, allowed=("planner",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(UsageError, match="as old keywords beside planning="):
            from_keywords("parallelize", {"planner": "greedy"}, autopar.PlanOptions(hardware="cpu-gloo"), None, None)
    with pytest.raises(UsageError, match="planning= takes an autopar.PlanOptions"):
        from_keywords("parallelize", {}, {"planner": "greedy"}, None, None)  # type: ignore[arg-type]
    model, batch = make_gpt(0, n_layer=1)
    with pytest.raises(UsageError, match="PipelineOptions\\(microbatches=...\\) only"):
        autopar.plan(model, MESH, batch, pipeline=autopar.PipelineOptions(schedule="gpipe"))


def test_groups_are_frozen_and_document_every_field() -> None:
    for cls in (autopar.PlanOptions, autopar.PipelineOptions, autopar.DebugOptions):
        for f in dataclasses.fields(cls):
            assert f"{f.name} (" in (cls.__doc__ or ""), (cls.__name__, f.name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls().x = 1  # type: ignore[attr-defined]
    assert len((autopar.parallelize.__doc__ or "").splitlines()) < 45
    # help(autopar.parallelize) fits one screen: the signature and docstring wrapped at 100 columns
    rendered = pydoc.render_doc(autopar.parallelize, renderer=pydoc.plaintext)
    assert sum(1 + len(line) // 100 for line in rendered.splitlines()) <= 50


def test_autopar_examples_and_benchmarks_use_only_the_new_spelling() -> None:
    """A `-W error::DeprecationWarning` run must not trip on autopar's own calls: no call of
    `parallelize` or `plan` in the package, the examples or the benchmarks passes an old keyword."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for folder in ("autopar", "examples", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                old = [k.arg for k in node.keywords if k.arg in OLD_KEYWORDS]
                if name in ("parallelize", "plan") and old:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {name}({', '.join(map(str, old))}=...)")
    assert found == []


def test_plan_options_weight_state_and_recompute_are_checked_where_given() -> None:
    PlanOptions = autopar.PlanOptions
    assert (PlanOptions().weight_state, PlanOptions().recompute) == (None, "auto")
    assert PlanOptions(weight_state="mixed", recompute="selective").recompute == "selective"
    with pytest.raises(UsageError, match="weight_state='fp8'"):
        PlanOptions(weight_state="fp8")
    with pytest.raises(UsageError, match="recompute=True"):
        PlanOptions(recompute=True)  # type: ignore[arg-type]
