"""What the search picks for mixture-of-experts layers, and the modeled step, on the H100 table.

For a few transformers MoE shapes (Mixtral-style top-2, Qwen3-MoE-style top-8) and meshes, plans
the model with `autopar.plan` (the search, hardware "h100-nvlink-ib", fp32) twice: at the defaults,
and with the grouped matmuls offering only the expert split (weights Shard(0) on every axis, as
tests/test_expert_parallel.py forces it). Prints how the search placed the expert weights
(`gate_up_proj`, `down_proj` of the first layer), the modeled step (collectives and compute, no
overlap) and the bytes each rank sends per step, for both.

Then the two token dispatchers side by side (`autopar.cost.dispatch`, no planning): the
all-gather dispatcher (tokens gathered, output reduce-scattered) and the all-to-all one (only the
routed rows move, split sizes exchanged first; `autopar.rules.token_dispatch`), with the experts
split over the whole mesh and the tokens over the same ranks, routing spread evenly: modeled
seconds and bytes per rank of the MoE layers' token traffic per step, forward and backward. Besides
the planned shapes, Mixtral 8x7B and a DeepSeek-V3 shape (bf16, 4096 tokens per rank, every layer
MoE) on 8 to 256 GPUs.

    python benchmarks/moe.py                                   # every shape on (8,) and (2, 4)
    python benchmarks/moe.py --shapes wide-16 --meshes 8 8x8
    python benchmarks/moe.py --dispatch-only                   # the dispatcher table alone
    python benchmarks/moe.py --gloo 8 --steps 2                # part (a) on 8 gloo ranks (~3 min, 4 GB RSS)
    python benchmarks/moe.py --placements --shapes wide-16 --meshes 8 2x4   # EP / expert TP / replicated

`--placements`: each shape and mesh planned three times with one placement of the experts forced
(split over the ranks, split inside every expert, replicated) and once by the search, to show
where each wins and what the search picks.

Writes benchmarks/results/moe.json (--gloo: moe_gloo.json, --placements: moe_placements.json). Issue 35 (b), Mixtral 8x7B and DeepSeek-V3
against their published configurations: benchmarks/moe_published.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
import transformers.integrations.moe  # noqa: F401  (registers transformers' grouped-matmul ops)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, table, write_result  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from multirank import run_ranks  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import autopar  # noqa: E402
from autopar.core.layout import R, Shard  # noqa: E402
from autopar.core.strategy import AxisStrategy, OpCall, Strategy  # noqa: E402
from autopar.cost.dispatch import DISPATCHERS, dispatch_cost  # noqa: E402
from autopar.cost.hardware import load_hardware, span_link  # noqa: E402
from autopar.rules import expert_parallel, routed_experts  # noqa: E402
from autopar.rules.base import Requirement, RuleRegistry  # noqa: E402
from autopar.rules.matmul import library_op  # noqa: E402
from autopar.rules.registry import default_registry  # noqa: E402

HARDWARE = "h100-nvlink-ib"
LAYERS, VOCAB = 2, 256


def mixtral(hidden: int, intermediate: int, experts: int) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        config = transformers.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=LAYERS,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=4096,
            num_local_experts=experts,
            num_experts_per_tok=2,
        )
        return transformers.MixtralForCausalLM(config)

    return make


def qwen3_moe(hidden: int, intermediate: int, experts: int) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        config = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=intermediate,
            moe_intermediate_size=intermediate,
            num_hidden_layers=LAYERS,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=hidden // 8,
            max_position_embeddings=4096,
            num_experts=experts,
            num_experts_per_tok=8,
        )
        return transformers.Qwen3MoeForCausalLM(config)

    return make


# name -> (model, batch, sequence)
SHAPES: dict[str, tuple[Callable[[], torch.nn.Module], int, int]] = {
    "toy-mixtral": (mixtral(32, 64, 8), 2, 16),
    "gloo-mixtral": (mixtral(64, 256, 8), 4, 32),  # part (a): 8 experts, 4 x 32 tokens on CPU ranks
    "wide-16": (mixtral(1024, 1024, 16), 8, 512),
    "wide-64": (mixtral(1024, 512, 64), 8, 512),
    "qwen3-64": (qwen3_moe(1024, 256, 64), 8, 512),
}
MESHES = {"8": (8,), "2x4": (2, 4), "8x8": (8, 8)}

# name -> (hidden, experts, top_k, MoE layers, tokens per rank on 8 ranks or None: the planned
# batch, dtype) for the dispatcher table
ROUTING: dict[str, tuple[int, int, int, int, int | None, torch.dtype]] = {
    "toy-mixtral": (32, 8, 2, LAYERS, None, torch.float32),
    "wide-16": (1024, 16, 2, LAYERS, None, torch.float32),
    "wide-64": (1024, 64, 2, LAYERS, None, torch.float32),
    "qwen3-64": (1024, 64, 8, LAYERS, None, torch.float32),
    "mixtral-8x7b": (4096, 8, 2, 32, 4096, torch.bfloat16),
    "deepseek-v3": (7168, 256, 8, 58, 4096, torch.bfloat16),
}
DISPATCH_RANKS = {
    "toy-mixtral": (8,),
    "wide-16": (8, 16),
    "wide-64": (8, 64),
    "qwen3-64": (8, 64),
    "mixtral-8x7b": (8,),
    "deepseek-v3": (8, 64, 256),
}


def dispatch_rows() -> list[dict[str, Any]]:
    """Both dispatchers' modeled token traffic per step, experts and tokens over `ep` ranks."""
    hw = load_hardware(HARDWARE)
    rows = []
    for name, (hidden, experts, top_k, layers, per_rank, dtype) in ROUTING.items():
        for ep in DISPATCH_RANKS[name]:
            if name in SHAPES:
                _, batch, seq = SHAPES[name]
                tokens = batch * seq // ep
            else:
                tokens = per_rank or 0
            for dispatcher in DISPATCHERS:
                cost = dispatch_cost(
                    dispatcher, tokens, hidden, top_k, experts, ep, span_link(hw, ep, 1), dtype
                )
                rows.append(
                    {
                        "shape": name,
                        "ep": ep,
                        "tokens_per_rank": tokens,
                        "dispatcher": dispatcher,
                        "dispatch_ms": 1e3 * layers * cost.seconds,
                        "MB_per_rank": layers * cost.bytes_sent / 1e6,
                    }
                )
    return rows


def _grouped_mm_keeping(keep: Callable[[AxisStrategy], bool], anchor: bool | None = None) -> RuleRegistry:
    """The default rules with transformers' grouped matmuls (forward and backward) offering only the
    strategies `keep` admits; `anchor` overrides the rules' own (None keeps it)."""
    registry = default_registry()
    for name in ("grouped_mm_fallback", "grouped_mm_fallback_backward"):
        op = library_op("transformers", name)
        rule = registry.get(op)
        assert rule is not None, name

        def kept(call: OpCall, strategies: Any = rule.strategies) -> list[AxisStrategy]:
            return [s for s in strategies(call) if keep(s)]

        registry.register(
            op, kept, family=rule.family, localize=rule.localize,
            anchor=rule.anchor if anchor is None else anchor, uneven=rule.uneven,
        )  # fmt: skip
    return registry


def _weight_experts_split(strategy: AxisStrategy) -> bool:
    """Whether a grouped matmul strategy splits the weight's experts (its input 1, (E, K, N))."""
    return strategy.inputs[1] == Shard(expert_parallel.EXPERT_DIM)


def experts_only() -> RuleRegistry:
    """The default rules with the grouped matmuls offering only the expert split (an anchor, as
    tests/test_expert_parallel.py forces it)."""
    return _grouped_mm_keeping(_weight_experts_split, anchor=True)


def _inside_only() -> RuleRegistry:
    """The default rules with the grouped matmuls never splitting their experts (only inside them)."""
    return _grouped_mm_keeping(lambda s: not _weight_experts_split(s))


def _replicated_only() -> RuleRegistry:
    """The default rules with the grouped matmuls holding every expert whole on every rank (their
    weights replicated: each rank multiplies its own tokens' rows by every expert)."""
    return _grouped_mm_keeping(lambda s: s.inputs[1] == R)


def measure(shape_name: str, mesh: tuple[int, ...], forced: bool, token_dispatch: str = "allgather") -> dict[str, Any]:
    make, batch, seq = SHAPES[shape_name]
    torch.manual_seed(0)
    model = make()
    ids = torch.randint(VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    planning = autopar.PlanOptions(
        hardware=HARDWARE, registry=experts_only() if forced else None, token_dispatch=token_dispatch
    )
    start = time.process_time()
    result = autopar.plan(
        model, mesh, (), example_kwargs={"input_ids": ids, "labels": ids}, planning=planning
    )
    program = result.compiled.program
    experts = {
        name.rsplit(".", 1)[-1]: str(layout)
        for name, layout in zip(program.param_names, program.param_layouts)
        if ".layers.0.mlp.experts." in name
    }
    placement = result.compiled.report.experts
    return {
        "shape": shape_name,
        "mesh": "x".join(map(str, mesh)),
        "plan": "forced expert split" if forced else "search",
        "token_dispatch": token_dispatch,
        "dispatcher": placement.dispatcher if placement is not None and placement.axes else "-",
        # what the all-to-all dispatcher's exchanges inside the ops send (not in MB_per_rank)
        "inside_MB": placement.inside_bytes / 1e6 if placement is not None else 0.0,
        "gate_up_proj": experts.get("gate_up_proj", "?"),
        "down_proj": experts.get("down_proj", "?"),
        "step_ms": 1e3 * result.step_time,
        "comm_ms": 1e3 * result.comm_time,
        "MB_per_rank": result.comm_bytes / 1e6,
        "plan_cpu_s": time.process_time() - start,
    }


def _all_to_all_only() -> RuleRegistry:
    """The default rules with every routed-experts op's experts split over the mesh's one axis and
    the tokens exchanged inside the op (the all-to-all dispatcher; with token_dispatch="alltoall"
    the trace puts one routed-experts op in place of each experts module)."""
    registry = default_registry().copy()

    def admits(call: OpCall, strategy: Strategy) -> bool:
        return routed_experts.expert_axes(call.op, strategy) == (0,) == routed_experts.all_to_all_axes(call.op, strategy)

    for op in routed_experts.ROUTED_OPS:
        registry.require(op, Requirement(admits, "experts and the all-to-all over mesh axis 0"))
    return registry


# name -> (the rules, PlanOptions.token_dispatch) of each plan part (a) parallelizes
GLOO_PLANS: dict[str, tuple[Callable[[], RuleRegistry], str]] = {
    "expert split, all-gather": (experts_only, "allgather"),
    "expert split, all-to-all": (_all_to_all_only, "alltoall"),
    "split inside experts": (_inside_only, "allgather"),
}
# issue 35 item 3's three placements of the experts, each forced, against the search's own choice
PLACEMENTS: dict[str, Callable[[], RuleRegistry] | None] = {
    "expert split (EP)": experts_only,
    "split inside (expert TP)": _inside_only,
    "replicated": _replicated_only,
    "search": None,
}


def _expert_placement(layout: str) -> str:
    """What a `gate_up_proj` layout says: the experts split (S(0) on some axis), split inside
    (S(1)/S(2)), or whole on every rank."""
    if "S(0)" in layout:
        return "EP"
    return "expert TP" if "S(" in layout else "replicated"


def placement_rows(shapes: list[str], meshes: list[str]) -> list[dict[str, Any]]:
    """Each shape and mesh planned with each placement of `PLACEMENTS` forced and by the search:
    modeled step (no overlap), bytes sent and expert weights held per rank."""
    rows = []
    for shape_name in shapes:
        make, batch, seq = SHAPES[shape_name]
        ids = torch.randint(VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
        for mesh_name in meshes:
            for label, registry in PLACEMENTS.items():
                torch.manual_seed(0)
                planning = autopar.PlanOptions(hardware=HARDWARE, registry=registry() if registry else None)
                result = autopar.plan(make(), MESHES[mesh_name], (), example_kwargs={"input_ids": ids, "labels": ids},
                                      planning=planning)  # fmt: skip
                program = result.compiled.program
                layouts = dict(zip(program.param_names, program.param_layouts))
                gate_up = next(str(v) for k, v in layouts.items() if k.endswith("layers.0.mlp.experts.gate_up_proj"))
                experts = result.compiled.report.experts
                rows.append({
                    "shape": shape_name, "mesh": mesh_name, "plan": label, "gate_up_proj": gate_up,
                    "placement": _expert_placement(gate_up), "step_ms": 1e3 * result.step_time,
                    "comm_ms": 1e3 * result.comm_time, "MB_per_rank": result.comm_bytes / 1e6,
                    "expert_MiB_per_rank": experts.weight_bytes_local / 2**20 if experts is not None else 0.0,
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def _gloo_job(rank: int, world_size: int, shape_name: str, steps: int) -> dict[str, Any]:
    """One gloo rank: the same model and batch parallelized with each plan over (world_size,), then
    `steps` timed forward+backward steps each (after one warm-up): this rank's expert-weight bytes
    and its CPU seconds per step (thread CPU time: the 2 shared cores' load does not inflate it),
    and the slowest rank's wall seconds per step."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    make, batch, seq = SHAPES[shape_name]
    ids = torch.randint(VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for name, (registry, dispatch) in GLOO_PLANS.items():
        torch.manual_seed(0)
        pmodel = autopar.parallelize(
            make(), mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids},
            planning=autopar.PlanOptions(registry=registry(), token_dispatch=dispatch),
        )
        held = sum(
            p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
            for n, p in pmodel.named_parameters()
            if ".mlp.experts." in n
        )
        losses = []
        for step in range(steps + 1):
            if step == 1:
                dist.barrier()
                cpu, wall = time.thread_time(), time.perf_counter()
            loss = pmodel(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(float(loss.detach()))
        cpu, wall = (time.thread_time() - cpu) / steps, (time.perf_counter() - wall) / steps
        slowest = torch.tensor([wall], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = {"expert_bytes": held, "cpu_s": cpu, "wall_s": float(slowest), "loss": losses[0]}
    return out


def gloo_rows(ranks: int, shape_name: str, steps: int) -> tuple[list[dict[str, Any]], list[float]]:
    """Issue 35 (a): per-rank expert-weight memory and step time on `ranks` gloo ranks, expert
    split against the split inside the experts; the load average before and after."""
    load = [os.getloadavg()[0]]
    results = run_ranks(ranks, _gloo_job, shape_name, steps, timeout=1200)
    load.append(os.getloadavg()[0])
    rows = []
    for name in GLOO_PLANS:
        per_rank = [r[name] for r in results]
        rows.append(
            {
                "shape": shape_name,
                "ranks": ranks,
                "plan": name,
                "expert_MiB_per_rank": max(r["expert_bytes"] for r in per_rank) / 2**20,
                "cpu_ms_per_step_median_rank": 1e3 * statistics.median(r["cpu_s"] for r in per_rank),
                "wall_ms_per_step_slowest_rank": 1e3 * per_rank[0]["wall_s"],
                "first_loss": per_rank[0]["loss"],
            }
        )
    return rows, load


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--meshes", nargs="+", default=["8", "2x4"], choices=list(MESHES))
    parser.add_argument("--no-forced", action="store_true", help="only the search's plan")
    parser.add_argument("--dispatch-only", action="store_true", help="only the dispatcher table")
    parser.add_argument(
        "--token-dispatch",
        nargs="+",
        default=["allgather"],
        choices=["allgather", "alltoall", "auto"],
        help="PlanOptions.token_dispatch of the search's plans (each one a row)",
    )
    parser.add_argument("--placements", action="store_true", help="only EP / expert TP / replicated / search")
    parser.add_argument("--gloo", type=int, default=0, help="only part (a): this many gloo ranks")
    parser.add_argument("--gloo-shape", default="gloo-mixtral", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan (--gloo)")
    args = parser.parse_args()
    if args.gloo:
        gloo, load = gloo_rows(args.gloo, args.gloo_shape, args.steps)
        heads = list(gloo[0])
        print(table(heads, [[f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in heads] for r in gloo]))
        print(f"load average (1 min) before, after: {load[0]:.1f}, {load[1]:.1f}")
        write_result("moe_gloo", {"rows": gloo, "load_average_1min": load, "steps": args.steps})
        return
    if args.placements:
        placed = placement_rows(args.shapes, args.meshes)
        heads = ["shape", "mesh", "plan", "gate_up_proj", "placement", "step_ms", "comm_ms", "MB_per_rank",
                 "expert_MiB_per_rank"]  # fmt: skip
        print(table(heads, [[f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in heads] for r in placed]))
        write_result("moe_placements", {"hardware": HARDWARE, "layers": LAYERS, "rows": placed})
        return
    dispatch = dispatch_rows()
    heads = ["shape", "ep", "tokens_per_rank", "dispatcher", "dispatch_ms", "MB_per_rank"]
    print(
        table(heads, [[f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in heads] for r in dispatch])
    )
    if args.dispatch_only:
        write_result("moe_dispatch", {"hardware": HARDWARE, "rows": dispatch})
        return
    rows = []
    for shape_name in args.shapes:
        for mesh_name in args.meshes:
            for forced in (False,) if args.no_forced else (False, True):
                for dispatcher in ["allgather"] if forced else args.token_dispatch:
                    row = measure(shape_name, MESHES[mesh_name], forced, dispatcher)
                    rows.append(row)
                    print(row, flush=True)
    columns = [
        "shape",
        "mesh",
        "plan",
        "token_dispatch",
        "dispatcher",
        "gate_up_proj",
        "down_proj",
        "step_ms",
        "comm_ms",
        "MB_per_rank",
        "inside_MB",
        "plan_cpu_s",
    ]
    print(
        table(columns, [[f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in columns] for r in rows])
    )
    name = "moe" if args.token_dispatch == ["allgather"] else "moe_token_dispatch"
    write_result(name, {"hardware": HARDWARE, "layers": LAYERS, "rows": rows, "dispatch": dispatch})


if __name__ == "__main__":
    main()
