"""Debug dumps: one text file per stage, a collectives table and a summary, per rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from pass_fixtures import gpt_compiled, is_comm, model_case

from autopar.api import compile_for_rank
from autopar.core.mesh import Mesh
from autopar.core.meta import info
from autopar.reporting.dump import DUMP_ENV, dump_dir_from

MESH = (2, 2, 2)
NAMES = ("x", "y", "z")
FILES = {
    "1_trace.txt",
    "2_propagate.txt",
    "3_insert_comm.txt",
    "4_schedule.txt",
    "5_emit_forward.txt",
    "5_emit_backward.txt",
    "collectives.txt",
    "summary.txt",
    "timeline.json",  # autopar.cost.timeline: modeled step (tests/test_timeline.py checks the contents)
    "timeline.png",
    "overlap.txt",
}
MODELS_PY = str(Path(__file__).resolve().parent.parent / "examples" / "models.py")


def _entries(text: str) -> dict[str, tuple[str, str]]:
    """node name -> (head line, detail line) of a stage dump."""
    lines = text.splitlines()
    assert lines[0] == "# mesh (x=2, y=2, z=2)  axes x, y, z"
    out = {}
    for i, line in enumerate(lines):
        match = re.match(r"%(\w+) = ", line)
        if match:
            detail = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
            out[match.group(1)] = (line, detail)
    return out


def test_dump_dir_writes_every_stage() -> None:
    _, path = gpt_compiled(MESH, (0, 0, 0))
    assert path.name == "rank0"
    assert {p.name for p in path.iterdir()} == FILES
    for name in {n for n in FILES if n[0].isdigit()}:
        assert _entries((path / name).read_text()), name


def test_trace_dump_has_module_paths_and_sources_but_no_layouts() -> None:
    compiled, path = gpt_compiled(MESH, (0, 0, 0))
    entries = _entries((path / "1_trace.txt").read_text())
    head, detail = next(v for k, v in entries.items() if k.startswith("addmm"))
    assert "aten.addmm.default(" in head
    assert f"@ blocks.0.attn.qkv @ {MODELS_PY}:" in detail
    assert "[S(" not in detail and "local[" not in detail
    assert "param wte.weight" in "\n".join(d for _, d in entries.values())


def test_propagate_dump_shows_both_layout_forms_module_and_source() -> None:
    compiled, path = gpt_compiled(MESH, (0, 0, 0))
    entries = _entries((path / "2_propagate.txt").read_text())
    # no communication yet at this stage
    assert not any("_c10d_functional" in head for head, _ in entries.values())
    checked = 0
    for node in compiled.graph.graph.nodes:
        if node.op != "call_function" or is_comm(node):
            continue
        head, detail = entries[node.name]
        node_info = info(node)
        assert detail.startswith(f"    [{node_info.phase[:3]}]")
        for lay in node_info.layouts:
            text = f"{lay.per_axis_str()} {lay.per_dim_str(NAMES)} local{list(lay.local_shape(MESH))}"
            assert text in detail, (node.name, text, detail)
        assert f"@ {node_info.module_path}" in detail
        if node_info.source:
            assert node_info.source in detail
        checked += 1
    assert checked > 300
    _, q = entries["addmm"]  # the search (default) cuts the fused qkv: this is q's projection
    # e.g. "[S(1), S(0), S(0)] f32[128/yz, 32/x] local[32, 16]": a 3-D split, 1/8 of the output
    found = re.search(
        r"\[(S\(\d\)|P|R)(, (S\(\d\)|P|R)){2}\] f32\[128(/\w+)?, 32(/\w+)?\] (\+\w+ )?local\[(\d+), (\d+)\]",
        q,
    )
    assert found and int(found.group(7)) * int(found.group(8)) * 8 == 128 * 32, q
    assert f"@ blocks.0.attn.qkv @ {MODELS_PY}:37 in forward" in q
    params = [d for _, d in entries.values() if " param " in d]
    assert len(params) == len(compiled.program.param_names)
    assert all("stored split over all axes" in d for d in params)


def test_comm_and_emit_dumps() -> None:
    compiled, path = gpt_compiled(MESH, (0, 0, 0))
    comm = _entries((path / "3_insert_comm.txt").read_text())
    comm_lines = [d for _, d in comm.values() if "COMM " in d]
    assert len(comm_lines) == len(compiled.report.collectives)
    assert any(re.search(r"COMM all_gather\[z\] dim \d group=<z> \d+ B/rank", d) for d in comm_lines)
    scheduled = _entries((path / "4_schedule.txt").read_text())
    # schedule reorders and buckets: it drops only the collectives it merged and their waits, and
    # adds only the merged buffers' nodes
    folded = {r.node for r in compiled.report.collectives if r.bucket}
    waits = {
        n: re.match(r"%\w+ = _c10d_functional\.wait_tensor\.default\(%(\w+)\)", head)
        for n, (head, _) in comm.items()
    }
    folded |= {n for n, m in waits.items() if m and m.group(1) in folded}
    assert folded and set(comm) - set(scheduled) == folded
    assert all("(bucket)" in scheduled[n][1] for n in set(scheduled) - set(comm))
    for name in ("5_emit_forward.txt", "5_emit_backward.txt"):
        entries = _entries((path / name).read_text())
        gm = compiled.program.forward if "forward" in name else compiled.program.backward
        assert set(entries) == {n.name for n in gm.graph.nodes}
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and node.op != "output":
                assert f"shape {list(val.shape)}" in entries[node.name][1], node.name


def test_collectives_table_and_summary() -> None:
    compiled, path = gpt_compiled(MESH, (0, 0, 0))
    report = compiled.report
    lines = (path / "collectives.txt").read_text().splitlines()
    assert lines[0].split()[:4] == ["phase", "kind", "axis", "bytes/rank"]
    rows = lines[1:-1]
    assert len(rows) == len(report.collectives) > 0
    total = 0
    for row, rec in zip(rows, report.collectives):
        phase, kind, axis, nbytes, node = row.split()[:5]
        assert (phase, kind, axis, node) == (rec.phase, rec.kind, rec.axis, rec.node)
        assert kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all") and axis in NAMES
        assert float(nbytes) == pytest.approx(rec.bytes, abs=0.5)
        assert f"{rec.layout_before} -> {rec.layout_after}" in row
        total += rec.bytes
    assert total == pytest.approx(report.bytes_per_step())
    assert (
        lines[-1] == f"total {report.bytes_per_step():.0f} bytes per rank per step in {len(rows)} collectives"
    )
    summary = (path / "summary.txt").read_text()
    assert summary == str(report) + "\n"
    assert summary.startswith("mesh (x=2, y=2, z=2) (8 ranks)\n")
    assert f"collectives per step: {len(rows)}" in summary


def test_environment_variable_turns_dumps_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = model_case("two_linear")
    monkeypatch.setenv(DUMP_ENV, str(tmp_path))
    compiled = compile_for_rank(model, Mesh.from_shape(MESH), inputs, coords=(1, 1, 0), rank=6)
    path = tmp_path / "rank6"
    assert {p.name for p in path.iterdir()} == FILES
    assert (path / "summary.txt").read_text() == str(compiled.report) + "\n"
    assert f"{compiled.report.bytes_per_step():.0f} bytes" in (path / "collectives.txt").read_text()
    # an explicit dump_dir wins over the variable
    other = tmp_path / "explicit"
    assert dump_dir_from(other, 2) == other / "rank2" and (other / "rank2").is_dir()
    monkeypatch.delenv(DUMP_ENV)
    assert dump_dir_from(None, 0) is None
    monkeypatch.setenv(DUMP_ENV, "")
    assert dump_dir_from(None, 0) is None
