"""The forward's in-place writes into its own inputs, done to the caller's tensors as serial does.

A model may write into a tensor it is given (FSMT's `shift_tokens_right` replaces -100 in the
labels by the pad id, `labels.masked_fill_(...)`): serial, the caller's tensor changes. The trace
makes each such input's new value a forward output (`JointSignature.input_updates`), planned like
the user's outputs; after the program ran, each is gathered whole and copied into the tensor the
caller passed, so the caller sees what serial leaves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.core.errors import UsageError
from autopar.runtime.param_feed import contiguous_strides, to_dtensor_placements
from autopar.runtime.program import EmittedProgram


def write_inputs_back(
    program: EmittedProgram,
    outputs: Sequence[torch.Tensor],
    tensors: Sequence[torch.Tensor],
    device_mesh: DeviceMesh | None,
    local_inputs: bool,
) -> None:
    """Copy each input's new value among the forward `outputs` (this rank's block of it) whole
    into the caller's tensor (`tensors`: the call's tensor inputs). Every rank calls it (gathering
    a split value is a collective)."""
    updates = program.input_updates
    if not updates:
        return
    first = len(outputs) - len(program.buffer_updates) - len(updates)  # after the user's outputs
    values, layouts = outputs[first : first + len(updates)], program.output_layouts[first : first + len(updates)]
    if local_inputs:
        raise UsageError(
            f"the model writes into its tensor input {updates[0]} in place; with inputs=\"local\" "
            "each rank holds its own shard of that input, which autopar does not write back yet",
            op="in-place update of an input",
            hint='use inputs="global", or have the model update a copy (x = x.clone() before the in-place op)',
        )
    with torch.no_grad():
        for index, local, layout in zip(updates, values, layouts):
            whole = local
            if not layout.is_replicated:
                assert device_mesh is not None, "a split value needs the mesh it is split over"
                whole = DTensor.from_local(
                    local,
                    device_mesh,
                    to_dtensor_placements(layout),
                    run_check=False,
                    shape=torch.Size(layout.shape),
                    stride=contiguous_strides(layout.shape),
                ).full_tensor()
            tensors[index].copy_(whole)
