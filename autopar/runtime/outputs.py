"""Outputs that behave like the serial model's: the loss and metrics computed outside the model.

A parallel module's non-scalar outputs are `OutputTensor`s: DTensors (global view, laid out as the
plan chose, so a batch- or class-split output stays split on every rank) that the user's own code
can mix with plain tensors, as torchvision's, timm's and diffusers' loops do
(`F.cross_entropy(pmodel(x), y)`, `(logits.argmax(-1) == y).float().mean().item()`).

Why a subclass and not torch's `implicit_replication()`: the user's loss runs after our call has
returned, and its backward runs later still, so a context would have to stay entered (process-wide
state) across the user's code. The subclass carries the behaviour with the value instead: every
ATen op with an `OutputTensor` among its arguments, forward or backward (autograd saves the
subclass instances), goes through `OutputTensor.__torch_dispatch__`, which

- treats plain tensors as replicated: every rank passes the same global batch, so a plain target
  is the whole target on every rank;
- runs the op on DTensor's own sharding rules only where they are exact for every layout
  (`_runs_split`): pointwise ops, views, sums/means/extrema, softmax;
- splits a loss op with a mean or sum reduction (mse, smooth-l1, huber, BCE, ...) into its
  elementwise form and a reduction, forward and backward: DTensor treats these ops as pointwise
  and divides by the local element count, which is silently wrong on split inputs (torch 2.13);
- splits nll_loss (cross entropy) into per-row losses and a sum divided by the weight of the
  targets counted on the whole target: DTensor's mean divides by the rows the rank holds;
- runs every other op (index, topk, sort, `.item()`, ...) on replicated inputs: the serial op on
  the whole value, correct whatever DTensor's rule says, at the price of a gather for that op.

`__torch_function__` adds what leaves the tensor world: a 0-d result (a loss, an accuracy) comes
back as a plain replicated tensor (its `.item()` needs no collective, so `if rank == 0:
print(loss.item())` works); `.tolist()`, `.numpy()`, `__array__` read the whole value (a collective:
every rank calls them, as every rank calls the model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils import _pytree as pytree

from autopar.core.errors import UsageError

aten = torch.ops.aten

# Ops whose DTensor rule is exact for every input layout (Partial included): besides every
# pointwise-tagged op and every view but as_strided.
_SPLIT_SAFE = {
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.amax.default, aten.amin.default, aten.argmax.default, aten.argmin.default,
    aten.any.default, aten.any.dim, aten.all.default, aten.all.dim,
    aten._softmax.default, aten._log_softmax.default,
    aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
    aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default,
    aten.clone.default, aten._to_copy.default, aten.detach.default, aten.alias.default,
    aten.expand.default, aten.view.default, aten._unsafe_view.default,
}  # fmt: skip

# Loss ops computed elementwise and then reduced; their `reduction` argument: 0 none, 1 mean, 2 sum.
_ELEMENTWISE_LOSSES = {
    aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
    aten.binary_cross_entropy.default, aten.soft_margin_loss.default,
    aten.binary_cross_entropy_with_logits.default,
}  # fmt: skip
_ELEMENTWISE_LOSS_GRADS = {
    aten.mse_loss_backward.default, aten.smooth_l1_loss_backward.default,
    aten.huber_loss_backward.default, aten.binary_cross_entropy_backward.default,
    aten.soft_margin_loss_backward.default,
}  # fmt: skip

_NLL = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}
_NLL_GRADS = {aten.nll_loss_backward.default, aten.nll_loss2d_backward.default}

# Tensor methods whose result leaves the tensor world: they read the whole (serial) value.
_VALUE_READS: set[Callable[..., Any]] = {
    torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__,
}  # fmt: skip


def _runs_split(func: torch._ops.OpOverload) -> bool:
    if func in _SPLIT_SAFE or torch.Tag.pointwise in func.tags:
        return True
    return func.is_view and func.overloadpacket is not aten.as_strided


class OutputTensor(DTensor):
    """A parallel module's output: a DTensor whose ops with plain tensors, and whose values read
    out, equal the serial model's (see the module doc)."""

    _gathered_view: bool = False  # set on a view that DTensor had to gather to cut (a copy)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _VALUE_READS:
            return func(_whole(args[0]), *args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if getattr(func, "__name__", "") in ("__get__", "__set__"):
            return result  # an attribute (`.grad`, `.shape`): as stored
        inputs = {id(a) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        return pytree.tree_map_only(DTensor, lambda r: _plain_scalar(r, inputs), result)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        _refuse_writing_a_gathered_view(func, args)
        leaves = pytree.tree_leaves((args, kwargs))
        mesh = next(a.device_mesh for a in leaves if isinstance(a, DTensor))
        local = any(isinstance(a, LocalBatchOutput) for a in leaves)
        if local:
            _refuse_plain(func, leaves)
        bases, base_kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: _as_dtensor(t, mesh), (args, kwargs)
        )
        if func in _ELEMENTWISE_LOSSES or func in _ELEMENTWISE_LOSS_GRADS:
            result = _reduced_loss(func, bases, base_kwargs)
        elif func in _NLL or func in _NLL_GRADS:
            result = _reduced_nll(func, bases, base_kwargs, mesh)
        elif (
            _runs_split(func)
            and not (func._schema.is_mutable and _partial_among(bases))
            and not _index_reduction_over_a_split(func, bases, base_kwargs)
        ):
            try:
                result = func(*bases, **base_kwargs)
            except RuntimeError:  # DTensor refuses the layout (unbind along a split dim): whole values;
                # a refusal after DTensor started a collective leaks it: such ops are routed above
                result = _on_replicated(func, bases, base_kwargs)
        else:
            result = _on_replicated(func, bases, base_kwargs)
        if func._schema.is_mutable:  # an in-place op hands back the tensor it changed, itself
            originals = {
                id(b): a
                for a, b in zip(pytree.tree_leaves((args, kwargs)), pytree.tree_leaves((bases, base_kwargs)))
            }
            result = pytree.tree_map_only(DTensor, lambda r: originals.get(id(r), r), result)
        outputs = pytree.tree_map_only(DTensor, _as_local_output if local else _as_output, result)
        if func.is_view and isinstance(outputs, OutputTensor) and not _aliases(result, bases[0]):
            outputs._gathered_view = True  # DTensor gathered to make this view: a copy, not a view
        return outputs


def _aliases(view: Any, base: Any) -> bool:
    if not isinstance(view, DTensor) or not isinstance(base, DTensor):
        return True
    return bool(
        view._local_tensor.untyped_storage().data_ptr() == base._local_tensor.untyped_storage().data_ptr()
    )


def _refuse_writing_a_gathered_view(func: Any, args: tuple[Any, ...]) -> None:
    """A view DTensor had to gather (a slice across a split dim) is a copy: an in-place op on it
    would leave the output it was cut from unchanged, which serial would change."""
    if not func._schema.is_mutable:
        return
    for argument, value in zip(func._schema.arguments, args):
        written = argument.alias_info is not None and argument.alias_info.is_write
        if written and getattr(value, "_gathered_view", False):
            raise UsageError(
                f"{func} writes into a view of a split autopar output that had to be gathered to be "
                "cut, so the output itself would not change as it does in serial",
                op=str(func),
                hint="compute out of place (torch.where, index_put, cat), or write into out.full_tensor()",
            )


class LocalBatchOutput(OutputTensor):
    """An output of a module called with `inputs="local"`: there a plain tensor is one rank's
    shard of the batch, not the whole value, so mixing one in is refused (not silently
    replicated); values read out whole as OutputTensor's do."""


def _refuse_plain(func: Any, leaves: list[Any]) -> None:
    for value in leaves:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.numel() > 1:
            raise UsageError(
                f'{func} mixes an output of a module called with inputs="local" with a plain '
                f"tensor of shape {list(value.shape)}: there a plain tensor is this rank's shard of "
                "the batch, and its global value is not known",
                op=str(func),
                hint="make it a DTensor: DTensor.from_local(y, mesh, [Shard(0)] * mesh.ndim) for this "
                "rank's shard of the targets, distribute_tensor(w, mesh, [Replicate()] * mesh.ndim) for a "
                "value every rank holds whole",
            )


def _partial_among(args: Any) -> bool:
    """DTensor refuses an in-place op that would have to change a partial sum's layout."""
    return any(
        isinstance(a, DTensor) and any(p.is_partial() for p in a.placements) for a in pytree.tree_leaves(args)
    )


def as_output(value: DTensor, local_inputs: bool = False) -> OutputTensor:
    """`value` as an OutputTensor (a LocalBatchOutput for a module called with local batches),
    through autograd (gradients flow back unchanged)."""
    return _AsOutput.apply(value, local_inputs)  # type: ignore[no-any-return]


class _AsOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: DTensor, local_inputs: bool) -> OutputTensor:  # type: ignore[override]
        ctx.mesh = value.device_mesh
        return _as_local_output(value) if local_inputs else _as_output(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # a plain gradient the user passed (`out.backward(torch.ones(...))`) is the whole value
        return (grad if isinstance(grad, DTensor) else _as_dtensor(grad, ctx.mesh)), None


def _below(local: torch.Tensor) -> torch.Tensor:
    """A local block to wrap below autograd, where its requires_grad flag means nothing: detached,
    as torch asks (else it warns on every output, "To construct DTensor from torch.Tensor...")."""
    return local.detach() if local.requires_grad else local


_INDEX_REDUCTIONS = {aten.argmax.default, aten.argmin.default}


def _index_reduction_over_a_split(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """argmax/argmin across a split dim (or over every dim) go straight to the whole value. On a
    multi-axis layout (logits (Shard(2), Shard(0))) DTensor's rule starts a collective and then
    fails a reshape (torch 2.13); the `except RuntimeError` fallback gave the right value but the
    started collective was never waited (c10d's registry grew by one per call, every rank warned at
    exit), and nothing can wait on it afterwards. Along a whole dim they stay split."""
    if func not in _INDEX_REDUCTIONS:
        return False
    value = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        return not all(p.is_replicate() for p in value.placements)
    dim = dim % max(value.dim(), 1)
    return any(p.is_shard(dim) or p.is_partial() for p in value.placements)


def _as_output(value: DTensor) -> OutputTensor:
    """Below autograd: the same local block and layout, as the subclass."""
    if isinstance(value, OutputTensor):
        return value
    return OutputTensor(_below(value._local_tensor), value._spec, requires_grad=False)  # type: ignore[call-arg]


def _as_local_output(value: DTensor) -> OutputTensor:
    if isinstance(value, LocalBatchOutput):
        return value
    return LocalBatchOutput(_below(value._local_tensor), value._spec, requires_grad=False)  # type: ignore[call-arg]


def _as_dtensor(value: torch.Tensor, mesh: Any) -> DTensor:
    """Below autograd, every tensor argument as a base DTensor (DTensor's fast path takes those):
    a plain one is the same value on every rank, so replicated."""
    if isinstance(value, DTensor):
        if type(value) is DTensor:
            return value
        return DTensor(_below(value._local_tensor), value._spec, requires_grad=False)  # type: ignore[call-arg]
    meta = TensorMeta(shape=value.shape, stride=value.stride(), dtype=value.dtype)
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
    return DTensor(_below(value), spec, requires_grad=False)  # type: ignore[call-arg]


def _replicated(value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    if all(p.is_replicate() for p in value.placements):
        return value
    return value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)


def _on_replicated(func: Any, args: Any, kwargs: Any) -> Any:
    """The op on whole values: torch's own op on the replicated local tensors, which are the whole
    values, so exact whatever DTensor's rule (or lack of one) says. An in-place op changes the
    whole copy, which is then laid out back into the tensor it was meant to change."""
    leaves = pytree.tree_leaves((args, kwargs))
    mesh = next(a.device_mesh for a in leaves if isinstance(a, DTensor))
    whole_args, whole_kwargs = pytree.tree_map_only(DTensor, _replicated, (args, kwargs))
    wholes = [d for d in pytree.tree_leaves((whole_args, whole_kwargs)) if isinstance(d, DTensor)]
    local_args, local_kwargs = pytree.tree_map_only(
        DTensor, lambda d: d._local_tensor, (whole_args, whole_kwargs)
    )
    result = func(*local_args, **local_kwargs)
    by_local = {id(d._local_tensor): d for d in wholes}  # an in-place op hands back its argument
    result = pytree.tree_map_only(
        torch.Tensor, lambda t: by_local[id(t)] if id(t) in by_local else _as_dtensor(t, mesh), result
    )
    if not func._schema.is_mutable:
        return result
    written = {id(w): a for a, w in zip(leaves, pytree.tree_leaves((whole_args, whole_kwargs))) if w is not a}
    for copy_id, target in written.items():
        whole = next(w for w in pytree.tree_leaves((whole_args, whole_kwargs)) if id(w) == copy_id)
        target._local_tensor.copy_(_laid_out(whole, target.placements))
    return pytree.tree_map_only(DTensor, lambda r: written.get(id(r), r), result)


def _laid_out(whole: DTensor, placements: Any) -> torch.Tensor:
    """This rank's block of replicated `whole` laid out as `placements`; a partial sum is the
    whole value on the first rank of its mesh axis and zero on the others (exact, unlike a
    division), and an average, max or min is the whole value on every rank."""
    mesh = whole.device_mesh
    kept = [Replicate() if p.is_partial() else p for p in placements]
    local = whole.redistribute(mesh, kept)._local_tensor
    coordinate = tuple(mesh.get_coordinate() or ())
    for axis, p in enumerate(placements):
        if p.is_partial() and getattr(p, "reduce_op", "sum") == "sum" and coordinate[axis] != 0:
            return torch.zeros_like(local)
    return local


def _reduced_loss(func: Any, args: Any, kwargs: Any) -> Any:
    """A loss op (or its gradient) with a mean or sum reduction, as the elementwise loss and a
    reduction whose DTensor rules are exact on split inputs."""
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args)) | dict(kwargs)
    reduction = int(values.get("reduction", 1))
    values["reduction"] = 0
    if func in _ELEMENTWISE_LOSS_GRADS and reduction != 0:
        # grad_output is the 0-d gradient of the reduced loss: spread over every element
        grad = aten.expand.default(values["grad_output"], list(values["self"].shape))
        values["grad_output"] = aten.div.Scalar(grad, values["self"].numel()) if reduction == 1 else grad
    try:
        result = func(**values)
    except NotImplementedError:  # DTensor has no rule for the op
        return _on_replicated(func, args, kwargs)
    if func in _ELEMENTWISE_LOSS_GRADS or reduction == 0:
        return result
    return aten.mean.default(result) if reduction == 1 else aten.sum.default(result)


def _reduced_nll(func: Any, args: Any, kwargs: Any, mesh: Any) -> Any:
    """nll_loss (cross entropy's second half) with a mean or sum reduction, as the per-row losses
    (exact on split rows) and a sum divided by the weight of the targets counted on the whole
    target: DTensor's mean divides by the weight of the rows a rank holds."""
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args)) | dict(kwargs)
    reduction = int(values["reduction"])
    if reduction == 0:
        return _split_or_replicated(func, args, kwargs)
    target = _replicated(values["target"])._local_tensor
    counted = target != values["ignore_index"]
    weight = values.get("weight")
    if weight is None:
        weights = counted.to(values["self"].dtype)
    else:
        weights = _replicated(weight)._local_tensor[torch.where(counted, target, 0)] * counted
    total = _as_dtensor(weights.sum().to(values["self"].dtype), mesh)
    values["reduction"] = 0
    if func in _NLL:
        try:
            rows, _ = func(**values)
        except NotImplementedError:  # DTensor has no rule for the op
            return _on_replicated(func, args, kwargs)
        loss = aten.sum.default(rows)
        return (aten.div.Tensor(loss, total) if reduction == 1 else loss), total
    grad = values["grad_output"]
    grad = aten.div.Tensor(grad, total) if reduction == 1 else grad
    values["grad_output"] = aten.expand.default(grad, list(target.shape))
    return _split_or_replicated(func, (), values)


def _split_or_replicated(func: Any, args: Any, kwargs: Any) -> Any:
    try:
        return func(*args, **kwargs)
    except NotImplementedError:  # DTensor has no rule for the op
        return _on_replicated(func, args, kwargs)


def _whole(value: Any) -> torch.Tensor:
    if isinstance(value, DTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return value.full_tensor()
    return value  # type: ignore[no-any-return]


def _plain_scalar(value: DTensor, inputs: set[int]) -> Any:
    """A 0-d result (a loss, a metric) as a plain replicated tensor, differentiably; an argument
    handed back (an in-place op's `self`) stays what it is."""
    if value.dim() != 0 or id(value) in inputs:
        return value
    with torch._C.DisableTorchFunctionSubclass():
        return _PlainScalar.apply(value)


class _PlainScalar(torch.autograd.Function):
    """Whole value out; its gradient goes back in as an OutputTensor, so that the backward ops it
    meets mix with the plain tensors autograd saved (a target) as the forward ops did."""

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = value._spec
        return _replicated(value)._local_tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        spec = ctx.spec
        mesh = spec.mesh
        meta = TensorMeta(shape=grad.shape, stride=grad.stride(), dtype=grad.dtype)
        replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
        return OutputTensor(_below(grad), replicated, requires_grad=False)  # type: ignore[call-arg]
