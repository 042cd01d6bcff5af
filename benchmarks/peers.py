"""autopar against what a user would pick instead: the same GPT trained on 8 gloo ranks by DDP, FSDP2
(`fully_shard`), torch tensor parallelism (`parallelize_module` with a hand-written Colwise/Rowwise
plan) alone and under FSDP2, and autopar on its `auto` mesh, on (8,), (2,4) and (2,2,2), and in
FSDP's pattern on (8,) (axis "dp", greedy planner). The model is examples/models.make_gpt at width
256, 4 layers, 8 heads, 64 tokens, vocabulary 512 (3.3 M parameters), on one batch of 8 sequences;
SGD with momentum (linear in the gradient).

What it measures, per variant:

- step time: one forward + backward + SGD-with-momentum step, the slowest rank's. Every variant is
  built in the same 8-rank job (forked by tests/multirank.py, one torch thread per rank); after the
  warm-up steps, `--rounds` rounds (default 7) each time `--steps` steps (default 2) of every
  variant, the order rotating (and reversed every other round) so that drifts in machine load hit
  all alike. We report the
  median over rounds and the min-max spread, and for autopar `auto` the median over rounds of its
  ratio to the fastest peer that stores about 1/p of the parameters (same round).
- parameters per rank: elements each rank stores (a DTensor's `to_local()`, tied weights once).
- peak RSS per rank, measured apart for each variant: every variant is also built and trained
  alone (`--check-steps` steps) in a fresh 8-rank job, forked from the same light parent, so every
  rank starts from the same RSS (the parent's torch and autopar imports, ~280 MiB here). The table gives the
  process peak (`ru_maxrss`: setup, autopar's compile and planning included) of the largest and
  the median rank. The JSON also has the RSS at start and after setup, the peak during setup and
  the peak over the training steps alone (reset after setup via /proc/self/clear_refs; it starts
  from what setup left resident, as the allocator keeps freed memory).
- losses: every variant starts from the same weights and trains on the same batch; its loss at each
  of the `--check-steps` steps (the mean over ranks of each rank's loss: the global loss for
  autopar and TP, the mean of equal-sized shards for DDP/FSDP2) must equal the serial model's to
  rtol 1e-4, in the fresh jobs and in the timing job.
- collectives per step: one extra step per variant under a dispatch mode that counts the c10d and
  functional-collective ops it sees on rank 0 (waits not counted), by op and group size, and the
  bytes a rank sends for them on a ring ((g - 1) / g of the whole buffer, twice for an all-reduce).
  autopar's count includes its per-call input check (one 8-rank all-reduce of fingerprints).

autopar's explicit meshes are planned with `parallelize`'s default cost (element counts, no
hardware table); `mesh_shape="auto"` prices every factorization of 8 on the `cpu-gloo` table and
plans the chosen mesh on it, with its weights stored sharded or replicated, whichever models
faster (docs/planning.md, "Weight storage"). The report compares `auto` with the fastest peer
storing about 1/p of the parameters and with the fastest peer of all (DDP, replicated weights).

The torch TP plan (`parallelize_module` per block): attention's fused qkv and the MLP's fc are
ColwiseParallel, both proj are RowwiseParallel; embeddings, layer norms and the tied lm_head stay
replicated (no loss parallel: the head is tied to the embedding). As torch's TP tutorial asks of
attention, the user adapts it to local heads: the qkv weight's rows are permuted so that each
rank's contiguous column shard holds its heads' q, k and v, and attention's forward reads its
local width (`chunk(3)` and `view(B, T, -1, head_dim)`); numerically the serial model. TP+FSDP2
is that plan on the "tp" axis of a (2,4) ("dp", "tp") mesh with `fully_shard` per block and root
on "dp". FSDP2 alone: `fully_shard` per block and root on (8,). DDP: `DistributedDataParallel`.
DDP and FSDP2 ranks each take their 1/dp of the batch rows. `autopar 8 dp greedy` is autopar on
(8,) with the axis named "dp" and the greedy planner, which then splits every op by the batch and
stores every weight split (gathered where used, gradients reduce-scattered): FSDP's pattern, which
the search does not choose.

Not run by default: `autopar auto (check blocking)`, the same plan as `auto` with the per-call
input check waited on before the forward (as before it was settled inside it), to time the
difference in one job: `--only 'DDP,FSDP2,autopar auto,autopar auto (check blocking)'`.

    python benchmarks/peers.py            # ~5 min on 2 busy cores: fresh jobs for memory, then timing
    python benchmarks/peers.py --quick    # ~2 min: no fresh jobs (RSS is each rank's process peak
                                          # with every variant built), 3 rounds of 1 step

Writes benchmarks/results/peers.json (or <name>.json).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import sys
import time
import types
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, git_state, table, write_result  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from multirank import run_ranks  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import autopar  # noqa: E402
from autopar.core.mesh import default_axis_names  # noqa: E402
from autopar.runtime.module import ParallelModule  # noqa: E402
from examples.models import CausalSelfAttention, make_gpt  # noqa: E402

WORLD = 8
SEED = 0
MODEL = {"n_embd": 256, "n_layer": 4, "n_head": 8, "block_size": 64, "vocab_size": 512}
LR, MOMENTUM = 0.1, 0.9
RTOL = 1e-4
VARIANTS = (
    "DDP",
    "FSDP2",
    "torch TP",
    "torch TP+FSDP2",
    "autopar auto",
    "autopar 8",
    "autopar 2x4",
    "autopar 2x2x2",
    "autopar 8 dp greedy",
    "autopar auto (check blocking)",
)
BLOCKING = "autopar auto (check blocking)"  # not run by default: `--only` names it to compare
ONE_OVER_P = 1.25  # a variant "stores 1/p" when its parameters per rank are within this of total / p


@dataclass
class Built:
    """One variant on this rank: what to call, on which rows of the batch, and its mesh."""

    module: nn.Module
    batch: tuple[torch.Tensor, ...]
    mesh: str
    optimizer: torch.optim.Optimizer | None = None


# ---------------------------------------------------------------------------------------------
# the variants


def _rows(batch: tuple[torch.Tensor, ...], parts: int, index: int) -> tuple[torch.Tensor, ...]:
    """This data-parallel rank's rows of every batch tensor (equal shares)."""
    return tuple(t.chunk(parts, dim=0)[index].contiguous() for t in batch)


def _tp_attention_forward(self: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward on this rank's heads (the user's TP adaptation of attention)."""
    B, T, C = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=2)  # local: this rank's heads of q, k and v (rows permuted)
    head_dim = C // self.n_head
    q, k, v = (t.view(B, T, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


def _group_qkv_by_rank(attn: CausalSelfAttention, tp: int) -> None:
    """Reorder the fused qkv's output rows [q | k | v] into [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so
    that ColwiseParallel's contiguous shard r holds rank r's heads of q, k and v."""
    width = attn.qkv.out_features // 3
    share = width // tp
    order = torch.cat(
        [
            torch.arange(part * width + r * share, part * width + (r + 1) * share)
            for r in range(tp)
            for part in range(3)
        ]
    )
    with torch.no_grad():
        attn.qkv.weight.copy_(attn.qkv.weight[order])
        attn.qkv.bias.copy_(attn.qkv.bias[order])


def _torch_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The hand-written Megatron plan: column-parallel qkv and fc, row-parallel projections."""
    tp = tp_mesh.size()
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:  # type: ignore[union-attr]
        assert block.attn.n_head % tp == 0, "heads must split evenly over the tp axis"
        _group_qkv_by_rank(block.attn, tp)
        block.attn.forward = types.MethodType(_tp_attention_forward, block.attn)
        parallelize_module(block, tp_mesh, plan)


def _fully_shard(model: nn.Module, mesh: DeviceMesh) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build(name: str, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> Built:
    """Variant `name` of `model` on this rank (the model is consumed: built in place or compiled)."""
    rank = dist.get_rank()
    if name == "DDP":
        return Built(DistributedDataParallel(model), _rows(batch, WORLD, rank), "8")
    if name == "FSDP2":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        _fully_shard(model, mesh)
        return Built(model, _rows(batch, WORLD, mesh.get_local_rank()), "8")
    if name == "torch TP":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        _torch_tp(model, mesh)
        return Built(model, batch, "8")
    if name == "torch TP+FSDP2":
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        _torch_tp(model, mesh["tp"])
        _fully_shard(model, mesh["dp"])
        return Built(model, _rows(batch, 2, mesh.get_local_rank("dp")), "2x4 (dp, tp)")
    if name == "autopar auto":
        pmodel = autopar.parallelize(model, WORLD, example_inputs=batch, mesh_shape="auto")
        chosen = tuple(pmodel.mesh_choice.chosen.shape)  # type: ignore[union-attr, arg-type]
        return Built(pmodel, batch, "auto: " + "x".join(map(str, chosen)))
    if name == BLOCKING:  # auto whose input check settles before the forward (as before peers17)
        built = build("autopar auto", model, batch)
        for run in built.module._programs.values():  # type: ignore[union-attr]
            run.gate = None  # no gate: `ParallelModule.forward` settles the check at once
        return built
    if name == "autopar 8 dp greedy":  # FSDP's pattern: every axis splits the batch (a "dp" name)
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        pmodel = autopar.parallelize(model, mesh, example_inputs=batch, planning=autopar.PlanOptions(planner="greedy"))
        return Built(pmodel, batch, "8 (dp), greedy")
    if name.startswith("autopar "):
        shape = tuple(int(s) for s in name.split()[1].split("x"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=default_axis_names(len(shape)))
        return Built(autopar.parallelize(model, mesh, example_inputs=batch), batch, "x".join(map(str, shape)))
    raise ValueError(f"unknown variant {name!r}")


def _built(name: str) -> Built:
    model, batch = make_gpt(SEED, WORLD, **MODEL)  # the same weights and batch on every rank
    built = build(name, model, batch)
    built.optimizer = torch.optim.SGD(built.module.parameters(), lr=LR, momentum=MOMENTUM)
    return built


# ---------------------------------------------------------------------------------------------
# measurements inside a rank


def _step(built: Built) -> float:
    assert built.optimizer is not None
    built.optimizer.zero_grad(set_to_none=True)
    loss = built.module(*built.batch)
    loss.backward()
    built.optimizer.step()
    return float(loss.detach())


def params_per_rank(module: nn.Module) -> int:
    """Elements of the parameters this rank stores (local shards; tied parameters once)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) / 1024


def _reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _process_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active (c10d and functional collectives, not waits),
    by op and group size, and the elements each rank sends for them on a ring: (g - 1) / g of the
    whole buffer (the gathered, reduced or exchanged tensor), twice that for an all-reduce."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        namespace, _, op = func._schema.name.partition("::")
        if namespace in self.NAMESPACES and not any(w in op for w in ("wait", "wrap", "barrier")):
            leaves = pytree.tree_leaves((args, kwargs))
            sizes = [t.numel() for t in leaves if isinstance(t, torch.Tensor)]
            g = _group_size(leaves)
            if namespace != "c10d" and "all_gather" in op:  # the gathered output is not an argument
                whole = sum(sizes) * g
            else:
                whole = max(sizes, default=0)
            factor = 2 if op.startswith(("all_reduce", "allreduce")) else 1
            key = f"{op.strip('_')} ({g})"
            self.counts[key] += 1
            self.sent[key] += factor * whole * (g - 1) // g
        return func(*args, **kwargs)


def _group_size(leaves: list[Any]) -> int:
    """The size of the process group among a collective's arguments (a name or a ProcessGroup)."""
    for leaf in leaves:
        if isinstance(leaf, torch.ScriptObject):
            return dist.ProcessGroup.unbox(leaf).size()
        if isinstance(leaf, str):
            try:
                return dist.distributed_c10d._resolve_process_group(leaf).size()  # type: ignore[arg-type]
            except Exception:  # another string argument (a reduce op's name)
                continue
    return dist.get_world_size()


def _count_collectives(built: Built) -> dict[str, Any]:
    counter = CollectiveCounter()
    with counter:
        _step(built)
    return {"counts": dict(counter.counts), "sent_elements": dict(counter.sent)}


def _memory_job(rank: int, world_size: int, name: str, check_steps: int) -> dict[str, Any]:
    """One variant alone in fresh processes: setup, `check_steps` training steps, RSS."""
    start_mib = _status_mib("VmRSS")
    t0 = time.perf_counter()
    built = _built(name)
    setup_s = time.perf_counter() - t0
    setup_rss = _status_mib("VmRSS")
    setup_peak = _status_mib("VmHWM")
    _reset_peak_rss()
    losses = [_step(built) for _ in range(check_steps)]
    return {
        "mesh": built.mesh,
        "losses": losses,
        "params_per_rank": params_per_rank(built.module),
        "setup_s": setup_s,
        "rss_start_mib": start_mib,
        "rss_after_setup_mib": setup_rss,
        "peak_setup_mib": setup_peak,
        "peak_train_mib": _status_mib("VmHWM"),
        "peak_process_mib": _process_peak_mib(),
    }


def _rotation(names: list[str], index: int) -> list[str]:
    order = names[index % len(names) :] + names[: index % len(names)]
    return order[::-1] if index % 2 else order


def _timing_job(
    rank: int, world_size: int, names: tuple[str, ...], check_steps: int, rounds: int, steps: int
) -> dict[str, Any]:
    """Every variant in this one job; warm-up (the loss check), collectives, alternated rounds."""
    built: dict[str, Built] = {}
    setup_s: dict[str, float] = {}
    for name in names:
        dist.barrier()
        t0 = time.perf_counter()
        built[name] = _built(name)
        setup_s[name] = time.perf_counter() - t0
    losses = {name: [_step(b) for _ in range(check_steps)] for name, b in built.items()}
    collectives = {name: _count_collectives(b) for name, b in built.items()}
    per_step: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in _rotation(list(names), index):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                _step(built[name])
            per_step[name].append(_slowest(time.perf_counter() - t0) / steps)
    extra: dict[str, Any] = {}
    for name, b in built.items():
        if isinstance(b.module, ParallelModule):
            extra[name] = {"plan_summary": b.module.plan_summary() if rank == 0 else ""}
            choice = getattr(b.module, "mesh_choice", None)
            if choice is not None and rank == 0:
                extra[name]["mesh_choice"] = choice.table()
    return {
        "mesh": {name: b.mesh for name, b in built.items()},
        "params_per_rank": {name: params_per_rank(b.module) for name, b in built.items()},
        "setup_s": setup_s,
        "losses": losses,
        "collectives": collectives,
        "step_s": per_step,
        "autopar": extra,
        "peak_process_mib": _process_peak_mib(),
    }


def _serial_job(rank: int, world_size: int, check_steps: int, timed_steps: int) -> dict[str, Any]:
    """The reference: the serial model's losses (and, not alternated with the others, its step)."""
    model, batch = make_gpt(SEED, WORLD, **MODEL)
    total = sum(p.numel() for p in model.parameters())
    built = Built(model, batch, "1", torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    _reset_peak_rss()
    losses = [_step(built) for _ in range(check_steps)]
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        _step(built)
        times.append(time.perf_counter() - t0)
    return {
        "losses": losses,
        "params": total,
        "step_s": statistics.median(times),
        "peak_train_mib": _status_mib("VmHWM"),
        "peak_process_mib": _process_peak_mib(),
    }


# ---------------------------------------------------------------------------------------------
# the report


def _global_losses(per_rank: list[list[float]]) -> list[float]:
    """Each step's loss as the mean over ranks (the global loss for every variant here)."""
    return [statistics.fmean(step) for step in zip(*per_rank)]


def _loss_check(losses: list[float], serial: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, serial))


def summarize(
    serial: dict[str, Any], timing: list[dict[str, Any]], memory: dict[str, list[dict[str, Any]]] | None
) -> dict[str, Any]:
    names = list(timing[0]["step_s"])
    total = serial["params"]
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        times = timing[0]["step_s"][name]  # already the slowest rank's, the same on every rank
        losses = _global_losses([r["losses"][name] for r in timing])
        params = max(r["params_per_rank"][name] for r in timing)
        row: dict[str, Any] = {
            "mesh": timing[0]["mesh"][name],
            "step_ms": [1e3 * t for t in times],
            "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times),
            "params_per_rank": params,
            "params_x_one_over_p": params / (total / WORLD),
            "losses": losses,
            "loss_max_rel_diff": _loss_check(losses, serial["losses"]),
            "setup_s_max": max(r["setup_s"][name] for r in timing),
            "collectives_rank0": timing[0]["collectives"][name],
        }
        if memory is not None:
            runs = memory[name]
            fresh = _global_losses([r["losses"] for r in runs])
            row["fresh_job"] = {
                "losses": fresh,
                "loss_max_rel_diff": _loss_check(fresh, serial["losses"]),
                "setup_s_max": max(r["setup_s"] for r in runs),
                **{
                    key: [r[key] for r in runs]
                    for key in (
                        "rss_start_mib",
                        "rss_after_setup_mib",
                        "peak_setup_mib",
                        "peak_train_mib",
                        "peak_process_mib",
                    )
                },
            }
            row["loss_max_rel_diff"] = max(row["loss_max_rel_diff"], row["fresh_job"]["loss_max_rel_diff"])
        if name in timing[0]["autopar"]:
            row["autopar"] = timing[0]["autopar"][name]
        rows[name] = row
    peers = [n for n in names if not n.startswith("autopar") and rows[n]["params_x_one_over_p"] <= ONE_OVER_P]
    if not peers or "autopar auto" not in rows:
        return {"total_params": total, "rows": rows, "goal": None}
    fastest = min(peers, key=lambda n: rows[n]["median_ms"])
    ratios = [a / b for a, b in zip(rows["autopar auto"]["step_ms"], rows[fastest]["step_ms"])]
    every = [n for n in names if not n.startswith("autopar")]
    overall = min(every, key=lambda n: rows[n]["median_ms"])
    against = [a / b for a, b in zip(rows["autopar auto"]["step_ms"], rows[overall]["step_ms"])]
    goal = {
        "peers_storing_one_over_p": peers,
        "fastest": fastest,
        "auto_over_fastest_per_round": ratios,
        "median_ratio": statistics.median(ratios),
        "met": statistics.median(ratios) <= 1.0,
        # issue 29 item 6: against every peer, DDP (weights replicated) included
        "fastest_peer": overall,
        "auto_over_fastest_peer_per_round": against,
        "median_ratio_fastest_peer": statistics.median(against),
        "met_every_peer": statistics.median(against) <= 1.0,
    }
    return {"total_params": total, "rows": rows, "goal": goal}


def _collectives_text(c: dict[str, Any]) -> str:
    n = sum(c["counts"].values())
    sent = sum(c["sent_elements"].values())
    return f"{n} / {4 * sent / 1e6:.1f}"


def print_table(summary: dict[str, Any], serial: dict[str, Any], fresh: bool) -> str:
    headers = [
        "variant",
        "mesh",
        "params/rank (x 1/p)",
        "peak RSS MiB, largest / median rank",
        "step ms median",
        "min-max",
        "collectives / MB sent per rank per step",
        f"losses = serial (rtol {RTOL:g})",
    ]
    rows = [
        [
            "serial (1 process, not alternated)",
            "1",
            f"{serial['params'] / 1e6:.2f} M (8.00)",
            f"{serial['peak_process_mib']:.0f}",
            f"{1e3 * serial['step_s']:.0f}",
            "",
            "",
            "reference",
        ]
    ]
    for name, r in summary["rows"].items():
        if fresh:
            f = r["fresh_job"]
            rss = f"{max(f['peak_process_mib']):.0f} / {statistics.median(f['peak_process_mib']):.0f}"
        else:
            rss = "n/a (--quick)"
        rows.append(
            [
                name,
                r["mesh"],
                f"{r['params_per_rank'] / 1e6:.3f} M ({r['params_x_one_over_p']:.2f})",
                rss,
                f"{r['median_ms']:.0f}",
                f"{r['min_ms']:.0f}-{r['max_ms']:.0f}",
                _collectives_text(r["collectives_rank0"]),
                f"yes ({r['loss_max_rel_diff']:.1e})"
                if r["loss_max_rel_diff"] <= RTOL
                else f"NO ({r['loss_max_rel_diff']:.1e})",
            ]
        )
    return table(headers, rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="no fresh per-variant jobs; 3 rounds of 1 step")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 7; --quick 3)")
    parser.add_argument("--steps", type=int, help="steps per timed block (default 2; --quick 1)")
    parser.add_argument("--check-steps", type=int, default=3, help="warm-up steps whose losses are checked")
    parser.add_argument("--only", help="comma-separated variants (default: all)")
    parser.add_argument("--name", default="peers", help="writes benchmarks/results/<name>.json")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (1 if args.quick else 2)
    names = tuple(args.only.split(",")) if args.only else tuple(v for v in VARIANTS if v != BLOCKING)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")

    start = time.perf_counter()
    load = [os.getloadavg()[0]]
    serial = run_ranks(1, _serial_job, args.check_steps, 5, timeout=600)[0]
    print(f"serial: losses {serial['losses']}", flush=True)
    memory: dict[str, list[dict[str, Any]]] | None = None
    if not args.quick:
        memory = {}
        for name in names:
            t0 = time.perf_counter()
            memory[name] = run_ranks(WORLD, _memory_job, name, args.check_steps, timeout=1800)
            print(f"{name}: fresh job {time.perf_counter() - t0:.0f} s", flush=True)
        load.append(os.getloadavg()[0])
    t0 = time.perf_counter()
    timing = run_ranks(WORLD, _timing_job, names, args.check_steps, rounds, steps, timeout=3000)
    print(f"timing job: {time.perf_counter() - t0:.0f} s", flush=True)
    load.append(os.getloadavg()[0])
    summary = summarize(serial, timing, memory)
    text = print_table(summary, serial, memory is not None)
    print(text)
    if memory is None:
        print(
            f"process peak RSS with every variant built, largest rank: {max(r['peak_process_mib'] for r in timing):.0f} MiB"
        )
    goal = summary["goal"]
    if goal is not None:
        ratios = goal["auto_over_fastest_per_round"]
        print(
            f"autopar auto ({summary['rows']['autopar auto']['mesh']}) / fastest 1/p peer ({goal['fastest']}): "
            f"median {goal['median_ratio']:.2f} per round (range {min(ratios):.2f}-{max(ratios):.2f}); "
            f"goal {'met' if goal['met'] else 'not met'}"
        )
        against = goal["auto_over_fastest_peer_per_round"]
        print(
            f"autopar auto / fastest peer ({goal['fastest_peer']}): median {goal['median_ratio_fastest_peer']:.2f} "
            f"per round (range {min(against):.2f}-{max(against):.2f}); "
            f"goal {'met' if goal['met_every_peer'] else 'not met'}"
        )
    rows = summary["rows"]
    if BLOCKING in rows and "autopar auto" in rows:  # the same plan, the check settled at once or in the forward
        gated = [a / b for a, b in zip(rows["autopar auto"]["step_ms"], rows[BLOCKING]["step_ms"])]
        summary["auto_over_blocking_per_round"] = gated
        print(
            f"autopar auto / {BLOCKING}: median {statistics.median(gated):.2f} per round "
            f"(range {min(gated):.2f}-{max(gated):.2f})"
        )
    for name, r in rows.items():
        print(f"  {name}: {r['collectives_rank0']['counts']}")
    payload = {
        "model": {"factory": "examples.models.make_gpt", "batch": WORLD, "seed": SEED, **MODEL},
        "optimizer": {"SGD": {"lr": LR, "momentum": MOMENTUM}},
        "check_steps": args.check_steps,
        "rounds": rounds,
        "steps_per_round": steps,
        "threads_per_rank": 1,
        "quick": args.quick,
        "git": git_state(),
        "wall_s": time.perf_counter() - start,
        "load_average_1min": load,
        "serial": serial,
        **summary,
        "table": text,
    }
    print(f"wrote {write_result(args.name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
