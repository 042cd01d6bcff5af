"""Where a trace failed and what to tell the user: the user's frame (a library model's file and
line, and the user's own call that led there), the module path of a node, and the hint for each
kind of failure torch.export and the joint trace raise (`autopar.passes.trace`)."""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch.fx as fx
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from autopar.core.errors import AutoparError, ModelAssertionError, ModelValueError, TraceError

_TORCH_FRAME = re.compile(r"/(torch|torchvision)/")
_LIBRARY_FRAME = re.compile(r"/(site-packages|dist-packages)/")  # a library model's own code
# autopar's frames are never the user's: the package's and the passes folder's, as imported (through
# the source tree's symlink autopar/passes) or resolved (passes/ itself, which is inside no package
# folder: resolving __file__ up two levels would name the repository root, examples/ and all).
_OWN_DIRS = tuple(
    sorted(
        {
            f"{folder}{os.sep}"
            for folder in (
                Path(inspect.getfile(TraceError)).resolve().parents[1],
                Path(__file__).parent,
                Path(__file__).resolve().parent,
            )
        }
    )
)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def export_error(model: nn.Module, exc: BaseException, traced: nn.Module | None = None) -> TraceError:
    """The error for a failed torch.export of `model` (`traced`: the copy the export ran, whose
    submodules a failure's frames hold)."""
    packed = packed_rnn(exc, traced or model)
    if packed is not None:
        rnn, path = packed
        return TraceError(
            f"{type(rnn).__name__} {path!r} of {type(model).__name__} is called on a PackedSequence "
            "(pack_padded_sequence): its packed rows and batch_sizes are counted from the lengths' "
            "values, and a plan is made for fixed shapes",
            op=f"{type(rnn).__name__} on a PackedSequence",
            where=user_frame_of(exc),
            hint=PACKED_SEQUENCE_HINT,
        )
    site = user_frame_of(exc)
    module = failing_module(exc, traced or model)
    return TraceError(
        f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {first_lines(exc)}",
        op=failing_op(exc),
        where=f"{module or '<root>'} @ {site}" if module is not None and site else site,
        hint=trace_hint(
            exc,
            "make the forward traceable by torch.export (no data-dependent Python control flow on "
            "tensor values, no unsupported Python side effects); see the torch.export docs",
        ),
    )


# torch's note on a data-dependent guard: "Caused by: (_refs/__init__.py:4264 in unbind)"
_CAUSED_BY = re.compile(r"Caused by: \(\S+:\d+ in (\w+)\)")


def failing_op(exc: BaseException) -> str | None:
    """The torch function a data-dependent guard failed in (`unbind` where Python iterates over a
    tensor whose size values set, LongcatFlash's loop over the experts hit), as torch's message
    names it; else the innermost torch frame's function under the user's frame; None if neither."""
    found = _CAUSED_BY.search(str(exc))
    if found:
        return found.group(1)
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if _TORCH_FRAME.search(f.filename)]
    return inside[-1].name if inside and not raised_in_user_code(exc) else None


def failing_module(exc: BaseException, model: nn.Module) -> str | None:
    """The module path of the innermost `forward` of `model` (or one of its submodules) the
    failure passed through: "" for the model itself, None where no frame is one of its modules."""
    names = {id(module): name for name, module in model.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


NO_EXAMPLE_HINT = (
    "no example batch was given (example_inputs=(), example_kwargs=None), so the model was traced on "
    "a call with no arguments; pass a batch as the model's calls pass it: example_inputs=(x,) for "
    "positional arguments, example_kwargs={\"input_ids\": ids, ...} for keywords"
)


def without_example(error: TraceError | ModelAssertionError | ModelValueError) -> AutoparError:
    """`error` (the trace's failure, or the model's own check) where the caller gave no example
    inputs at all: the same error with the hint to pass some. A model that needs an argument
    fails on the empty call, and the failure's own hint (the batch, the model's traceability)
    would send the user looking in the wrong place."""
    return type(error)(error.message, op=error.op, where=error.where, layouts=error.layouts, hint=NO_EXAMPLE_HINT)


def raised_in_user_code(exc: BaseException) -> bool:
    """Whether the innermost frame of `exc` is outside torch: an `assert` the model wrote."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and not _TORCH_FRAME.search(frames[-1].filename)


def node_where(node: fx.Node) -> str:
    return f"{module_path(node) or '<root>'} @ {user_frame(node.meta.get('stack_trace') or '')}"


def module_path(node: fx.Node) -> str:
    """The deepest module the node's op was called in ("" at the root)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def user_frame(stack_trace: str) -> str:
    """Where the op was called: the innermost frame outside torch (a library model's modeling file
    when the op sits inside one), and then the innermost frame of the user's own code that led
    there, if that is another one."""
    frames = [(path, int(line), fn) for path, line, fn in _FRAME.findall(stack_trace)]
    return _call_site(frames)


def user_frame_of(exc: BaseException) -> str:
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    site = _call_site(frames)
    if not site:  # raised while replaying a graph: torch quotes the user's frames in the message
        quoted = [(path, int(line), fn) for path, line, fn in _FRAME.findall(str(exc))]
        site = _call_site(quoted)
    return site


_DATA_DEPENDENT = re.compile(r"DynamicOutputShape|GuardOnDataDependent|data-dependent|unbacked", re.IGNORECASE)
DATA_DEPENDENT_HINT = (
    "an op's output size depends on tensor values (nonzero, torch.where(mask), boolean indexing: "
    "for example tokens per expert in a mixture of experts); a plan is made for fixed shapes, so "
    "route every token through every expert and zero the others with dense gates (scatter the "
    "top-k weights into a tokens x experts matrix), or give each expert a fixed capacity; dropless, "
    "sort the (token, expert) pairs by expert and multiply every expert's rows with one "
    "torch._grouped_mm(rows, weights (E, K, N), offs=rows per expert cumulated) in bfloat16 "
    "(examples/torch_models.py GroupedMoE), whose experts autopar can split over ranks"
)


# a guard on a value read by Python (`if`/`assert` on a tensor, .item()), not on a size
_VALUE_GUARD = re.compile(r"GuardOnDataDependentSymNode.*Size-like symbols: none", re.DOTALL)
VALUE_DEPENDENT_HINT = (
    "Python code reads a tensor's value here (if or assert on a tensor, .item(), bool()): one graph "
    "is compiled for every batch, so a branch chosen by values cannot be traced; compute both sides "
    "with torch.where, check the inputs outside forward (in the data pipeline), and turn off random "
    "layer skipping (LayerDrop: layerdrop=0 in the model's config)"
)

ITEM_HINT = (
    "Python reads a tensor's value here (.item(), float(t), int(t)): one graph is compiled for every "
    "batch, and a Python number read from a batch's values cannot be part of it; keep it a tensor "
    "(x / x.abs().amax() instead of x / x.abs().max().item()), or compute it outside forward and "
    "pass it as an input; "
    + VALUE_DEPENDENT_HINT
)


CAUSAL_MASK_HINT = (
    "torch's nn.Transformer / TransformerEncoder / TransformerDecoder compare the mask you pass with a "
    "causal mask to detect causality (torch.nn.modules.transformer._detect_is_causal_mask), which reads "
    "the mask's values; say it instead: pass tgt_is_causal=True (nn.Transformer, TransformerDecoder) or "
    "is_causal=True / src_is_causal=True (TransformerEncoder, nn.Transformer's encoder) with the causal "
    "mask, and torch skips the comparison"
)
CTC_HINT = (
    "F.ctc_loss with targets concatenated into one 1-D tensor: which sample owns which target is read "
    "from target_lengths' values, which the plan cannot know ahead; pad the targets to a (batch, "
    "longest target) tensor (any filler past each length), which autopar traces and splits by batch, "
    "or compute the loss outside the parallel module on its output (loss = F.ctc_loss(pmodel(x), ...))"
)


def _frames_of(exc: BaseException) -> list[str]:
    """Function names of every frame in `exc`'s traceback and those of its causes."""
    names: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names += [frame.name for frame in traceback.extract_tb(current.__traceback__)]
        current = current.__cause__ or current.__context__
    return names


# a guard on a size that values decide (`nonzero(...).size(0) > 0`): torch names its size-like symbol
_SIZE_GUARD = re.compile(r"GuardOnDataDependentSymNode.*Size-like symbols: (?!none)", re.DOTALL)


def reads_a_size(err: BaseException) -> bool:
    """Whether `err` (or its cause) is torch.export's refusal of Python branching on a size the
    inputs' values decide, as DeBERTa's classifier loss does on its count of labelled rows."""
    current: BaseException | None = err
    while current is not None:
        if _SIZE_GUARD.search(f"{type(current).__name__}: {current}"):
            return True
        current = current.__cause__
    return False


def joint_hint(exc: BaseException) -> str:
    """The hint for a failed joint forward+backward export: a value read by Python (`.item()`,
    which torch.export traced but the joint export on fake tensors cannot run) is the value-read
    hint, not the differentiability one."""
    if "_local_scalar_dense" in f"{type(exc).__name__}: {exc}":
        return ITEM_HINT
    return trace_hint(exc, "the model must be differentiable with a single output that backward() is called on")


# torch.export's refusal of an argument whose class is no pytree container (a user's dataclass batch)
_UNSUPPORTED_INPUT = re.compile(r"Unsupported input type <class '([\w.]+)'>")
UNSUPPORTED_INPUT_HINT = (
    "register the class of that argument before parallelize: torch.export.register_dataclass({name}) "
    "for a dataclass (torch.utils._pytree.register_pytree_node for another class); the trace and the "
    "parallel module then take it as the model does. Or pass its tensors as separate arguments"
)


def trace_hint(exc: BaseException, otherwise: str) -> str:
    """The hint for what failed: torch's causal-mask detection, CTC's alignment table, a value read
    by Python, a data-dependent shape; else `otherwise`."""
    text = f"{type(exc).__name__}: {exc}"
    unsupported = _UNSUPPORTED_INPUT.search(text)
    if unsupported:
        return UNSUPPORTED_INPUT_HINT.format(name=unsupported.group(1).rpartition(".")[2])
    if "_detect_is_causal_mask" in _frames_of(exc):
        return CAUSAL_MASK_HINT
    if "_ctc_loss" in text:
        return CTC_HINT
    if _VALUE_GUARD.search(text):
        return VALUE_DEPENDENT_HINT
    return DATA_DEPENDENT_HINT if _DATA_DEPENDENT.search(text) else otherwise


def _call_site(frames: Sequence[tuple[str, int, str]]) -> str:
    """`frames` outermost first -> "file:line in fn", with " (from file:line in fn)" for the user's
    code when the call site is in a library."""
    outside = [f for f in frames if not _TORCH_FRAME.search(f[0]) and not f[0].startswith(_OWN_DIRS)]
    if not outside:
        return ""
    path, line, fn = outside[-1]
    site = f"{path}:{line} in {fn}"
    if _LIBRARY_FRAME.search(path):
        user = [f for f in outside if not _LIBRARY_FRAME.search(f[0])]
        if user:
            site += f" (from {user[-1][0]}:{user[-1][1]} in {user[-1][2]})"
    return site


def first_lines(exc: BaseException, n: int = 6) -> str:
    return "\n".join(str(exc).strip().splitlines()[:n])


@contextlib.contextmanager
def without_partial_graph() -> Iterator[None]:
    """torch.export prints the partial graph of a failed export to stderr (a page of generated
    code per value Python read): autopar's own error says where and why, and a failed export that
    autopar retries on real values (`autopar.passes.value_guards`) is not the user's to read.
    Everything else written to stderr meanwhile (warnings) still reaches it."""
    buffer = io.StringIO()
    failure: BaseException | None = None
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException as exc:
        failure = exc
        raise
    finally:
        text = buffer.getvalue()
        partial = getattr(failure, "partial_fx_graph", None)
        if partial is not None:
            text = text.replace(f"{partial}\n", "")  # each of torch's two wrappers prints it
        if text:
            sys.stderr.write(text)


def refuse_rnn_dropout(model: nn.Module, graph: fx.Graph) -> None:
    """Refuse a multi-layer nn.LSTM / nn.GRU / nn.RNN with dropout between its layers, in training.
    torch's own decomposition of the rnn ops (`torch._decomp`'s `_rnn_helper`, which torch.export
    applies) drops the inter-layer dropout: the parallel module would train as if dropout were 0,
    silently unlike serial. `graph` is torch.export's graph: only an RNN the forward calls counts."""
    for path, module in model.named_modules():
        if not (isinstance(module, nn.RNNBase) and module.training and module.num_layers > 1 and module.dropout > 0):
            continue
        called = [node for node in graph.nodes if node.op == "call_function" and module_path(node) == path]
        if not called:
            continue
        raise TraceError(
            f"{type(module).__name__} {path!r} has dropout={module.dropout} between its "
            f"{module.num_layers} layers in training: torch.export's decomposition of the rnn op "
            "drops that dropout, so the parallel module would train as if it were 0, unlike serial",
            op=f"{type(module).__name__}(num_layers={module.num_layers}, dropout={module.dropout})",
            where=node_where(called[0]),
            hint=(
                f"build {path!r} with dropout=0 and stack single-layer {type(module).__name__}s with an "
                "nn.Dropout between them (autopar replays serial's dropout masks exactly), or call "
                "model.eval() for inference"
            ),
        )


PACKED_SEQUENCE_HINT = (
    "pass the padded batch itself to the RNN (batch, longest, features) and read each sequence's "
    "last valid step from its output: out[torch.arange(len(lengths)), lengths - 1]; for a "
    "unidirectional RNN the outputs up to each length do not depend on the padding after it, so "
    "they equal the packed run's (a bidirectional RNN's backward direction does read the padding: "
    "reverse each sequence within its length, or mask); the padded batch also splits over ranks"
)


def packed_rnn(exc: BaseException, model: nn.Module) -> tuple[nn.Module, str] | None:
    """The RNN submodule of `model` (and its path) whose forward, in `exc`'s traceback or its
    causes', was running on a PackedSequence: torch's RNNs size their initial state by the packed
    batch's `batch_sizes[0]`, a tensor, so the export fails inside torch with a message about
    sizes that names neither the RNN nor the packing."""
    paths = {id(module): path for path, module in model.named_modules()}
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            frame_locals = tb.tb_frame.f_locals
            module = frame_locals.get("self")
            if isinstance(module, nn.RNNBase) and any(isinstance(v, PackedSequence) for v in frame_locals.values()):
                return module, paths.get(id(module), type(module).__name__)
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return None
