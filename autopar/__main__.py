"""Command line: `python -m autopar <command>` (or `autopar <command>`).

Each command is a subparser registered in `_COMMANDS`; add one with a `register(subparsers)`-style
function that sets `func` on its parser.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from autopar.compiler.coverage import run as run_coverage
from autopar.core.errors import AutoparError
from autopar.cost.calibrate import calibrate


def _run_calibrate(args: argparse.Namespace) -> int:
    groups = tuple(int(g) for g in args.groups.split(",")) if args.groups else ()
    calibrate(
        ranks=args.ranks,
        out=args.out,
        quick=args.quick,
        threads=args.threads,
        groups=groups,
        busy_s=args.busy_ms / 1e3,
    )
    return 0


def _add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine (matmul rate, memory bandwidth, gloo collectives) into the cpu-gloo table",
        description="Measure this machine and write the cpu-gloo hardware table used by the cost model.",
    )
    p.add_argument("--ranks", type=int, default=4, help="local gloo ranks to time collectives on (default 4)")
    p.add_argument(
        "--out", default=None, help="where to write the table (default: the checked-in cpu-gloo.json)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per device for the compute numbers"
    )
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (seconds; for tests)")
    p.add_argument(
        "--groups",
        help="time collectives as a job meets them: every rank busy, on subgroups of these sizes "
        "(comma-separated, e.g. 2,4,8 with --ranks 8)",
    )
    p.add_argument(
        "--busy-ms", type=float, default=2.0, help="with --groups: compute before each call (default 2 ms)"
    )
    p.set_defaults(func=_run_calibrate)


def _run_coverage(args: argparse.Namespace) -> int:
    return run_coverage(args.factory, args.mesh, args.registry)


def _add_coverage(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "coverage",
        help="list every op of a model's joint graph with the rule family that covers it, or 'missing'",
        description="Trace the model that MODULE:FACTORY builds (FACTORY() or FACTORY(seed) returns "
        "(model, batch)) and list each op of its forward+backward graph with its count and rule "
        "family. Exits 1 if any op has no sharding rule.",
    )
    p.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. examples.zoo:make_llama")
    p.add_argument("--mesh", default="2,2,2", help="mesh shape to trace for, e.g. 2,2,2 or 8 (default 2,2,2)")
    p.add_argument(
        "--registry",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a function returning your RuleRegistry (with rules for custom ops), "
        "e.g. examples.custom_op:custom_registry (default: the built-in rules)",
    )
    p.set_defaults(func=_run_coverage)


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_calibrate, _add_coverage]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__.splitlines()[0] if __doc__ else None)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; an `AutoparError` is printed (no traceback) and exits with 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except AutoparError as exc:
        print(f"autopar {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
