"""torch.export of the user's model for the trace (`autopar.passes.trace`): the export itself, on
fake tensors or on the example's real values, with the routes and quiet contexts it needs and the
errors it raises named for the user; and the constants an export on real values leaves behind."""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from autopar.core.meta import NodeInfo, info, set_info, signature
from autopar.passes.ctc import CTCRoute
from autopar.passes.eager_checks import model_error
from autopar.passes.host_random import without_host_draws
from autopar.passes.masked_writes import is_view_op
from autopar.passes.trace_errors import export_error, raised_in_user_code, without_partial_graph
from autopar.passes.value_guards import quiet_symbolic_shapes, reading_real_values

_DATA_GETTER = torch._C.TensorBase.data.__get__  # type: ignore[attr-defined]


class DataAsDetach(TorchFunctionMode):
    """`tensor.data` read as `tensor.detach()` while torch.export traces: the same values without
    the autograd history, but `.data` makes its tensor without dispatching an op, so the export
    cannot see where it comes from and lifts it as a constant (a fake one: "We found a fake tensor
    in the exported program constant's list"; on real values, the constant of a model that reads
    an activation's range, I-BERT's `x_act.data.min()`). `detach` is an op the graph records."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func == _DATA_GETTER:  # a fresh method-wrapper each time: equal, never identical
            return args[0].detach()
        return func(*args, **(kwargs or {}))


_NONZERO = (torch.Tensor.nonzero, torch.nonzero)


class NonzeroAsColumns(TorchFunctionMode):
    """`x.nonzero(as_tuple=True)` (and one-argument `torch.where(x)`) computed as the columns of
    `x.nonzero()` while torch.export traces: the same index tensors, but torch's tuple form loses
    the unknown row count of its result on the example's real values ("Pending unbacked symbols
    {u1} not in returned outputs", Longformer's global-attention indices), where the plain
    `nonzero` keeps it, so that autopar can pin it as a count guard (`autopar.passes.value_guards`).
    A 0-d `x` is left to torch (its tuple form treats it as 1-d)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        as_tuple = (func in _NONZERO and kwargs.get("as_tuple") is True and set(kwargs) == {"as_tuple"}) or (
            func is torch.where and len(args) == 1 and not kwargs
        )
        x = args[0] if args else None
        if as_tuple and isinstance(x, torch.Tensor) and x.dim() > 0:
            found = x.nonzero()
            return tuple(found[:, i] for i in range(x.dim()))
        return func(*args, **kwargs)


def foreign_buffers_as_constants(gm: fx.GraphModule, forward: nn.Module, model: nn.Module) -> None:
    """Tensors the forward made on the example's real values (`torch.tensor(pad_id)` in
    transformers' `shift_tokens_right`) come out of torch.export's unlifted module as attributes
    the joint trace reads as buffers, which the user's model does not have: they become constants
    of the program (role "constant", their values in the signature), as the tensors a trace on
    fake values makes do (`_lift_constants`)."""
    own = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    sig = signature(gm)
    for node in gm.graph.nodes:
        if node.op != "placeholder" or info(node).role != "buffer" or info(node).param_name in own:
            continue
        name = str(info(node).param_name)
        owner_path, _, attr = name.rpartition(".")
        value = getattr(forward.get_submodule(owner_path), attr)
        set_info(node, NodeInfo(role="constant", phase="forward", param_name=name))
        sig.constants[name] = value.detach().clone()
        sig.buffer_names.remove(name)


def export_model(
    model: nn.Module,
    fake_model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reading_values: bool = False,
) -> Any:
    """torch.export of `fake_model` (the user's `model` with fake tensors); `reading_values`: of a
    copy holding the real tensors, run on the example's real values, which decide every value
    Python reads, each condition kept as a runtime assertion (`autopar.passes.value_guards`)."""

    def run() -> Any:
        # CTCRoute: F.ctc_loss as autopar's fixed-shape op (torch's sizes an output by values)
        with warnings.catch_warnings(), CTCRoute(), DataAsDetach(), NonzeroAsColumns(), quiet_symbolic_shapes(), without_partial_graph():
            # nn.LSTM / nn.GRU re-assign their weight list
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights")
            if not reading_values:
                return torch.export.export(fake_model, args, kwargs, strict=False)
            with reading_real_values():
                return torch.export.export(fake_model, args, kwargs, strict=False)

    def checked() -> Any:
        try:
            return run()
        except (AssertionError, ValueError) as exc:
            if reading_values and raised_in_user_code(exc):  # the model's own check failed on these values
                raise model_error(model, exc) from exc
            raise export_error(model, exc, fake_model) from exc
        except Exception as exc:  # torch raises many types; the user needs the location and the cause
            raise export_error(model, exc, fake_model) from exc

    # a numpy or Python random draw would be a constant of the program: refused (host_random)
    return without_host_draws(type(model).__name__, checked)


def outputs_as_copies_of_views(module: fx.GraphModule) -> int:
    """Where several outputs of `module` (torch.export's module) are views of one intermediate
    value, make all but the first copies, in place; returns how many. The joint export returns
    the base of such views as an extra output, with a tangent of the base's shape, for torch's
    runtime to rebuild the views (ProphetNet's logits and n-gram logits, slices of its predicting
    streams); a copy is the same values, and a lone view of an intermediate the joint export
    already returns as a plain output. An output that is a view of another output (CLIP's
    `logits_per_image = logits_per_text.t()`) gets no tangent of its own from the joint export,
    which counts on torch's runtime to replay the view: its gradient (a loss on it alone) was
    dropped, so the later of the two is copied too. Views of inputs and weights are left: torch
    handles those without an extra output."""
    graph = module.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    seen: dict[fx.Node, fx.Node] = {}  # base -> the first output viewing it
    copies: dict[fx.Node, fx.Node] = {}

    def base_of(node: fx.Node) -> fx.Node | None:
        base = node
        while base.op == "call_function" and (is_view_op(base) or base.target is operator.getitem):
            if not base.args or not isinstance(base.args[0], fx.Node):
                return None
            base = base.args[0]
        return base if base is not node and base.op == "call_function" else None

    def copied(node: fx.Node) -> fx.Node:
        # an output that is itself the base of another output's view counts as viewing itself
        base = base_of(node) or (node if node.op == "call_function" else None)
        if base is None or seen.setdefault(base, node) is node:
            return node
        if node not in copies:
            with graph.inserting_before(output):
                copies[node] = graph.call_function(torch.ops.aten.clone.default, (node,))
            copies[node].meta.update(node.meta)
        return copies[node]

    output.args = fx.map_arg(output.args, copied)
    if copies:
        graph.lint()
        module.recompile()
    return len(copies)


def windows_as_slices(module: fx.GraphModule) -> int:
    """`as_strided` that cuts a dense tensor into overlapping windows (Longformer's and LED's
    sliding-window chunks: windows of W rows every `step` rows, W a multiple of `step`) rewritten
    as a view into blocks of `step` rows and the cat of W / step slices of them, one block further
    each: the same values through ops that have rules, where an `as_strided` of overlapping
    windows has none; one that is its input as it is (a single window) replaced by the input.
    `as_strided` reads storage, not the tensor's dims: a base whose dims are a permutation of its
    memory order (Longformer's query and key, `transpose(1, 2).reshape(b * h, s, d)` of a
    sequence-major projection, once the window is smaller than the sequence) is permuted to that
    order first, and the windows permuted back. Only where nothing writes into the windows in
    place (the cat is a copy, the `as_strided` a view); returns how many were rewritten."""
    graph = module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.as_strided.default:
            continue
        if _same_view(node) and not _written_through(node):  # one window: the tensor as it is
            node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
            graph.erase_node(node)
            rewritten += 1
            continue
        window = _window_of(node)
        if window is None or _written_through(node):
            continue
        base_order, out_order, k, step, blocks_shape = window
        size = [(_ints(node.args[1]) or [])[d] for d in out_order]
        aten = torch.ops.aten
        new: list[fx.Node] = []
        with graph.inserting_before(node):
            base = node.args[0]
            if base_order != sorted(base_order):
                new.append(base := graph.call_function(aten.permute.default, (base, base_order)))
            new.append(blocks := graph.call_function(aten.view.default, (base, blocks_shape)))
            parts = [
                graph.call_function(aten.slice.Tensor, (blocks, k, j, j + size[k]))
                for j in range(size[k + 1] // step)
            ]
            new += [*parts, graph.call_function(aten.cat.default, (parts, k + 1))]
            if out_order != sorted(out_order):
                back = [out_order.index(d) for d in range(len(out_order))]
                new.append(graph.call_function(aten.permute.default, (new[-1], back)))
        base_val = node.args[0].meta["val"]  # type: ignore[union-attr]
        with base_val.fake_mode if hasattr(base_val, "fake_mode") else contextlib.nullcontext():
            for made in new:  # each new node's value: its op on its inputs' values
                made.meta.update({key: value for key, value in node.meta.items() if key != "val"})
                args = fx.map_arg(made.args, lambda n: n.meta["val"])
                made.meta["val"] = made.target(*args)  # type: ignore[operator]
        node.replace_all_uses_with(new[-1])
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
        module.recompile()
    return rewritten


def _window_of(node: fx.Node) -> tuple[list[int], list[int], int, int, list[int]] | None:
    """(base's memory order, the windows' memory order, k, step, blocks' shape) when
    `as_strided(x, size, stride, 0)` reads, along dims k and k+1 of the windows in memory order,
    windows of size[k+1] rows every `step` rows of a dense x (its dims a permutation of a
    contiguous tensor's, from storage offset 0) that they cover exactly. The blocks' shape is that
    of x permuted to its memory order, whose view it is."""
    base = node.args[0]
    val = base.meta.get("val") if isinstance(base, fx.Node) else None
    offset = node.args[3] if len(node.args) > 3 else 0
    if not isinstance(val, torch.Tensor) or val.storage_offset() != 0 or offset not in (0, None):
        return None
    base_order = _memory_order(list(val.shape), list(val.stride()))
    size, stride = _ints(node.args[1]), _ints(node.args[2])
    if not base_order or size is None or stride is None:
        return None
    out_order = _memory_order(size, stride, dense=False)
    size, stride = [size[d] for d in out_order], [stride[d] for d in out_order]
    for k in range(len(size) - 1):
        count, width, inner = size[k], size[k + 1], stride[k + 1]
        if inner <= 0 or stride[k] % inner or count < 2:
            continue
        step = stride[k] // inner
        if step >= width or width % step:
            continue  # not overlapping, or windows not made of whole blocks
        length = (count - 1) * step + width
        merged_size = [*size[:k], length, *size[k + 2 :]]
        merged_stride = [*stride[:k], inner, *stride[k + 2 :]]
        if math.prod(merged_size) != val.numel() or not _row_major(merged_size, merged_stride):
            continue
        return base_order, out_order, k, step, [*size[:k], length // step, step, *size[k + 2 :]]
    return None


def _memory_order(shape: list[int], stride: list[int], dense: bool = True) -> list[int]:
    """The dims by decreasing stride, those of one element last (their stride means nothing):
    the permutation that makes a dense tensor contiguous. `dense`: [] when the elements are not
    one dense block (a slice, an expanded dim)."""
    order = sorted(range(len(shape)), key=lambda d: (shape[d] == 1, -stride[d], d))
    if dense and not _row_major([shape[d] for d in order], [stride[d] for d in order]):
        return []
    return order


def _row_major(size: list[int], stride: list[int]) -> bool:
    """Whether `stride` is the contiguous layout of `size` (a dim of one element may have any)."""
    return all(n == 1 or s == t for n, s, t in zip(size, stride, _row_major_strides(size)))


def _same_view(node: fx.Node) -> bool:
    """Whether `as_strided(x, size, stride)` is x itself: x's shape, and x's strides on every dim
    longer than 1 (Longformer's chunks of a sequence one window long)."""
    base = node.args[0]
    val = base.meta.get("val") if isinstance(base, fx.Node) else None
    size, stride = _ints(node.args[1]), _ints(node.args[2])
    offset = node.args[3] if len(node.args) > 3 else None
    if not isinstance(val, torch.Tensor) or size is None or stride is None or size != list(val.shape):
        return False
    if offset is not None and offset != val.storage_offset():
        return False
    return all(n == 1 or s == t for n, s, t in zip(size, stride, val.stride()))


def _ints(value: Any) -> list[int] | None:
    """`value` as a list of Python ints, if it is a list or tuple of them."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        return None
    return [int(v) for v in value]


def _row_major_strides(size: list[int]) -> list[int]:
    strides, running = [], 1
    for n in reversed(size):
        strides.append(running)
        running *= n
    return strides[::-1]


def _written_through(node: fx.Node) -> bool:
    """Whether an op writes in place into `node`'s value or a view of it."""
    stack = list(node.users)
    while stack:
        user = stack.pop()
        schema = getattr(user.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if user.op == "call_function" and (is_view_op(user) or user.target is operator.getitem):
            stack.extend(user.users)
    return False
