"""Bounded failure: process groups whose waits end, and the first failure named on every rank.

torch creates a DeviceMesh's axis groups with its default timeout (30 minutes), whatever
`init_process_group(timeout=...)` says, so a rank that died left the ranks that share no group
with it blocked for half an hour. `parallelize` makes its own groups for every mesh axis and one
over all ranks for its agreement checks, all with its `timeout`, meets every rank first at a
monitored barrier (gloo names the ranks that never came) and records the first failure of a step
in the job's store, so that a rank whose collective broke can say which rank failed first.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.errors import AutoparError, MeshError, RankFailureError, UsageError
from autopar.core.mesh import Mesh

DEFAULT_TIMEOUT_S = 300.0  # a step of a large model on slow links stays well under this
# The store's failure records are kept per `parallelize` call of the job ("generation"): a failure
# caught in one (every rank raised, the user retried with other options) is not the "first
# failure" of the next one's steps. Every rank calls parallelize the same number of times, so
# each rank's own count, kept in the store (no process state), names the same generation.
GENERATION_PREFIX = "autopar/parallelize_calls/"
FIRST_FAILURE_KEY = "first_failure"
REPORTED_PREFIX = "saw_broken_collective/"
REPORT_WAIT_S = 5.0  # how long a rank waits for the others to report a broken collective too


@dataclass(frozen=True)
class Groups:
    """autopar's own process groups: one over all ranks, and this rank's group along each axis."""

    world: dist.ProcessGroup
    axis_names: tuple[str, ...]  # group names, as the emitted collectives address them
    timeout: timedelta


def as_timeout(value: float | timedelta) -> timedelta:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise UsageError(
            f"timeout must be a positive number of seconds, got {value!r}", hint="for example 300"
        )
    return timedelta(seconds=seconds)


def make_groups(device_mesh: DeviceMesh, timeout: timedelta) -> Groups:
    """Every rank meets at a barrier bounded by `timeout`, then builds the groups (a collective
    call: every rank of the job runs it in the same order)."""
    meet_every_rank(timeout)
    world = dist.new_group(timeout=timeout)
    ranks = device_mesh.mesh
    names = []
    for axis in range(ranks.ndim):
        rows = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
        mine, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
        names.append(mine.group_name)
    return Groups(world, tuple(names), timeout)


@dataclass(frozen=True)
class PipelineGroups:
    """The groups of a mesh with a pipeline axis: `stage` are a stage's groups on its tensor sub-mesh
    (its `world` is this rank's slice: the ranks that run the same stages), `pp` this rank's
    pipeline group (the ranks at its sub-mesh coordinates, one per pipeline rank)."""

    stage: Groups
    pp: dist.ProcessGroup


def make_pipeline_groups(device_mesh: DeviceMesh, pp_axis: int, timeout: timedelta) -> PipelineGroups:
    """`make_groups` for a mesh with a pipeline axis: every rank meets, then builds every axis's
    groups and one per pipeline slice (a collective call: every rank runs it in the same order)."""
    meet_every_rank(timeout)
    ranks = device_mesh.mesh
    names = []
    pp_group = None
    for axis in range(ranks.ndim):
        rows = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
        mine, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
        if axis == pp_axis:
            pp_group = mine
        else:
            names.append(mine.group_name)
    slices = ranks.movedim(pp_axis, 0).reshape(ranks.shape[pp_axis], -1).tolist()
    stage_world, _ = dist.new_subgroups_by_enumeration(slices, timeout=timeout)
    assert pp_group is not None
    return PipelineGroups(Groups(stage_world, tuple(names), timeout), pp_group)


def meet_every_rank(timeout: timedelta) -> None:
    """Wait at most `timeout` for every rank to reach this point. gloo's monitored barrier names
    the ranks that did not come; other backends have none, and meet at the first collective."""
    if dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    except RuntimeError as exc:
        first = first_failure()
        told = f"; first failure recorded in the job: {first}" if first else ""
        raise RankFailureError(
            f"not every rank called parallelize within {timeout.total_seconds():g} s: {_first_line(exc)}{told}",
            hint="every rank of the job must call parallelize (the same model and inputs); a rank that "
            "raised before it says why in its own log; parallelize(..., timeout=) sets the bound",
        ) from exc


def start_generation() -> None:
    """Count this rank's `parallelize` call in the store: the failure records that follow belong
    to it (see GENERATION_PREFIX). Without a process group there is nothing to count."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # no store, or its host is gone: the meeting will say
        dist.distributed_c10d._get_default_store().add(f"{GENERATION_PREFIX}{dist.get_rank()}", 1)


def _failure_store() -> dist.Store:
    """The job's store under this rank's current generation's prefix (raises without a store)."""
    store = dist.distributed_c10d._get_default_store()
    generation = store.add(f"{GENERATION_PREFIX}{dist.get_rank()}", 0)
    return dist.PrefixStore(f"autopar/{generation}/", store)


def record_failure(rank: int, exc: BaseException) -> None:
    """Keep the first failure of this generation in the job's store (later ones leave it), for the
    other ranks' errors."""
    with contextlib.suppress(Exception):  # no store, or its host is gone: nothing to keep
        _failure_store().compare_set(FIRST_FAILURE_KEY, "", f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}")


def first_failure() -> str | None:
    """The first failure a rank recorded since the last `parallelize` began, if any rank did and the
    store answers."""
    with contextlib.suppress(Exception):
        store = _failure_store()
        if store.check([FIRST_FAILURE_KEY]):
            return store.get(FIRST_FAILURE_KEY).decode()
    return None


def failure_error(rank: int, exc: BaseException, timeout: timedelta | None, during: str = "") -> RankFailureError:
    """The error a rank raises when a collective of its step (or of `parallelize`, `during`)
    broke: what it saw, the first failure of a rank's own computation recorded in the job, and the
    ranks that did not report a broken collective themselves (the one that failed or was killed,
    or one still waiting)."""
    first = first_failure()
    silent = _silent_ranks(rank, REPORT_WAIT_S)
    bound = f" (waits end after {timeout.total_seconds():g} s)" if timeout is not None else ""
    told = f"; first failure recorded in the job: {first}" if first else ""
    if silent:
        told += (
            f"; ranks that did not report a broken collective within {REPORT_WAIT_S:g} s (failed "
            f"first, killed, or still waiting): {silent}"
        )
    if not first and silent is None:
        told += "; the job's store does not answer either: its host (rank 0, unless torchrun's agent holds it) is gone"
    where = f" {during}" if during else ""
    return RankFailureError(
        f"a collective{where} failed on rank {rank}{bound}: {_first_line(exc)}{told}",
        hint=(
            "another rank failed or was killed inside parallelize: look at the first failing rank's "
            "error; every rank must call parallelize with the same model and inputs"
            if during
            else "another rank failed, was killed or stopped calling the module: look at the first "
            "failing rank's error; every rank must run the same steps"
        ),
    )


@contextlib.contextmanager
def failures_named(timeout: timedelta | None) -> Iterator[None]:
    """Around a step's collectives: a failure is recorded as the job's first if none was, and a
    broken or timed-out collective becomes a `RankFailureError` naming the first failure recorded.
    An AutoparError passes as it is: every rank raises it alike (mismatched inputs, bad indices)."""
    try:
        yield
    except AutoparError:
        raise
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if is_collective_failure(exc):  # a consequence of another rank's failure
            raise failure_error(rank, exc, timeout) from exc
        record_failure(rank, exc)  # this rank's own: the others' errors name it
        raise


@contextlib.contextmanager
def parallelize_failures_named(timeout: timedelta | None) -> Iterator[None]:
    """Around `parallelize`'s work after the ranks met (checks, trace, plan agreement,
    materialization): as `failures_named`, but an AutoparError of this rank is recorded too (a
    trace or an init that fails on one rank only leaves the others in a collective), and a broken
    collective wrapped in another error (a trace's, a broadcast's) is still the others' failure."""
    try:
        yield
    except RankFailureError:
        raise
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if _broken_collective(exc):
            raise failure_error(rank, exc, timeout, "inside parallelize") from exc
        record_failure(rank, exc)
        raise


P = ParamSpec("P")
R = TypeVar("R")


def names_parallelize_failures(fn: Callable[P, R]) -> Callable[P, R]:
    """`parallelize` as a whole under `parallelize_failures_named`: a rank that fails before the
    meeting (its own arguments, the mesh choice) is named in the others' meeting error, and a
    collective outside the compile (a pipeline's) that breaks is named like the compile's."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            timeout: timedelta | None = as_timeout(kwargs.get("timeout", DEFAULT_TIMEOUT_S))  # type: ignore[arg-type]
        except (AutoparError, TypeError, ValueError):  # parallelize itself says what is wrong with it
            timeout = None
        start_generation()
        with parallelize_failures_named(timeout):
            return fn(*args, **kwargs)

    return wrapper


def _broken_collective(exc: BaseException) -> bool:
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if not isinstance(cause, AutoparError) and is_collective_failure(cause):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _silent_ranks(rank: int, wait_s: float) -> list[int] | None:
    """Say in the store that this rank saw a broken collective, and wait up to `wait_s` for the
    others to say it too: those that never do are the likely cause. None without a store."""
    try:
        store = _failure_store()
        world = dist.get_world_size()
        store.set(f"{REPORTED_PREFIX}{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            silent = [r for r in range(world) if not store.check([f"{REPORTED_PREFIX}{r}"])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.1)
    except Exception:  # the store's host is gone: nothing more to learn
        return None


def is_collective_failure(exc: BaseException) -> bool:
    """A failure of the transport or a wait, as opposed to an error of this rank's own computation."""
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, dist.DistError) or any(
        mark in text
        for mark in ("gloo", "Connection closed", "Timed out", "timed out", "NCCL", "DistBackendError")
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_device_mesh(mesh: Any) -> Mesh:
    """The torch DeviceMesh `parallelize` was given, checked against the job (a DeviceMesh, an
    initialized process group of its size, 1 to 4 axes), as the compiler's `Mesh`."""
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(
            f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}",
            hint='build one with torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2, 2))',
        )
    if not dist.is_initialized():
        raise MeshError(
            "torch.distributed is not initialized", hint="run under torchrun or init_process_group first"
        )
    world = dist.get_world_size()
    if mesh.size() != world:
        raise MeshError(
            f"mesh {tuple(mesh.shape)} has {mesh.size()} ranks but the job has {world}",
            hint=f"use a mesh whose axis sizes multiply to {world}",
        )
    if not 1 <= mesh.ndim <= 4:
        raise MeshError(f"meshes of 1 to 4 axes are supported, got {mesh.ndim}", hint="merge or drop axes")
    return Mesh.from_device_mesh(mesh)
