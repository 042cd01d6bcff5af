"""What one rank runs: the emitted forward and backward programs and how their values map to the
user's parameters and inputs. emit produces it and `ParallelModule` runs it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from autopar.core.layout import Layout, Replicate
from autopar.core.meta import IndexCheck, ParamPart
from autopar.core.value_guards import ValueGuards


@dataclass
class EmittedProgram:
    """What a rank runs. forward: (params..., inputs...) -> (outputs..., saved...)."""

    forward: fx.GraphModule
    backward: fx.GraphModule  # (saved..., tangents...) -> parameter gradients (storage layout), input gradients
    param_names: list[str]
    param_layouts: list[Layout]  # storage layouts, placeholder order
    input_layouts: list[Layout]
    output_layouts: list[Layout]
    tangent_outputs: list[int]  # which user output each tangent belongs to
    num_saved: int
    coords: tuple[int, ...]
    # parameters cut out of a fused one (`autopar.passes.fused`): name -> which chunk of which
    param_parts: dict[str, ParamPart] = field(default_factory=dict)
    # buffers the forward updates: their new values are the last forward outputs, in this order
    buffer_updates: list[str] = field(default_factory=list)
    # inputs the forward writes into in place: their new values are the forward outputs before the
    # buffers', written back into the caller's tensors (`JointSignature.input_updates`)
    input_updates: list[int] = field(default_factory=list)
    # tensors the forward made from Python data (lifted by export): name -> value, whole on every rank
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    # inputs whose values index a tensor: checked before the forward runs (`IndexCheck`)
    index_checks: list[IndexCheck] = field(default_factory=list)
    # conditions on the inputs' values this program was traced under: checked before it runs
    value_guards: ValueGuards | None = None
    # inputs that get a gradient: the tensor input index of each backward output after the
    # parameters' gradients (whole on every rank, like the input the user passed)
    input_grads: list[int] = field(default_factory=list)
    device_type: str = "cpu"  # where its tensors live: the mesh's device

    def param_value(self, name: str, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The value of program parameter `name` given the user's parameters by name (a chunk of
        the user's fused parameter for a part)."""
        if name in self.constants:
            return self.constants[name]
        part = self.param_parts.get(name)
        return part.of(params[part.source]) if part is not None else params[name]

    def source_layouts(self) -> dict[str, Layout]:
        """Storage layout of every user parameter the program reads; a fused parameter's parts
        share one layout that leaves the cut dim whole, which is then the whole parameter's."""
        result: dict[str, Layout] = {}
        for name, layout in zip(self.param_names, self.param_layouts):
            if name in self.constants:
                continue
            part = self.param_parts.get(name)
            if part is None:
                result[name] = layout
                continue
            if layout.shard_axes(part.dim) or result.get(part.source, layout).placements != layout.placements:
                raise AssertionError(f"parts of {part.source} are not stored alike with dim {part.dim} whole")
            shape = list(layout.shape)
            shape[part.dim] *= part.count
            result[part.source] = Layout(layout.placements, tuple(shape), layout.dtype)
        return result

    def on_devices(self, device_ndim: int) -> EmittedProgram:
        """The program's interface on the device mesh: over-decomposed programs were emitted on a
        mesh with in-process chunk axes, on which parameters, inputs and outputs are whole."""
        if len(self.coords) == device_ndim:
            return self

        def drop(layout: Layout) -> Layout:
            extra = layout.placements[device_ndim:]
            if any(not isinstance(p, Replicate) for p in extra):
                raise AssertionError(f"interface layout {layout} is split over an in-process axis")
            return Layout(layout.placements[:device_ndim], layout.shape, layout.dtype)

        return replace(
            self,
            param_layouts=[drop(x) for x in self.param_layouts],
            input_layouts=[drop(x) for x in self.input_layouts],
            output_layouts=[drop(x) for x in self.output_layouts],
            coords=self.coords[:device_ndim],
        )


def local_value(full: torch.Tensor, layout: Layout, mesh_shape: Sequence[int], coords: Sequence[int]) -> Any:
    """This rank's block of a full tensor (parameters at start-up, inputs at call time)."""
    out = full
    local = layout.local_shape(mesh_shape, coords)
    for d in range(full.dim()):
        if local[d] != full.shape[d]:
            chunks = layout.local_chunks(mesh_shape, coords, d)  # two for a load-balanced dim
            pieces = [out.narrow(d, start, length) for start, length in chunks]
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
    return out
