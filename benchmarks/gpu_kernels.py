"""What one GPU's kernels reach, by shape: the measurements a calibrated step model needs.

The hardware tables price a matmul at the spec sheet's peak and an element-wise op at the spec
sheet's memory bandwidth. `benchmarks/gpu_check.py` measured a whole training step at about half
of what that predicts; this script measures the pieces, on the device, in one call:

- **matmul**: bf16 (and fp32) `torch.mm` rates for the shapes a transformer layer runs (tokens x
  width x width, width x SwiGLU hidden, the vocabulary head, their backward transposes) and square
  sizes, as TFLOP/s and as a fraction of the table's peak;
- **element-wise**: achieved bytes/s (read + write) of add, mul, SiLU and a copy over sizes from
  1 MiB to 1 GiB, as a fraction of the table's bandwidth;
- **launch**: the time of a tiny op issued back to back (the floor every kernel pays);
- **attention**: flash attention forward and backward TFLOP/s (causal, bf16) at the lengths the
  published runs use.

Each number is the median of timed repeats after a warm-up, timed with CUDA events. On a CPU it
runs the same measurements in a tiny configuration (`--tiny`), so the script never rots.

    python benchmarks/gpu_kernels.py                  # ~1 min on one H100
    python benchmarks/gpu_kernels.py --tiny --device cpu

Writes benchmarks/results/gpu_kernels.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.cost.calibrate import calibrated_table  # noqa: E402
from autopar.cost.hardware import TABLES_DIR, load_hardware  # noqa: E402

# (tokens, in, out): a LLaMA layer's projections at widths 2048 / 4096 / 8192 (forward; backward
# runs the same products transposed), the vocabulary head, and squares.
WIDTHS = (2048, 4096, 8192)
TOKENS = (2048, 8192, 32768)


def matmul_shapes(tiny: bool) -> list[tuple[int, int, int]]:
    if tiny:
        return [(64, 32, 32), (64, 32, 96), (128, 64, 64)]
    shapes = []
    for d in WIDTHS:
        hidden = int(8 * d / 3 / 256 + 1) * 256  # SwiGLU's inner width, rounded up as LLaMA does
        for t in TOKENS:
            shapes += [(t, d, d), (t, d, hidden), (t, hidden, d), (t, d, d // 4)]
    shapes += [(8192, 2048, 32000), (8192, 4096, 128256)] + [(n, n, n) for n in (1024, 4096, 8192, 16384)]
    return sorted(set(shapes))


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = 10) -> float:
    """Median seconds of `fn` over `repeats` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_matmuls(device: torch.device, tiny: bool, peak: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, n in matmul_shapes(tiny):
            if dtype == torch.float32 and m * n > 8192 * 8192:
                continue  # fp32 rows: a few, for the tables' fp32 entry
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds = timed(lambda a=a, b=b: torch.mm(a, b), device)
            rate = 2.0 * m * n * k / seconds
            name = str(dtype).removeprefix("torch.")
            rows.append(
                {"dtype": name, "m": m, "k": k, "n": n, "seconds": seconds, "tflops": rate / 1e12,
                 "of_peak": rate / peak[name]}
            )  # fmt: skip
            del a, b
    return rows


def measure_elementwise(device: torch.device, tiny: bool, bandwidth: float) -> list[dict[str, Any]]:
    rows = []
    sizes = [2**k for k in ((16, 18, 20) if tiny else (18, 20, 22, 24, 26, 28))]  # elements, bf16
    for elements in sizes:
        x = torch.randn(elements, device=device, dtype=torch.bfloat16)
        y = torch.randn(elements, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        ops: dict[str, tuple[Callable[[], Any], int]] = {
            "copy": (lambda x=x, out=out: out.copy_(x), 2),
            "add": (lambda x=x, y=y, out=out: torch.add(x, y, out=out), 3),
            "mul": (lambda x=x, y=y, out=out: torch.mul(x, y, out=out), 3),
            "silu": (lambda x=x: F.silu(x), 2),
        }
        for name, (fn, tensors) in ops.items():
            seconds = timed(fn, device)
            moved = tensors * elements * x.element_size()
            rows.append(
                {"op": name, "elements": elements, "seconds": seconds, "bytes_per_s": moved / seconds,
                 "of_bandwidth": moved / seconds / bandwidth}
            )  # fmt: skip
        del x, y, out
    return rows


def measure_launch(device: torch.device) -> float:
    """Seconds per tiny op issued back to back (1000 adds of one element, timed together)."""
    x = torch.zeros(1, device=device)

    def thousand() -> None:
        for _ in range(1000):
            x.add_(1)

    return timed(thousand, device, repeats=5) / 1000


def measure_attention(device: torch.device, tiny: bool, peak: float) -> list[dict[str, Any]]:
    rows = []
    cases = [(2, 4, 64, 32)] if tiny else [(4, 16, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for b, h, length, hd in cases:
        q, k, v = (torch.randn(b, h, length, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, length, hd, device=device, dtype=dtype)
        flops = 4.0 * b * h * length * length * hd / 2  # causal: half the products
        forward = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)

        def both(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, grad: torch.Tensor = grad) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        total = timed(both, device)
        backward = max(total - forward, 1e-9)
        rows.append(
            {"batch": b, "heads": h, "length": length, "head_dim": hd, "forward_s": forward, "backward_s": backward,
             "forward_of_peak": flops / forward / peak, "backward_of_peak": 2.5 * flops / backward / peak}
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--hardware", default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_kernels.json"))
    parser.add_argument(
        "--write-table", metavar="NAME", help="write autopar/cost/tables/NAME.json: --hardware's table with these kernel rates"
    )
    parser.add_argument("--from-json", metavar="PATH", help="take the measurements from an earlier report instead")
    args = parser.parse_args(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        write_table(report, args.hardware or report["hardware_table"], args.write_table)
        return report
    device = torch.device(args.device)
    table = load_hardware(args.hardware or ("h100-nvlink-ib" if device.type == "cuda" else "cpu-gloo"))
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "hardware_table": table.name,
        "peak_flops": dict(table.peak_flops),
        "memory_bandwidth": table.memory_bandwidth,
    }
    report["launch_s"] = measure_launch(device)
    print("launch", report["launch_s"], flush=True)
    report["elementwise"] = measure_elementwise(device, args.tiny, table.memory_bandwidth)
    report["attention"] = measure_attention(device, args.tiny, table.peak_flops["bfloat16"])
    report["matmul"] = measure_matmuls(device, args.tiny, dict(table.peak_flops))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    if args.write_table:
        write_table(report, table.name, args.write_table)
    return report


def write_table(report: dict[str, Any], base: str, name: str | None) -> None:
    if not name:
        raise SystemExit("--from-json needs --write-table NAME")
    table = calibrated_table(load_hardware(base), report, name, time.strftime("%Y-%m-%d"))
    path = TABLES_DIR / f"{name}.json"
    path.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {path}")


def render(report: dict[str, Any]) -> str:
    lines = [f"launch: {1e6 * report['launch_s']:.1f} us per tiny op", "", "| dtype | m x k x n | TFLOP/s | of peak |"]
    lines.append("|---|---|---|---|")
    for r in report["matmul"]:
        lines.append(f"| {r['dtype']} | {r['m']} x {r['k']} x {r['n']} | {r['tflops']:.1f} | {100 * r['of_peak']:.0f} % |")
    lines += ["", "| op | elements | GB/s | of bandwidth |", "|---|---|---|---|"]
    for r in report["elementwise"]:
        lines.append(f"| {r['op']} | {r['elements']} | {r['bytes_per_s'] / 1e9:.0f} | {100 * r['of_bandwidth']:.0f} % |")
    lines += ["", "| attention b x h x L x d | forward of peak | backward of peak |", "|---|---|---|"]
    for r in report["attention"]:
        lines.append(
            f"| {r['batch']} x {r['heads']} x {r['length']} x {r['head_dim']} | {100 * r['forward_of_peak']:.0f} % | "
            f"{100 * r['backward_of_peak']:.0f} % |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
