"""Stage 1, trace: the user's module -> one joint forward+backward ATen graph on fake tensors.

torch.export first (it copes with real-world models), then AOTAutograd's joint export. Weights are
never copied: the model is cloned with fake parameters. Every node keeps the user's module path and
source line for dumps and errors. With more than one rank, a few fused ops whose sharded forms need
cross-rank sums (layer norm, nll loss) are decomposed into primitive ops, inside the joint export
(one trace over the model, not a second pass over the joint graph).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from autopar.core.errors import ModelAssertionError, ModelValueError, TraceError
from autopar.core.meta import (
    MEMORY_ORDER_KEY,
    SIGNATURE_KEY,
    JointSignature,
    NodeInfo,
    OutputStructure,
    ParamPart,
    Phase,
    Role,
    info,
    set_info,
    signature,
)
from autopar.core.precision import AutocastState, MixedPrecision, autocast_off
from autopar.core.value_guards import generators_kept
from autopar.passes.autograd_functions import (
    custom_function_error,
    functions_as_ops,
    verify_function_splits,
)
from autopar.passes.checkpoint_regions import CheckpointWatch, mark_checkpoint_regions
from autopar.passes.eager_checks import eager_error, eager_run
from autopar.passes.fused import split_fused_linears
from autopar.passes.hooks import recorded_forward_hooks, refuse_gradient_hooks, warn_side_effect_hooks
from autopar.passes.host_random import host_generators_kept
from autopar.passes.index_checks import find_index_checks
from autopar.passes.joint_rewrites import (
    drop_identities,
    merge_repeated_calls,
    merge_tied,
    simplify_strided,
    tied_groups,
)
from autopar.passes.mixed_precision import cast_parameters_on_read
from autopar.passes.random_guards import eager_draw_states, serial_draws
from autopar.passes.repeats import MIN_BLOCKS, NotRepeated, RepeatedBlocks, stamp_repeated_blocks
from autopar.passes.repeats_find import cut_to_two_blocks, find_repeated_blocks
from autopar.passes.routed_experts_trace import mark_routing_imbalance, routed_experts_traced
from autopar.passes.trace_errors import (
    CAUSAL_MASK_HINT,
    CTC_HINT,
    DATA_DEPENDENT_HINT,
    VALUE_DEPENDENT_HINT,
    first_lines,
    joint_hint,
    module_path,
    node_where,
    reads_a_size,
    refuse_rnn_dropout,
    user_frame,
    user_frame_of,
    without_example,
)
from autopar.passes.trace_export import (
    export_model,
    foreign_buffers_as_constants,
    outputs_as_copies_of_views,
    windows_as_slices,
)
from autopar.passes.trace_outputs import OutputRecord, hidden_tensors_error, tensor_outputs
from autopar.passes.value_guards import (
    flat_values,
    inputs_have_values,
    private_inputs,
    serial_raises,
    split_value_guards,
    valued_copy,
)
from autopar.rules.autograd_function import FunctionTable
from autopar.rules.decompositions import refuse_target_dtypes, sharding_decompositions

__all__ = ["CAUSAL_MASK_HINT", "CTC_HINT", "DATA_DEPENDENT_HINT", "VALUE_DEPENDENT_HINT", "fake_clone", "trace"]



def trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    decompose: bool = True,
    example_kwargs: dict[str, Any] | None = None,
    split_fused: bool = False,
    repeats: bool = True,
    forward_only: bool = False,
    autocast: AutocastState = (),
    mixed_precision: MixedPrecision | None = None,
    routed_experts: bool = False,
    depth: int | None = None,
) -> fx.GraphModule:
    """Joint graph of `model`: placeholders (params, buffers, inputs, tangents) -> (outputs, grads).

    `split_fused` cuts fused linears whose output is split into equal pieces into one linear per
    piece (`autopar.passes.fused`). `repeats` exports identical blocks' joint graph once and copies
    it (`autopar.passes.repeats`); False exports every block (the same graph, slower).
    `forward_only` traces as under `torch.no_grad()`: no parameter requires a gradient, so the
    graph has no backward part (evaluation and inference programs).
    `autocast`: the forward runs inside these autocast regions, so the graph holds their casts
    explicitly; autocast active around this call is not traced (`autopar.core.precision`).
    `mixed_precision`: every parameter read in the forward is read as a copy in its `param_dtype`
    (`autopar.passes.mixed_precision`).
    `routed_experts`: transformers' experts modules are traced as one `autopar::routed_experts` op
    each (`autopar.passes.routed_experts_trace`), so the plan can place the all-to-all dispatcher.
    `depth`: identical blocks are copied only up to this many per container (at least
    `repeats.MIN_BLOCKS`): the graph of the same model cut to `depth` blocks, which a planner can
    price in place of the whole depth (`autopar.compiler.auto_mesh`); None: every block."""
    # numpy's and Python's generators as the trace found them (a draw in forward is refused: host_random)
    with autocast_off(), host_generators_kept(), routed_experts_traced(model, routed_experts), functions_as_ops(not forward_only) as functions:
        try:
            gm = _trace(
                model, example_inputs, decompose, example_kwargs, split_fused, repeats, forward_only, autocast,
                mixed_precision, functions, depth,
            )
            mark_routing_imbalance(gm, model)
            return gm
        except TraceError as failed:
            # a batch the model itself rejects (a check torch.export defers to run time, as BART's
            # end-of-sequence count) fails the trace later, somewhere else: the model's own error
            own = eager_error(model, tuple(example_inputs), example_kwargs or {})
            if not example_inputs and not example_kwargs:  # called with nothing: say to pass a batch
                raise without_example(own or failed) from failed
            if own is None:
                raise
            raise own from failed


def _trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    decompose: bool,
    example_kwargs: dict[str, Any] | None,
    split_fused: bool,
    repeats: bool,
    forward_only: bool,
    autocast: AutocastState,
    mixed_precision: MixedPrecision | None,
    functions: FunctionTable,
    depth: int | None = None,
) -> fx.GraphModule:
    example_kwargs = example_kwargs or {}
    if not forward_only:  # hooks on gradients would be dropped: refused by name (passes/hooks.py)
        refuse_gradient_hooks(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_model = fake_clone(model, fake_mode, frozen=forward_only)
    hooks_seen = recorded_forward_hooks(fake_model)
    outputs = OutputRecord()
    if mixed_precision is not None and mixed_precision.param_dtype is not None:
        cast_parameters_on_read(fake_model, mixed_precision.param_dtype)
    fake_model.forward = tensor_outputs(fake_model, outputs, autocast, mixed_precision)  # type: ignore[method-assign]
    fake_args = tuple(_fakeify(x, fake_mode, forward_only) for x in example_inputs)
    fake_kwargs = {k: _fakeify(v, fake_mode, forward_only) for k, v in example_kwargs.items()}
    tied = tied_groups(model)
    containers = find_repeated_blocks(fake_model, fake_args, fake_kwargs, fake_mode, tied) if repeats else []
    groups = [group for group, _ in containers]
    if depth is not None:  # copy fewer blocks: the graph of the model cut to `depth` blocks
        groups = [replace(g, count=min(g.count, max(depth, MIN_BLOCKS))) for g in groups]
    watch = CheckpointWatch(fake_model)  # the user's torch.utils.checkpoint regions
    restore = cut_to_two_blocks(containers)
    guards = None
    try:
        exported = export_model(model, fake_model, fake_args, fake_kwargs)
        forward = exported.module()
        # checks torch.export defers to run time (torch._check on a value, as transformers' BART
        # family makes of its end-of-sequence count): guards too
        example = flat_values(tuple(example_inputs), example_kwargs)
        guards = split_value_guards(forward, node_where, example)
    except TraceError as err:
        watch.close()
        restore()
        # a read of a size the inputs' values decide (`if mask.nonzero().size(0) > 0:`) may be served
        # the same way, with the size made static by its count guard; if not, its own error stands
        size_read = err.hint == DATA_DEPENDENT_HINT and reads_a_size(err)
        if (err.hint != VALUE_DEPENDENT_HINT and not size_read) or not inputs_have_values(
            tuple(example_inputs), example_kwargs
        ):
            raise
        # Python reads a value: trace again on the example's real values, with the conditions as guards
        tensors = [x for x in pytree.tree_leaves((tuple(example_inputs), example_kwargs)) if isinstance(x, torch.Tensor)]
        real_device = tensors[0].device if tensors else torch.device("cpu")
        real_model = valued_copy(model, real_device)
        recorded_forward_hooks(real_model, hooks_seen)
        watch = CheckpointWatch(real_model)
        restore, groups = (lambda: None), []
        if mixed_precision is not None and mixed_precision.param_dtype is not None:
            cast_parameters_on_read(real_model, mixed_precision.param_dtype)
        real_model.forward = tensor_outputs(real_model, outputs, autocast, mixed_precision)  # type: ignore[method-assign]
        real_args, real_kwargs = private_inputs(tuple(example_inputs), example_kwargs, forward_only)
        try:
            # the trace draws what the serial model would from the generators' state now (a random
            # branch takes the outcome a call's guards compute), and leaves the state as it was
            with generators_kept(real_device):
                draws = eager_draw_states(eager_run(model, real_device, tuple(example_inputs), example_kwargs), real_device)
            with generators_kept(real_device), serial_draws(draws, real_device):
                exported = export_model(model, real_model, real_args, real_kwargs, reading_values=True)
        except (ModelAssertionError, ModelValueError) as raised:
            if raised.__cause__ is None or not serial_raises(model, tuple(example_inputs), example_kwargs, raised.__cause__):
                raise TraceError(
                    f"tracing {type(model).__name__} on the example's values raised what the model run "
                    f"eagerly does not: {raised.message}",
                    where=raised.where,
                    hint=VALUE_DEPENDENT_HINT,
                ) from raised
            raise
        except TraceError:
            if size_read:
                raise err from None
            raise
        unlifted = exported.module()
        try:
            guards = split_value_guards(unlifted, node_where, flat_values(tuple(example_inputs), example_kwargs))
        except TraceError:
            if size_read:
                raise err from None
            raise
        forward = fake_clone(unlifted, fake_mode, frozen=forward_only)
    finally:
        watch.close()
    warn_side_effect_hooks(hooks_seen)
    try:
        refuse_rnn_dropout(model, exported.graph_module.graph)
    except TraceError:
        restore()
        raise
    if outputs.functions:
        restore()
        raise custom_function_error(outputs.functions, exported.graph_module.graph, functions)
    if outputs.hidden:
        restore()
        raise hidden_tensors_error(model, outputs.hidden)
    decompositions = sharding_decompositions() if decompose else None
    in_spec = pytree.tree_flatten((tuple(example_inputs), example_kwargs))[1]
    joint = _Joint(model, fake_mode, fake_args, fake_kwargs, decompositions, tied, split_fused, in_spec, outputs)
    try:
        gm = joint.export(forward, groups)
    except NotRepeated:  # block 1's joint graph is not the self-contained run the copy needs
        restore()
        groups = []
        forward = export_model(model, fake_model, fake_args, fake_kwargs).module()
        split_value_guards(forward, node_where, flat_values(tuple(example_inputs), example_kwargs))  # the same guards
        gm = joint.export(forward, [])
    restore()
    foreign_buffers_as_constants(gm, forward, model)
    if not decompose:  # the decomposed nll_loss checks its targets' dtype; the kernel's fake does not
        refuse_target_dtypes(gm, type(model).__name__)
    mark_checkpoint_regions(gm, watch.regions(), groups)
    merge_tied(gm, tied)
    drop_identities(gm)
    simplify_strided(gm)
    merge_repeated_calls(gm)
    signature(gm).index_checks = find_index_checks(gm)
    verify_function_splits(gm, functions)
    signature(gm).value_guards = guards
    gm.graph.lint()
    # Python code for the joint graph is generated only when someone runs or prints it: the later
    # passes rewrite the graph and call recompile() several times, and none of them runs it.
    lazy = _LazyGraphModule.from_graphmodule(gm)
    lazy.meta.update(gm.meta)
    return lazy


@dataclass
class _Joint:
    """The joint export of torch.export's module, with what it needs besides the module."""

    model: nn.Module
    fake_mode: FakeTensorMode
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    decompositions: Any
    tied: list[list[str]]
    split_fused: bool
    in_spec: Any
    outputs: OutputRecord

    def export(self, forward: fx.GraphModule, groups: list[RepeatedBlocks]) -> fx.GraphModule:
        """Joint-export torch.export's module, annotate, and copy block 1 of each of `groups` (the
        module has blocks 0 and 1 of each)."""
        from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

        outputs_as_copies_of_views(forward)  # no output the joint export rebuilds from a hidden base
        windows_as_slices(forward)  # overlapping windows of as_strided: slices and a cat
        parts: dict[str, ParamPart] = {}
        if self.split_fused:
            parts = split_fused_linears(
                forward, self.fake_mode, [name for group in self.tied for name in group]
            )
        try:
            with contextlib.ExitStack() as stack:
                joint = aot_export_joint_with_descriptors(
                    stack, forward, self.args, self.kwargs, decompositions=self.decompositions
                )
                gm = joint.graph_module
        except Exception as exc:
            raise TraceError(
                f"building the joint forward+backward graph of {type(self.model).__name__} failed: "
                f"{type(exc).__name__}: {first_lines(exc)}",
                where=user_frame_of(exc),
                hint=joint_hint(exc),
            ) from exc
        gm.graph._codegen = fx.graph.CodeGen()  # flat positional calling convention, flat outputs
        _annotate(gm, self.model, in_spec=self.in_spec, parts=parts, outputs=self.outputs.structure)
        if groups:
            stamp_repeated_blocks(gm, groups)
        return gm


def fake_clone(
    model: nn.Module, fake_mode: FakeTensorMode, frozen: bool = False, device: torch.device | str = "cpu"
) -> nn.Module:
    """A structural copy of `model` whose parameters and buffers are fake tensors on `device` (CPU
    by default; `frozen`: none requires a gradient).

    Works for real and meta-device models alike; tied parameters stay the same object.
    """
    memo: dict[int, Any] = {}
    with fake_mode:
        tensors: list[torch.Tensor] = [t for _, t in model.named_parameters(remove_duplicate=False)]
        tensors += [t for _, t in model.named_buffers(remove_duplicate=False)]
        for tensor in tensors:
            if id(tensor) in memo:
                continue
            fake = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            if isinstance(tensor, nn.Parameter):
                memo[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad and not frozen)
            else:
                memo[id(tensor)] = fake
    return copy.deepcopy(model, memo)


def _fakeify(value: Any, fake_mode: FakeTensorMode, frozen: bool = False) -> Any:
    """A fake copy of an input; it requires grad as the input does (the joint graph then also
    computes its gradient), except in a forward-only trace (`frozen`)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cpu":  # a batch on a GPU or on meta: the trace runs on CPU fakes, as the weights do
        with fake_mode:
            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
        return fake.requires_grad_(value.requires_grad and not frozen)
    if frozen:
        value = value.detach()
    return fake_mode.from_tensor(value)


def _desc_kind(desc: Any) -> str:
    return type(desc).__name__ if desc is not None else "None"


def _annotate(
    gm: fx.GraphModule,
    model: nn.Module,
    in_spec: Any,
    parts: dict[str, ParamPart],
    outputs: OutputStructure | None,
) -> None:
    params: list[str] = []
    buffers: list[str] = []
    num_inputs = 0
    num_tangents = 0
    flags: list[fx.Node] = []
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    requires_grad.update({name: requires_grad[part.source] for name, part in parts.items()})
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        kind = _desc_kind(desc)
        role: Role
        if kind == "ParamAOTInput":
            role, name, index = "param", desc.target, None
            params.append(name)
        elif kind == "BufferAOTInput":
            role, name, index = "buffer", desc.target, None
            buffers.append(name)
        elif kind == "PlainAOTInput" and not isinstance(node.meta.get("val"), torch.Tensor):
            flags.append(node)  # a flag (bool, number, string, None, enum): a constant of this program
            continue
        elif kind == "PlainAOTInput":
            role, name, index = "input", None, num_inputs
            num_inputs += 1
        elif kind == "TangentAOTInput":
            role, name = "tangent", None
            index = getattr(getattr(desc, "output", None), "idx", num_tangents)
            num_tangents += 1
        else:
            raise TraceError(
                f"unsupported graph input kind {kind} ({node.name})",
                hint="models that mutate inputs or use RNG state in backward are not supported yet",
            )
        phase: Phase = "backward" if role == "tangent" else "forward"
        set_info(node, NodeInfo(role=role, phase=phase, param_name=name, input_index=index))
    # torch.export specializes the program on each non-tensor argument's value, so the graph reads
    # none of them: the program takes tensors only, and another value compiles another program
    # (the call key holds every non-tensor argument's value)
    for node in flags:
        if node.users:
            raise TraceError(
                f"the traced graph reads the non-tensor argument {node.name} as a value",
                hint="pass numbers the model computes with as tensors, or as constants of the model",
            )
        gm.graph.erase_node(node)

    output = next(n for n in gm.graph.nodes if n.op == "output")
    descs = output.meta.get("desc") or []
    outs = list(output.args[0])
    user: list[Any] = []
    updates: list[Any] = []  # new values of buffers the forward updates (BatchNorm running stats)
    buffer_updates: list[str] = []
    new_inputs: list[Any] = []  # new values of inputs the forward writes into (FSMT's labels)
    input_updates: list[int] = []
    grads: list[Any] = []
    grad_of: list[str] = []
    input_grads: list[Any] = []  # gradients of user inputs that require grad, after the parameters'
    input_grad_of: list[int] = []
    input_index = {
        getattr(n.meta["desc"], "idx", None): info(n).input_index
        for n in gm.graph.nodes
        if n.op == "placeholder" and info(n).role == "input"
    }
    for value, desc in zip(outs, descs):
        kind = _desc_kind(desc)
        if kind == "PlainAOTOutput":
            user.append(value)
        elif kind == "InputMutationAOTOutput" and _desc_kind(desc.mutated_input) == "BufferAOTInput":
            buffer_updates.append(desc.mutated_input.target)
            updates.append(value)
        elif kind == "GradAOTOutput" and _desc_kind(desc.grad_of) == "ParamAOTInput":
            grad_of.append(desc.grad_of.target)
            grads.append(value)
        elif kind == "GradAOTOutput" and _desc_kind(desc.grad_of) == "PlainAOTInput" and value is not None:
            input_grad_of.append(int(input_index[desc.grad_of.idx]))  # type: ignore[arg-type]
            input_grads.append(value)
        elif kind == "GradAOTOutput" or (kind == "None" and value is None):
            continue  # absent gradients: the input does not reach the outputs
        elif kind == "InputMutationAOTOutput" and _desc_kind(desc.mutated_input) == "PlainAOTInput":
            input_updates.append(int(input_index[desc.mutated_input.idx]))  # type: ignore[arg-type]
            new_inputs.append(value)
        elif kind == "InputMutationAOTOutput" and _desc_kind(desc.mutated_input) == "ParamAOTInput":
            raise _parameter_update_error(model, value, str(desc.mutated_input.target))
        else:
            raise TraceError(
                f"unsupported graph output kind {kind} ({desc})",
                hint="the forward may update its own buffers (BatchNorm running statistics), "
                "not its inputs or parameters in place",
            )
    # the inputs' and the buffers' new values count as forward outputs, after the user's (the
    # buffers' last: the planners find them at the end)
    num_user_outputs = len(user) + len(new_inputs) + len(updates)
    output.args = (tuple(user + new_inputs + updates + grads + input_grads),)
    set_info(output, NodeInfo(role="output", phase="backward"))

    tangent_nodes = {n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "tangent"}
    backward: set[fx.Node] = set(tangent_nodes)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        tag = node.meta.get("partitioner_tag")
        is_bwd = tag == "is_backward" or any(a in backward for a in node.all_input_nodes)
        if is_bwd:
            backward.add(node)
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            first = next((a.meta.get("val") for a in node.all_input_nodes), None)
            if isinstance(first, torch.Tensor):
                node.meta[MEMORY_ORDER_KEY] = tuple(first.dim_order())
        set_info(
            node,
            NodeInfo(
                role="compute",
                phase="backward" if is_bwd else "forward",
                module_path=module_path(node) or "<root>",
                source=user_frame(node.meta.get("stack_trace") or ""),
            ),
        )
    gm.meta[SIGNATURE_KEY] = JointSignature(
        param_names=params,
        aliases={},
        buffer_names=buffers,
        num_inputs=num_inputs,
        num_tangents=num_tangents,
        num_user_outputs=num_user_outputs,
        grad_of=grad_of,
        in_spec=in_spec,
        requires_grad=requires_grad,
        param_parts=parts,
        constants=_lift_constants(gm),
        outputs=outputs,
        buffer_updates=buffer_updates,
        input_updates=input_updates,
        input_grads=input_grad_of,
    )


def _parameter_update_error(model: nn.Module, value: Any, target: str) -> TraceError:
    """The forward writes into one of its parameters in place (nn.Embedding(max_norm=...)
    renormalizes the rows it looks up): each rank holds its own block or copy of the parameter,
    and a write the graph makes during forward is not one autopar can replay on them."""
    where = node_where(value) if isinstance(value, fx.Node) else None
    owner_path = target.rpartition(".")[0]
    owner = model.get_submodule(owner_path) if owner_path else model
    embedding = isinstance(owner, nn.Embedding) and owner.max_norm is not None
    cause = f" (nn.Embedding(max_norm={owner.max_norm}) renormalizes the rows it looks up)" if embedding else ""
    return TraceError(
        f"{type(model).__name__} writes into its parameter {target!r} in place during forward{cause}; "
        "each rank holds its own block or copy of a parameter, and autopar does not replay a "
        "forward's write into one",
        op=f"in-place update of parameter {target}",
        where=where,
        hint=(
            f"build {owner_path or 'the module'} without max_norm and bound the looked-up vectors out "
            "of place in forward (v = emb(x); v = v * (max_norm / v.norm(dim=-1, keepdim=True)).clamp(max=1)), "
            "or renormalize the weight yourself between training steps"
            if embedding
            else "update the parameter outside forward (between training steps, under torch.no_grad()), "
            "or compute the changed value out of place in forward"
        ),
    )


def _lift_constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tensors the forward made from Python data (export keeps them as `get_attr` attributes of the
    graph module, e.g. the empty tensors a transformers cache starts from) become placeholders of
    role "constant": every stage then treats them like a buffer that every rank holds whole, and
    the emitted program receives their values as inputs. Returns name -> real value."""
    constants: dict[str, torch.Tensor] = {}
    last_placeholder = next(n for n in reversed(gm.graph.nodes) if n.op == "placeholder")
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        value = getattr(gm, str(node.target))
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue
        name = str(node.target)
        with gm.graph.inserting_after(last_placeholder):
            lifted = gm.graph.placeholder(name)
        lifted.meta.update(node.meta)
        set_info(lifted, NodeInfo(role="constant", phase="forward", param_name=name))
        node.replace_all_uses_with(lifted)
        gm.graph.erase_node(node)
        delattr(gm, name)
        constants[name] = value.detach().clone()
        last_placeholder = lifted
    return constants
