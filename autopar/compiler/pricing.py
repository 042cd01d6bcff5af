"""What `autopar.plan` returns: one rank's compiled program priced on a hardware table.

`price` models the program the driver compiled (on fake tensors: nothing is allocated at the
model's size): communication and compute time per step and memory per rank; `PlanResult` holds
them with the compiled graph, explains layouts, and prints the comparison with the fixed schemes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autopar.compiler.driver import Compiled, compile_conditions
from autopar.compiler.pipeline_mesh import PipelineMeshChoice
from autopar.core.errors import UnknownNameError
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, held_bytes, info
from autopar.cost.formulas import ADAMW_STATE_FACTOR, MemoryBreakdown, memory_per_rank
from autopar.cost.timeline import overlap_summary
from autopar.cost.work import causal_skipped, compute_rate, global_work, work_split
from autopar.planning.mesh_choice import MeshChoice
from autopar.planning.ring_cost import op_extra_cost
from autopar.planning.search_cost import TimeCost
from autopar.rules.routed_experts import node_routing_imbalance


@dataclass
class PlanResult:
    mesh: Mesh
    hardware: str
    planner: str
    compiled: Compiled
    comm_time: float  # s per step, collectives priced one after another (no overlap)
    compute_time: float  # s per step, roofline over every op of the joint graph
    memory: MemoryBreakdown
    # plan(compare=True): this plan and the fixed 1-D / 2-D / cube plans of the same graph
    comparison: list[Compared] = field(default_factory=list)
    # plan(model, "auto", ..., world_size=N): every candidate mesh, ranked (autopar.planning.mesh_choice)
    mesh_choice: MeshChoice | None = None
    # plan(model, "auto", ..., world_size=N, microbatches=M): pipeline depths beside the meshes
    pipeline_choice: PipelineMeshChoice | None = None

    @property
    def comm_elements(self) -> float:
        """Elements sent per rank per step by every collective of the emitted program."""
        return sum(c.elements for c in self.compiled.report.collectives)

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes for c in self.compiled.report.collectives)

    @property
    def step_time(self) -> float:
        """Modeled step time with no overlap of communication and compute (an upper bound)."""
        return self.comm_time + self.compute_time

    def overlap(self) -> dict[str, dict[str, float]] | None:
        """Modeled overlap (autopar.cost.timeline): totals of the step before and after the schedule stage."""
        timelines = self.compiled.timelines
        return overlap_summary(*timelines) if timelines is not None else None

    def layouts(self) -> dict[str, str]:
        """Every node's layout(s), per-dim form, keyed by node name."""
        names = self.mesh.axis_names
        return {
            n.name: " ; ".join(lay.per_dim_str(names) for lay in info(n).layouts)
            for n in self.compiled.graph.graph.nodes
            if has_info(n) and info(n).layouts and info(n).role != "comm"
        }

    def explain(self, node_name: str) -> str:
        """Why a node got its layout: its strategy, the planner's reason, where it comes from."""
        node = next((n for n in self.compiled.graph.graph.nodes if n.name == node_name), None)
        if node is None or not has_info(node):
            known = list(self.layouts())
            raise UnknownNameError(
                f"no node {node_name!r} in the plan",
                hint=f"explain takes a node name of the compiled graph, the keys of result.layouts() "
                f"(this plan has {len(known)}, e.g. {', '.join(known[:3])})",
            )
        node_info = info(node)
        names = self.mesh.axis_names
        lines = [f"{node.name} = {node.target}  @ {node_info.where()}"]
        if node_info.strategy is not None:
            ins = ", ".join(lay.per_dim_str(names) for lay in node_info.strategy.inputs)
            lines.append(f"  inputs wanted: {ins}")
        lines.append(f"  outputs: {', '.join(lay.per_dim_str(names) for lay in node_info.layouts)}")
        lines.append(f"  reason: {node_info.note or 'implied by its producers'}")
        experts = self.compiled.report.experts
        if experts is not None and experts.names(node):
            lines.append(f"  {experts}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        report = self.compiled.report
        return {
            "mesh": dict(zip(self.mesh.axis_names, self.mesh.shape)),
            "hardware": self.hardware,
            "planner": self.planner,
            "modeled_seconds_per_step": {
                "communication": self.comm_time,
                "compute": self.compute_time,
                "total_no_overlap": self.step_time,
            },
            "memory_bytes_per_rank": {
                "params": self.memory.params,
                "grads": self.memory.grads,
                "optimizer": self.memory.optimizer,
                "activations": self.memory.activations,
                "working": self.memory.working,
                "total": self.memory.total,
            },
            "param_bytes": {"per_rank": report.param_bytes_local, "total": report.param_bytes_total},
            "collectives": [
                {
                    "phase": c.phase,
                    "kind": c.kind,
                    "axis": c.axis,
                    "elements": c.elements,
                    "bytes": c.bytes,
                    "node": c.node,
                    "module": c.module_path,
                    "before": c.layout_before,
                    "after": c.layout_after,
                }
                for c in report.collectives
            ],
            "layouts": self.layouts(),
            "overlap": self.overlap(),
            "comparison": [c.to_json(self) for c in self.comparison],
        }

    def save_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def __str__(self) -> str:
        m = self.memory
        lines = [
            str(self.compiled.report),
            f"modeled on {self.hardware}: communication {self.comm_time * 1e3:.3f} ms + compute "
            f"{self.compute_time * 1e3:.3f} ms = {self.step_time * 1e3:.3f} ms per step (no overlap)",
            f"memory per rank: params {m.params / 1e6:.1f} MB, grads {m.grads / 1e6:.1f} MB, optimizer "
            f"{m.optimizer / 1e6:.1f} MB, saved activations {m.activations / 1e6:.1f} MB, working {m.working / 1e6:.1f} MB, "
            f"total {m.total / 1e6:.1f} MB",
        ]
        overlap = self.overlap()
        if overlap is not None:
            before, after = overlap["unscheduled"], overlap["scheduled"]
            lines.append(
                f"overlap (timeline model): exposed communication {100 * before['exposed_fraction']:.1f}% "
                f"unscheduled -> {100 * after['exposed_fraction']:.1f}% scheduled, step "
                f"{before['step_time'] * 1e3:.3f} -> {after['step_time'] * 1e3:.3f} ms"
            )
        if self.comparison:
            lines.append(self.compare_text())
        if self.mesh_choice is not None:
            lines.append(self.mesh_choice.table())
        if self.pipeline_choice is not None:
            lines.append(self.pipeline_choice.table())
        return "\n".join(lines)

    def compare_text(self) -> str:
        """The comparison as a table: per plan, comm per rank, modeled times, memory, x this plan."""
        rows = [
            ("plan", "mesh", "comm M el/rank", "comm MB/rank", "comm ms", "compute ms", "step ms", "mem MB/rank",
             "step / chosen")
        ]
        notes = []
        for c in self.comparison:
            if c.result is None:
                rows.append((c.name, "-", "-", "-", "-", "-", "-", "-", "-"))
            else:
                r = c.result
                rows.append(
                    (
                        c.name,
                        "x".join(map(str, r.mesh.shape)),
                        f"{r.comm_elements / 1e6:.3f}",
                        f"{r.comm_bytes / 1e6:.3f}",
                        f"{r.comm_time * 1e3:.3f}",
                        f"{r.compute_time * 1e3:.3f}",
                        f"{r.step_time * 1e3:.3f}",
                        f"{r.memory.total / 1e6:.1f}",
                        f"{r.step_time / self.step_time:.2f}x",
                    )
                )
            if c.note:
                notes.append(f"  {c.name}: {c.note}")
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        text = [f"comparison on {self.hardware} (same traced graph, {self.mesh.size} ranks each):"]
        text += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        return "\n".join(text + notes)


@dataclass
class Compared:
    """One row of a comparison: a plan of the same graph, or why a fixed scheme cannot run."""

    name: str
    mesh_shape: tuple[int, ...] | None
    note: str
    result: PlanResult | None

    def to_json(self, chosen: PlanResult) -> dict[str, Any]:
        r = self.result
        if r is None:
            return {"name": self.name, "feasible": False, "note": self.note}
        return {
            "name": self.name,
            "feasible": True,
            "note": self.note,
            "mesh": list(r.mesh.shape),
            "comm_elements_per_rank": r.comm_elements,
            "comm_bytes_per_rank": r.comm_bytes,
            "comm_seconds": r.comm_time,
            "compute_seconds": r.compute_time,
            "step_seconds": r.step_time,
            "memory_bytes_per_rank": r.memory.total,
            "step_time_over_chosen": r.step_time / chosen.step_time,
        }


@compile_conditions
def price(compiled: Compiled, mesh: Mesh, hardware: str, planner: str) -> PlanResult:
    """Model one compiled rank program on `hardware`: communication, compute, memory per rank."""
    work = compiled.graph_mesh or mesh  # over-decomposed: layouts carry the in-process chunk axis
    cost = TimeCost(hardware, work.shape, work.in_process)
    program = compiled.program
    comm = 0.0
    for gm in (program.forward, program.backward):
        for node in gm.graph.nodes:
            step = info(node).comm if has_info(node) else None
            if step is not None:
                comm += cost.mesh.step(step)
    compute = sum(_node_compute(node, cost, work.shape) for node in compiled.graph.graph.nodes)
    out = next(n for n in program.forward.graph.nodes if n.op == "output")
    saved = list(out.args[0])[len(program.output_layouts) :]  # type: ignore[arg-type]
    activation_bytes = sum(_bytes(n) for n in saved if isinstance(n, fx.Node) and n.op != "placeholder")
    param_bytes = compiled.report.param_bytes_local
    memory = memory_per_rank(param_bytes, param_bytes, ADAMW_STATE_FACTOR, activation_bytes)
    # the working memory (`planning.working`) with the emitted gradient buckets (`emitted_memory`):
    # not in the program's outputs, counted by the compile when asked
    assert compiled.working is not None, "price a compile made with compile_for_rank(..., priced=True)"
    memory = dataclasses.replace(memory, working=compiled.working)
    return PlanResult(mesh, hardware, planner, compiled, comm, compute, memory)


def _node_compute(node: fx.Node, cost: TimeCost, shape: tuple[int, ...]) -> float:
    if node.op != "call_function" or not has_info(node) or info(node).strategy is None:
        return 0.0
    strategy = info(node).strategy
    assert strategy is not None
    work, rate = global_work(node), compute_rate(node)
    extra = op_extra_cost(node.target, causal_skipped(node), strategy, work, rate, cost, node_routing_imbalance(node))
    return cost.compute(work, work_split(strategy, shape), rate) + extra


def _bytes(node: fx.Node) -> int:
    return held_bytes(node.meta.get("val"))
