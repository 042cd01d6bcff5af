"""A pipelined model built on the meta device: each rank makes only its own stages' tensors
(docs/pipeline.md#a-model-built-on-meta).

The model's whole initialization runs on every rank, call by call from the random state
`parallelize` began with (`autopar.runtime.materialize`), so every draw is the serial one; a tensor
of another stage is whole only during the calls that write it, then dropped. No rank ever holds
the whole model: what it keeps is its stages' share (a tied weight that several stages read, once
on each rank holding one of them).
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.compiler.pipeline_checkpoint import unit_stage
from autopar.compiler.pipeline_split import StageProgram, get_attr
from autopar.runtime.materialize import InitFn, materialize_in_place, meta_tensor_names

__all__ = ["held_names", "make_stage_tensors"]


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
