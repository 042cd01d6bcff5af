"""Does the search price context parallelism and choose it where it is cheaper? The zoo's LLaMA
(width 256, 2 layers) planned on the h100-nvlink-ib table with and without the attention rules'
sequence split (everything else the default registry): the searched plan's objective in each case
(modeled seconds of compute and collectives, `SearchReport.final_cost`) and the layout the search
gave the first attention call. And on a ("dp", "cp") mesh, the objective of each strategy the "cp"
axis can be asked for (`PlanOptions.context_parallel`), with the modeled activations per rank (ring
attention keeps its key/value blocks split, all-gather keeps them whole). And (`--memory`) the
strategy the search picks by itself as `memory_limit` tightens. Modeled, not measured. Run:
`python benchmarks/context_parallel_pricing.py` (`--cp` for the second table only, `--memory` for
the third only; writes benchmarks/results/context_parallel_memory.json)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `examples` is a plain directory at the repository root
    sys.path.insert(0, str(ROOT))

from _common import table, write_result  # noqa: E402

import autopar  # noqa: E402
from autopar.compiler.driver import trace_for  # noqa: E402
from autopar.core.errors import MemoryLimitError  # noqa: E402
from autopar.core.layout import Shard, is_balanced  # noqa: E402
from autopar.core.mesh import Mesh  # noqa: E402
from autopar.core.meta import info  # noqa: E402
from autopar.core.strategy import AxisStrategy, OpCall, Strategy  # noqa: E402
from autopar.planning.search import search_layouts  # noqa: E402
from autopar.planning.search_cost import TimeCost  # noqa: E402
from autopar.rules import nn as nn_rules  # noqa: E402
from autopar.rules.base import RuleRegistry  # noqa: E402
from autopar.rules.context_parallel import (  # noqa: E402
    BACKWARD,
    CP_STRATEGIES,
    FORWARD,
    localize_attention,
    require_context_parallel,
)
from autopar.rules.registry import default_registry  # noqa: E402
from examples.zoo import make_llama  # noqa: E402

CASES = [  # mesh, sequence, batch, query heads, k/v heads
    ((4,), 1024, 2, 2, 1),
    ((8,), 4096, 1, 8, 2),
    ((2, 4), 2048, 2, 4, 1),
]


def without_sequence_split() -> RuleRegistry:
    """The default registry with the attention pair offering batch and heads splits only."""
    registry = default_registry()

    def forward(call: OpCall) -> list[AxisStrategy]:
        return [s for s in nn_rules.sdpa_rule(call) if s.inputs[0] != Shard(2)]

    def backward(call: OpCall) -> list[AxisStrategy]:
        return [s for s in nn_rules.sdpa_backward_rule(call) if s.inputs[1] != Shard(2)]

    for op, rule in ((FORWARD, forward), (BACKWARD, backward)):
        registry.register(op, rule, family="nn", localize=localize_attention, anchor=True, uneven=True)
    return registry


CP_CASE = ((2, 4), 2048, 2, 8, 2)  # mesh ("dp", "cp"), sequence, batch, query heads, k/v heads


def forced_strategies() -> None:
    """The searched objective with each strategy required on the "cp" axis."""
    shape, seq, batch, heads, kv_heads = CP_CASE
    model, _ = make_llama(
        0, batch_size=batch, n_head=heads, n_kv_head=kv_heads, seq_len=seq, dim=256, hidden=512, vocab_size=512
    )
    ids = torch.randint(512, (batch, seq), generator=torch.Generator().manual_seed(0))
    mesh = Mesh.from_shape(shape, ("dp", "cp"))
    gm = trace_for(model, mesh, (ids, ids))
    print(f"mesh {shape} (dp, cp), sequence {seq}, batch {batch}, heads {heads} ({kv_heads})\n")
    print("| context_parallel | first attention's inputs, searched | objective (ms) | activations per rank (MiB) |")
    print("| --- | --- | --- | --- |")
    results = []
    for strategy in CP_STRATEGIES:
        registry = require_context_parallel(default_registry(), 1, strategy)
        plan = search_layouts(gm, mesh, registry, cost=TimeCost("h100-nvlink-ib", shape), memory_limit=float("inf"))
        first = next(n for n in gm.graph.nodes if n.target is FORWARD)
        inputs = str(plan.strategies[first.name]).split(" ->")[0]
        activations = plan.memory.activations / 2**20 if plan.memory is not None else float("nan")
        objective = gm.meta["autopar_search"].final_cost
        print(f"| {strategy} | `{inputs}` | {objective * 1e3:.3f} | {activations:.1f} |", flush=True)
        results.append({"strategy": strategy, "attention_inputs": inputs, "objective_s": objective,
                        "activations_mib": activations})  # fmt: skip
    write_result("context_parallel_cp", {"case": CP_CASE, "rows": results})


MEMORY_CASE = ((2, 4), 1024, 2, 2, 2)  # mesh, sequence, batch, query heads, k/v heads: neither fills 4 ranks
FRACTIONS = (None, 0.7, 0.5, 0.4, 0.3, 0.2, 0.15)  # of the memory the plan at no limit needs


def attention_kind(strategy: Strategy, cp: int | None) -> str:
    """What the first attention call does on each mesh axis: batch, heads, sequence split with
    keys gathered ("allgather"), ring, their load-balanced forms, or whole ("-")."""
    q, k = strategy.inputs[0], strategy.inputs[1]
    kinds = []
    for qp, kp in zip(q.placements, k.placements):
        balanced = "balanced " if is_balanced(qp) else ""
        if not isinstance(qp, Shard):
            kinds.append("-")
        elif qp.dim == 0:
            kinds.append("batch")
        elif qp.dim == 1:
            kinds.append("heads")
        else:
            kinds.append(balanced + ("ring" if isinstance(kp, Shard) else "allgather"))
    names = ["cp" if a == cp else f"axis {a}" for a in range(len(kinds))]
    return ", ".join(f"{n}: {k}" for n, k in zip(names, kinds))


def memory_limits() -> None:
    """The plan `autopar.plan` picks as `memory_limit` tightens, on a mesh with a "cp" axis
    (every strategy offered, `context_parallel="auto"`) and on one without (the sequence split
    with keys gathered is the only one there): which attention strategy, the objective, the
    memory the plan needs per rank, and how many blocks it recomputes."""
    shape, seq, batch, heads, kv_heads = MEMORY_CASE
    model, data = make_llama(
        0, batch_size=batch, n_head=heads, n_kv_head=kv_heads, seq_len=seq, dim=64, hidden=128, vocab_size=128
    )
    print(f"mesh {shape}, sequence {seq}, batch {batch}, heads {heads} ({kv_heads}), width 64, 2 layers\n")
    rows, results = [], []
    for names in (("dp", "cp"), ("x", "y")):
        base = None
        for fraction in FRACTIONS:
            limit = None if fraction is None else fraction * base  # type: ignore[operator]
            options = autopar.PlanOptions(hardware="h100-nvlink-ib")
            label = "none" if limit is None else f"{fraction:.2f} ({limit / 2**20:.2f} MiB)"
            try:
                result = autopar.plan(model, shape, data, mesh_names=names, memory_limit=limit, planning=options)
            except MemoryLimitError as error:
                rows.append([names, label, "no plan fits (`MemoryLimitError`)", "-", f"{error.memory / 2**20:.2f}", "-"])
                results.append({"names": names, "limit": limit, "error": str(error).splitlines()[0]})
                break
            report = result.compiled.graph.meta["autopar_search"]
            base = base if base is not None else report.memory
            first = next(n for n in result.compiled.graph.graph.nodes if n.target is FORWARD)
            kind = attention_kind(info(first).strategy, names.index("cp") if "cp" in names else None)
            rows.append([names, label, kind, f"{report.final_cost * 1e3:.3f}", f"{report.memory / 2**20:.2f}",
                         len(report.recomputed)])  # fmt: skip
            results.append({"names": names, "limit": limit, "attention": kind, "objective_s": report.final_cost,
                            "memory": report.memory, "recomputed": len(report.recomputed)})  # fmt: skip
            print(rows[-1], flush=True)
    print(table(["mesh names", "memory_limit (of the free plan's)", "first attention, per axis", "objective (ms)",
                 "memory per rank (MiB)", "blocks recomputed"], rows))  # fmt: skip
    write_result("context_parallel_memory", {"case": MEMORY_CASE, "rows": results})


def main() -> None:
    if "--cp" in sys.argv:
        forced_strategies()
        return
    if "--memory" in sys.argv:
        memory_limits()
        return
    print(
        "| mesh | sequence | batch | heads (k/v) | first attention's inputs, searched | objective with CP (ms) | without (ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape, seq, batch, heads, kv_heads in CASES:
        model, _ = make_llama(
            0,
            batch_size=batch,
            n_head=heads,
            n_kv_head=kv_heads,
            seq_len=seq,
            dim=256,
            hidden=512,
            vocab_size=512,
        )
        ids = torch.randint(512, (batch, seq), generator=torch.Generator().manual_seed(0))
        mesh = Mesh.from_shape(shape)
        gm = trace_for(model, mesh, (ids, ids))
        steps, layouts = [], []
        for registry in (default_registry(), without_sequence_split()):
            plan = search_layouts(
                gm, mesh, registry, cost=TimeCost("h100-nvlink-ib", shape), memory_limit=float("inf")
            )
            steps.append(gm.meta["autopar_search"].final_cost * 1e3)
            first = next(n for n in gm.graph.nodes if n.target is FORWARD)
            layouts.append(str(plan.strategies[first.name]).split(" ->")[0])
        print(
            f"| {shape} | {seq} | {batch} | {heads} ({kv_heads}) | `{layouts[0]}` | {steps[0]:.3f} | {steps[1]:.3f} |"
        )
    print()
    forced_strategies()


if __name__ == "__main__":
    main()
