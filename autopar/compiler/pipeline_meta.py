"""A pipelined model built on the meta device: each rank makes only its own stages' tensors
(docs/pipeline.md#a-model-built-on-meta).

The model's whole initialization runs on every rank, call by call from the random state
`parallelize` began with (`autopar.runtime.materialize`), so every draw is the serial one; a tensor
of another stage is whole only during the calls that write it, then dropped. No rank ever holds
the whole model: what it keeps is its stages' share (a tied weight that several stages read, once
on each rank holding one of them). A later call whose stage reads a tensor its rank does not hold
(an argument left out, so the model reads a buffer instead) gets it, whole, from a rank that holds
it (`MetaHolders`): its value there, initialized, loaded or trained, is the serial model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from autopar.compiler.pipeline_checkpoint import unit_stage
from autopar.compiler.pipeline_split import PipelineSplitError, StageProgram, get_attr
from autopar.runtime.materialize import InitFn, hold_whole, materialize_in_place, meta_tensor_names
from autopar.runtime.pipeline_transport import PipelineTransport

__all__ = ["MetaHolders", "held_names", "make_stage_tensors"]


def held_names(model: nn.Module, program: StageProgram, stages: tuple[int, ...], *, read: bool) -> set[str]:
    """The names of the model's tensors that `stages` hold: with `read`, those their programs read;
    and always the model's tensors no stage reads whose module they hold (`unit_stage`), as the
    state dict and `named_buffers` keep them. What a rank makes of a model built on meta."""
    names: set[str] = set()
    if read:
        for s in stages:
            names.update(a for a in program.stages[s].attrs if a not in program.constants)
    every = {a for st in program.stages for a in st.attrs if a not in program.constants}
    read_ids = {id(get_attr(model, a)) for a in every}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) not in read_ids and unit_stage(program, name) in stages:
            names.add(name)
    return names


def make_stage_tensors(
    model: nn.Module,
    program: StageProgram,
    stages: tuple[int, ...],
    *,
    read: bool,
    init_fn: InitFn | None,
    seeded: torch.Tensor,
    device: torch.device | str,
) -> int:
    """Make the meta tensors of `model` that `stages` hold (`held_names`) real, in the model under
    every name, equal to the model built on `device` from the random state `seeded` (the model's
    own initialization, or `init_fn(module)` on every module); the other stages' stay on meta.
    `read=False` (stages run by parallel modules, which make their own blocks of what they read):
    only the tensors no stage reads. Returns the bytes made (0: nothing on meta to make)."""
    if not meta_tensor_names(model):
        return 0
    names = held_names(model, program, stages, read=read)
    if not names:
        return 0
    torch.random.set_rng_state(seeded)
    return materialize_in_place(model, names, init_fn, device)


class MetaHolders:
    """Which rank of the pp group holds which tensor of a model built on meta, on a 1-D pipeline
    mesh (every rank keeps the same record: every rank exports every stage's program).

    After the first program each rank holds its stages' tensors (`held_names`); every tensor of the
    model is held by some rank (a read one by its readers, an unread one by its unit's stage). A
    later program whose stage reads a tensor its rank does not hold (BERT reads its
    `token_type_ids` buffer only when that argument is missing; a model's default reads a buffer of
    the root, stage 0's, in the last stage) would run on a meta tensor; `receive` sends it whole
    from the lowest rank that holds it to each rank that now reads it, before any stage runs, so
    its value is what the model holds (after `load_checkpoint` or training too), not a new init."""

    def __init__(self, model: nn.Module, program: StageProgram, stages_of: Sequence[tuple[int, ...]]) -> None:
        first: dict[int, str] = {}
        self.canonical: dict[str, str] = {}  # every name of a tensor -> its first name
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.canonical[name] = first.setdefault(id(tensor), name)
        self.held = [
            {self.canonical.get(n, n) for n in held_names(model, program, stages, read=True)} for stages in stages_of
        ]
        self.stages_of = tuple(stages_of)

    def receive(
        self, model: nn.Module, program: StageProgram, transport: PipelineTransport, rank: int, device: torch.device | str
    ) -> int:
        """Send and receive the tensors that `program`'s stages read and their ranks do not hold
        (point to point on the pp group, in name order, the same on every rank); each received one
        is held by the model under every name. Returns the bytes this rank received."""
        wanted: dict[str, list[int]] = {}
        for q, stages in enumerate(self.stages_of):
            for s in stages:
                for attr in program.stages[s].attrs:
                    name = self.canonical.get(attr)
                    if name is not None and name not in self.held[q] and q not in wanted.setdefault(name, []):
                        wanted[name].append(q)
        received = 0
        for name in sorted(wanted):
            holders = [q for q, held in enumerate(self.held) if name in held]
            if not holders:
                raise PipelineSplitError(
                    f"a stage reads {name} in this call, and no rank holds it (a model built on meta)",
                    hint="pass the same set of arguments on every call as in example_inputs / example_kwargs",
                )
            source = holders[0]
            for q in wanted[name]:
                if rank == source:
                    sent = transport.isend(get_attr(model, name).detach().contiguous(), q, 0)
                    if sent is not None:
                        sent.wait()
                elif rank == q:
                    meta = get_attr(model, name)
                    value = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                    transport.recv(value, source, 0)
                    hold_whole(model, name, value)
                    received += value.numel() * value.element_size()
                self.held[q].add(name)
        return received
