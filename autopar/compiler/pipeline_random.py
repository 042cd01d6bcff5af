"""Dropout and other random ops in a pipeline with the serial model's numbers (docs/pipeline.md#dropout).

The serial step draws each dropout mask once, over the whole batch, in the order of the model's
ops; a pipeline runs each microbatch apart, on the rank of each stage. So every rank, at the start
of a step, draws every dropout op's whole-batch mask from the generator state the serial model
would have (every rank seeds alike), in the serial order and as eager dropout draws it
(`empty_like(input).bernoulli_(1 - p)`, then divided by `1 - p`), keeps the masks of its own
stages, and leaves its generator where the serial step would. Each microbatch's dropout then
multiplies by its rows of the whole mask, a new input of its stage: the rows along the one dim
where the microbatch's input is smaller than the batch's (dim 0, or a flattened batch-times-heads
dim), at the offset of the microbatches before it. This is the tensor-only path's idea (`rules/local_ops.dropout_block`:
draw the global mask, keep one's block) applied to the microbatch cut.

Attention's own dropout (`scaled_dot_product_attention` with `dropout_p > 0`, GPT-2's default
`attn_pdrop`) is drawn the same way: on the CPU, eager attention with dropout runs its math kernel
(the fused CPU kernel takes no dropout), which draws `bernoulli_(1 - p)` over the probabilities'
`[..., L, S]` shape after the softmax, as an eager dropout would. The node becomes that math with
the microbatch's rows of the mask (`attention_dropped`): the serial numbers, bit for bit.

`rand`, `randn` (and their `_like` forms) and `bernoulli(x, p)` draw numbers that depend only on
their shape, so they are drawn whole the same way and the node becomes its microbatch's rows; a
draw without the batch's rows (`torch.rand([])`, a per-call scalar) is the whole draw itself, the
one value serial's batch shares, given to every microbatch. `bernoulli` of a tensor of
probabilities is, on the CPU, one uniform draw per element compared with its probability, so the
node becomes `rows < probabilities`.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.core.errors import AutoparError

aten = torch.ops.aten

# The dropout ops a pipeline draws exactly: (input, p, train) -> output / (output, mask).
_DROPOUTS = {aten.dropout.default: False, aten.native_dropout.default: True}
# Attention with dropout inside: exact on the CPU in float32 / float64 (`attention_dropped`).
_ATTENTION = aten.scaled_dot_product_attention.default
# Ops whose numbers depend only on their output's shape and dtype (and the generator), by the kind
# of draw that makes them; `bernoulli` (a tensor of probabilities) is `rand < p` on the CPU.
_SHAPED = {
    aten.rand.default: "rand",
    aten.rand_like.default: "rand",
    aten.randn.default: "randn",
    aten.randn_like.default: "randn",
    aten.bernoulli.p: "bernoulli_p",
    aten.bernoulli.default: "bernoulli",
}


def attention_dropped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    keep: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`scaled_dot_product_attention(..., dropout_p=p)` as the CPU's math kernel computes it, its
    dropout replaced by a product with `keep` (the mask scaled by 1 / (1 - p)), op for op: q and
    the transposed k each scaled by sqrt(scale), a boolean mask made -inf / 0 and added, a softmax
    that gives 0 to a row masked whole, then the mask, then the product with v. Equal to eager
    attention drawing that mask, gradients included (checked bit for bit in
    tests/test_pipeline_dropout.py)."""
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query.size(-1)))
    scaled = query * (-factor if negative else factor)
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(attn_mask.logical_not(), -math.inf)
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scores = torch.matmul(scaled, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.matmul(aten._safe_softmax(scores, -1) * keep, value)


@dataclass(frozen=True)
class RandomOp:
    """One op of a stage program that draws random numbers: `name` its node in stage `stage`'s
    module, `shape` / `dtype` what it draws for this microbatch (a dropout's input), `p` the
    dropout rate or `bernoulli`'s probability; `kind` how it draws (`draw_whole`): "dropout",
    "attention", "rand", "randn", "bernoulli_p" (a number p) or "bernoulli" (a tensor of
    probabilities), "other" for the ops it does not draw; `exact` False for an op the pipeline cannot draw as serial does (another random
    op, a non-contiguous tensor, attention's dropout off the CPU or below float32)."""

    stage: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    p: float
    exact: bool
    kind: str = "dropout"


def _arguments(node: fx.Node) -> dict[str, Any]:
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        else:
            out[arg.name] = node.kwargs.get(arg.name, arg.default_value)
    return out


def draws(node: fx.Node) -> bool:
    """Whether a graph node draws random numbers when run (a dropout with p = 0 or train=False
    draws none, as eager dropout returns its input then; `bernoulli(x, 0)` still draws)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    if node.target not in _DROPOUTS and node.target is not _ATTENTION:
        return True
    arguments = _arguments(node)
    rate = arguments.get("p", arguments.get("dropout_p"))
    if isinstance(rate, (int, float)) and rate == 0:
        return False
    return arguments.get("train", True) is not False


def _shaped_op(node: fx.Node, stage: int) -> RandomOp:
    """A `_SHAPED` op: exact when serial's draw is one over its output's shape in memory order
    (contiguous), and for `bernoulli` of a tensor when that is `rand < p` (the CPU kernel, float32
    / float64 probabilities; checked in tests/test_pipeline_random.py)."""
    kind = _SHAPED[node.target]  # type: ignore[index]
    val = node.meta.get("val")
    arguments = _arguments(node)
    if not isinstance(val, torch.Tensor):
        return RandomOp(stage, node.name, (), torch.float32, 0.0, False, kind)
    exact = val.is_contiguous() and val.dtype.is_floating_point and arguments.get("generator") is None
    p = 0.0
    if kind == "bernoulli_p":
        rate = arguments["p"]
        exact = exact and isinstance(rate, (int, float))
        p = float(rate) if isinstance(rate, (int, float)) else 0.0
    elif kind == "bernoulli":
        probs = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        exact = (
            exact and isinstance(probs, torch.Tensor) and probs.is_contiguous() and probs.dtype == val.dtype
            and val.device.type == "cpu" and val.dtype in (torch.float32, torch.float64)
        )  # fmt: skip
    return RandomOp(stage, node.name, tuple(int(d) for d in val.shape), val.dtype, p, exact, kind)


def random_op(node: fx.Node, stage: int) -> RandomOp:
    """`node` (which `draws`) as stage `stage`'s random op."""
    if node.target in _SHAPED:
        return _shaped_op(node, stage)
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if node.target is _ATTENTION and isinstance(val, torch.Tensor):
        key = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        p = float(_arguments(node)["dropout_p"])
        exact = (
            isinstance(key, torch.Tensor) and val.device.type == "cpu"
            and val.dtype in (torch.float32, torch.float64) and 0 < p < 1
        )  # fmt: skip
        shape = (*val.shape[:-1], int(key.shape[-2])) if isinstance(key, torch.Tensor) else ()
        return RandomOp(stage, node.name, tuple(int(d) for d in shape), val.dtype, p, exact, "attention")
    if node.target not in _DROPOUTS or not isinstance(val, torch.Tensor):
        return RandomOp(stage, node.name, (), torch.float32, 0.0, False, "other")
    p = float(_arguments(node)["p"])
    exact = val.is_contiguous() and 0 < p < 1
    return RandomOp(stage, node.name, tuple(int(d) for d in val.shape), val.dtype, p, exact)


def whole_shapes(gm: fx.GraphModule) -> list[RandomOp | None]:
    """The whole batch's random ops in graph order (None for one the pipeline cannot draw as
    serial does)."""
    return [op if op.exact else None for op in (random_op(n, 0) for n in gm.graph.nodes if draws(n))]


def draw_whole(op: RandomOp, device: torch.device | str) -> torch.Tensor:
    """What op draws, over its whole `shape`, as the eager op draws it (the same kernel on the
    same shape from the same generator state gives the same numbers): a dropout's noise scaled by
    1 / (1 - p), `bernoulli(x, p)`'s zeros and ones, `rand` / `randn`'s numbers, and for `bernoulli`
    of a tensor the uniform numbers its CPU kernel compares with the probabilities."""
    empty = torch.empty(op.shape, dtype=op.dtype, device=device)
    if op.kind in ("dropout", "attention"):
        return empty.bernoulli_(1 - op.p).div_(1 - op.p)
    if op.kind == "bernoulli_p":
        return empty.bernoulli_(op.p)
    if op.kind in ("rand", "bernoulli"):
        return empty.uniform_()
    if op.kind == "randn":
        return empty.normal_()
    raise AutoparError(f"no whole-batch draw for random op {op.name} ({op.kind})", hint="this is a bug in autopar's pipeline")


class DropoutMasks:
    """One step's dropout masks on this rank: `draw` makes every op's whole-batch mask in the serial
    order (keeping this rank's stages'), `current` is the microbatch the stage runs now, and
    `rows(op)` its rows of op's mask."""

    def __init__(self) -> None:
        self.masks: dict[int, torch.Tensor] = {}
        self.cuts: dict[tuple[int, int], tuple[int, int, int] | None] = {}  # (op, m) -> dim, start, length
        self.current = 0
        self.drawn = False  # False: this step's ops draw per microbatch (not the serial numbers)
        self.own: dict[tuple[int, int], torch.Tensor] = {}  # (op, m) -> a microbatch's own draw

    def draw(
        self,
        whole: Sequence[RandomOp],
        keep: set[int],
        micro: Sequence[Sequence[tuple[int, ...]]],
        device: torch.device | str,
    ) -> bool:
        """Draw the step's masks; `micro[m][k]` is op k's input shape in microbatch m. False (and
        nothing drawn) when some op's microbatch inputs are not cuts of its batch input along
        one dim, so their rows cannot be told apart."""
        cuts: dict[tuple[int, int], tuple[int, int, int] | None] = {}
        for k, op in enumerate(whole):
            shape = op.shape
            dims = {d for shapes in micro for d in range(len(shape)) if shapes[k][d] != shape[d]}
            if any(len(shapes[k]) != len(shape) for shapes in micro) or len(dims) > 1:
                return False
            if not dims:  # the batch's mask is every microbatch's (it does not depend on the rows)
                cuts.update({(k, m): None for m in range(len(micro))})
                continue
            (d,) = dims
            start = 0
            for m, shapes in enumerate(micro):
                cuts[(k, m)] = (d, start, shapes[k][d])
                start += shapes[k][d]
            if start != shape[d]:
                return False
        self.cuts = cuts
        self.drawn = True
        self.masks = {}
        for k, op in enumerate(whole):
            noise = draw_whole(op, device)  # every op's, in the serial order: the generator advances as serial's
            if k in keep:
                self.masks[k] = noise
        return True

    def draw_per_microbatch(
        self, micro: Sequence[Sequence[RandomOp]], keep: set[int], device: torch.device | str
    ) -> None:
        """Where the serial masks cannot be drawn: each microbatch's own (as eager dropout on the
        microbatch would draw; equal to serial in distribution only)."""
        self.drawn = False
        self.masks, self.cuts, self.own = {}, {}, {}
        for m, ops in enumerate(micro):
            for k, op in enumerate(ops):
                if k in keep:
                    self.own[(k, m)] = draw_whole(op, device)

    def rows(self, op: int) -> torch.Tensor:
        """Op `op`'s mask (scaled by 1 / (1 - p)) for the current microbatch's rows."""
        if not self.drawn:
            return self.own[(op, self.current)]
        mask = self.masks[op]
        cut = self.cuts[(op, self.current)]
        return mask if cut is None else mask.narrow(*cut)


def install_masks(stages: Sequence[tuple[fx.GraphModule, list[tuple[str, Any]]]], ops: Sequence[RandomOp]) -> None:
    """Replace each random op `ops[k]` in its stage's module (`stages[stage]`: the module and its
    sources) by a new input, the microbatch's rows of op k's whole-batch draw (source
    `("mask", k)`): a dropout by a product with its scaled mask, as eager dropout multiplies by its
    noise (`native_dropout`'s boolean mask is `mask != 0`); `rand`, `randn` and `bernoulli(x, p)` by
    the rows themselves; `bernoulli` of probabilities by `rows < probabilities`. As an input, the
    mask is planned like any (split with the batch on tensor axes)."""
    for k, op in enumerate(ops):
        gm, sources = stages[op.stage]
        graph = gm.graph
        node = next(n for n in graph.nodes if n.name == op.name)
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            mask = graph.placeholder(f"autopar_dropout_mask_{k}")
        sources.append(("mask", k))
        if node.target is _ATTENTION:
            arguments = _arguments(node)
            with graph.inserting_before(node):
                options: dict[str, Any] = {name: arguments[name] for name in ("is_causal", "scale", "enable_gqa")}
                out = graph.call_function(attention_dropped, (*node.args[:3], arguments["attn_mask"], mask), options)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            continue
        if op.kind != "dropout":  # rand, randn, bernoulli: the rows drawn are the op's values
            replacement: fx.Node = mask
            if op.kind in ("bernoulli", "bernoulli_p"):
                with graph.inserting_before(node):
                    source = node.args[0]
                    if op.kind == "bernoulli":  # as its CPU kernel: uniform < probability, in its dtype
                        below = graph.call_function(aten.lt.Tensor, (mask, source))
                        replacement = graph.call_function(aten._to_copy.default, (below,), {"dtype": op.dtype})
                    else:  # (sign: finite for any finite or infinite input)
                        source = graph.call_function(aten.sign.default, (source,))
                    # bernoulli's derivative is zeros for its input: the input's producers get a
                    # zero gradient from it, as serial's do (None would skip weight decay)
                    zero = graph.call_function(aten.mul.Tensor, (source, 0))
                    replacement = graph.call_function(aten.add.Tensor, (replacement, zero))
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
            continue
        with graph.inserting_before(node):
            out = graph.call_function(aten.mul.Tensor, (node.args[0], mask))
            if _DROPOUTS[node.target]:  # type: ignore[index]
                keep = graph.call_function(aten.ne.Scalar, (mask, 0))
        if _DROPOUTS[node.target]:  # type: ignore[index]
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise AutoparError(
                        f"native_dropout {node.name} is read other than by its two outputs",
                        hint="this is a bug in autopar's pipeline dropout",
                    )
                user.replace_all_uses_with(out if user.args[1] == 0 else keep)
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(out)
        graph.erase_node(node)
    for gm, _ in {id(g): (g, src) for g, src in stages}.values():
        gm.recompile()


WholeOps = list[RandomOp | None]


class PipelineDropout:
    """A pipelined module's dropout: makes each stage program's dropouts read the step's masks
    (`adopt`) and draws them before each step (`prepare`); warns once where it cannot (a random op
    other than dropout, microbatch inputs that are not row cuts of the batch's), and those draw per
    microbatch: equal to serial in distribution, not in value."""

    def __init__(self) -> None:
        self.masks = DropoutMasks()
        self.whole: dict[tuple[Any, ...], WholeOps] = {}  # batch random ops, by batch key
        self.warned = False

    def warn(self, why: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"autopar pipeline: the model draws random numbers in training ({why}): each microbatch "
                "draws its own, so the loss and gradients equal the serial model's in distribution, not "
                "in value (eval(), models without random ops and dropout on contiguous inputs are exact)",
                stacklevel=4,
            )

    def adopt(self, stages: Sequence[tuple[fx.GraphModule, list[tuple[str, Any]]]], ops: Sequence[RandomOp]) -> None:
        """A new stage program's random ops (`stages`: each stage's module and sources): its
        dropouts read the step's masks when every op is one the pipeline draws exactly."""
        if not ops:
            return
        inexact = [op.name for op in ops if not op.exact]
        if inexact:
            self.warn(
                f"{', '.join(inexact[:3])}: not a dropout, rand, randn or bernoulli on a contiguous "
                "tensor (randint, normal, multinomial, an explicit generator, attention's own dropout "
                "off the CPU or below float32, bernoulli of probabilities off the CPU), which the "
                "pipeline cannot draw as the serial model does"
            )
        else:
            install_masks(stages, ops)
    def prepare(
        self,
        key: tuple[Any, ...],
        export_batch: Callable[[], WholeOps],
        micro: Sequence[Sequence[RandomOp]],
        stages: Sequence[int],
        device: torch.device | str,
    ) -> None:
        """Before a step in training: draw every op's whole-batch mask (`export_batch` lists the
        batch's random ops, exported once per batch shape), keeping those of `stages`."""
        self.masks.drawn = False
        if not micro[0] or not all(op.exact for op in micro[0]):
            return  # (inexact ops stay in the graphs: they draw as eager ops do)
        whole = self.whole.get(key)
        if whole is None:
            whole = self.whole[key] = export_batch()
        exact = [w for w in whole if w is not None]
        keep = {k for k, op in enumerate(micro[0]) if op.stage in stages}
        if (
            len(exact) != len(whole) or len(whole) != len(micro[0])
            or any(w.kind != op.kind for w, op in zip(exact, micro[0]))
        ):  # fmt: skip
            self.warn("its random ops on the whole batch are not those of a microbatch")
            self.masks.draw_per_microbatch(micro, keep, device)
            return
        shapes = [[op.shape for op in ops] for ops in micro]
        if not self.masks.draw(exact, keep, shapes, device):
            self.warn("a dropout's microbatch inputs are not row cuts of its batch input")
            self.masks.draw_per_microbatch(micro, keep, device)
