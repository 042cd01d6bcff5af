"""`autopar.plan`: the whole compiler on a mesh shape, without processes or weights.

It traces on fake tensors (a model built on the meta device works), plans, inserts collectives and
emits one rank's program, then prices the result on a hardware table: modeled communication and
compute time per step and memory per rank. Nothing is allocated at the model's size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.api import Compiled, compile_for_rank
from autopar.cost import ADAMW_STATE_FACTOR, MemoryBreakdown, memory_per_rank
from autopar.mesh import Mesh
from autopar.meta import has_info, info
from autopar.planner import global_work, work_split
from autopar.rules.base import RuleRegistry
from autopar.search import TimeCost


@dataclass
class PlanResult:
    mesh: Mesh
    hardware: str
    planner: str
    compiled: Compiled
    comm_time: float  # s per step, collectives priced one after another (no overlap)
    compute_time: float  # s per step, roofline over every op of the joint graph
    memory: MemoryBreakdown

    @property
    def step_time(self) -> float:
        """Modeled step time with no overlap of communication and compute (an upper bound)."""
        return self.comm_time + self.compute_time

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
            raise KeyError(f"no node {node_name!r} in the plan")
        node_info = info(node)
        names = self.mesh.axis_names
        lines = [f"{node.name} = {node.target}  @ {node_info.where()}"]
        if node_info.strategy is not None:
            ins = ", ".join(lay.per_dim_str(names) for lay in node_info.strategy.inputs)
            lines.append(f"  inputs wanted: {ins}")
        lines.append(f"  outputs: {', '.join(lay.per_dim_str(names) for lay in node_info.layouts)}")
        lines.append(f"  reason: {node_info.note or 'implied by its producers'}")
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
        }

    def save_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def __str__(self) -> str:
        m = self.memory
        return "\n".join(
            [
                str(self.compiled.report),
                f"modeled on {self.hardware}: communication {self.comm_time * 1e3:.3f} ms + compute "
                f"{self.compute_time * 1e3:.3f} ms = {self.step_time * 1e3:.3f} ms per step (no overlap)",
                f"memory per rank: params {m.params / 1e6:.1f} MB, grads {m.grads / 1e6:.1f} MB, optimizer "
                f"{m.optimizer / 1e6:.1f} MB, saved activations {m.activations / 1e6:.1f} MB, total {m.total / 1e6:.1f} MB",
            ]
        )


def plan(
    model: nn.Module,
    mesh_shape: Sequence[int],
    example_inputs: Sequence[Any],
    *,
    hardware: str = "h100-nvlink-ib",
    planner: str = "search",
    mesh_names: Sequence[str] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    registry: RuleRegistry | None = None,
) -> PlanResult:
    """Plan `model` for a mesh of `mesh_shape` ranks on `hardware`, in this process, allocating no weights."""
    mesh = Mesh.from_shape(tuple(mesh_shape), tuple(mesh_names) if mesh_names else None)
    compiled = compile_for_rank(
        model,
        mesh,
        tuple(example_inputs),
        coords=(0,) * mesh.ndim,
        example_kwargs=example_kwargs,
        registry=registry,
        planner=planner,
        hardware=hardware,
    )
    cost = TimeCost(hardware, mesh.shape)
    program = compiled.program
    comm = 0.0
    for gm in (program.forward, program.backward):
        for node in gm.graph.nodes:
            step = info(node).comm if has_info(node) else None
            if step is not None:
                comm += cost.mesh.step(step)
    compute = sum(_node_compute(node, cost, mesh.shape) for node in compiled.graph.graph.nodes)
    out = next(n for n in program.forward.graph.nodes if n.op == "output")
    saved = list(out.args[0])[len(program.output_layouts) :]  # type: ignore[arg-type]
    activation_bytes = sum(_bytes(n) for n in saved if isinstance(n, fx.Node) and n.op != "placeholder")
    param_bytes = compiled.report.param_bytes_local
    memory = memory_per_rank(param_bytes, param_bytes, ADAMW_STATE_FACTOR, activation_bytes)
    return PlanResult(mesh, hardware, planner, compiled, comm, compute, memory)


def _node_compute(node: fx.Node, cost: TimeCost, shape: tuple[int, ...]) -> float:
    if node.op != "call_function" or not has_info(node) or info(node).strategy is None:
        return 0.0
    strategy = info(node).strategy
    assert strategy is not None
    return cost.compute(global_work(node), work_split(strategy, shape))


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0
