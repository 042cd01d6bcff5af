"""Build the module a rank runs: plan a model on a mesh whose process groups exist, emit this
rank's program and wrap it in a `ParallelModule` (what `parallelize` does after it has checked its
arguments and chosen the mesh, and what a pipeline does for each stage on its tensor sub-mesh)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.compiler.driver import compile_for_rank, graph_fingerprint, structure_copy
from autopar.core.errors import AutoparError, InputMismatchError
from autopar.core.mesh import Mesh
from autopar.core.meta import OutputStructure, signature
from autopar.core.plan import Plan
from autopar.core.precision import AutocastState, MixedPrecision
from autopar.rules.base import RuleRegistry
from autopar.runtime.agreement import (
    Fingerprint,
    choice_on_rank0,
    collective_device,
    decided_on_rank0,
    fingerprint,
    first_disagreement,
)
from autopar.runtime.call_checks import input_names, positional_names
from autopar.runtime.call_keys import CallMode
from autopar.runtime.groups import Groups, parallelize_failures_named
from autopar.runtime.local_batch import GLOBAL, LOCAL
from autopar.runtime.materialize import InitFn, initialized_blocks, meta_tensor_names
from autopar.runtime.module import ParallelModule
from autopar.runtime.program import EmittedProgram
from autopar.runtime.wire import all_gathered


@dataclass(frozen=True)
class ModuleOptions:
    """The options of `parallelize` that shape one compiled module (the whole model's, or one
    pipeline stage's on its tensor sub-mesh)."""

    registry: RuleRegistry | None = None
    planner: str = "search"
    schedule: bool | str = True
    hardware: str | None = None
    memory_limit: float | None = None
    over_decompose: int | str = 1
    split_fused: bool | None = None
    in_flight_bytes: int | None = None
    mixed_precision: MixedPrecision | None = None
    check_inputs: bool = True
    inputs: str = GLOBAL
    dump_dir: str | os.PathLike[str] | None = None
    init_fn: InitFn | None = None
    compile: bool = False
    storage: str = "auto"
    decompose_matmuls: str = "auto"
    token_dispatch: str = "allgather"
    # a pipeline stage's microbatches in flight on this rank: its saved activations count that often
    activation_copies: int = 1
    # 1 where a pipeline stage sums its microbatches' unreduced gradients (0: the stored gradient only)
    gradient_copies: int = 0


def compile_module(
    model: nn.Module,
    autopar_mesh: Mesh,
    groups: Groups,
    opts: ModuleOptions,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None,
    traced_inputs: Sequence[Any],
    traced_kwargs: dict[str, Any] | None,
    *,
    autocast: AutocastState,
    seeded: torch.Tensor,
    init_model: nn.Module | None = None,
    plain_when_replicated: bool = False,
) -> ParallelModule:
    """Plan `model` on `autopar_mesh` (whose process groups are `groups`), emit this rank's program
    and wrap it in the module the user calls. Every rank of `groups.world` calls it together.

    Meta tensors are made from the random state `seeded` by the initialization of `init_model`
    (default `model`): a pipeline stage's module holds some of the user's model's tensors under
    their names there, and only the whole model's initialization draws the serial numbers.

    `plain_when_replicated`: a plan storing every tensor whole on every rank gives the module plain
    tensors, not DTensors (`ParallelModule`); a pipeline's stages keep DTensors, which its runtime
    and checkpoints read on the stage's sub-mesh.

    A rank that fails or dies in here (trace, plan, materialization) ends the others' waits with a
    `RankFailureError` naming it and its error (`parallelize_failures_named`)."""
    with parallelize_failures_named(groups.timeout):
        mesh = autopar_mesh.device_mesh
        assert mesh is not None
        inputs, check_inputs, init_fn = opts.inputs, opts.check_inputs, opts.init_fn
        autopar_mesh = replace(autopar_mesh, group_names=groups.axis_names)
        on_meta = set(meta_tensor_names(model))
        examples: list[tuple[str, torch.Tensor]] = []
        if check_inputs and inputs == GLOBAL:  # local shards differ by design
            tensors = [
                x for x in pytree.tree_leaves((example_inputs, example_kwargs)) if isinstance(x, torch.Tensor)
            ]
            examples = list(
                zip(input_names(tuple(example_inputs), example_kwargs or {}, positional_names(model)), tensors)
            )
        if not on_meta:
            check_weights_agree(model, groups.world, examples=examples)
        options: dict[str, Any] = dict(
            registry=opts.registry,
            rank=dist.get_rank(),
            planner=opts.planner,
            agree=functools.partial(agree_across_ranks, group=groups.world),
            agree_choice=choice_on_rank0(groups.world),
            schedule=opts.schedule,
            hardware=opts.hardware,
            memory_limit=opts.memory_limit,
            over_decompose=opts.over_decompose,
            split_fused=opts.split_fused,
            in_flight_bytes=opts.in_flight_bytes,
            mixed_precision=opts.mixed_precision,
            storage=opts.storage,
            decompose_matmuls=opts.decompose_matmuls,
            token_dispatch=opts.token_dispatch,
            activation_copies=opts.activation_copies,
            gradient_copies=opts.gradient_copies,
        )
        compiled = compile_for_rank(
            model,
            autopar_mesh,
            traced_inputs,
            example_kwargs=traced_kwargs,
            dump_dir=opts.dump_dir,
            autocast=autocast,
            **options,
        )
        sig = signature(compiled.graph)
        flat, _ = pytree.tree_flatten((example_inputs, example_kwargs or {}))
        specs = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in flat]
        structure = structure_copy(model)
        blocks: dict[str, torch.Tensor] = {}
        if on_meta:
            torch.random.set_rng_state(seeded)
            program = compiled.program
            made = initialized_blocks(
                model if init_model is None else init_model,
                program.source_layouts(),
                autopar_mesh.shape,
                program.coords,
                init_fn,
                device=mesh.device_type,
            )
            blocks = made.blocks
            check_weights_agree(model, groups.world, skip=on_meta, prints=made.fingerprints, examples=examples)

        def compile_call(
            args: tuple[Any, ...], kwargs: dict[str, Any], mode: CallMode
        ) -> tuple[EmittedProgram, OutputStructure | None]:
            """Another program of the same model, for a call the first does not fit (new shapes, eval,
            autocast, weights cast to another dtype)."""
            structure.train(mode.training)
            for path, training in mode.flags:  # each submodule's own flag, as the user set it
                structure.get_submodule(path).training = training
            cast_like(structure, mode.dtypes)
            again = compile_for_rank(
                structure,
                autopar_mesh,
                args,
                example_kwargs=kwargs,
                forward_only=mode.forward_only,
                autocast=mode.autocast,
                **options,
            )
            return again.program, signature(again.graph).outputs

        result = ParallelModule(
            compiled.program,
            autopar_mesh,
            model,
            sig.aliases,
            sig.in_spec,
            specs,
            compiled.report,
            sig.outputs,
            compile=compile_call,
            example_flat=flat,
            check_inputs=check_inputs,
            groups=groups,
            local_blocks=blocks,
            local_inputs=inputs == LOCAL,
            autocast=autocast,
            inductor=opts.compile,
            plain_when_replicated=plain_when_replicated,
        )
        return result


def agree_across_ranks(
    gm: fx.GraphModule, make_plan: Callable[[], Plan], group: dist.ProcessGroup | None = None
) -> Plan:
    """Rank 0 plans and broadcasts; every rank first checks that all traced the same graph.

    Failures travel with the broadcast, so a rank whose planning raised never leaves the others
    waiting in a collective.
    """
    mine = graph_fingerprint(gm)
    everyone = all_gathered(mine, group, collective_device(group))
    differing = [r for r, f in enumerate(everyone) if f != mine]
    if differing:
        raise AutoparError(
            f"ranks traced different graphs (this rank differs from ranks {differing})",
            hint="every rank must call parallelize with the same model code, shapes and dtypes",
        )
    return decided_on_rank0(make_plan, "planning", group)


def cast_like(structure: nn.Module, dtypes: Sequence[tuple[str, torch.dtype]]) -> None:
    """Give the meta copy that later programs trace the parallel module's tensor dtypes (a
    `pmodel.to(torch.bfloat16)` after parallelize)."""
    for name, dtype in dtypes:
        path, _, leaf = name.rpartition(".")
        module = structure.get_submodule(path)
        if leaf in module._parameters:
            param = module._parameters[leaf]
            if param is not None and param.dtype != dtype:
                param.data = param.data.to(dtype)
        elif leaf in module._buffers:
            buffer = module._buffers[leaf]
            if buffer is not None and buffer.dtype != dtype:
                module._buffers[leaf] = buffer.to(dtype)


def check_weights_agree(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    skip: Collection[str] = (),
    prints: Sequence[tuple[str, Fingerprint]] = (),
    examples: Sequence[tuple[str, torch.Tensor]] = (),
) -> None:
    """Every rank must start from the same weights; otherwise each stores its block of its own
    weights and the result mixes them. One all-reduce of six numbers per tensor (`fingerprint`: sums weighted by position too, so a
    swapped row shows) finds out (for
    the tensors of a meta-device model, `prints` of the whole tensors its initialization made),
    and of the example inputs (`examples`, by name) in the same all-gather."""
    named = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if n not in skip]
    inputs = [(f"example input {n}", fingerprint(t)) for n, t in examples]
    differing = first_disagreement([*[(n, fingerprint(t)) for n, t in named], *prints, *inputs], group)
    if differing is not None and differing.name.startswith("example input "):
        name, rank = differing.name, differing.rank
        raise InputMismatchError(
            f"{name.removeprefix('example input ')} of example_inputs differs between rank 0 and rank "
            f"{rank}: every rank must pass the same example inputs (the global batch)",
            hint='give every rank the same example batch, or pass inputs="local" if each rank '
            "passes its own shard of the batch",
        )
    if differing is not None:
        name, rank = differing.name, differing.rank
        raise AutoparError(
            f"{name} differs between rank 0 and rank {rank}: every rank must pass the same weights",
            hint="seed every rank alike before building the model (torch.manual_seed), or load the "
            "same checkpoint on every rank",
        )
