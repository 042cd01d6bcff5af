"""Plan summaries: parameters per rank and every collective a step runs, with bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autopar.core.collectives import DecomposedPair, bucket_members
from autopar.core.layout import Replicate
from autopar.core.mesh import Mesh
from autopar.core.meta import NodeInfo, has_info, held_bytes, info
from autopar.core.redistribute import CommStep
from autopar.cost.formulas import format_bytes
from autopar.reporting.experts import ExpertPlacement


@dataclass(frozen=True)
class CollectiveRecord:
    phase: str
    kind: str
    axis: str
    group: str
    elements: float  # sent per rank
    bytes: float
    node: str
    module_path: str
    layout_before: str
    layout_after: str
    bucket: str = ""  # the merged collective that carries it, when bucketing folded it into one


@dataclass(frozen=True)
class SavedActivations:
    """What the forward hands the backward, per rank: modeled with nothing recomputed or gathered
    again, and in this program, with what the plan recomputes in backward."""

    before: float | None  # bytes, modeled before any recomputation (None: the plan did not model it)
    after: float  # bytes of the emitted forward's saved outputs
    recomputed: tuple[str, ...] = ()  # units: "region:<path>" (the user's), "block:<path>", "op:<node>"
    copied_ops: int = 0  # forward ops copied into backward

    def __str__(self) -> str:
        before = f"{format_bytes(self.before)} -> " if self.before is not None else ""
        line = f"saved activations per rank: {before}{format_bytes(self.after)}"
        if not self.recomputed:
            return line
        kinds = Counter(unit.split(":", 1)[0] for unit in self.recomputed)
        shown = ", ".join(self.recomputed[:6]) + (", ..." if len(self.recomputed) > 6 else "")
        counts = ", ".join(f"{n} {kind}{'s' if n > 1 else ''}" for kind, n in sorted(kinds.items()))
        return f"{line}; recomputed in backward: {counts} ({self.copied_ops} ops): {shown}"


@dataclass
class PlanReport:
    mesh: str
    world_size: int
    param_bytes_local: int
    param_bytes_total: int
    replicated_params: list[str] = field(default_factory=list)
    # of those, parts of a cut fused parameter, replicated because their cut dim stays whole
    replicated_parts: list[str] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)
    schedule: Any = None
    activations: SavedActivations | None = None
    storage: str = ""  # how the plan stores weights: "sharded", "replicated" ("" where not chosen by the search)
    experts: ExpertPlacement | None = None  # where the MoE layers' experts are (None: no expert split)
    decomposed: tuple[DecomposedPair, ...] = ()  # collective-matmul pairs considered for decomposition
    decomposed_steps: dict[str, float] = field(default_factory=dict)  # the "auto" choice's modeled steps

    @property
    def param_fraction(self) -> float:
        return self.param_bytes_local / max(1, self.param_bytes_total)

    def bytes_per_step(self) -> float:
        return sum(c.bytes for c in self.collectives)

    def __str__(self) -> str:
        lines = [
            f"mesh {self.mesh} ({self.world_size} ranks)",
            f"parameters per rank: {self.param_bytes_local / 1e6:.3f} MB of {self.param_bytes_total / 1e6:.3f} MB "
            f"({self.param_fraction * self.world_size:.3f} x total/{self.world_size})",
        ]
        small = [name for name in self.replicated_params if name not in self.replicated_parts]
        if self.storage == "replicated":
            lines.append(
                "weights stored as the plan computes with them (replicated storage, DDP's pattern: "
                "no weight gathered before use, each gradient reduced to the ranks that store it): "
                f"{len(self.replicated_params)} replicated on some axis"
            )
        elif small:
            lines.append(f"replicated on some axis (too small to split): {', '.join(small)}")
        if self.replicated_parts:
            lines.append(
                "replicated on some axis (a part of a fused parameter keeps its cut dim whole, so that "
                f"the fused parameter stays one evenly sharded tensor): {', '.join(self.replicated_parts)}"
            )
        if self.experts is not None:
            lines.append(str(self.experts))
        counts: Counter[tuple[str, str, str]] = Counter()
        volume: dict[tuple[str, str, str], float] = {}
        for c in self.collectives:
            counts[(c.phase, c.kind, c.axis)] += 1
            volume[(c.phase, c.kind, c.axis)] = volume.get((c.phase, c.kind, c.axis), 0.0) + c.bytes
        lines.append(
            f"collectives per step: {len(self.collectives)}, {self.bytes_per_step() / 1e6:.3f} MB sent per rank"
        )
        lines.append(f"  {'phase':<9} {'kind':<15} {'axis':<5} {'count':>5} {'KB/rank':>10}")
        for key in sorted(counts):
            phase, kind, axis = key
            lines.append(f"  {phase:<9} {kind:<15} {axis:<5} {counts[key]:>5} {volume[key] / 1e3:>10.1f}")
        if self.activations is not None and (self.activations.after or self.activations.recomputed):
            lines.append(str(self.activations))
        if self.decomposed:
            kept = [d for d in self.decomposed if d.kept]
            lines.append(f"decomposed collective matmuls: {len(kept)} of {len(self.decomposed)} pairs that qualify")
            lines.extend(f"  {d.describe()}" for d in kept)
            if self.decomposed_steps:
                compared = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in self.decomposed_steps.items())
                lines.append(f"  chosen by the modeled step: {compared}")
        if self.schedule is not None:
            s = self.schedule
            lines.append(
                f"schedule: {s.waits_moved} waits moved later, {s.issues_moved} collectives issued earlier, "
                f"{s.overlapped_ops} compute ops overlap in-flight collectives"
            )
            if s.buckets:
                issued = len(self.collectives) - s.bucketed + s.buckets
                lines.append(
                    f"  bucketing: {s.bucketed} collectives merged into {s.buckets}, {issued} issued per step"
                )
            cap = format_bytes(s.in_flight_cap) if s.in_flight_cap is not None else "none"
            lines.append(
                f"  in-flight memory cap {cap}: {s.cap_delays} issues delayed, {s.cap_forced_waits} waits moved earlier"
            )
        return "\n".join(lines)


def collect(graphs: list[fx.GraphModule], mesh: Mesh) -> list[CollectiveRecord]:
    records = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if not has_info(node) or info(node).comm is None:
                continue
            node_info = info(node)
            step = node_info.comm
            assert step is not None
            members = bucket_members(node)
            if not members:
                records.append(_record(node_info, step, node.name, node_info.module_path, "", mesh))
            for m in members:  # one record per collective the plan asked for, as without bucketing
                records.append(_record(node_info, m.step, m.name, m.module_path, node.name, mesh))
    return records


def _record(
    node_info: NodeInfo, step: CommStep, name: str, module_path: str, bucket: str, mesh: Mesh
) -> CollectiveRecord:
    return CollectiveRecord(
        phase=node_info.phase,
        kind=step.kind,
        axis=mesh.axis_names[step.axis],
        group=node_info.comm_group or "",
        elements=step.elements_sent(mesh.shape),
        bytes=step.bytes_sent(mesh.shape),
        node=name,
        module_path=module_path,
        layout_before=step.before.per_dim_str(mesh.axis_names),
        layout_after=step.after.per_dim_str(mesh.axis_names),
        bucket=bucket,
    )


def build_report(
    program: Any,
    mesh: Mesh,
    schedule: Any = None,
    graph_mesh: Mesh | None = None,
    *,
    saved_before: float | None = None,
    recomputed: tuple[str, ...] = (),
    copied_ops: int = 0,
    storage: str = "",
    decomposed: tuple[DecomposedPair, ...] = (),
    decomposed_steps: dict[str, float] | None = None,
) -> PlanReport:
    """`graph_mesh`: the mesh the program's collectives are laid out on, when it has more axes than
    the device mesh (over-decomposition's in-process chunk axis). `saved_before`, `recomputed`,
    `copied_ops`: the plan's activation memory before recomputation and what it recomputes."""
    # the model's state only: tensors the forward made from Python data (`program.constants`,
    # export's `_tensor_constant0`) are the program's, whole on every rank, and no one stores them
    state = [
        (name, lay)
        for name, lay in zip(program.param_names, program.param_layouts)
        if name not in program.constants
    ]
    local = sum(lay.local_bytes(mesh.shape) for _, lay in state)
    total = sum(lay.local_bytes([1] * mesh.ndim) for _, lay in state)
    replicated = [
        name
        for name, lay in state
        if any(isinstance(p, Replicate) and mesh.shape[a] > 1 for a, p in enumerate(lay.placements))
    ]
    return PlanReport(
        mesh=str(mesh),
        world_size=mesh.size,
        param_bytes_local=local,
        param_bytes_total=total,
        replicated_params=replicated,
        replicated_parts=[name for name in replicated if name in program.param_parts],
        collectives=collect([program.forward, program.backward], graph_mesh or mesh),
        schedule=schedule,
        activations=SavedActivations(saved_before, _saved_bytes(program), recomputed, copied_ops),
        storage=storage,
        decomposed=decomposed,
        decomposed_steps=dict(decomposed_steps or {}),
    )


def _saved_bytes(program: Any) -> float:
    """Bytes of the tensors the forward program hands the backward (its outputs past the user's),
    parameters and inputs aside (those are stored anyway); a broadcast view by the storage it spans
    (`held_bytes`)."""
    output = next(n for n in program.forward.graph.nodes if n.op == "output")
    total = 0.0
    for node in list(output.args[0])[len(program.output_layouts) :]:
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            continue
        total += held_bytes(node.meta.get("val"))
    return total
