"""Sweep over diffusers models (`examples/diffusers_zoo.py`, toy size), trained as diffusers'
training scripts train them: the noise-prediction MSE (the VAE's reconstruction MSE + KL)
computed outside the model. The question it answers: does autopar train the diffusion models
people train equal to serial, and what stops the ones it does not.

Two checks per model, each in forked children with a hard time budget:

- **lockstep**: every rank's program of a 2x2x2 mesh in one process against serial
  (`tests/pass_fixtures.assert_call_matches_serial`), with the loss inside a thin module
  (`diffusers_zoo.LossInside`), since that harness compares a model whose first output is the loss,
  in a child of `zoo_sweep.run_forked`; float32 first, float64 where float32 differs (serial float32 and float64 agree to ~1e-6 here);
- **gloo**: 2 real gloo ranks (`tests/multirank.run_ranks`), `autopar.parallelize` on the bare diffusers model, the loss computed
  outside it on its output, two SGD-with-momentum steps beside serial: the largest relative
  difference of the loss, every gradient and every parameter.

A result is pass, or fail with the exception's type and first line; anything but an
`AutoparError` (and autopar's own `InternalError`) is flagged INTERNAL.

    python benchmarks/diffusers_sweep.py [--only UNet2DModel,AutoencoderKL] [--budget 600]

Writes benchmarks/results/diffusers_sweep.json and diffusers_sweep.md beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT), str(ROOT / "tests")]

from _common import environment, table  # noqa: E402
from multirank import run_ranks  # noqa: E402
from pass_fixtures import assert_call_matches_serial  # noqa: E402
from zoo_sweep import _cell, check_float32_then_float64, reason_of, run_forked  # noqa: E402

import autopar  # noqa: E402
from examples import diffusers_zoo  # noqa: E402

MESH = (2, 2, 2)
GLOO_RANKS = 2
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "diffusers_sweep.json"
# a relative difference (to the tensor's largest entry) above this is a mismatch
GLOO_RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}


def _quiet() -> None:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    warnings.filterwarnings("ignore")


def _lockstep(name: str, conn: Connection) -> None:
    """In the child: the 2x2x2 lockstep check, float32 then float64 on a mismatch."""
    _quiet()
    case = diffusers_zoo.case(name)
    conn.send({"phase": "build"})
    model, batch = case.build(torch.float32)
    row: dict[str, Any] = {"phase": "check", "params": sum(p.numel() for p in model.parameters())}
    conn.send(row)

    def in_float64() -> Any:
        model64, batch64 = case.build(torch.float64)
        return assert_call_matches_serial(
            diffusers_zoo.LossInside(model64, case), MESH, batch64, atol=1e-9, rtol=1e-9
        )

    check_float32_then_float64(
        row, lambda: assert_call_matches_serial(diffusers_zoo.LossInside(model, case), MESH, batch), in_float64
    )
    conn.send(row)


def _rel(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """The largest difference relative to `want`'s largest entry, or to `floor` where that is
    smaller: a gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
    shift) is rounding noise in both runs, not a scale to measure against."""
    scale = max(float(want.abs().max()) if want.numel() else 0.0, floor)
    return float((got.detach() - want.detach()).abs().max()) / (scale or 1.0)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _gloo_body(rank: int, world_size: int, name: str, dtype: torch.dtype) -> dict[str, Any]:
    """On each gloo rank: the bare model parallelized, the loss outside, 2 SGD-momentum steps
    beside serial; the worst relative differences."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    case = diffusers_zoo.case(name)
    model, batch = case.build(dtype)
    serial = copy.deepcopy(model)
    args, kwargs = case.inputs(batch)
    mesh = init_device_mesh("cpu", (world_size,))
    pmodel = autopar.parallelize(model, mesh, example_inputs=args, example_kwargs=kwargs)
    popt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    pparams = dict(pmodel.named_parameters())
    sparams = dict(serial.named_parameters())
    missing = sorted(set(sparams) ^ set(pparams))
    for step in range(2):
        losses = []
        for module, opt in ((pmodel, popt), (serial, sopt)):
            opt.zero_grad()
            torch.manual_seed(step)  # the same draws (DiT's class-label dropout) in both
            loss = case.loss(module(*args, **kwargs), batch)
            loss.backward()
            losses.append(_full(loss))
        worst["loss"] = max(worst["loss"], _rel(losses[0], losses[1]))
        floor = 1e-3 * max(float(q.grad.abs().max()) for q in sparams.values() if q.grad is not None)
        for n, q in sparams.items():
            p = pparams.get(n)
            if p is None or q.grad is None:
                continue
            if p.grad is None:
                missing.append(f"{n} (no gradient)")
                continue
            worst["grad"] = max(worst["grad"], _rel(_full(p.grad), q.grad, floor))
        popt.step()
        sopt.step()
    for n, q in sparams.items():
        if n in pparams:
            worst["param"] = max(worst["param"], _rel(_full(pparams[n]), q))
    return {"worst": worst, "missing": missing[:5], "loss_type": type(losses[0]).__name__}


def _gloo(name: str, budget_s: float) -> dict[str, Any]:
    """The 2-rank gloo check, float32 then float64 where float32 is off. Run from the sweep's own
    process: `run_ranks` forks the ranks and kills them on its timeout (a daemonic child of
    `run_forked` may not fork)."""
    start = time.perf_counter()
    row: dict[str, Any] = {}
    try:
        for dtype in (torch.float32, torch.float64):
            result = run_ranks(GLOO_RANKS, _gloo_body, name, dtype, timeout=budget_s)[0]
            worst, missing = result["worst"], result["missing"]
            ok = max(worst.values()) <= GLOO_RTOL[dtype] and not missing
            row.update(worst={k: f"{v:.1e}" for k, v in worst.items()}, dtype=str(dtype).removeprefix("torch."))
            if ok:
                break
    except Exception as exc:
        row.update(result="fail", reason=reason_of(exc), traceback=traceback.format_exc(limit=-4))
    else:
        diffs = ", ".join(f"{k} {v}" for k, v in row["worst"].items())
        if ok:
            row.update(result="pass", reason=f"{row['dtype']}: worst relative {diffs}")
        else:
            what = f"; parameters missing or without gradient: {missing}" if missing else ""
            row.update(result="fail", reason=f"INTERNAL does not match serial: float64 worst relative {diffs}{what}")
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def markdown(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["results"]:
        lock, gloo = r["lockstep"], r["gloo"]
        rows.append(
            [
                r["model"],
                lock.get("params", ""),
                lock.get("ops", ""),
                f"{lock['result']} ({lock['seconds']} s)",
                _cell(lock["reason"]),
                f"{gloo['result']} ({gloo['seconds']} s)",
                _cell(gloo["reason"]),
            ]
        )
    env = payload["environment"]
    return "\n".join(
        [
            "# diffusers models: lockstep on 2x2x2 and 2 gloo ranks against serial",
            "",
            f"Generated by `benchmarks/diffusers_sweep.py`; models from `examples/diffusers_zoo.py` (batch "
            f"{diffusers_zoo.BATCH}, {diffusers_zoo.IMAGE}x{diffusers_zoo.IMAGE} samples), torch {env['torch']}, "
            f"diffusers {payload['settings']['diffusers']}, {env['cpus']} shared CPU cores. Lockstep: the loss "
            "inside a thin module, every rank of a 2x2x2 mesh; gloo: the loss outside the bare model, "
            "2 SGD-with-momentum steps on 2 ranks, largest difference relative to each tensor's largest entry.",
            "",
            table(["model", "params", "ops", "lockstep 2x2x2", "lockstep reason", "gloo (2,)", "gloo detail"], rows),
        ]
    ) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path; the .md goes beside it")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per check")
    parser.add_argument("--skip-gloo", action="store_true", help="the lockstep check only")
    parser.add_argument("--resume", action="store_true", help="keep --out's rows for the models not run")
    args = parser.parse_args(argv)
    import diffusers

    names = [c.name for c in diffusers_zoo.CASES]
    if args.only:
        names = [n for n in names if n in set(args.only.split(","))]
    kept = []
    if args.resume and args.out.exists():
        kept = [r for r in json.loads(args.out.read_text())["results"] if r["model"] not in names]
    payload: dict[str, Any] = {
        "benchmark": "diffusers_sweep",
        "environment": environment(),
        "settings": {"mesh": list(MESH), "gloo_ranks": GLOO_RANKS, "diffusers": diffusers.__version__},
        "results": kept,
    }
    skipped = {"result": "not run", "reason": "--skip-gloo", "seconds": 0}
    for name in names:
        start = time.perf_counter()
        lock = run_forked(_lockstep, (name,), args.budget)
        print(f"{name} lockstep: {lock['result']} {lock['seconds']} s {lock['reason']}", flush=True)
        gloo = skipped if args.skip_gloo else _gloo(name, args.budget)
        print(f"{name} gloo: {gloo['result']} {gloo['seconds']} s {gloo['reason']}", flush=True)
        payload["results"].append(
            {"model": name, "lockstep": lock, "gloo": gloo, "seconds": round(time.perf_counter() - start, 1)}
        )
        order = {c.name: i for i, c in enumerate(diffusers_zoo.CASES)}
        payload["results"].sort(key=lambda r: order.get(r["model"], 99))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        args.out.with_suffix(".md").write_text(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
