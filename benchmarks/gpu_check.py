"""One GPU, one call: a LLaMA-style model of about 1B parameters trained in bfloat16 through
`autopar.parallelize` on a 1-rank NCCL mesh (eager programs and `compile=True`), beside the same
model in plain PyTorch eager and under `torch.compile`, with the step model's prediction for it.

Why this exists: everything autopar says about speed comes from its cost model, priced from
hardware tables. This is the cheapest measured point to hold it against: one device, no
communication, so the gap between the measured step and the modeled one is the compute model's
error alone (kernel efficiency against the table's peak, launch and element-wise overhead), and
the gap between autopar's rows and plain PyTorch's is what autopar's runtime costs on a device.

Each variant builds the model from the same seed directly on the device in bfloat16, trains
`--warmup` steps (the first pays any compile and is reported on its own), then `--steps` timed
steps of forward, backward and AdamW (foreach, the default). Reported per variant: median step,
tokens/s, MFU (model FLOPs over the step time and the device's dense bf16 peak; model FLOPs are
6 N per token for the N matmul weights plus 12 L T d per token for attention, Megatron's count),
peak memory allocated, and the last loss (the variants share seed and batch, so losses agree to
bf16 noise). The predictions are `autopar.plan` for the same model, batch and 1-rank mesh on the
spec-sheet table and (on a GPU) on `h100-calibrated`, whose kernel rates `benchmarks/gpu_kernels.py`
measured, planned on the meta device.

    python benchmarks/gpu_check.py                       # on a CUDA machine, ~4 min on one H100
    python benchmarks/gpu_check.py --tiny --device cpu   # seconds: what CI runs so it never rots

Writes benchmarks/results/gpu_check.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.cost.hardware import load_hardware  # noqa: E402
from autopar.rules import device_attention  # noqa: E402
from examples.zoo import Llama, LlamaConfig  # noqa: E402

# About 1.0 B parameters: TinyLlama's widths with 16 layers (grouped-query attention, 4 k/v heads).
FULL = {
    "vocab_size": 32000, "dim": 2048, "n_layer": 16, "n_head": 16, "n_kv_head": 4, "hidden": 5632, "seq_len": 2048,
}  # fmt: skip
TINY = {"vocab_size": 64, "dim": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "hidden": 64, "seq_len": 16}
VARIANTS = ("torch eager", "torch.compile", "autopar eager", "autopar compile=True")


def model_flops_per_token(cfg: LlamaConfig) -> float:
    """Megatron's model FLOPs per token: 6 per matmul weight (forward and backward) and
    12 L T d for the attention scores and their weighted sum (full, not causal, as Megatron counts)."""
    kv = cfg.dim // cfg.n_head * cfg.n_kv_head
    per_layer = cfg.dim * (2 * cfg.dim + 2 * kv) + 3 * cfg.dim * cfg.hidden
    matmul_weights = cfg.n_layer * per_layer + cfg.dim * cfg.vocab_size  # the head; the embedding is a lookup
    return 6.0 * matmul_weights + 12.0 * cfg.n_layer * cfg.seq_len * cfg.dim


def parameter_count(cfg: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(cfg).parameters())


def build(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    return model.to(dtype)


def batch(cfg: LlamaConfig, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len), generator=gen)
    return idx.to(device), torch.roll(idx, -1, dims=1).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseMarks:
    """Time marks between a step's phases: CUDA events on a GPU (read after the step's sync),
    wall-clock otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def milliseconds(self) -> list[float]:
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [float(a.elapsed_time(b)) for a, b in pairs]
        return [1e3 * (b - a) for a, b in pairs]


def profile_step(step: Callable[[], Any], device: torch.device, path: Path) -> None:
    """One more step under torch.profiler: the top ops by self device time (CPU time off a GPU)
    and how many kernels and ops one step launches, written to `path`."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type))
    ops = sum(e.count for e in events if str(getattr(e, "device_type", "")).endswith("CPU") and e.key.startswith("aten::"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"device kernels: {kernels}, aten ops: {ops}\n" + events.table(sort_by=sort, row_limit=30) + "\n")


def measure_variant(
    name: str,
    cfg: LlamaConfig,
    inputs: tuple[torch.Tensor, torch.Tensor],
    mesh: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Build, wrap and train one variant; times, memory and the last loss."""
    device = inputs[0].device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dtype = torch.float32 if args.tiny and device.type == "cpu" else torch.bfloat16
    model = build(cfg, device, dtype)
    wrap_start = time.perf_counter()
    run: Callable[..., torch.Tensor]
    if name == "torch eager":
        run, params = model, list(model.parameters())
    elif name == "torch.compile":
        run, params = torch.compile(model), list(model.parameters())
    else:
        pmodel = autopar.parallelize(
            model, mesh, example_inputs=inputs, compile=name.endswith("compile=True")
        )
        del model  # what a user keeps is the parallel module
        run, params = pmodel, list(pmodel.parameters())
    wrap_s = time.perf_counter() - wrap_start
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> tuple[float, torch.Tensor, list[float]]:
        """One step; its wall seconds, loss, and forward / backward / optimizer milliseconds
        (CUDA events on a GPU, so the phases are the device's time, not the launch's)."""
        marks = PhaseMarks(device)
        start = time.perf_counter()
        marks.mark()
        loss = run(*inputs)
        marks.mark()
        loss.backward()
        marks.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.mark()
        sync(device)
        return time.perf_counter() - start, loss, marks.milliseconds()

    first_s, _, _ = step()
    for _ in range(args.warmup - 1):
        step()
    times, loss, phases = [], None, []
    for _ in range(args.steps):
        seconds, loss, split = step()
        times.append(seconds)
        phases.append(split)
    if args.profile:
        profile_step(step, device, Path(args.out).with_name(f"{Path(args.out).stem}_profile_{name.replace(' ', '_').replace('=', '')}.txt"))
    step_s = statistics.median(times)
    tokens = inputs[0].numel()
    out = {
        "variant": name,
        "wrap_s": wrap_s,
        "first_step_s": first_s,
        "step_ms": 1e3 * step_s,
        "step_ms_range": (1e3 * min(times), 1e3 * max(times)),
        "tokens_per_s": tokens / step_s,
        "model_tflops_per_s": model_flops_per_token(cfg) * tokens / step_s / 1e12,
        "loss": float(loss.detach().float()) if loss is not None else None,
        "phase_ms": {
            phase: statistics.median(split[i] for split in phases)
            for i, phase in enumerate(("forward", "backward", "optimizer"))
        },
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    if name.startswith("autopar"):
        out["plan"] = pmodel.plan_summary().splitlines()[0]
    return out


def modeled(cfg: LlamaConfig, batch_size: int, hardware: str, dtype: torch.dtype) -> dict[str, Any]:
    """The step model's prediction for the same model and batch on a 1-rank mesh, planned on meta."""
    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    idx = torch.zeros(batch_size, cfg.seq_len, dtype=torch.long)
    start = time.perf_counter()
    result = autopar.plan(model, (1,), (idx, idx), planning=autopar.PlanOptions(hardware=hardware))
    return {
        "hardware": hardware,
        "step_ms": 1e3 * result.step_time,
        "compute_ms": 1e3 * result.compute_time,
        "memory_gib": result.memory.total / 2**30,
        "plan_s": time.perf_counter() - start,
    }


def attention_pair_errors(device: torch.device) -> dict[str, float]:
    """The attention pair programs call off the CPU (flash kernels in half precision, the math path
    in float32) against autograd through `F.scaled_dot_product_attention` in float64: largest
    absolute error of the output and of each input gradient, per path."""
    errors: dict[str, float] = {}
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(2, 128, 4, 64, generator=gen).transpose(1, 2) for _ in range(3))
        grad = torch.randn(2, 4, 128, 64, generator=gen)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        expected = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        expected.backward(grad.double())
        on = [t.to(device, dtype) for t in (q, k, v)]
        out, lse = device_attention.attention_forward(*on, 0.0, True)
        grads = device_attention.attention_backward(grad.to(device, dtype), *on, out, lse, 0.0, True)
        path = "cpu kernel" if device.type == "cpu" else device_attention.fused_kernel(*on, 0.0, True, None, None)
        name = f"{str(dtype).removeprefix('torch.')} ({path})"
        errors[name] = max(
            (got.double().cpu() - want).abs().max().item()
            for got, want in zip((out, *grads), (expected, *(leaf.grad for leaf in leaves)))
        )
        scores = (leaves[0] @ leaves[1].transpose(-2, -1) / math.sqrt(q.shape[-1])).detach()
        scores = scores.masked_fill(torch.ones(128, 128, dtype=torch.bool).triu(1), float("-inf"))
        errors[f"{name} logsumexp"] = (lse.double().cpu() - scores.logsumexp(-1)).abs().max().item()
    return errors


def init_one_rank(device: torch.device) -> Any:
    """A 1-rank process group (NCCL on a GPU, gloo on CPU) and its DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    return init_device_mesh(device.type, (1,))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the CI configuration: a 2-layer toy")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument(
        "--shape", nargs="*", default=[], metavar="KEY=N", help="other LlamaConfig fields, e.g. dim=4096 seq_len=4096"
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--hardware", default=None, help="the table the prediction uses")
    parser.add_argument("--profile", action="store_true", help="profile one more step per variant (top ops, beside --out)")
    parser.add_argument(
        "--modeled", nargs="*", default=None, metavar="TABLE",
        help="further tables to predict the step with (default on a GPU: h100-calibrated when --hardware is not given)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_check.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    shape = dict(TINY if args.tiny else FULL)
    if args.layers is not None:
        shape["n_layer"] = args.layers
    shape.update({key: int(value) for key, value in (item.split("=", 1) for item in args.shape)})
    cfg = LlamaConfig(**shape)
    hardware = args.hardware or ("h100-nvlink-ib" if device.type == "cuda" else "cpu-gloo")
    table = load_hardware(hardware)
    dtype = torch.float32 if args.tiny and device.type == "cpu" else torch.bfloat16
    peak = table.peak_flops[str(dtype).removeprefix("torch.")]
    mesh = init_one_rank(device)
    inputs = batch(cfg, args.batch, device)
    report: dict[str, Any] = {
        "config": {**shape, "batch": args.batch, "dtype": str(dtype), "params": parameter_count(cfg)},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "peak_tflops": peak / 1e12,
        "rows": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
    report["attention_pair_max_error"] = attention_pair_errors(device)
    print("attention pair", json.dumps(report["attention_pair_max_error"]), flush=True)
    report["modeled"] = []
    further = args.modeled
    if further is None:
        further = ["h100-calibrated"] if device.type == "cuda" and args.hardware is None else []
    for name in [hardware, *further]:
        try:
            report["modeled"].append(modeled(cfg, args.batch, name, dtype))
        except Exception as exc:  # a measurement: keep going and say what failed
            report["modeled"].append({"hardware": name, "error": f"{type(exc).__name__}: {exc}"})
        print("modeled", json.dumps(report["modeled"][-1]), flush=True)
    for name in args.variants:
        try:
            row = measure_variant(name, cfg, inputs, mesh, args)
        except Exception as exc:
            traceback.print_exc()
            row = {"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        row["mfu"] = row["model_tflops_per_s"] * 1e12 / peak if "model_tflops_per_s" in row else None
        report["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(render(report))
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        "| variant | step ms (range) | tokens/s | MFU | peak memory GiB | first step s | wrap s | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        lines.append(
            f"| {r['variant']} | {r['step_ms']:.1f} ({r['step_ms_range'][0]:.1f}-{r['step_ms_range'][1]:.1f}) | "
            f"{r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f} % | {memory} | {r['first_step_s']:.1f} | "
            f"{r['wrap_s']:.1f} | {r['loss']:.4f} |"
        )
    for m in report.get("modeled", []):
        if "step_ms" in m:
            lines.append(
                f"| step model ({m['hardware']}) | {m['step_ms']:.1f} | | | {m['memory_gib']:.1f} | | plan {m['plan_s']:.1f} | |"
            )
    timed = [r for r in report["rows"] if "phase_ms" in r]
    if timed:
        lines += ["", "| variant | forward ms | backward ms | optimizer ms |", "|---|---|---|---|"]
        for r in timed:
            ph = r["phase_ms"]
            lines.append(f"| {r['variant']} | {ph['forward']:.1f} | {ph['backward']:.1f} | {ph['optimizer']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
