"""Debug dumps: each stage's graph as text with layouts and local shapes, and a collectives table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.core.errors import UsageError
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, info
from autopar.cost.timeline import Timeline
from autopar.reporting.timeline_views import overlap_text, write_chrome_trace, write_png

DUMP_ENV = "AUTOPAR_DUMP_DIR"


def dump_dir_from(explicit: str | os.PathLike[str] | None, rank: int) -> Path | None:
    base = explicit if explicit is not None else os.environ.get(DUMP_ENV)
    if not base:
        return None
    path = Path(base) / f"rank{rank}"
    try:
        if not path.is_symlink():
            path.mkdir(parents=True, exist_ok=True)
        links = [path] if path.is_symlink() else [p for p in path.iterdir() if p.is_symlink()]
    except OSError as exc:
        raise UsageError(
            f"cannot write debug dumps to {base}: {exc.strerror or exc}",
            hint=f"give a writable directory as dump_dir (or {DUMP_ENV})",
        ) from exc
    if links:
        # a dump would write through the link: someone else's file overwritten (in a shared /tmp)
        raise UsageError(
            f"cannot write debug dumps to {base}: {links[0]} is a symbolic link (to {os.readlink(links[0])}), "
            "and dumps never write through links",
            hint=f"remove the link, or give a fresh directory of your own as dump_dir (or {DUMP_ENV})",
        )
    return path


def _write(file: Path, text: str) -> None:
    """Write `text` to `file`, refusing a link planted there since the directory was checked."""
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise UsageError(
            f"cannot write the debug dump {file}: {exc.strerror or exc} (a symbolic link there is refused)",
            hint=f"give a fresh directory of your own as dump_dir (or {DUMP_ENV})",
        ) from exc
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def _arg(x: Any) -> str:
    if isinstance(x, fx.Node):
        return f"%{x.name}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_arg(v) for v in x) + "]"
    return repr(x)


def _target(node: fx.Node) -> str:
    t = node.target
    return str(t) if not callable(t) or hasattr(t, "_schema") else getattr(t, "__name__", str(t))


def graph_text(gm: fx.GraphModule, mesh: Mesh, *, local: bool) -> str:
    """One line per node: name = op(args)  layout (per axis) | per dim | local shape  @ module, source."""
    lines = [f"# mesh {mesh}  axes {', '.join(mesh.axis_names)}"]
    for node in gm.graph.nodes:
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        head = f"%{node.name} = {node.op if node.op != 'call_function' else _target(node)}({args})"
        if not has_info(node):
            lines.append(head)
            continue
        node_info = info(node)
        parts = [f"[{node_info.phase[:3]}]"]
        for lay in node_info.layouts:
            parts.append(
                f"{lay.per_axis_str()} {lay.per_dim_str(mesh.axis_names)} local{list(lay.local_shape(mesh.shape))}"
            )
        if local:
            vals = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
            if vals:
                parts.append("shape " + " ".join(str(list(v.shape)) for v in vals))
        if node_info.comm is not None:
            step = node_info.comm
            parts.append(
                f"COMM {step.describe(mesh.axis_names)} group={node_info.comm_group} "
                f"{step.bytes_sent(mesh.shape):.0f} B/rank"
            )
        if node_info.param_name:
            parts.append(f"param {node_info.param_name}")
        where = node_info.where()
        if where:
            parts.append(f"@ {where}")
        if node_info.note:
            parts.append(f"({node_info.note})")
        lines.append(f"{head}\n    " + "  ".join(parts))
    return "\n".join(lines) + "\n"


def write_stage(path: Path | None, name: str, gm: fx.GraphModule, mesh: Mesh, *, local: bool = False) -> None:
    if path is None:
        return
    _write(path / f"{name}.txt", graph_text(gm, mesh, local=local))


def write_collectives(path: Path | None, report: Any) -> None:
    if path is None:
        return
    rows = [
        f"{'phase':<9} {'kind':<15} {'axis':<5} {'bytes/rank':>12} {'node':<28} {'before -> after':<50} module"
    ]
    for c in report.collectives:
        rows.append(
            f"{c.phase:<9} {c.kind:<15} {c.axis:<5} {c.bytes:>12.0f} {c.node:<28} "
            f"{c.layout_before + ' -> ' + c.layout_after:<50} {c.module_path}"
            + (f"  [in bucket {c.bucket}]" if c.bucket else "")
        )
    rows.append(
        f"total {report.bytes_per_step():.0f} bytes per rank per step in {len(report.collectives)} collectives"
    )
    _write(path / "collectives.txt", "\n".join(rows) + "\n")
    _write(path / "summary.txt", str(report) + "\n")


def write_timeline(path: Path | None, timelines: tuple[Timeline, Timeline], rank: int) -> None:
    """timeline.json (Chrome / Perfetto trace of the scheduled step), timeline.png (unscheduled above
    scheduled) and overlap.txt (per collective: modeled time, overlapped compute, exposed time)."""
    if path is None:
        return
    before, after = timelines
    write_chrome_trace(after, path / "timeline.json", rank)
    write_png(path / "timeline.png", after, before)
    _write(path / "overlap.txt", overlap_text(before, after))
