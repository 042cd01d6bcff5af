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

Writes benchmarks/results/moe.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
import transformers.integrations.moe  # noqa: F401  (registers transformers' grouped-matmul ops)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import table, write_result  # noqa: E402

import autopar  # noqa: E402
from autopar.core.strategy import AxisStrategy, OpCall  # noqa: E402
from autopar.cost.dispatch import DISPATCHERS, dispatch_cost  # noqa: E402
from autopar.cost.hardware import load_hardware, span_link  # noqa: E402
from autopar.rules import expert_parallel  # noqa: E402
from autopar.rules.base import RuleRegistry  # noqa: E402
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


def experts_only() -> RuleRegistry:
    """The default rules with the grouped matmuls offering only the expert split."""
    registry = default_registry()
    for name, strategies in (
        ("grouped_mm_fallback", expert_parallel.expert_split_forward),
        ("grouped_mm_fallback_backward", expert_parallel.expert_split_backward),
    ):
        op = library_op("transformers", name)
        rule = registry.get(op)
        assert rule is not None, name

        def only(call: OpCall, strategies: Any = strategies) -> list[AxisStrategy]:
            return list(strategies(call))

        registry.register(
            op, only, family=rule.family, localize=rule.localize, anchor=True, uneven=rule.uneven
        )
    return registry


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
    args = parser.parse_args()
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
