"""Dropout in a pipeline with the serial model's numbers (docs/pipeline.md#dropout).

The serial step draws each dropout mask once, over the whole batch, in the order of the model's
ops; a pipeline runs each microbatch apart, on the rank of each stage. So every rank, at the start
of a step, draws every dropout op's whole-batch mask from the generator state the serial model
would have (every rank seeds alike), in the serial order and as eager dropout draws it
(`empty_like(input).bernoulli_(1 - p)`, then divided by `1 - p`), keeps the masks of its own
stages, and leaves its generator where the serial step would. Each microbatch's dropout then
multiplies by its rows of the whole mask: the rows along the one dim where the microbatch's input
is smaller than the batch's (dim 0, or a flattened batch-times-heads dim), at the offset of the
microbatches before it. This is the tensor-only path's idea (`rules/local_ops.dropout_block`:
draw the global mask, keep one's block) applied to the microbatch cut.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

aten = torch.ops.aten

# The dropout ops a pipeline draws exactly: (input, p, train) -> output / (output, mask).
_DROPOUTS = {aten.dropout.default: False, aten.native_dropout.default: True}


@dataclass(frozen=True)
class RandomOp:
    """One op of a stage program that draws random numbers: `name` its node in stage `stage`'s
    module, `shape` / `dtype` its input's for this microbatch, `p` the dropout rate; `exact` False
    for an op the pipeline cannot draw as serial does (not a dropout, a non-contiguous input)."""

    stage: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    p: float
    exact: bool


def _arguments(node: fx.Node) -> dict[str, object]:
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, object] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        else:
            out[arg.name] = node.kwargs.get(arg.name, arg.default_value)
    return out


def draws(node: fx.Node) -> bool:
    """Whether a graph node draws random numbers when run (a dropout with p = 0 or train=False
    draws none, as eager dropout returns its input then)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    arguments = _arguments(node)
    rate = arguments.get("p", arguments.get("dropout_p"))
    if isinstance(rate, (int, float)) and rate == 0:
        return False
    return arguments.get("train", True) is not False


def random_op(node: fx.Node, stage: int) -> RandomOp:
    """`node` (which `draws`) as stage `stage`'s random op."""
    val = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if node.target not in _DROPOUTS or not isinstance(val, torch.Tensor):
        return RandomOp(stage, node.name, (), torch.float32, 0.0, False)
    p = float(_arguments(node)["p"])  # type: ignore[arg-type]
    exact = val.is_contiguous() and 0 < p < 1
    return RandomOp(stage, node.name, tuple(int(d) for d in val.shape), val.dtype, p, exact)


def whole_shapes(gm: fx.GraphModule) -> list[tuple[tuple[int, ...], torch.dtype, float] | None]:
    """The whole batch's random ops in graph order: their input shape, dtype and rate (None for
    one the pipeline cannot draw as serial does)."""
    out: list[tuple[tuple[int, ...], torch.dtype, float] | None] = []
    for n in gm.graph.nodes:
        if draws(n):
            op = random_op(n, 0)
            out.append((op.shape, op.dtype, op.p) if op.exact else None)
    return out


class DropoutMasks:
    """One step's dropout masks on this rank: `draw` makes every op's whole-batch mask in the serial
    order (keeping this rank's stages'), `current` is the microbatch the stage runs now, and
    `rows(op)` its rows of op's mask."""

    def __init__(self) -> None:
        self.masks: dict[int, torch.Tensor] = {}
        self.cuts: dict[tuple[int, int], tuple[int, int, int] | None] = {}  # (op, m) -> dim, start, length
        self.current = 0
        self.drawn = False  # False: this step's ops draw per microbatch (not the serial numbers)

    def draw(
        self,
        whole: Sequence[tuple[tuple[int, ...], torch.dtype, float]],
        keep: set[int],
        micro: Sequence[Sequence[tuple[int, ...]]],
        device: torch.device | str,
    ) -> bool:
        """Draw the step's masks; `micro[m][k]` is op k's input shape in microbatch m. False (and
        nothing drawn) when some op's microbatch inputs are not cuts of its batch input along
        one dim, so their rows cannot be told apart."""
        cuts: dict[tuple[int, int], tuple[int, int, int] | None] = {}
        for k, (shape, _, _) in enumerate(whole):
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
        for k, (shape, dtype, p) in enumerate(whole):
            noise = torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p)
            if k in keep:
                self.masks[k] = noise.div_(1 - p)
        return True

    def rows(self, op: int) -> torch.Tensor:
        """Op `op`'s mask (scaled by 1 / (1 - p)) for the current microbatch's rows."""
        mask = self.masks[op]
        cut = self.cuts[(op, self.current)]
        return mask if cut is None else mask.narrow(*cut)


class MaskedDropout(nn.Module):
    """A stage program's dropout op `op`, multiplying by the current microbatch's rows of the
    step's mask (as eager dropout multiplies by its noise); `native`: also return the boolean mask,
    as `native_dropout` does."""

    def __init__(self, masks: DropoutMasks, op: int, p: float, native: bool) -> None:
        super().__init__()
        self.masks = masks
        self.op = op
        self.p = p
        self.native = native

    def forward(self, x: torch.Tensor, *rest: object) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.masks.drawn:  # the step could not draw the serial masks (warned): eager dropout
            out, keep = aten.native_dropout.default(x, self.p, True)
            return (out, keep) if self.native else out
        mask = self.masks.rows(self.op)
        out = x * mask
        return (out, mask != 0) if self.native else out


def install_masks(modules: Sequence[fx.GraphModule], ops: Sequence[RandomOp], masks: DropoutMasks) -> None:
    """Replace each random op `ops[k]` in its stage's module (`modules[stage]`) by a
    `MaskedDropout` reading `masks`; every op must be `exact`."""
    for k, op in enumerate(ops):
        gm = modules[op.stage]
        node = next(n for n in gm.graph.nodes if n.name == op.name)
        name = f"autopar_dropout_{k}"
        gm.add_submodule(name, MaskedDropout(masks, k, op.p, native=_DROPOUTS[node.target]))  # type: ignore[index]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, (node.args[0],))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    for gm in {id(g): g for g in modules}.values():
        gm.recompile()


WholeOps = list[tuple[tuple[int, ...], torch.dtype, float] | None]


class PipelineDropout:
    """A pipelined module's dropout: installs the step's masks into each stage program it can
    (`adopt`) and draws them before each step (`prepare`); warns once where it cannot (stages
    run by parallel modules, a random op other than dropout, microbatch inputs that are not row cuts
    of the batch's), and those draw per microbatch: equal to serial in distribution, not in value."""

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
                "in value (eval() and dropout-free models are exact; so is dropout on a 1-D pp mesh)",
                stacklevel=4,
            )

    def adopt(self, modules: Sequence[fx.GraphModule], ops: Sequence[RandomOp], installable: bool) -> None:
        """A new stage program's random ops: its dropouts read the step's masks when every op is
        one the pipeline draws exactly and its stages run their own graphs (`installable`)."""
        if not ops:
            return
        inexact = [op.name for op in ops if not op.exact]
        if not installable:
            self.warn("its stages are parallel modules on tensor axes beside pp")
        elif inexact:
            self.warn(f"{', '.join(inexact[:3])} is not a dropout on a contiguous input")
        else:
            install_masks(modules, ops, self.masks)

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
        if not micro[0]:
            return
        whole = self.whole.get(key)
        if whole is None:
            whole = self.whole[key] = export_batch()
        exact = [w for w in whole if w is not None]
        if len(exact) != len(whole) or len(whole) != len(micro[0]):
            self.warn("its random ops on the whole batch are not those of a microbatch")
            return
        keep = {k for k, op in enumerate(micro[0]) if op.stage in stages}
        shapes = [[op.shape for op in ops] for ops in micro]
        if not self.masks.draw(exact, keep, shapes, device):
            self.warn("a dropout's microbatch inputs are not row cuts of its batch input")
