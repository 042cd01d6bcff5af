"""Sweep over the transformers model zoo: every rank's program of a 2x2x2 mesh, run in lockstep in
one process, against the serial model, for each architecture `examples/hf_zoo.py` builds at toy
size. The question it answers: of the models people fine-tune, how many does autopar compile
correctly as the library ships them, and what stops the rest.

A model is *in the sweep* when it builds from its toy config and returns a loss for its labels
serially (the first size variant of `hf_zoo.VARIANTS` that does); the rest are listed as skipped
and not counted. Each model in the sweep runs `tests/pass_fixtures.assert_call_matches_serial`:
pass, or fail with the exception's type and first line. An exception that is not an
`AutoparError`, and autopar's own `InternalError`, are flagged INTERNAL (a bug in autopar, not a
missing feature); a result that differs from serial reads "INTERNAL AssertionError ... does not
match serial".

Each model runs in a forked child of a process that has already imported torch, transformers and
autopar (forked before any torch op runs, so no thread pool is inherited): one model's leftovers
(fake modes, memory) cannot leak into the next, and the time budget is a hard one (the child is
killed).

    python benchmarks/zoo_sweep.py                         # the whole zoo (hours on 2 cores)
    python benchmarks/zoo_sweep.py --max-minutes 45        # as many as fit, tasks interleaved
    python benchmarks/zoo_sweep.py --only BertForMaskedLM,LlamaForCausalLM
    python benchmarks/zoo_sweep.py --resume                # go on where a previous run stopped
    python benchmarks/zoo_sweep.py --only T5ForSequenceClassification --budget-clock cpu \
        --out /tmp/rerun.json --update benchmarks/results/zoo_sweep.json  # re-run rows alone
    python benchmarks/zoo_sweep.py --only BitForImageClassification --max-rss-gib 3   # stop a child past 3 GiB

`--budget-clock cpu` counts the budget in the child's CPU seconds (all its threads), not wall
seconds: on a machine other jobs load, a model's wall time grows with their load and a wall budget
would time out models that fit it on an idle machine. Every row records both (`seconds`, `cpu_s`).
`--update MAIN.json` puts the rows just run into MAIN (replacing that architecture's row, marked
as re-run alone, with the date and the budget's clock) and rewrites MAIN's tables.

Writes benchmarks/results/zoo_sweep.json (after every model) and zoo_sweep.md beside it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT), str(ROOT / "tests")]

from _common import LAZY_IMPORTS, environment, table  # noqa: E402
from pass_fixtures import assert_compiled_matches_serial, compile_every_rank  # noqa: E402

from autopar.core.errors import AutoparError, InternalError  # noqa: E402
from autopar.core.meta import has_info, info  # noqa: E402
from examples import hf_zoo  # noqa: E402

MESH = (2, 2, 2)
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "zoo_sweep.json"
DEFAULT_BUDGET_S = 120.0
WALL_CAP = 10.0  # --budget-clock cpu: a child is still killed after this many budgets of wall time
VERBOSE = False  # --verbose: the children's stderr (library warnings, torch.export's graph dumps)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def reason_of(exc: BaseException) -> str:
    """Exception type and the first line of its message; INTERNAL where autopar is at fault."""
    first = first_line(exc)
    name = type(exc).__name__
    if isinstance(exc, InternalError):
        return f"INTERNAL {name}: {first}"
    if isinstance(exc, AutoparError):
        return f"{name}: {first}"
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, AssertionError) and any("torch/testing" in f.filename for f in frames):
        return f"INTERNAL {name}: {first} does not match serial"
    return f"INTERNAL {name}: {first}"


def _joint_ops(compiled: dict[tuple[int, ...], Any]) -> int:
    """Ops of rank (0, 0, 0)'s joint forward+backward graph, the inserted communication left out."""
    graph = compiled[(0,) * len(MESH)].graph.graph
    return sum(
        1 for n in graph.nodes if n.op == "call_function" and not (has_info(n) and info(n).role == "comm")
    )


def _run_one(arch: hf_zoo.Arch, conn: Connection) -> None:
    """In the child: build, check serially, then the lockstep check; each stage's result is sent
    as soon as known, so that the parent knows how far a killed child got."""
    if not VERBOSE:  # torch.export prints whole graphs on a data-dependent guard; the JSON has the traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    row: dict[str, Any] = {"phase": "build"}
    conn.send(row)
    try:
        model, kwargs, variant = hf_zoo.build_working(arch)
    except Exception as exc:
        conn.send({**row, "result": "skipped", "reason": f"{type(exc).__name__}: {first_line(exc)}"})
        return
    row.update(
        phase="check",
        params=sum(p.numel() for p in model.parameters()),
        # a per-stage size (a function of the stage's index) as the list the config holds
        variant={
            k: getattr(model.config, k, None) if callable(v) else v for k, v in hf_zoo.VARIANTS[variant].items()
        },
        inputs={k: list(v.shape) for k, v in kwargs.items()},
    )
    conn.send(row)
    start = time.perf_counter()

    def in_float32() -> dict[tuple[int, ...], Any]:
        row["phase"] = "compile"
        conn.send(row)
        began = time.process_time()
        compiled = compile_every_rank(model, MESH, (), kwargs)
        # so that a row stopped in the check says how long the compile took
        row.update(phase="lockstep", compile_cpu_s=round(time.process_time() - began, 1))
        conn.send(row)
        assert_compiled_matches_serial(compiled, model, MESH, (), kwargs, explain=False)
        return compiled

    def in_float64() -> dict[tuple[int, ...], Any]:
        inputs = _as_float64(kwargs)
        compiled = compile_every_rank(model.double(), MESH, (), inputs)
        assert_compiled_matches_serial(compiled, model, MESH, (), inputs, atol=1e-9, rtol=1e-9)
        return compiled

    check_float32_then_float64(row, in_float32, in_float64)
    row.pop("phase", None)
    row["check_s"] = round(time.perf_counter() - start, 1)
    row["cpu_s"] = round(time.process_time(), 1)  # build included, as a killed child's count has it
    row["peak_rss_gib"] = peak_rss_gib()
    conn.send(row)


def peak_rss_gib() -> float | None:
    """This process's peak resident memory so far (Linux's VmHWM), GiB; None off Linux."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return round(int(found.group(1)) / 2**20, 2) if found else None


def check_float32_then_float64(
    row: dict[str, Any], in_float32: Callable[[], Any], in_float64: Callable[[], Any]
) -> None:
    """Record in `row` whether the float32 check passes and, where it is off by a number, whether
    the float64 one does: in float64 rounding vanishes (1e-16 per op), so a float32 mismatch from
    summing in another order passes there while a lowering bug stays a mismatch. The float64 run
    starts after the float32 one's exception is gone: its traceback held that run's frames (every
    rank's programs and values), a whole check's memory more."""
    try:
        compiled = in_float32()
    except AssertionError as exc:
        row.update(result="fail", reason=reason_of(exc), traceback=traceback.format_exc(limit=-4))
        reason, first = reason_of(exc), first_line(exc)
    except Exception as exc:
        row.update(result="fail", reason=reason_of(exc), traceback=traceback.format_exc(limit=-4))
        return
    else:
        row.update(result="pass", reason="", ops=_joint_ops(compiled))
        return
    try:
        compiled = in_float64()
    except Exception as again:
        row.update(reason=f"{reason}; in float64: {reason_of(again)}")
    else:
        row.update(result="pass", reason=f"in float64 (float32: {first})", ops=_joint_ops(compiled))


def _as_float64(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}


def run_forked(
    target: Callable[..., None],
    args: tuple[Any, ...],
    budget_s: float,
    clock: str = "wall",
    max_rss_gib: float | None = None,
) -> dict[str, Any]:
    """`target(*args, conn)` in a forked child, killed after `budget_s` seconds: the last row it
    sent, with `result` and `reason` filled in where the child died or ran out of time, and
    `seconds` (wall) and `cpu_s` (the child's CPU time, all threads). The child sends
    `{"phase": ...}` rows as it goes and a row with `result` at the end (shared by the diffusers
    sweep). `clock`: "wall", or "cpu" for a budget of the child's CPU seconds (capped at
    `WALL_CAP` budgets of wall time). `max_rss_gib`: the child is also killed once its resident
    memory passes this many GiB (read every second; a fail, its reason says where it was), so
    that one model cannot take a shared machine's memory; the row's `max_rss_gib` is the most
    seen by that polling, `peak_rss_gib` the child's own peak where it finished."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    start = time.perf_counter()
    proc.start()
    child.close()
    row: dict[str, Any] = {}
    deadline = start + (budget_s * WALL_CAP if clock == "cpu" else budget_s)
    cpu = 0.0
    over = False
    rss = 0.0
    over_memory = False
    while "result" not in row and (left := deadline - time.perf_counter()) > 0:
        cpu = _cpu_seconds(proc.pid) or cpu
        rss = max(rss, _rss_gib(proc.pid) or 0.0)
        if clock == "cpu" and cpu >= budget_s:
            over = True
            break
        if max_rss_gib is not None and rss > max_rss_gib:
            over_memory = True
            break
        if parent.poll(min(left, 1.0)):
            try:
                row = parent.recv()
            except EOFError:  # the child is gone without its result
                break
    over = over or time.perf_counter() >= deadline
    if proc.is_alive():
        cpu = _cpu_seconds(proc.pid) or cpu
        proc.kill()
    proc.join()
    parent.close()
    seconds = time.perf_counter() - start
    cpu = row.get("cpu_s", cpu)
    if "result" not in row:
        phase = row.get("phase", "build")
        unit = "CPU s" if clock == "cpu" else "s"
        what = f"over the {budget_s:.0f} {unit} budget" if over else f"child died (exit code {proc.exitcode})"
        if over and clock == "cpu" and cpu < budget_s:  # the wall cap, not the CPU budget, ended it
            what = f"over the wall cap ({budget_s * WALL_CAP:.0f} s) at {cpu:.0f} of {budget_s:.0f} CPU s"
        if over_memory:
            row.update(
                result="fail",
                reason=f"OVER MEMORY: {rss:.2f} GiB resident, over the {max_rss_gib:g} GiB cap, at {cpu:.0f} CPU s ({where(row)})",
            )
        elif phase == "build":
            row.update(result="skipped", reason=f"TIMEOUT building or calling serially: {what}")
        elif over:
            row.update(result="timeout", reason=f"TIMEOUT: {what} ({where(row)})")
        else:
            row.update(result="fail", reason=f"INTERNAL crash: {what}")
    row.pop("phase", None)
    return {**row, "seconds": round(seconds, 1), "cpu_s": round(cpu, 1), "max_rss_gib": round(rss, 2)}


def where(row: dict[str, Any]) -> str:
    """Where a stopped child was, from the last phase it sent: in the compile of every rank's
    program (trace, plan search, lowering), or in the lockstep check with the compile's CPU
    seconds (a child that sends no finer phase: "compile + lockstep check")."""
    phase = row.get("phase")
    if phase == "compile":
        return "in the compile: trace, plan search, every rank's lowering"
    if phase == "lockstep":
        return f"in the lockstep check, after a compile of {row.get('compile_cpu_s', 0):.0f} CPU s"
    return "compile + lockstep check"


def _rss_gib(pid: int | None) -> float | None:
    """Resident memory of process `pid` now, GiB (Linux /proc); None where it cannot be read."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` so far, all its threads (Linux /proc); None
    where it cannot be read (gone, or not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_arch(
    arch: hf_zoo.Arch, budget_s: float, clock: str = "wall", max_rss_gib: float | None = None
) -> dict[str, Any]:
    """One architecture in a forked child, killed after `budget_s` seconds of `clock` (or past
    `max_rss_gib` of resident memory)."""
    row = run_forked(_run_one, (arch,), budget_s, clock, max_rss_gib)
    return {"task": arch.task, "model_type": arch.model_type, "architecture": arch.model_class, **row}


def interleaved(archs: list[hf_zoo.Arch]) -> list[hf_zoo.Arch]:
    """Round-robin over the tasks, so that a sweep cut short still covers every family."""
    by_task: dict[str, list[hf_zoo.Arch]] = defaultdict(list)
    for arch in archs:
        by_task[arch.task].append(arch)
    queues = list(by_task.values())
    out: list[hf_zoo.Arch] = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


def summary(results: list[dict[str, Any]]) -> dict[str, int]:
    counts = defaultdict(int)
    for row in results:
        counts[row["result"]] += 1
    swept = len(results) - counts["skipped"]
    return {
        "passed": counts["pass"],
        "in_sweep": swept,
        "skipped": counts["skipped"],
        "failed": counts["fail"],
        "timeout": counts["timeout"],
    }


def summary_line(results: list[dict[str, Any]]) -> str:
    s = summary(results)
    line = f"{s['passed']} passed of {s['in_sweep']} in the sweep ({s['skipped']} skipped)"
    return line + (f"; {s['timeout']} over the time budget" if s["timeout"] else "")


def group_of(reason: str) -> str:
    """A reason with its particulars (parameter lists, shapes, numbers) elided, so that the same
    failure in different models groups together."""
    reason = re.sub(r"\[[^\]]*\]", "[...]", reason)
    reason = re.sub(r"(graph of|could not trace) \w+", r"\1 <model>", reason)
    reason = reason.split(" (unhinted")[0]
    return re.sub(r"\b\d+\b", "N", reason)


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def markdown(payload: dict[str, Any]) -> str:
    """The results as a page: the summary, counts per task, failures grouped by reason, every row,
    the skipped."""
    results = payload["results"]
    settings = payload["settings"]
    swept = [r for r in results if r["result"] != "skipped"]
    lines = [
        "# transformers zoo on a 2x2x2 mesh: every rank in lockstep against serial",
        "",
        f"**{summary_line(results)}.**",
        "",
        f"Generated by `benchmarks/zoo_sweep.py`; models from `examples/hf_zoo.py` (batch {hf_zoo.BATCH}, "
        f"sequence {hf_zoo.SEQ}, width 32, 2 layers, vocabulary {hf_zoo.VOCAB}, image {hf_zoo.IMAGE}, "
        f"library defaults otherwise), torch {payload['environment']['torch']}, transformers "
        f"{settings['transformers']}, budget {settings['budget_s']:.0f} s per model, sweep wall time "
        f"{settings.get('wall_minutes', 0):.1f} min on {payload['environment']['cpus']} shared CPU cores.",
    ]
    reruns = [r for r in results if r.get("rerun")]
    if reruns:
        lines += [
            "",
            f"{len(reruns)} rows were re-run alone after the sweep, on later code (each row's own "
            "run, its wall and CPU seconds, in the section \"Re-run alone\" below); the counts "
            "above include them.",
        ]
    if settings.get("not_run"):
        lines += ["", f"Not run (the sweep's time ran out): {settings['not_run']} architectures."]
    per_task = []
    for task in hf_zoo.TASKS:
        rows = [r for r in results if r["task"] == task]
        count = {k: sum(r["result"] == k for r in rows) for k in ("pass", "fail", "timeout", "skipped")}
        per_task.append(
            [
                task,
                len(rows) - count["skipped"],
                count["pass"],
                count["fail"],
                count["timeout"],
                count["skipped"],
            ]
        )
    lines += ["", table(["task", "in sweep", "pass", "fail", "timeout", "skipped"], per_task)]
    groups: dict[str, list[str]] = defaultdict(list)
    for row in swept:
        if row["result"] != "pass":
            groups[group_of(row["reason"])].append(row["architecture"])
    if groups:
        lines += ["", "## Failures by reason", ""]
        for reason, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"- **{_cell(reason, 300)}** ({len(names)}): {', '.join(sorted(names))}")
    rows = [
        [
            r["task"],
            r["architecture"],
            r.get("params", ""),
            r.get("ops", ""),
            r["result"],
            r["seconds"],
            _cell(r["reason"]),
        ]
        for r in swept
    ]
    lines += [
        "",
        "## In the sweep",
        "",
        table(["task", "architecture", "params", "ops", "result", "s", "reason"], rows),
    ]
    if reruns:
        lines += ["", "## Re-run alone", ""]
        lines.append(
            table(
                ["architecture", "result", "wall s", "CPU s", "when", "reason"],
                [[r["architecture"], r["result"], r["seconds"], r.get("cpu_s", ""), r["rerun"], _cell(r["reason"], 120)] for r in reruns],
            )
        )
    skipped = [r for r in results if r["result"] == "skipped"]
    if skipped:
        lines += ["", "## Skipped (do not build or return no loss at toy size; not counted)", ""]
        lines += [f"- {r['architecture']} ({r['task']}): {_cell(r['reason'], 300)}" for r in skipped]
    return "\n".join(lines) + "\n"


def write(out: Path, payload: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    payload["summary"] = summary(payload["results"])
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(payload))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--limit", type=int, default=None, help="the first N architectures (tasks interleaved)"
    )
    parser.add_argument("--only", default="", help="comma-separated class names or model types")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path; the .md goes beside it")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds per model")
    parser.add_argument(
        "--budget-clock", choices=("wall", "cpu"), default="wall", help="what --budget counts: wall or child CPU s"
    )
    parser.add_argument(
        "--max-rss-gib", type=float, default=None, help="kill a model's child past this resident memory"
    )
    parser.add_argument("--max-minutes", type=float, default=None, help="start no model after this long")
    parser.add_argument("--resume", action="store_true", help="keep --out's rows, run the rest")
    parser.add_argument(
        "--retry", default="", help="with --resume: run again the kept rows of these results (fail,timeout)"
    )
    parser.add_argument("--update", type=Path, default=None, help="merge the rows run into this sweep JSON")
    parser.add_argument("--tables-only", action="store_true", help="rewrite the .md from --out's JSON")
    parser.add_argument("--verbose", action="store_true", help="keep the children's stderr")
    args = parser.parse_args(argv)
    global VERBOSE
    VERBOSE = args.verbose
    if args.tables_only:
        payload = json.loads(args.out.read_text())
        write(args.out, payload)
        print(summary_line(payload["results"]))
        return 0

    for name in LAZY_IMPORTS:  # imported once here, not in every child
        importlib.import_module(name)
    import transformers

    archs = interleaved(hf_zoo.architectures())
    if args.only:
        wanted = set(args.only.split(","))
        archs = [a for a in archs if a.model_class in wanted or a.model_type in wanted]
        missing = wanted - {a.model_class for a in archs} - {a.model_type for a in archs}
        if missing:
            parser.error(f"not in the zoo: {', '.join(sorted(missing))}")
    if args.limit is not None:
        archs = archs[: args.limit]
    results: list[dict[str, Any]] = []
    prior_minutes = 0.0
    if args.resume and args.out.exists():
        previous = json.loads(args.out.read_text())
        results, prior_minutes = previous["results"], previous["settings"].get("wall_minutes", 0.0)
    retried = set(filter(None, args.retry.split(",")))
    results = [r for r in results if r["result"] not in retried]
    done = {r["architecture"] for r in results}
    payload: dict[str, Any] = {
        "benchmark": "zoo_sweep",
        "environment": environment(),
        "settings": {
            "mesh": list(MESH),
            "transformers": transformers.__version__,
            "budget_s": args.budget,
            "budget_clock": args.budget_clock,
            "batch": hf_zoo.BATCH,
            "seq": hf_zoo.SEQ,
            "architectures": len(archs),
        },
        "results": results,
    }
    start = time.perf_counter()
    todo = [a for a in archs if a.model_class not in done]
    for i, arch in enumerate(todo):
        elapsed = (time.perf_counter() - start) / 60
        if args.max_minutes is not None and elapsed > args.max_minutes:
            payload["settings"]["not_run"] = len(todo) - i
            print(f"stopping after {elapsed:.1f} min: {len(todo) - i} not run", flush=True)
            break
        row = run_arch(arch, args.budget, args.budget_clock, args.max_rss_gib)
        results.append(row)
        print(
            f"[{len(results)}/{len(archs)}] {row['architecture']}: {row['result']} {row['seconds']} s {row['reason']}",
            flush=True,
        )
        payload["settings"]["wall_minutes"] = prior_minutes + (time.perf_counter() - start) / 60
        write(args.out, payload)
    payload["settings"]["wall_minutes"] = prior_minutes + (time.perf_counter() - start) / 60
    write(args.out, payload)
    print(summary_line(results), flush=True)
    if args.update is not None:
        stamp = f"re-run alone {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.budget:.0f} {args.budget_clock} s budget"
        update(args.update, [r for r in results if r["architecture"] in {a.model_class for a in archs}], stamp)
        print(f"{args.update}: {summary_line(json.loads(args.update.read_text())['results'])}", flush=True)
    return 0


def update(main_json: Path, rows: list[dict[str, Any]], stamp: str) -> None:
    """Replace `main_json`'s rows of the architectures in `rows` by those, each marked `rerun`
    (`stamp`: when, alone, which budget), and rewrite its tables."""
    payload = json.loads(main_json.read_text())
    fresh = {r["architecture"]: {**r, "rerun": stamp} for r in rows}
    payload["results"] = [fresh.pop(r["architecture"], r) for r in payload["results"]] + list(fresh.values())
    write(main_json, payload)


if __name__ == "__main__":
    sys.exit(main())
