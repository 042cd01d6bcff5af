"""What `parallelize` returns: a module that runs this rank's emitted graphs under autograd.

Parameters are DTensors (original names, global shapes, local storage shards), so torch
optimizers, `clip_grad_norm_` and distributed checkpointing work on them unchanged. Where the
plan stores every parameter and buffer whole on every rank (DDP's plan), they are plain tensors
instead, as under DDP: each rank's copy is the whole value, so nothing needs DTensor's global view,
and the user's optimizer, gradient accumulation and clipping run at plain tensors' speed (each
DTensor op costs tens of microseconds of dispatch on top, which on a CPU rank was a third of the
step's overhead: docs/benchmarks.md). `forward`
runs the emitted forward graph inside an autograd.Function whose backward runs the emitted backward
graph; the local gradients it returns flow through `DTensor.to_local` into DTensor `.grad`s.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autopar.core.errors import AutoparError, InputMismatchError, UsageError
from autopar.core.layout import Layout
from autopar.core.mesh import Mesh
from autopar.core.meta import OutputStructure
from autopar.core.precision import AutocastState, compilable_autocast
from autopar.core.user_warning import warn_at_caller, without_gloo_alltoall_notice
from autopar.runtime.agreement import Fingerprint, fingerprint, stored_disagreement
from autopar.runtime.call_checks import (
    CallHistory,
    InputCheck,
    check_indices,
    gate_forward,
    input_names,
    positional_names,
    refuse_input_gradients,
    structure_digest,
)
from autopar.runtime.call_keys import (
    CallMode,
    call_key,
    check_example_call,
    difference_from,
    value_only_differences,
)
from autopar.runtime.checkpoint_names import transformers_renamer
from autopar.runtime.checkpoint_prefix import model_prefixes
from autopar.runtime.defer_reduction import GradAccumulation, ReductionSplit
from autopar.runtime.groups import Groups, failures_named
from autopar.runtime.input_updates import write_inputs_back
from autopar.runtime.local_batch import batch_tensor, global_stand_ins, shard_rows
from autopar.runtime.module_state import FullState, load_serial_state
from autopar.runtime.module_tree import flag_containers, lookup, register_at
from autopar.runtime.outputs import as_output
from autopar.runtime.param_feed import (
    FeedPlan,
    ParamFeed,
    contiguous_strides,
    plan_feed,
    to_dtensor_placements,
)
from autopar.runtime.program import EmittedProgram, local_value
from autopar.runtime.program_cache import CachedProgram, CacheThrash
from autopar.runtime.relayout import relaid
from autopar.runtime.run_program import RunProgram, WeightDeferral, compiled_by_inductor
from autopar.runtime.source_attributes import SourceAttributes
from autopar.runtime.source_watch import SourceWatch
from autopar.runtime.split_backward import SplitBackward
from autopar.runtime.stage_calls import StageCalls

# Compiles `(args, kwargs, mode)` into this rank's program and its output structure; every rank
# calls it together (it plans on rank 0 and broadcasts).
Compile = Callable[
    [tuple[Any, ...], dict[str, Any], CallMode], tuple[EmittedProgram, "OutputStructure | None"]
]
MAX_PROGRAMS = 8  # programs kept per module (input signatures x modes), least recently used dropped
_LOG = logging.getLogger("autopar")


class ParallelModule(FullState, SourceAttributes, StageCalls, nn.Module):
    """This rank's share of the model; call it with the same global inputs on every rank.

    A call whose input shapes, dtypes or non-tensor arguments differ from every compiled one, or in
    another mode (`eval()`, or under `torch.no_grad()`: a forward-only program), compiles a program
    for it with `compile` (when given) and keeps it; all programs share the parameters.
    """

    def __init__(
        self,
        program: EmittedProgram,
        mesh: Mesh,
        source: nn.Module,
        aliases: dict[str, str],
        in_spec: Any,
        example_specs: Sequence[tuple[tuple[int, ...], torch.dtype] | None],
        report: Any = None,
        outputs: OutputStructure | None = None,
        compile: Compile | None = None,
        example_flat: Sequence[Any] | None = None,
        check_inputs: bool = False,
        groups: Groups | None = None,
        local_blocks: Mapping[str, torch.Tensor] | None = None,
        local_inputs: bool = False,
        autocast: AutocastState = (),
        inductor: bool = False,
        plain_when_replicated: bool = False,
    ) -> None:
        super().__init__()
        assert mesh.device_mesh is not None
        self.remember_source(source)
        self._program = program
        self._mesh = mesh
        self._in_spec = in_spec
        self._example_specs = list(example_specs)
        self._compile = compile
        self._check_inputs_agree = check_inputs
        self._local_inputs = local_inputs  # each rank passes its own shard of the batch (`local_batch`)
        self._inductor = inductor  # run each program's graphs compiled by Inductor
        self._groups = groups
        self._deferral: WeightDeferral | None = None  # set around a zero-bubble call (deferring_weights)
        self._splits: dict[int, SplitBackward] = {}  # each program's backward cut in two, once
        self._accumulation: GradAccumulation | None = None  # set around a pipeline's calls
        self._reduction_splits: dict[int, ReductionSplit] = {}  # each backward cut at its reductions
        self._positional_names = positional_names(source)  # to name inputs in errors
        self._history = CallHistory()  # ranks a call apart are named as such (call_checks)
        self.report = report
        self.training = source.training
        self._programs: OrderedDict[Any, CachedProgram] = OrderedDict()
        self._values_seen: dict[tuple[int, type], set[Any]] = {}  # plain arguments that compiled programs by value
        self._values_warned: set[int] = set()
        self._thrash = CacheThrash(MAX_PROGRAMS)  # warns once when a dropped program compiles again
        self._first = first = self._prepared(program, outputs)
        self._holders: dict[str, tuple[nn.Module, str]] = {}  # tensor name -> its submodule, leaf (`_held`)
        self._dtype_names: list[str] | None = None  # the names `_tensor_dtypes` reads
        device_type = mesh.device_mesh.device_type
        self._autocast_devices = tuple(dict.fromkeys(("cpu", device_type)))
        full: dict[str, torch.Tensor] = dict(source.named_parameters(remove_duplicate=False))
        buffers = dict(source.named_buffers(remove_duplicate=False))
        full.update(buffers)
        layouts = program.source_layouts()  # a fused parameter's parts make one layout
        # DDP's plan: every stored tensor whole on every rank, held as plain tensors (module doc)
        self.plain_storage = plain_when_replicated and all(lay.is_replicated for lay in layouts.values())
        saved = set(source.state_dict(keep_vars=True))  # buffers outside it are not persistent
        self.aliases = dict(aliases)  # tied name -> the name it is stored under
        self.not_stored: list[str] = []  # the source's tensors that no program reads
        self.model_prefixes = model_prefixes(source)  # submodule -> base_model_prefix, for loading
        self.source_config = getattr(source, "config", None)  # a transformers model's: export writes it
        # register in the source model's order so named_parameters()/state_dict() read the same
        for name in [*dict(source.named_parameters(remove_duplicate=False)), *buffers]:
            if name in aliases:
                register_at(
                    self, name, lookup(self, aliases[name]), buffer=name in buffers, persistent=name in saved
                )
                continue
            if name not in layouts:
                self.not_stored.append(name)
                continue
            tensor = full[name].detach()
            layout = layouts[name]
            if tensor.device.type == "meta":  # made on this rank as its block only (`materialize`)
                local = local_blocks[name] if local_blocks is not None else tensor
                if local.device.type == "meta":
                    raise AssertionError(f"{name} is on the meta device and was not initialized")
            else:
                local = local_value(tensor, layout, mesh.shape, program.coords).clone().contiguous()
            if self.plain_storage:
                if name in buffers:
                    register_at(self, name, local, buffer=True, persistent=name in saved)
                else:
                    register_at(self, name, nn.Parameter(local, requires_grad=full[name].requires_grad))
                continue
            dt = DTensor.from_local(
                local,
                mesh.device_mesh,
                to_dtensor_placements(layout),
                run_check=False,
                shape=tensor.shape,
                # the blocks are contiguous whatever the model's memory format (channels_last)
                stride=torch.empty(tensor.shape, device="meta").stride(),
            )
            if name in buffers:
                register_at(self, name, dt, buffer=True, persistent=name in saved)
            else:
                register_at(self, name, nn.Parameter(dt, requires_grad=full[name].requires_grad))
        # every submodule of the source, as a container whose training flag the user sets as on the
        # source (`pmodel.drop.eval()`); each call's program is for the flags at call time
        self._flagged = flag_containers(self, source)
        # a state dict loaded on some ranks only, or a different one on each, would train a mixture
        self._loading: list[tuple[str, Fingerprint]] = []  # a state dict's whole tensors, while it loads
        self.register_load_state_dict_post_hook(_check_after_load)
        self._source_watch = SourceWatch(source, self._flagged)  # later eval()/hooks on the model, hooks on pmodel's submodules
        self.checkpoint_renamer = transformers_renamer(source)  # save_pretrained's own names (load_checkpoint)
        if example_flat is not None:
            mode = CallMode(self.training, False, autocast, self._tensor_dtypes(), self.module_flags())
            first_key = call_key(in_spec, example_flat, mode)
            self._programs[first_key] = first
            self._thrash.signatures.add(first_key)

    def check_stored_agree(
        self, after: str, whole: Sequence[tuple[str, torch.Tensor | Fingerprint]] = ()
    ) -> None:
        """Refuse, on every rank alike, stored blocks whose copies differ between the ranks that
        hold the same block, and `whole` tensors (what the load read: every rank the same whole
        value) that differ between any ranks: one all-reduce of fingerprints. `after` names the
        load for the error. Every rank calls it together, as it calls what loads."""
        named = [*whole, *self.named_parameters(), *self.named_buffers()]
        timeout = self._groups.timeout if self._groups is not None else None
        with failures_named(timeout):
            differing = stored_disagreement(named, self.world_group)
        if differing is not None:
            block = "" if differing.name in dict(whole) else ", which hold the same block of it"
            raise AutoparError(
                f"after {after}, {differing.name} differs between rank {differing.first} and rank "
                f"{differing.rank}{block}: the ranks loaded different weights",
                hint="load the same checkpoint or state dict on every rank (the same path, the same "
                "step), and call the load on every rank together",
            )

    @property
    def program(self) -> EmittedProgram:
        return self._program

    def stored_block(self, name: str) -> tuple[slice, ...]:
        """Where this rank's stored block of parameter or buffer `name` lies in the whole tensor
        (what a checkpoint reader slices out of it)."""
        layout = self._first.source_layouts[self.aliases.get(name, name)]
        shape = tuple(self._mesh.shape)
        sizes = layout.local_shape(shape, self._program.coords)
        offsets = layout.local_offsets(shape, self._program.coords)
        return tuple(slice(start, start + size) for start, size in zip(offsets, sizes))

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """autopar's process group over every rank (its timeout bounds collectives on it)."""
        return self._groups.world if self._groups is not None else None

    # torch.compile(pmodel) must not trace the runtime (checks, compiles, collectives):
    # it runs as pmodel does; compile=True sends the programs through Inductor
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._history.calls += 1  # first: a call that fails on this rank alone still counts
        self._source_watch.check()
        # a DTensor input (another parallel module's output) is its global value to the program;
        # its gradient comes back laid out as it is, through full_tensor's backward
        if self._local_inputs and any(isinstance(x, DTensor) for x in pytree.tree_leaves((args, kwargs))):
            raise InputMismatchError(
                'a DTensor argument is a global value, but with inputs="local" every tensor argument '
                "is this rank's shard of the batch",
                hint='pass this rank\'s shard as a plain tensor, or use inputs="global"',
            )
        args, kwargs = pytree.tree_map_only(DTensor, lambda x: x.full_tensor(), (args, kwargs))
        flat, spec = pytree.tree_flatten((args, kwargs))
        names = input_names(args, kwargs, self._positional_names)  # for the errors below
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        timeout = self._groups.timeout if self._groups is not None else None
        world = self._groups.world if self._groups else None
        check: InputCheck | None = None  # the same inputs on every rank: settled before any collective
        with failures_named(timeout):  # the input checks and a compile's agreement are collectives
            if self._local_inputs:  # the program is traced for the batch the shards make together
                shard_rows(tensors, names, world, self._history.calls)
                program_args, program_kwargs = global_stand_ins((args, kwargs), self._mesh.size)
            else:
                if self._check_inputs_agree:
                    check = InputCheck(flat, names, self._history, world, structure_digest(flat, spec))
                program_args, program_kwargs = args, kwargs
            try:
                run = self._program_for(program_args, program_kwargs, flat, spec, check)
                program = run.program
                refuse_input_gradients(tensors, names, program.input_grads)
                check_indices(program.index_checks, tensors, names, world, across_ranks=self._local_inputs)
            except AutoparError:
                if check is not None:  # ranks whose inputs differ refuse that, together, first
                    check.settle()
                raise
            if check is not None:  # the forward settles it before its first collective (`InputGate`)
                if run.gate is not None:
                    run.gate.check = check
                else:
                    check.settle()
        local_inputs = self._local_inputs_of(tensors, program)
        num_outputs = len(program.output_layouts)
        # the inputs that want a gradient go in whole: the backward returns theirs whole
        wanting = [tensors[i] for i in program.input_grads]
        if self._local_inputs:
            assert self._mesh.device_mesh is not None
            wanting = [batch_tensor(x, self._mesh.device_mesh).full_tensor() for x in wanting]
        deferral: WeightDeferral | GradAccumulation | None = (
            self._deferral if self._deferral is not None else self._accumulation
        )
        if self._deferral is not None and self._inductor:
            raise UsageError(
                "a zero-bubble pipeline splits each stage's backward program in two, which compile=True "
                "(Inductor) does not do yet",
                hint='drop compile=True, or use schedule="1f1b" / "interleaved-1f1b"',
            )
        if deferral is None:  # the stored tensors themselves (`ParamFeed`)
            feed, sources = run.feed.feed, self._sources(run.feed)
        else:  # the weight-gradient and reduction splits take the program's views one to one
            feed = ParamFeed.one_to_one(len(program.param_names))
            sources = [self._local_param(run, name) for name in program.param_names]
        outputs = RunProgram.apply(
            program, feed, num_outputs, timeout, deferral, *sources, *local_inputs, *wanting
        )
        if check is not None:  # (settled in the forward: a graph without a gate settles here)
            with failures_named(timeout):
                check.settle()
        user = num_outputs - len(program.buffer_updates) - len(program.input_updates)
        with torch.no_grad():  # the forward's updates of its buffers (BatchNorm running stats)
            for name, value in zip(program.buffer_updates, outputs[user + len(program.input_updates) :]):
                _local(lookup(self, name)).copy_(value)
        write_inputs_back(program, outputs[:num_outputs], tensors, self._mesh.device_mesh, self._local_inputs)
        results = [self._wrap(o, lay) for o, lay in zip(outputs[:user], program.output_layouts)]
        if run.outputs is not None:  # the structure the model returned (a dict, a ModelOutput)
            return run.outputs.rebuild(results)
        return results[0] if len(results) == 1 else tuple(results)

    def _local_inputs_of(
        self, tensors: Sequence[torch.Tensor], program: EmittedProgram
    ) -> list[torch.Tensor]:
        """This rank's block of every input in the layout the program reads it in: cut from the
        global input, or (local batches) redistributed from the shards of all ranks."""
        if not self._local_inputs:
            shape = tuple(self._mesh.shape)
            return [
                local_value(x.detach(), lay, shape, program.coords)
                for x, lay in zip(tensors, program.input_layouts)
            ]
        mesh = self._mesh.device_mesh
        assert mesh is not None
        with without_gloo_alltoall_notice():
            return [
                batch_tensor(x.detach(), mesh).redistribute(mesh, to_dtensor_placements(lay)).to_local()
                for x, lay in zip(tensors, program.input_layouts)
            ]

    def _program_for(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], spec: Any, check: InputCheck | None = None
    ) -> CachedProgram:
        """The compiled program for this call, compiling one if none fits (see the class doc); a
        compile's collectives wait for the call's input `check` to settle."""
        grad = torch.is_grad_enabled()
        if self._compile is None:  # a module built around one program: it takes only that call
            check_example_call(flat, spec, self._in_spec, self._example_specs)
            guards = self._first.program.value_guards
            if guards is not None and not guards.hold(flat, self._device_type):
                raise InputMismatchError(
                    f"the program was compiled for inputs on which {guards.failing(flat, self._device_type)[0]} decides "
                    "another branch than on this call's",
                    hint="build the module with parallelize, which compiles a program for each branch",
                )
            return self._first
        mode = CallMode(
            self.training,
            not grad,
            compilable_autocast(self._autocast_devices),
            self._tensor_dtypes(),
            self.module_flags(),
        )
        key = call_key(spec, flat, mode)
        found = self._programs.get(key)
        if found is not None:
            self._refuse_local_guards(found)
            holding = found.holding(flat, self._device_type)
            if holding is not None:
                self._programs.move_to_end(key)
                return holding
            guards = found.program.value_guards
            assert guards is not None  # only a guarded program can fail to hold
            why = f"new input values ({guards.failing(flat, self._device_type)[0]} decides another branch)"
        else:
            why = difference_from(next(reversed(self._programs)), key) if self._programs else "this call"
            self._note_values(key)
        _LOG.info("autopar: compiling a program for %s", why)
        self._thrash.compiling(key)
        if check is not None:
            check.settle()
        program, outputs = self._compile(args, kwargs, mode)
        compiled = self._prepared(program, outputs, why)
        self._refuse_other_branch(compiled, flat)
        if found is not None:  # the same signature, another branch: kept beside the first
            found.others = [*found.others, compiled][-(MAX_PROGRAMS - 1) :]
            self._programs.move_to_end(key)
            return compiled
        self._programs[key] = compiled
        if len(self._programs) > MAX_PROGRAMS:
            self._thrash.dropping(self._programs.popitem(last=False)[0])
        return compiled

    @property
    def _device_type(self) -> str:
        assert self._mesh.device_mesh is not None
        return self._mesh.device_mesh.device_type

    def _refuse_other_branch(self, run: CachedProgram, flat: Sequence[Any]) -> None:
        """A program compiled for this call must take this call's branches: its trace ran the
        model on the call's values and the generators' state now, as its guards do."""
        guards = run.program.value_guards
        if guards is not None and not guards.hold(flat, self._device_type):
            raise AutoparError(
                f"the program compiled for this call took another branch at {guards.failing(flat, self._device_type)[0]} "
                "than its guards compute for the call",
                hint="the model's trace on the call's values drew other random numbers or read other "
                "values than the model run eagerly does; report this model to autopar",
            )

    def _note_values(self, key: Any) -> None:
        """Warn once per argument when a plain number or flag has compiled three programs: each
        value is a new program (seconds of compile, and at most MAX_PROGRAMS are kept)."""
        for index, values in value_only_differences(key, list(self._programs)).items():
            for kind in {type(value) for value in values}:
                seen = self._values_seen.setdefault((index, kind), set())
                seen.update(value for value in values if type(value) is kind)
                if len(seen) >= 3 and index not in self._values_warned:
                    self._values_warned.add(index)
                    warn_at_caller(
                        f"autopar: input {index} is a Python {kind.__name__} that has taken {len(seen)} "
                        f"values, and each value compiles its own program (at most {MAX_PROGRAMS} are "
                        "kept); pass it as a tensor (torch.tensor(t)) and one program serves every value"
                    )

    def _refuse_local_guards(self, run: CachedProgram) -> None:
        """A guard is evaluated on the global inputs, which a call with `inputs="local"` does not
        hand every rank."""
        guards = run.program.value_guards
        if self._local_inputs and guards is not None:
            raise UsageError(
                f'with inputs="local", {guards.conditions[0]} cannot be checked: the model chooses a '
                "branch by the values of its inputs, which each rank must then see whole",
                hint='pass the global batch on every rank (inputs="global", the default)',
            )

    def module_flags(self) -> tuple[tuple[str, bool], ...]:
        """The training flag of every submodule of the source model (by path) at this call."""
        return tuple((path, module.training) for path, module in self._flagged)

    def _tensor_dtypes(self) -> tuple[tuple[str, torch.dtype], ...]:
        """The dtype of every parameter and buffer now (after `.to()`, `.half()`, `p.data = ...`):
        the names come from one walk of the module, each tensor from its holder every call."""
        if self._dtype_names is None:
            self._dtype_names = [name for name, _ in [*self.named_parameters(), *self.named_buffers()]]
        found = [(name, self._held(name)) for name in self._dtype_names]
        if any(t is None for _, t in found):  # the user removed one: walk again
            self._dtype_names = None
            return tuple((name, t.dtype) for name, t in [*self.named_parameters(), *self.named_buffers()])
        return tuple((name, t.dtype) for name, t in found if t is not None)

    def _held(self, name: str) -> torch.Tensor | None:
        """The parameter or buffer `name` as its holder (the submodule) holds it now, None if it
        holds none: one dict read where `lookup` walks every attribute of the path (a call reads
        every stored tensor, ~70 for a small GPT: half a millisecond of walks)."""
        found = self._holders.get(name)
        if found is None:
            prefix, _, leaf = name.rpartition(".")
            holder = lookup(self, prefix) if prefix else self
            if not isinstance(holder, nn.Module):
                return None
            found = self._holders[name] = (holder, leaf)
        holder, leaf = found
        value = holder._parameters.get(leaf)
        return value if value is not None else holder._buffers.get(leaf)

    @property
    def programs(self) -> list[tuple[str, EmittedProgram]]:
        """The compiled programs, least recently used first, each with why it was compiled."""
        runs = [run for first in self._programs.values() for run in (first, *first.others)]
        return [(run.why or "example inputs", run.program) for run in runs]

    def _prepared(self, program: EmittedProgram, outputs: OutputStructure | None, why: str = "") -> CachedProgram:
        program.forward.meta["autopar_mesh_shape"] = tuple(self._mesh.shape)
        assert self._mesh.device_mesh is not None
        device = self._mesh.device_mesh.device_type
        # constants are the program's, not the user's model's: not registered as buffers
        constants = {name: value.to(device) for name, value in program.constants.items()}
        gate = None
        if self._inductor:  # (Inductor compiles the whole graph: the check settles before it runs)
            program = compiled_by_inductor(program)
        elif self._check_inputs_agree and not self._local_inputs:
            gate = gate_forward(program.forward)
        layouts = program.source_layouts()
        feed = plan_feed(program, constants, layouts)
        return CachedProgram(program, outputs, layouts, constants, feed, why, gate=gate)

    def _local_param(self, run: CachedProgram, name: str) -> torch.Tensor:
        """This rank's block of program parameter `name` in the layout the program wants: stored
        parameters are redistributed when a later program wants another layout (autograd brings
        the gradient back), and a part of a fused parameter is a chunk of the whole parameter's
        block (its cut dim is whole there), so autograd sums into it."""
        constant = run.constants.get(name)
        if constant is not None:
            return constant
        part = run.program.param_parts.get(name)
        source = part.source if part is not None else name
        local = self._local_as(lookup(self, source), run.source_layouts[source])
        return part.of(local) if part is not None else local

    def _sources(self, plan: FeedPlan) -> list[torch.Tensor]:
        """The tensors a call hands its program (`ParamFeed`): each stored DTensor as it is where
        the program reads it as stored, else its local block in the layout the program wants."""
        sources = []
        for name, layout, placements, constant in zip(plan.names, plan.layouts, plan.placements, plan.constants):
            if constant is not None:
                sources.append(constant)
                continue
            value = self._held(name)
            if value is None:
                value = lookup(self, name)
            if isinstance(value, DTensor) and value._spec.placements == placements:
                sources.append(value)
            else:
                assert layout is not None
                sources.append(self._local_as(value, layout))
        return sources

    def _local_as(self, value: Any, layout: Layout) -> torch.Tensor:
        """This rank's block of stored `value` in `layout`, differentiably (`relaid`): a plain
        (whole) stored tensor that a later program reads split gets its gradient gathered back
        whole, as a stored DTensor's comes back in its own layout, and a gradient the program
        does not return (a layer its branch skips) stays missing, as in serial."""
        assert self._mesh.device_mesh is not None
        return relaid(value, self._mesh.device_mesh, to_dtensor_placements(layout))

    def _wrap(self, local: torch.Tensor, layout: Layout) -> Any:
        if layout.is_replicated and len(layout.shape) == 0:
            return local
        assert self._mesh.device_mesh is not None
        value = DTensor.from_local(
            local,
            self._mesh.device_mesh,
            to_dtensor_placements(layout),
            run_check=False,
            shape=torch.Size(layout.shape),
            stride=contiguous_strides(layout.shape),
        )
        # with global inputs, a plain tensor the user mixes in (a target) is the whole value on
        # every rank: the output treats it as replicated; with local ones it is this rank's
        # shard, and the output refuses it (autopar/runtime/outputs.py)
        return as_output(value, self._local_inputs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Takes this module's state dict or the serial model's (plain whole tensors: each rank
        copies in its block of each). Every rank must pass the same whole tensors, and ranks that
        hold the same block must agree after (checked when loaded, `check_stored_agree`)."""
        _fingerprint_loading(self, state_dict, "")  # the whole tensors, before they become blocks
        return load_serial_state(self, super().load_state_dict, state_dict, strict, assign)

    def plan_summary(self) -> str:
        return str(self.report) if self.report is not None else ""


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _fingerprint_loading(module: ParallelModule, state_dict: Mapping[str, Any], prefix: str, *_: Any) -> None:
    """The whole (plain) tensors of a state dict being loaded: every rank must pass the same."""
    if prefix == "":
        module._loading = [
            (f"{name} of the state dict", fingerprint(value))
            for name, value in state_dict.items()
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        ]


def _check_after_load(module: ParallelModule, incompatible: Any) -> None:
    whole, module._loading = module._loading, []
    module.check_stored_agree("load_state_dict", whole)
