"""The compiler driver: runs trace -> propagate -> insert_comm -> schedule -> emit for one rank
(with the decomposition of collective matmuls between insert_comm and schedule).

It is the one place that knows the order of the stages and hands each its inputs: the plan choice
(`autopar.planning`) picks a `Plan`, the driver gives it to propagate, and the stages then talk only
through node metadata. Lowering a plan (propagate, insert_comm, per batch chunk) and pricing it
lowered and scheduled on a copy of the graph (`scheduled_step_time`, which the mesh choice ranks
candidates by) are `autopar.compiler.lowering`'s.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import hashlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.compiler.chunk_choice import chosen_chunks, chunk_candidates
from autopar.compiler.decompose_choice import check_decompose, decompose_chosen
from autopar.compiler.emitted_memory import emitted_working
from autopar.compiler.lowering import (
    ScheduledCopy,
    chunk_step_times,
    in_flight_budget,
    lower,
    prefer_scheduled,
)
from autopar.compiler.option_checks import check_context_parallel, check_options, check_token_dispatch
from autopar.compiler.rank_share import RankShare
from autopar.core.collectives import DECOMPOSED_KEY, DECOMPOSED_STEPS_KEY
from autopar.core.errors import AutoparError, InternalError, UsageError
from autopar.core.graph_copy import graph_copy
from autopar.core.mesh import Mesh
from autopar.core.meta import has_info, set_activation_copies, set_gradient_copies, where_of
from autopar.core.plan import Plan
from autopar.core.precision import AutocastState, MixedPrecision, autocast_off
from autopar.cost.timeline import Timeline, default_hardware, simulate
from autopar.passes import fused
from autopar.passes.emit import emit
from autopar.passes.recompute import RECOMPUTE_KEY
from autopar.passes.schedule import schedule as schedule_pass
from autopar.passes.trace import trace
from autopar.planning.greedy import choose_layouts
from autopar.planning.memory import plan_memory
from autopar.planning.recompute import has_checkpoint_regions
from autopar.planning.search import SearchPlan, fit_memory, search_layouts
from autopar.planning.search_cost import ElementCost, TimeCost
from autopar.planning.storage import unify_part_storage
from autopar.reporting.dump import dump_dir_from, write_collectives, write_stage, write_timeline
from autopar.reporting.experts import expert_placement
from autopar.reporting.report import PlanReport, build_report
from autopar.rules.base import RuleRegistry
from autopar.rules.context_parallel import context_parallel_registry
from autopar.rules.registry import default_registry
from autopar.rules.routed_experts import require_dispatcher
from autopar.runtime.agreement import ChoiceAgreement
from autopar.runtime.program import EmittedProgram


@dataclass
class Compiled:
    """Everything the pipeline produced for one rank (used by parallelize and by pass tests)."""

    graph: fx.GraphModule  # the joint graph after schedule, global layouts in node metadata
    program: EmittedProgram
    report: PlanReport
    # modeled step before and after the schedule stage (autopar.cost.timeline), when `hardware` is
    # given or a dump is written
    timelines: tuple[Timeline, Timeline] | None = None
    # the mesh the graph's layouts are on: the device mesh, plus a chunk axis when over-decomposed
    graph_mesh: Mesh | None = None
    chunks: int = 1  # batch chunks per rank (over-decomposition); 1: off
    chunk_step_times: dict[int, float] | None = None  # over_decompose="auto": modeled step per choice
    # bytes per rank: the emitted program's working memory with its gradient buckets
    # (`emitted_memory`), what `price` reports; counted only by a compile for it (`priced=True`)
    working: float | None = None


_P = ParamSpec("_P")
_R = TypeVar("_R")


def compile_conditions(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run `fn` with the cyclic garbage collector off (its previous state restored after) and
    autocast off: every compile, and every plan choice (`choose_mesh`, the pipeline's).

    A compile builds ~10^6 long-lived objects (graph nodes, metadata, fake tensors, layouts and
    candidate lists) and little cyclic garbage: the collector's repeated full passes over them
    cost 15-20% of a compile (benchmarks/compile_time.py) and ~30% of the mesh choice of a
    32-layer LLaMA on 64 ranks (benchmarks/plan_scale.py), for a few percent more peak memory. A compile runs inside the
    user's call, perhaps in an autocast region: the precision it compiles for is its `autocast`
    argument, and no stage's fake-tensor runs may be cast by the region around it.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with autocast_off():
            if not gc.isenabled():
                return fn(*args, **kwargs)
            gc.disable()
            try:
                return fn(*args, **kwargs)
            finally:
                gc.enable()

    return wrapper


@compile_conditions
def compile_for_rank(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[Any],
    *,
    coords: Sequence[int] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    registry: RuleRegistry | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    rank: int = 0,
    planner: str = "search",
    agree: Callable[[fx.GraphModule, Callable[[], Plan]], Plan] | None = None,
    agree_choice: ChoiceAgreement | None = None,
    hardware: str | None = None,
    table: str | None = None,
    schedule: bool = True,
    memory_limit: float | None = None,
    over_decompose: int | str = 1,
    split_fused: bool | None = None,
    in_flight_bytes: int | None = None,
    forward_only: bool = False,
    traced: fx.GraphModule | None = None,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
    storage: str = "auto",
    decompose_matmuls: str = "auto",
    token_dispatch: str = "allgather",
    activation_copies: int = 1,
    gradient_copies: int = 0,
    share: RankShare | None = None,
    priced: bool = False,
    flops_per_element: float | None = None,
    scheduled: ScheduledCopy | None = None,
) -> Compiled:
    """Run the five stages for the rank at `coords` (default: this process's mesh coordinate).

    `forward_only` compiles the forward alone, as run under `torch.no_grad()` (evaluation,
    inference): no backward graph, nothing saved for it. `autocast`: the autocast regions the
    program's calls run in (`autopar.core.precision`); their casts become nodes of the graph.
    `mixed_precision`: a whole-model policy (`MixedPrecision`): parameters read in `param_dtype`.

    `planner` is "search" (the default: the whole-graph search over every op's strategy, seeded by
    the greedy pass under every axis-role assignment and by the fixed schemes, priced on `hardware`
    or by element counts without one) or "greedy" (op by op, the first heuristic: faster to plan,
    more communication). `agree`, when given, decides how ranks settle on one plan (parallelize:
    rank 0 plans, all check). `table` names the table the schedule stage and the in-flight budget
    model on when `hardware` is None (layouts by element counts; default: cpu-gloo for a CPU
    DeviceMesh, else h100-nvlink-ib): `plan(device_type="cpu")` passes cpu-gloo, as a CPU job's.
    `flops_per_element` weighs compute against elements in element counts (`hardware` None): the
    flops a rank does in the time it sends one element (default 200, CPU/gloo-like;
    `search_cost.table_flops_per_element` gives a table's: `benchmarks/plan_quality.py` plans the
    H100-sized GPT at the H100's).
    `schedule=False` skips the schedule stage (bucketing and reordering): insert_comm's order stays,
    each collective waited on right after it is issued (no overlap), for measuring what it buys.
    `memory_limit` (bytes per rank) bounds the plan's modeled memory: the search trades time for
    memory under it (default: 90% of the `hardware` table's device memory, none without a table),
    the greedy planner (only when given) keeps its layouts and gathers weights again in backward;
    `MemoryLimitError` is raised if no plan fits. `over_decompose=k` runs each rank's batch as k
    chunks one after another so that one chunk's collectives overlap the next one's compute
    (`autopar.planning.overdecompose`); "auto" tries 1, 2 and 4 and keeps the fastest modeled step,
    decided once per program (`agree_choice`).
    `split_fused=True` cuts fused linears split into equal pieces (GPT's qkv) into one linear per
    piece, so each can be split by heads (`autopar.passes.fused`); default: with the search planner.
    `in_flight_bytes` caps the output buffers of collectives issued and not yet waited on (how far
    ahead the schedule prefetches); default `in_flight_budget`: what the memory limit leaves after
    the plan's modeled memory. `storage` ("auto", "sharded" or "replicated") is how the search
    stores the weights (`search_layouts`, `PlanOptions.storage`). `decompose_matmuls` ("auto",
    "on" or "off"): which all-gather -> matmul and matmul -> reduce-scatter pairs are cut into
    pieces that overlap each other (`autopar.passes.decompose_matmul`); "auto": where the modeled
    step is shorter, decided once per program. `agree_choice` settles such choices across ranks as
    `agree` the plan (`ChoiceAgreement`; None: this rank decides). `token_dispatch` ("allgather", "alltoall" or "auto"): how MoE layers' tokens
    reach their experts (`autopar.rules.routed_experts`): "allgather" traces transformers' experts
    as their ops (the all-gather dispatcher, or splits inside the experts); the others trace each
    experts module as one op, "alltoall" requiring the all-to-all dispatcher wherever the experts
    are split and "auto" letting the planner price both.
    `activation_copies`, `gradient_copies`: copies of the saved activations (a pipeline stage's
    microbatches in flight) and of the unreduced gradients (1: summed over microbatches) a rank holds.
    `traced`, when given, is `trace_for(...)` of this model, inputs and options, made once: it is
    copied instead of traced again (an in-process run of every rank's program compiles each rank
    from one trace, as each process of a real job traces once); `share`, the same `RankShare` for
    every rank of such a run, schedules each distinct lowered graph once.
    `priced=True`: the compile is for `price` (`autopar.plan`, the fixed schemes' comparison),
    which reports the emitted program's working memory with its gradient buckets: counted only
    then (one more memory walk of the traced graph), not on every rank of every `parallelize`.
    `scheduled`: the mesh choice's scheduled copy of the plan `agree` hands (`lowering.ScheduledCopy`,
    `MeshChoice.chosen_plan.scheduled`), taken instead of scheduling the lowered graph again where
    it was made for this very plan, these coordinates, table and in-flight cap, not over-decomposed,
    and the graph is scheduled as it is (no collective matmul decomposed; no dump written).
    """
    example_inputs = example_tuple(example_inputs, example_kwargs)
    check_options(model, mesh, coords, memory_limit, in_flight_bytes)
    check_decompose(decompose_matmuls)
    registry = require_dispatcher(registry if registry is not None else default_registry(), token_dispatch)
    candidates = chunk_candidates(over_decompose)
    path = dump_dir_from(dump_dir, rank)
    if traced is None:
        gm = trace_for(
            model, mesh, example_inputs, example_kwargs, planner, split_fused, forward_only, autocast, mixed_precision,
            token_dispatch,
        )
    else:
        gm = graph_copy(traced)  # the later stages rewrite the graph in place
    set_activation_copies(gm, activation_copies)
    set_gradient_copies(gm, gradient_copies)
    write_stage(path, "1_trace", gm, mesh)
    registry = context_parallel_registry(registry, mesh.axis_names)
    check_context_parallel(gm, mesh)
    check_token_dispatch(gm, mesh, token_dispatch)
    if planner not in ("search", "greedy"):
        raise AutoparError(f"unknown planner {planner!r}", hint='use "search" or "greedy"')

    def make_plan() -> Plan:
        with stage("plan"):
            cost = (
                TimeCost(hardware, mesh.shape)
                if hardware is not None
                else ElementCost(mesh.shape, flops_per_element=flops_per_element)
            )
            if planner == "greedy":
                greedy = choose_layouts(gm, mesh, registry)
                if memory_limit is None and not has_checkpoint_regions(gm):
                    return greedy
                limit = math.inf if memory_limit is None else memory_limit
                return fit_memory(gm, greedy, mesh, cost, limit)
            searched = search_layouts(gm, mesh, registry, cost=cost, memory_limit=memory_limit, storage=storage)
            if hardware is None or not schedule:
                return searched
            return prefer_scheduled(gm, searched, mesh, registry, hardware, memory_limit)

    plan = agree(gm, make_plan) if agree is not None else make_plan()
    asked = plan  # (the plan object a scheduled copy was made of, before its parts' storage is unified)
    searched = gm.meta.get("autopar_search")  # (the search's report: why the experts are where they are)
    with stage("plan"):
        plan = unify_part_storage(gm, plan, mesh.shape)
    base = tuple(coords) if coords is not None else mesh.my_coords()
    table = default_hardware(mesh, hardware if hardware is not None else table)
    if in_flight_bytes is None:
        in_flight_bytes = in_flight_budget(gm, plan, mesh, table, memory_limit)
    with stage("over-decomposition"):  # "auto": every count lowered, scheduled and modeled, once per program
        chunking = chosen_chunks(
            candidates,
            lambda counts: chunk_step_times(
                gm, plan, mesh, registry, base, counts, table, schedule, in_flight_bytes, decompose_matmuls
            ),
            agree_choice,
        )
    chunks = chunking.chunks
    # (the traced order, walked before lowering rewrites gm)
    steps = plan_memory(gm, plan, mesh.shape).working_steps if priced else None
    with stage("propagate / insert_comm"):
        gm, work = lower(gm, plan, mesh, registry, base, chunks, path)
    handed = scheduled if scheduled is not None and schedule and path is None else None
    if handed is not None and not handed.fits(asked, mesh, base, table, in_flight_bytes, chunks):
        handed = None
    lowered_gm = gm
    taken: list[tuple[Timeline, fx.GraphModule]] = []  # (the copy's timeline and graph, once taken)

    def take() -> tuple[Timeline, fx.GraphModule]:
        assert handed is not None
        taken.append(handed.take(lowered_gm))
        return taken[-1]

    whole = take if handed is not None else None
    with stage("decompose matmuls"):
        gm, prescheduled = decompose_chosen(
            gm, work, base, table, decompose_matmuls, schedule, in_flight_bytes, agree=agree_choice, whole=whole
        )
    write_stage(path, "3_insert_comm", gm, work)
    modeled_on = table if hardware is not None or path is not None else None
    # modeled before the schedule stage, which reorders the graph in place
    unscheduled = simulate(gm, work, modeled_on) if modeled_on is not None else None
    if schedule:
        with stage("schedule"):
            # "auto" that kept the graph whole has scheduled it already, to decide
            def run(lowered: fx.GraphModule) -> fx.GraphModule:
                return schedule_pass(lowered, work, hardware=table, in_flight_bytes=in_flight_bytes)

            if prescheduled is not None:
                gm = prescheduled
            elif handed is not None and handed.graph is not None and _as_lowered(gm, lowered_gm, decompose_matmuls):
                gm = take()[1]
            elif share is not None:
                gm = share.schedule(gm, (work, table, in_flight_bytes), run)
            else:
                gm = run(gm)
    write_stage(path, "4_schedule", gm, work)
    working = emitted_working(steps, gm, work) if steps is not None else None
    with stage("emit"):
        calls = share.calls if share is not None else None
        program = emit(gm, work, registry, (*base, *(0,) * work.in_process), calls).on_devices(mesh.ndim)
    write_stage(path, "5_emit_forward", program.forward, work, local=True)
    write_stage(path, "5_emit_backward", program.backward, work, local=True)
    savings = plan.savings if isinstance(plan, SearchPlan) else None
    report = build_report(
        program,
        mesh,
        gm.meta.get("autopar_schedule"),
        graph_mesh=work,
        saved_before=savings.activation_bytes_before if savings is not None and savings.recompute else None,
        recomputed=savings.units if savings is not None else (),
        copied_ops=gm.meta.get(RECOMPUTE_KEY, 0),
        storage=plan.storage if isinstance(plan, SearchPlan) else "",
        decomposed=gm.meta.get(DECOMPOSED_KEY, ()),
        decomposed_steps=gm.meta.get(DECOMPOSED_STEPS_KEY, {}),
    )
    report.experts = expert_placement(
        gm,
        program,
        mesh,
        report.collectives,
        getattr(searched, "experts_split_cost", None),
        getattr(searched, "experts_whole_cost", None),
        getattr(searched, "cost_unit", "elements"),
        getattr(searched, "dispatcher_costs", None),
        getattr(searched, "experts_axes_costs", None),
    )
    write_collectives(path, report)
    timelines = None
    if unscheduled is not None and modeled_on is not None:
        # the copy's own timeline where its graph is the program's (simulated on this table already)
        reused = taken[0][0] if taken and taken[0][1] is gm and modeled_on == table else None
        timelines = (unscheduled, reused if reused is not None else simulate(gm, work, modeled_on))
        write_timeline(path, timelines, rank)
    steps_of = dict(chunking.steps) if chunking.steps else None
    return Compiled(gm, program, report, timelines, work, chunks, steps_of, working)


def _as_lowered(gm: fx.GraphModule, lowered: fx.GraphModule, mode: str) -> bool:
    """Whether the decomposition stage left the lowered graph as it was (no pair rewritten), so
    that a scheduled copy of it is the schedule stage's result."""
    return gm is lowered and mode != "on" and not any(r.kept for r in gm.meta.get(DECOMPOSED_KEY, ()))


def example_tuple(example_inputs: Any, example_kwargs: Any = None) -> tuple[Any, ...]:
    """The example positional arguments as a tuple; anything else is the caller's mistake, said so."""
    if isinstance(example_inputs, (str, bytes)) or not isinstance(example_inputs, (tuple, list)):
        raise UsageError(
            f"example_inputs must be a tuple of the forward's positional arguments, got "
            f"{type(example_inputs).__name__}",
            hint="pass (x,) for one input, () when every input is a keyword in example_kwargs",
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise UsageError(
            f"example_kwargs must be a dict of keyword arguments, got {type(example_kwargs).__name__}",
            hint='for example {"input_ids": ids, "labels": ids}',
        )
    return tuple(example_inputs)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Run one stage: an exception from it that is not an `AutoparError` is a bug in autopar, and
    reaches the user as an `InternalError` naming the stage, the node and its op, caused by it."""
    try:
        yield
    except AutoparError:
        raise
    except Exception as exc:
        node = _innermost_node(exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InternalError(
            f"internal error in the {name} stage: {type(exc).__name__}: {first}",
            op=str(node.target) if node is not None and node.op == "call_function" else None,
            where=(where_of(node) if has_info(node) else node.name) if node is not None else None,
            hint="this is a bug in autopar, not in your model; please report it with this message "
            "(the original exception is chained below)",
        ) from exc


def _innermost_node(exc: BaseException) -> fx.Node | None:
    """The graph node the deepest frame of the traceback was working on, if any frame held one."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, fx.Node):
                found = value
                break
        tb = tb.tb_next
    return found


def structure_copy(model: nn.Module) -> nn.Module:
    """`model` with its parameters and buffers on the meta device (tied ones stay tied): what later
    compiles of the same model trace (new input shapes, eval mode) without a second copy of the
    weights. Other tensor attributes are copied as they are."""
    memo: dict[int, Any] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for _, tensor in named:
        if id(tensor) in memo:
            continue
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        is_param = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_param else meta
    return copy.deepcopy(model, memo)


def trace_for(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None = None,
    planner: str = "search",
    split_fused: bool | None = None,
    forward_only: bool = False,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
    token_dispatch: str = "allgather",
) -> fx.GraphModule:
    """The trace stage as `compile_for_rank` runs it with these options (the same for every rank)."""
    with stage("trace"):
        return trace(
            model,
            example_tuple(example_inputs, example_kwargs),
            decompose=mesh.size > 1,
            example_kwargs=example_kwargs,
            split_fused=fused.wanted(split_fused, planner),
            forward_only=forward_only,
            autocast=autocast,
            mixed_precision=mixed_precision,
            routed_experts=token_dispatch != "allgather" and mesh.size > 1,
        )


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """What every rank must have traced identically for one plan to fit all of them."""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        digest.update(f"{node.op}|{node.name}|{node.target}|{shape}\n".encode())
    return digest.hexdigest()


