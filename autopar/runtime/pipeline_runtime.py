"""Runs one training step of a pipeline schedule on this rank: the action list of
`autopar.core.pipeline_schedule` executed over the `pp` process group, or any other
`pipeline_transport.PipelineTransport` (docs/pipeline.md#runtime-pipeline-axis-alone).

The stages are plain callables (`StageRunner`); the backward is autograd's, from each stage's kept
(inputs, outputs) per microbatch. Messages are tagged by (direction, stage, microbatch, tensor), so
two ranks may read each other's messages in any order (gloo matches a receive to the send with its
tag); sends are `isend`s waited at the end of the step, receives are waited where the list puts
them, which are the simulator's semantics (`autopar.core.pipeline_simulate`). Adjacent stages on
one rank pass their values locally, without a message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError
from autopar.core.pipeline_schedule import Action, ActionKind, Schedule
from autopar.runtime.pipeline_transport import Pending, PipelineTransport, as_transport


class PipelineRuntimeError(AutoparError):
    """The pipeline runtime cannot run this step (a schedule it does not run, a broken message)."""


class UnsupportedScheduleError(PipelineRuntimeError, NotImplementedError):
    """A schedule the runtime does not run yet (zero-bubble needs each backward split in two)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor crossing a stage boundary (what a receive's buffer is made of)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def differentiable(self) -> bool:
        """Whether a gradient comes back for it (floating point and complex tensors only)."""
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass
class StageRunner:
    """One stage held by this rank, as the runtime calls it.

    `forward(m, received)` runs the stage on microbatch m, given the tensors that crossed the
    boundary into it (empty for the first stage), and returns what crosses the next boundary (the
    last stage: a 1-tuple, its microbatch's loss term). `params` are the trainable tensors it reads;
    `input_specs(m)` / `output_specs(m)` the boundary tensors of microbatch m (they differ when the
    microbatches do). `backward_weight(m)`, for zero-bubble schedules: the gradients of `params`
    from microbatch m's weight-gradient part, whose input-gradient part autograd ran earlier (a
    stage whose forward defers that part; None: the stage cannot split its backward).
    `reduce_grads()`, for stages whose backward accumulates its gradients unreduced over the step
    (`ParallelModule.accumulating_gradients`): its backwards return no parameter gradients, and
    the runtime calls it once, after the stage's last backward, for the step's reduced gradients."""

    index: int
    forward: Callable[[int, Sequence[torch.Tensor]], Sequence[torch.Tensor]]
    params: tuple[torch.Tensor, ...]
    input_specs: Callable[[int], tuple[TensorSpec, ...]]
    output_specs: Callable[[int], tuple[TensorSpec, ...]]
    backward_weight: Callable[[int], Sequence[torch.Tensor | None]] | None = None
    reduce_grads: Callable[[], Sequence[torch.Tensor | None]] | None = None
    # the user's inputs of microbatch m that require grad (leaves cut from the batch), whose
    # gradients the step returns in `StepResult.input_grads`
    input_leaves: Callable[[int], Sequence[torch.Tensor]] | None = None


@dataclass
class StepResult:
    """What one step leaves on this rank: `loss` is the sum of the last stage's microbatch loss
    terms (on the rank that holds the last stage, else None); `grads[s]` the gradients of stage s's
    `params`, summed over microbatches (None where a parameter got none, or in a forward-only step).
    `outputs[m]`: in a step that keeps them (inference), what the last stage returned for microbatch
    m (on the rank that holds it); `loss` is then None. `input_grads[(m, j)]`: the gradient of
    input leaf j of microbatch m (`StageRunner.input_leaves`), summed over this rank's stages."""

    loss: torch.Tensor | None
    grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class BoundaryScatter:
    """With tensor axes beside "pp", every rank of a stage's slice holds each boundary tensor whole;
    each sends only its 1/`size` of it (flat chunk `index`, zero-padded) to the rank at its own
    sub-mesh coordinates in the next stage, and the receiving slice all-gathers the chunks over
    `group` (PTD-P's scatter/gather: the slow pipeline links carry 1/t of the tensor per rank)."""

    group: dist.ProcessGroup
    size: int
    index: int

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of `t` (flattened, padded to a multiple of `size`)."""
        flat = t.detach().reshape(-1)
        per = -(-flat.numel() // self.size)
        piece = flat[self.index * per : (self.index + 1) * per]
        if piece.numel() < per:
            piece = torch.cat([piece, piece.new_zeros(per - piece.numel())])
        return piece.contiguous()

    def chunk_numel(self, spec: TensorSpec) -> int:
        return -(-math.prod(spec.shape) // self.size)

    def gather(self, piece: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """The whole tensor from every rank's chunk (one all-gather over the slice)."""
        out = piece.new_empty(piece.numel() * self.size)
        dist.all_gather_single(out, piece, group=self.group)
        return out[: math.prod(spec.shape)].view(spec.shape).clone()


_DIRECTIONS = {ActionKind.SEND_F: 0, ActionKind.RECV_F: 0, ActionKind.SEND_B: 1, ActionKind.RECV_B: 1}


def check_supported(schedule: Schedule, stages: Mapping[int, StageRunner] | None = None) -> None:
    """Refuse, before any work or message, a split-backward (zero-bubble) schedule for stages that
    cannot split their backward (`StageRunner.backward_weight` missing; `stages` None: none can)."""
    if schedule.split_backward and (
        stages is None or any(st.backward_weight is None for st in stages.values())
    ):
        raise UnsupportedScheduleError(
            f"the {schedule.name!r} schedule splits every backward into an input-gradient and a "
            "weight-gradient half (zero-bubble), which these stages do not",
            hint='use schedule="1f1b", "gpipe" or "interleaved-1f1b"; parallelize runs zero-bubble '
            "stages as compiled programs whose backward it splits",
        )


def message_tag(kind: ActionKind, stage: int, microbatch: int, index: int, schedule: Schedule) -> int:
    """The tag of tensor `index` of one message: unique per (direction, sending stage, microbatch,
    tensor) within a step, and computed alike by both ends from the schedule alone. A SEND_F of
    stage s and the RECV_F of s+1 name the same message (sender s), as do SEND_B of s and RECV_B of
    s-1 (sender s)."""
    sender = stage
    if kind == ActionKind.RECV_F:
        sender = stage - 1
    elif kind == ActionKind.RECV_B:
        sender = stage + 1
    per_tensor = 2 * schedule.num_stages * schedule.microbatches
    return (
        index * per_tensor
        + (_DIRECTIONS[kind] * schedule.num_stages + sender) * schedule.microbatches
        + microbatch
    )


class _Step:
    """The state of one step on one rank: kept activations, pending messages, local passes."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: Mapping[int, StageRunner],
        transport: PipelineTransport,
        loss_scale: float,
        forward_only: bool,
        device: torch.device,
        scatter: BoundaryScatter | None = None,
        keep_outputs: bool = False,
    ) -> None:
        self.schedule = schedule
        self.keep_outputs = keep_outputs
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.scatter = scatter
        self.device = device
        self.rank = rank
        self.stages = stages
        self.transport = transport
        self.loss_scale = loss_scale
        self.forward_only = forward_only
        self.last = schedule.num_stages - 1
        self.inputs: dict[tuple[int, int], list[torch.Tensor]] = {}  # received, by (stage, mb)
        self.kept: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.out_grads: dict[tuple[int, int], list[torch.Tensor]] = {}  # gradients of a stage's outputs
        self.in_grads: dict[tuple[int, int], list[torch.Tensor]] = {}  # gradients of a stage's inputs
        self.sends: list[tuple[Pending, torch.Tensor]] = []  # the tensor stays alive until waited
        self.loss: torch.Tensor | None = None
        # a step whose loss is outside the model: the gradients of the last stage's outputs, per
        # microbatch (None for an output no gradient reaches), given by `PendingStep.finish`
        self.output_grads: dict[int, list[torch.Tensor | None]] = {}
        self.grads: dict[int, list[torch.Tensor | None]] = {
            s: [None] * len(st.params) for s, st in stages.items()
        }
        self.owned: set[tuple[int, int]] = set()  # (stage, i): a sum of this step's, added into in place
        # stages whose gradients are reduced once, after their last backward: backwards left to run
        self.to_reduce = {s: schedule.microbatches for s, st in stages.items() if st.reduce_grads is not None}

    def run(self, actions: Sequence[Action], final: bool = True) -> StepResult:
        """Run `actions` and wait for their sends; `final=False` (the forwards of a step whose
        backwards run later) leaves the gradient reductions to the call that runs the rest."""
        try:
            for action in actions:
                self.do(action)
                if not self.forward_only:
                    self.reduce_ready()
            if not self.forward_only and final:
                self.reduce_ready(final=True)
        finally:
            for work, _ in self.sends:
                work.wait()
            self.sends.clear()
        return StepResult(self.loss, {} if self.forward_only else self.grads, self.outputs, self.input_grads)

    def do(self, a: Action) -> None:
        kind = a.kind
        if kind == ActionKind.FORWARD:
            self.forward(a.stage, a.microbatch)
        elif kind == ActionKind.BACKWARD:
            self.backward(a.stage, a.microbatch)
        elif kind == ActionKind.BACKWARD_INPUT:
            self.backward(a.stage, a.microbatch, weights=False)
        elif kind == ActionKind.BACKWARD_WEIGHT:
            self.backward_weight(a.stage, a.microbatch)
        elif kind == ActionKind.SEND_F:
            self.send(a, self.kept[(a.stage, a.microbatch)][1], self.stages[a.stage].output_specs(a.microbatch))
        elif kind == ActionKind.SEND_B:
            self.send(a, self.in_grads.pop((a.stage, a.microbatch)))
        elif kind == ActionKind.RECV_F:
            specs = self.stages[a.stage].input_specs(a.microbatch)
            self.inputs[(a.stage, a.microbatch)] = self.recv(a, specs)
        elif kind == ActionKind.RECV_B:
            specs = tuple(s for s in self.stages[a.stage].output_specs(a.microbatch) if s.differentiable)
            self.out_grads[(a.stage, a.microbatch)] = self.recv(a, specs)
        else:
            raise UnsupportedScheduleError(f"the pipeline runtime does not run {kind.name} actions ({a})")

    def reduce_ready(self, final: bool = False) -> None:
        """Reduce the gradients of each stage whose last backward has run, once the input gradient
        that backward made is on its way (sent, or handed to this rank's previous stage), so that
        the previous stage never waits for the reduction: it overlaps the rank's remaining work."""
        for stage, left in list(self.to_reduce.items()):
            waiting = any(s == stage for s, _ in self.in_grads) and self._sent_remotely(stage)
            if left or (waiting and not final):
                continue
            del self.to_reduce[stage]
            reduce_grads = self.stages[stage].reduce_grads
            assert reduce_grads is not None
            self._add_grads(stage, reduce_grads())

    def _sent_remotely(self, stage: int) -> bool:
        """Whether stage's input gradients go to another rank (a SEND_B): the reduction waits for it."""
        return stage > 0 and self.schedule.placement.rank_of(stage - 1) != self.rank

    def _add_grads(self, stage: int, found: Sequence[torch.Tensor | None]) -> None:
        """Add a backward's parameter gradients to the step's: the first kept as autograd gave it
        (it may be another parameter's too: an add's backward hands one tensor to both), the
        second summed into a new tensor of the step's own, later ones added into that in place."""
        acc = self.grads[stage]
        for i, g in enumerate(found):
            if g is None:
                continue
            before = acc[i]
            if before is None:
                acc[i] = g
            elif (stage, i) in self.owned:
                before.add_(g)
            else:
                acc[i] = before + g
                self.owned.add((stage, i))

    def send(self, a: Action, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec] | None = None) -> None:
        """Send `tensors`, each as its boundary spec's dtype where `specs` are given: the receiver
        allocates its buffer from the spec, and a stage run under the user's `torch.autocast`
        makes bfloat16 where the programs were exported in float32 (a Linear's output). Its values
        go as float32, exactly (before, the bytes were read as float32: a loss of 1e29 on gloo)."""
        assert a.peer is not None
        for i, t in enumerate(tensors):
            tag = message_tag(a.kind, a.stage, a.microbatch, i, self.schedule)
            if specs is not None and t.dtype != specs[i].dtype:
                t = t.to(specs[i].dtype)
            data = self.scatter.chunk(t) if self.scatter is not None else t.detach().contiguous()
            work = self.transport.isend(data, a.peer, tag)
            if work is not None:
                self.sends.append((work, data))

    def recv(self, a: Action, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        assert a.peer is not None
        out = []
        for i, spec in enumerate(specs):
            shape = (self.scatter.chunk_numel(spec),) if self.scatter is not None else spec.shape
            buf = torch.empty(shape, dtype=spec.dtype, device=self.device)
            tag = message_tag(a.kind, a.stage, a.microbatch, i, self.schedule)
            self.transport.recv(buf, a.peer, tag)
            out.append(self.scatter.gather(buf, spec) if self.scatter is not None else buf)
        return out

    def forward(self, stage: int, m: int) -> None:
        runner = self.stages[stage]
        if stage == 0:
            received: list[torch.Tensor] = []
        elif (stage, m) in self.inputs:
            received = self.inputs.pop((stage, m))
        else:  # the previous stage is on this rank: its outputs, cut from its graph
            received = [t.detach() for t in self.kept[(stage - 1, m)][1]]
        if not self.forward_only:
            received = [t.requires_grad_(True) if _differentiable(t) else t for t in received]
        outputs = list(runner.forward(m, received))
        if stage == self.last and self.keep_outputs:
            self.outputs[m] = [t.detach() for t in outputs]
            if not self.forward_only:
                self.kept[(stage, m)] = (received, outputs)
            return
        elif stage == self.last:
            (term,) = outputs
            value = term.detach()
            self.loss = value.clone() if self.loss is None else self.loss + value
        if self.forward_only:
            if stage != self.last:
                self.kept[(stage, m)] = ([], outputs)
            return
        self.kept[(stage, m)] = (received, outputs)

    def backward(self, stage: int, m: int, weights: bool = True) -> None:
        """Microbatch m's backward through stage `stage`: the gradients of its inputs (kept for the
        send) and, with `weights`, of its parameters; without, the stage keeps its weight part for
        `backward_weight`."""
        runner = self.stages[stage]
        received, outputs = self.kept.pop((stage, m))
        if stage == self.last and self.keep_outputs:  # the user's loss gave these
            given = self.output_grads.pop(m)
            outputs = [o for o, g in zip(outputs, given, strict=True) if g is not None]
            grads_out = [g for g in given if g is not None]
        elif stage == self.last:
            grads_out = [torch.full_like(outputs[0], self.loss_scale)]
        elif (stage, m) in self.out_grads:
            grads_out = self.out_grads.pop((stage, m))
        else:  # the next stage is on this rank
            grads_out = self.in_grads.pop((stage + 1, m))
        diff_outputs = [t for t in outputs if _differentiable(t)] if stage != self.last else outputs
        pairs = [(o, g) for o, g in zip(diff_outputs, grads_out, strict=True) if o.requires_grad]
        params = list(runner.params) if weights and runner.reduce_grads is None else []
        if stage in self.to_reduce:
            self.to_reduce[stage] -= 1
        leaves = list(runner.input_leaves(m)) if runner.input_leaves is not None else []
        inputs = [t for t in received if _differentiable(t)]
        wrt = params + inputs + leaves
        found: tuple[torch.Tensor | None, ...]
        if pairs and wrt:
            found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        elif pairs and (not weights or runner.reduce_grads is not None):
            # nothing to return, but the backward must run (it keeps W's inputs / adds its gradients).
            # Asked of the parameters (which get none here: W or the step's reduction gives them;
            # a relayout of one for another program's layout passes the missing gradient through),
            # never as `.backward()`: that would run the parameters' accumulation with no gradient,
            # firing a user's post-accumulate-grad hooks once per microbatch with `.grad` empty
            held = [p for p in runner.params if p.requires_grad]
            if held:
                torch.autograd.grad([o for o, _ in pairs], held, [g for _, g in pairs], allow_unused=True)
            else:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            found = ()
        else:
            found = tuple(None for _ in wrt)
        n, r = len(params), len(inputs)
        found = found if found else tuple(None for _ in wrt)
        self._add_grads(stage, found[:n])
        for j, g in enumerate(found[n + r :]):
            if g is not None:
                before = self.input_grads.get((m, j))
                self.input_grads[(m, j)] = g if before is None else before + g
        if stage > 0:
            self.in_grads[(stage, m)] = [
                torch.zeros_like(t) if g is None else g for t, g in zip(inputs, found[n : n + r], strict=True)
            ]

    def backward_weight(self, stage: int, m: int) -> None:
        """Microbatch m's weight-gradient part of stage `stage` (after its input part)."""
        runner = self.stages[stage]
        assert runner.backward_weight is not None
        self._add_grads(stage, runner.backward_weight(m))


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def run_step(
    schedule: Schedule,
    rank: int,
    stages: Mapping[int, StageRunner],
    group: dist.ProcessGroup | PipelineTransport | None,
    *,
    loss_scale: float,
    forward_only: bool = False,
    device: torch.device | str = "cpu",
    scatter: BoundaryScatter | None = None,
    keep_outputs: bool = False,
) -> StepResult:
    """Run rank `rank`'s action list of `schedule` once: every forward and backward of the step.

    `stages` are this rank's stages by index; `group` the pp process group (its rank r is pipeline
    rank r), or the transport its messages go by (`pipeline_transport`). Each microbatch's backward starts from `loss_scale` as the gradient of its loss term,
    so the step's gradients are those of `loss_scale * sum of terms`. `forward_only` runs the
    forwards and their messages only (no autograd graph is kept). Receive buffers are made on
    `device` (the mesh's). `scatter`: with tensor axes, each rank sends its chunk of every
    boundary tensor and the receiving slice gathers them (`BoundaryScatter`). `keep_outputs`
    (inference, forward only): the last stage returns outputs, not a loss term; the step keeps
    them per microbatch (`StepResult.outputs`)."""
    if keep_outputs and not forward_only:
        raise PipelineRuntimeError(
            "a step that keeps the last stage's outputs runs the forwards only; start_step runs one "
            "whose backwards start from the outputs' gradients"
        )
    if not forward_only:  # (a forward-only step has no backward to split)
        check_supported(schedule, stages)
    missing = sorted(set(schedule.placement.stages_of(rank)) - set(stages))
    if missing:
        raise PipelineRuntimeError(
            f"rank {rank} runs stages {missing} of the schedule but was not given them"
        )
    actions = schedule.actions[rank]
    if forward_only:
        keep = {ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F}
        actions = tuple(a for a in actions if a.kind in keep)
    step = _Step(
        schedule, rank, stages, as_transport(group), loss_scale, forward_only, torch.device(device), scatter,
        keep_outputs,
    )
    if forward_only:
        with torch.no_grad():
            return step.run(actions)
    with torch.enable_grad():
        return step.run(actions)


_BACKWARD_KINDS = frozenset(
    {ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.SEND_B, ActionKind.RECV_B}
)


class PendingStep:
    """A training step whose forwards have run and whose backwards wait for the gradients of the
    last stage's outputs: the step of a call whose loss the user computes from the outputs
    (docs/pipeline.md#a-loss-outside-the-model). `outputs[m]`: what the last stage returned for
    microbatch m (on the rank that holds it). `finish` runs the backwards, once."""

    def __init__(self, step: _Step, backwards: Sequence[Action]) -> None:
        self._step: _Step | None = step
        self._backwards = tuple(backwards)
        self.outputs = step.outputs

    @property
    def finished(self) -> bool:
        return self._step is None

    def finish(self, output_grads: Mapping[int, Sequence[torch.Tensor | None]]) -> StepResult:
        """The backwards of every microbatch, microbatch m's last stage starting from
        `output_grads[m]` (one per output of the last stage, None where none reaches it; ignored
        on ranks without the last stage); returns the parameters' gradients summed over the
        microbatches, reduced as a whole step's are. The kept activations are dropped after."""
        step = self._step
        if step is None:
            raise PipelineRuntimeError(
                "this pipelined step's backward already ran: its kept activations are gone",
                hint="call the pipelined model again for another backward (each call is one step)",
            )
        self._step = None
        if step.last in step.stages:
            step.output_grads = {m: list(g) for m, g in output_grads.items()}
        with torch.enable_grad():
            return step.run(self._backwards)


def start_step(
    schedule: Schedule,
    rank: int,
    stages: Mapping[int, StageRunner],
    group: dist.ProcessGroup | PipelineTransport | None,
    *,
    device: torch.device | str = "cpu",
    scatter: BoundaryScatter | None = None,
) -> PendingStep:
    """Run the forwards of rank `rank`'s action list of `schedule`, keeping what the backwards
    need, and return the step with its backwards still to run (`PendingStep.finish`). The last
    stage returns outputs, not a loss term. Every forward of the schedule must come before its
    first backward action (`forwards_then_backwards`: the loss is not known until the user has
    every microbatch's outputs)."""
    if schedule.split_backward:
        raise UnsupportedScheduleError(
            f"a step whose backwards start from its outputs' gradients runs whole backwards, not the "
            f"{schedule.name!r} schedule's split ones",
            hint="run it in forwards_then_backwards' order",
        )
    missing = sorted(set(schedule.placement.stages_of(rank)) - set(stages))
    if missing:
        raise PipelineRuntimeError(f"rank {rank} runs stages {missing} of the schedule but was not given them")
    actions = schedule.actions[rank]
    first = next((i for i, a in enumerate(actions) if a.kind in _BACKWARD_KINDS), len(actions))
    if any(a.kind not in _BACKWARD_KINDS for a in actions[first:]):
        raise PipelineRuntimeError(
            f"the {schedule.name!r} schedule interleaves forwards and backwards on rank {rank}",
            hint="a step whose loss is outside the model runs forwards_then_backwards' order",
        )
    transport = as_transport(group)
    step = _Step(schedule, rank, stages, transport, 1.0, False, torch.device(device), scatter, keep_outputs=True)
    with torch.enable_grad():
        step.run(actions[:first], final=False)
    return PendingStep(step, actions[first:])


def broadcast_loss(
    loss: torch.Tensor | None,
    src: int,
    group: dist.ProcessGroup | PipelineTransport | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The loss from pipeline rank `src` (the last stage's) on every rank of `group`, as a 0-d tensor."""
    buf = (
        torch.zeros((), dtype=dtype, device=device)
        if loss is None
        else loss.detach().reshape(()).to(dtype).clone()
    )
    as_transport(group).broadcast(buf, src)
    return buf


def sum_shared_grads(
    shared: Sequence[tuple[torch.Size, torch.dtype, torch.Tensor | None]],
    group: dist.ProcessGroup | PipelineTransport | None,
    device: torch.device | str = "cpu",
    owned: Sequence[bool] = (),
) -> list[torch.Tensor]:
    """Sum the gradient copies of parameters held by several stages (a tied embedding and head)
    over the pp group. Every rank passes every shared parameter in the same order: its gradient
    where it holds one, else None (it adds zeros). One all-reduce per parameter, into the gradient
    itself where `owned[i]` says nobody else reads it (a whole tensor gathered or summed for this),
    else into a copy."""
    transport = as_transport(group)
    out = []
    for i, (shape, dtype, grad) in enumerate(shared):
        if grad is None:
            buf = torch.zeros(shape, dtype=dtype, device=device)
        else:
            buf = grad.detach() if i < len(owned) and owned[i] else grad.detach().clone()
        transport.all_reduce(buf)
        out.append(buf)
    return out
