"""Run a function on N real gloo ranks, as forked processes, and collect what each returns.

Forking from a parent that has already imported torch starts 8 ranks in under a second, where
`mp.spawn`/`torchrun` pay ~15 s to import torch in every rank. The heavy modules are imported below,
in the parent, so that the forks inherit them (the first functional collective would otherwise
import torch._dynamo, ~1 s in every rank), and before its first fork the parent compiles a small
GPT once (`_warm_parent`), so that every rank inherits what a process's first trace and compile
set up once instead of repeating it.

The harness must never hang pytest: a rank that fails gets the others killed after a short grace
period (they are usually stuck in a collective waiting for it), and on timeout every rank is
killed, after its Python stacks were dumped so that the error says where each one was stuck.

Usage (in a test; ``fn`` must be a module-level or otherwise fork-visible callable)::

    def body(rank: int, world_size: int, x: float) -> float:
        t = torch.tensor([x]); dist.all_reduce(t); return t.item()

    assert run_ranks(8, body, 1.0) == [8.0] * 8
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401
import torch._inductor.config
import torch.distributed as dist
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.tensor  # noqa: F401
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.api import compile_for_rank
from autopar.core.mesh import Mesh
from autopar.testing.pipeline_lockstep import LockstepTransport, parallelize_in_lockstep, run_round_robin
from examples.models import make_gpt

# Once one rank has failed, how long the others get to finish before they are killed.
FAILURE_GRACE_S = 1.0

# Set by tests/conftest.py before each test: whether it is marked `multirank`, so in the group of
# tests that fork ranks one set at a time. None outside pytest (a script may fork ranks freely).
CURRENT_TEST_MARKED: bool | None = None


def _require_marker() -> None:
    """Refuse to fork ranks from a test that is not marked `multirank`: on the suite's two workers
    it would run beside another test's rank set, and no rendezvous should wait on a starved rank."""
    if CURRENT_TEST_MARKED is False:
        raise AssertionError(
            "this test forks gloo ranks but is not marked @pytest.mark.multirank: mark it, so that "
            "pytest-xdist runs it in the group of rank-forking tests (tests/conftest.py)"
        )


def _child(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
    tmp: str,
    timeout: float,
) -> None:
    with open(os.path.join(tmp, f"stacks.{rank}"), "w") as stacks:
        # The parent sends SIGUSR1 before killing a hung rank: this writes where it hung.
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
        torch.set_num_threads(1)  # N ranks share few cores; more threads only contend
        # and for the same reason Inductor (compile=True) compiles in the rank itself: a pool of
        # compile workers per rank would start fresh Pythons that each import torch again
        torch._inductor.config.compile_threads = 1
        try:
            store = dist.FileStore(os.path.join(tmp, "store"), world_size)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
            # Plain pickle, not the Connection's ForkingPickler: torch registers shared-memory
            # reductions there, which break once this process has exited.
            payload = pickle.dumps(("ok", fn(rank, world_size, *args)))
            ok = True
        except BaseException:
            payload = pickle.dumps(("raised", traceback.format_exc()))
            ok = False
        conn.send_bytes(payload)
        conn.close()
        if dist.is_initialized():
            # Gloo connects ranks without a barrier: a rank that returned early and closed its
            # connections would make a slower rank's connection set-up fail. A failed rank skips
            # this, so that peers stuck waiting for it see the closed connection and raise. The
            # result is sent already, so a barrier broken by a failed peer changes nothing.
            if ok:
                with contextlib.suppress(Exception):
                    dist.barrier()
            dist.destroy_process_group()


@functools.cache
def _warm_parent() -> None:
    """Compile a one-layer GPT for one rank of a (2, 2) planning mesh, once, in the parent.

    A process's first trace and compile pays for lazy imports, dispatch and decomposition tables
    and autopar's caches of pure functions (~0.8 s CPU of a 7 s GPT compile, measured); done here,
    before the first fork, every rank of every job inherits it instead of paying it again, on the
    few cores all ranks share. Nothing a rank checks is skipped: each still traces, plans and
    compiles its own model in full. The generator state and the warning filters are restored, so
    that no rank sees what this compile drew or warned (a cold process is README command 1's, run
    as a subprocess by tests/test_examples.py)."""
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, batch = make_gpt(0, n_layer=1)
        compile_for_rank(model, Mesh.from_shape((2, 2)), batch, coords=(0, 0))


class _RankKilledBySignal(AssertionError):
    """A rank's process was ended by a signal (not a Python exception, assertion or timeout)."""


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on each of ``world_size`` forked gloo ranks.

    Returns the ranks' return values in rank order. Raises AssertionError naming every rank that
    raised (with its traceback), died, or was still running when ``timeout`` seconds had passed.

    A job in which a rank is killed by a signal is run once more: on this shared 2-core machine,
    under heavy load, a rank has (rarely, ~1 launch in 15 at load average 20, none in 40 quieter
    launches) aborted inside gloo with no message. A second signal death, and every exception,
    assertion or timeout, fails at once.
    """
    try:
        return _run_ranks_once(world_size, fn, *args, timeout=timeout)
    except _RankKilledBySignal as first:
        print(
            f"run_ranks: a rank was killed by a signal; running the job once more.\n{first}", file=sys.stderr
        )
        return _run_ranks_once(world_size, fn, *args, timeout=timeout)


def _run_ranks_once(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float) -> list[Any]:
    _require_marker()
    _warm_parent()
    ctx = mp.get_context("fork")
    procs: list[Any] = []
    unanswered = list(range(world_size))  # until collected, any exit kills every child at once
    with tempfile.TemporaryDirectory(prefix="autopar-ranks-") as tmp:
        try:
            readers: dict[Connection, int] = {}
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, args=(rank, world_size, fn, args, writer, tmp, timeout))
                p.start()
                writer.close()  # the child now holds the only write end: its death gives us EOF
                procs.append(p)
                readers[reader] = rank
            results = _collect(readers, procs, timeout)
            unanswered = sorted(readers.values())
            for rank in unanswered:
                os.kill(procs[rank].pid, signal.SIGUSR1)  # its faulthandler writes where it hangs
            if unanswered:
                time.sleep(0.3)
            stacks = {rank: _own_frames(Path(tmp, f"stacks.{rank}").read_text()) for rank in unanswered}
        finally:
            for rank in unanswered:
                if rank < len(procs):
                    procs[rank].kill()
            teardown_deadline = time.monotonic() + 5.0  # ranks that answered are only tearing down
            for p in procs:
                p.join(timeout=max(0.0, teardown_deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()

    failures = []
    any_failed = any(status != "ok" for status, _ in results.values())
    for rank in range(world_size):
        if rank in unanswered:
            why = "was killed after another rank failed" if any_failed else f"timed out after {timeout:g} s"
            failures.append(f"--- rank {rank} {why}; its stacks:\n{stacks[rank] or '(none written)'}")
        elif results[rank][0] != "ok":
            failures.append(f"--- rank {rank} {results[rank][0]}:\n{results[rank][1]}")
    if failures:
        message = f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(failures)
        signal_deaths = [
            r
            for r in range(world_size)
            if r not in unanswered
            and results[r][0] == "died"
            and procs[r].exitcode is not None
            and procs[r].exitcode < 0
        ]
        if signal_deaths:
            raise _RankKilledBySignal(message)
        raise AssertionError(message)
    return [results[rank][1] for rank in range(world_size)]


def _collect(readers: dict[Connection, int], procs: list[Any], timeout: float) -> dict[int, tuple[str, Any]]:
    """Read each rank's result until all are in, the timeout passes, or the grace after a failure does.

    Ranks that never answered are left in ``readers``.
    """
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while readers and (remaining := deadline - time.monotonic()) > 0:
        for conn in wait(list(readers), timeout=remaining):
            assert isinstance(conn, Connection)
            rank = readers.pop(conn)
            try:
                results[rank] = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=1.0)
                results[rank] = ("died", f"exited with code {procs[rank].exitcode} before returning")
            conn.close()
            if results[rank][0] != "ok":
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    for conn in readers:
        conn.close()
    return results


def run_scenarios(
    world_size: int, scenarios: dict[str, Callable[[int, int], Any]], timeout: float = 120.0
) -> dict[str, list[Any]]:
    """Several scenarios, `fn(rank, world_size)` each, on one forked job of `world_size` ranks:
    every rank runs them in order, so the job's start (fork, rendezvous, a process's first use of
    each kind of work) is paid once. Returns each scenario's per-rank results, by its name.

    Meant for a module-scoped fixture whose tests each assert on their own scenario's results.
    Scenarios must leave nothing behind that another one reads; one that raises fails the job
    (its peers may be waiting in a collective), and the error names it with the rank's traceback.
    """
    per_rank = run_ranks(world_size, _run_in_order, list(scenarios.items()), timeout=timeout)
    return {name: [results[i] for results in per_rank] for i, name in enumerate(scenarios)}


def _run_in_order(rank: int, world_size: int, scenarios: list[tuple[str, Callable[[int, int], Any]]]) -> list[Any]:
    results = []
    for name, fn in scenarios:
        try:
            results.append(fn(rank, world_size))
        except BaseException as error:
            raise AssertionError(f"scenario {name} failed on rank {rank}") from error
    return results


def _own_frames(dump: str) -> str:
    """A faulthandler dump without the frames below ``_child``, which the fork copied from the parent."""
    lines = dump.strip().splitlines()
    cut = next((i for i, line in enumerate(lines) if line.endswith(" in _child")), len(lines) - 1)
    return "\n".join(lines[: cut + 1])


def run_ranks_with_faults(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0
) -> list[tuple[str, Any, float]]:
    """Like `run_ranks`, for jobs in which ranks are meant to fail: no rank is killed because
    another failed. Returns each rank's (status, value or traceback, seconds from the start until
    it answered or died); status is "ok", "raised", "died", or "hung" for a rank still running at
    `timeout` (then killed)."""
    _require_marker()
    _warm_parent()
    ctx = mp.get_context("fork")
    procs: list[Any] = []
    ended: dict[int, tuple[str, Any, float]] = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autopar-faults-") as tmp:
        readers: dict[Connection, int] = {}
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, args=(rank, world_size, fn, args, writer, tmp, timeout))
                p.start()
                writer.close()
                procs.append(p)
                readers[reader] = rank
            deadline = start + timeout
            while readers and (remaining := deadline - time.monotonic()) > 0:
                for conn in wait(list(readers), timeout=remaining):
                    assert isinstance(conn, Connection)
                    rank = readers.pop(conn)
                    seconds = time.monotonic() - start
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        procs[rank].join(timeout=1.0)
                        status, value = "died", f"exit code {procs[rank].exitcode}"
                    conn.close()
                    ended[rank] = (status, value, seconds)
        finally:
            for conn, rank in readers.items():
                conn.close()
                ended[rank] = ("hung", "", time.monotonic() - start)
                procs[rank].kill()
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [ended[rank] for rank in range(world_size)]


def train_side_by_side(
    pairs: list[tuple[torch.nn.Module, tuple[Any, ...]]], steps: int = 2, lr: float = 0.1
) -> list[float]:
    """SGD with momentum (linear in the gradient, so parameters compare as gradients do) on each
    (module, batch) in turn, `steps` times; every loss, in that order."""
    optimizers = [torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9) for module, _ in pairs]
    losses = []
    for _ in range(steps):
        for (module, batch), optimizer in zip(pairs, optimizers):
            optimizer.zero_grad()
            loss = module(*batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses


def seeded_steps_beside_serial(
    pmodel: torch.nn.Module,
    serial: torch.nn.Module,
    batch: tuple[Any, ...],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    tol: dict[str, float],
    what: str = "",
    steps: int = 2,
) -> None:
    """`steps` optimizer steps of the parallel module and its serial copy side by side, the
    generator seeded alike (100 + step) before each one's call, so that random ops in both draw
    from the same state: each step's losses must be equal, and the generator must be left where
    the serial step leaves it (the parallel module draws what serial draws, no more, no less)."""
    optimizers = [make_optimizer(m.parameters()) for m in (pmodel, serial)]
    for step in range(steps):
        losses, after = [], []
        for module, optimizer in zip((pmodel, serial), optimizers):
            torch.manual_seed(100 + step)  # every rank and the serial model: the same state
            optimizer.zero_grad()
            loss = module(*batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            after.append(torch.get_rng_state())
        torch.testing.assert_close(losses[0], losses[1], **tol, msg=f"{what} step {step}")
        assert torch.equal(after[0], after[1]), f"{what} step {step}: the generator is left elsewhere than serial's"


def assert_parameters_equal_serial(
    pmodel: torch.nn.Module, serial: torch.nn.Module, tol: dict[str, float], what: str = ""
) -> None:
    """Every gradient and parameter of the parallel module (DTensors gathered whole) equals the
    serial copy's of the same name."""
    ref = dict(serial.named_parameters())
    for name, p in pmodel.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        value = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        torch.testing.assert_close(grad, ref[name].grad, **tol, msg=f"{what} grad {name}")
        torch.testing.assert_close(value, ref[name].detach(), **tol, msg=f"{what} param {name}")


def pipelined(
    model: torch.nn.Module,
    world: int,
    transport: LockstepTransport | None = None,
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    pipeline: autopar.PipelineOptions,
) -> Any:
    """`autopar.parallelize` of `model` on a ("pp",) mesh of `world` ranks: this gloo rank's, or,
    given a lockstep `transport`, that rank's in this process (`parallelize_in_lockstep`)."""
    if transport is not None:
        return parallelize_in_lockstep(model, transport, example_inputs, example_kwargs, pipeline=pipeline)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    return autopar.parallelize(
        model, mesh, example_inputs=example_inputs, example_kwargs=example_kwargs, pipeline=pipeline
    )


def run_in_lockstep(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(rank, world, *args, transport=...)` for every rank of a `world`-rank pipeline, in this
    process (`run_round_robin`): a `run_ranks` job whose pipeline `pipelined` builds."""
    return run_round_robin(world, lambda rank, transport: fn(rank, world, *args, transport=transport))


def run_scenarios_in_lockstep(world: int, scenarios: dict[str, Callable[..., Any]]) -> dict[str, list[Any]]:
    """`run_scenarios`' results, each scenario's ranks run in this process (`run_in_lockstep`)."""
    return {name: run_in_lockstep(world, fn) for name, fn in scenarios.items()}
