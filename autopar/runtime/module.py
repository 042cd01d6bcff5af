"""What `parallelize` returns: a module that runs this rank's emitted graphs under autograd.

Parameters are DTensors (original names, global shapes, local storage shards), so torch
optimizers, `clip_grad_norm_` and distributed checkpointing work on them unchanged. `forward`
runs the emitted forward graph inside an autograd.Function whose backward runs the emitted backward
graph; the local gradients it returns flow through `DTensor.to_local` into DTensor `.grad`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.placement_types import Partial as DPartial
from torch.utils import _pytree as pytree

from autopar.core.errors import InputMismatchError
from autopar.core.layout import Layout, Partial, Shard
from autopar.core.mesh import Mesh
from autopar.runtime.program import EmittedProgram, local_value


def to_dtensor_placements(layout: Layout) -> list[Any]:
    result: list[Any] = []
    for p in layout.placements:
        if isinstance(p, Shard):
            result.append(DShard(p.dim))
        elif isinstance(p, Partial):
            result.append(DPartial())
        else:
            result.append(DReplicate())
    return result


class _RunProgram(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, program: EmittedProgram, num_outputs: int, *flat: torch.Tensor) -> Any:
        results = program.forward(*flat)
        outputs, saved = results[:num_outputs], results[num_outputs:]
        ctx.program = program
        ctx.save_for_backward(*saved)
        ctx.num_flat = len(flat)
        ctx.num_params = len(program.param_names)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        program: EmittedProgram = ctx.program
        tangents = []
        for index in program.tangent_outputs:
            grad = grads[index]
            if grad is None:
                layout = program.output_layouts[index]
                grad = torch.zeros(
                    layout.local_shape(_mesh_shape_of(program), program.coords), dtype=layout.dtype
                )
            tangents.append(grad.contiguous())
        param_grads = program.backward(*ctx.saved_tensors, *tangents)
        rest = [None] * (ctx.num_flat - ctx.num_params)
        return (None, None, *param_grads, *rest)


def _mesh_shape_of(program: EmittedProgram) -> tuple[int, ...]:
    return tuple(program.forward.meta.get("autopar_mesh_shape", ()))


class ParallelModule(nn.Module):
    """This rank's share of the model; call it with the same global inputs on every rank."""

    def __init__(
        self,
        program: EmittedProgram,
        mesh: Mesh,
        source: nn.Module,
        aliases: dict[str, str],
        in_spec: Any,
        example_specs: Sequence[tuple[tuple[int, ...], torch.dtype] | None],
        report: Any = None,
    ) -> None:
        super().__init__()
        assert mesh.device_mesh is not None
        self._program = program
        self._mesh = mesh
        self._in_spec = in_spec
        self._example_specs = list(example_specs)
        self.report = report
        program.forward.meta["autopar_mesh_shape"] = tuple(mesh.shape)
        full: dict[str, torch.Tensor] = dict(source.named_parameters(remove_duplicate=False))
        buffers = dict(source.named_buffers(remove_duplicate=False))
        full.update(buffers)
        layouts = program.source_layouts()  # a fused parameter's parts make one layout
        self._ordered: list[str] = list(program.param_names)
        # register in the source model's order so named_parameters()/state_dict() read the same
        for name in [*dict(source.named_parameters(remove_duplicate=False)), *buffers]:
            if name in aliases:
                _register(self, name, _lookup(self, aliases[name]), buffer=name in buffers)
                continue
            if name not in layouts:
                continue
            tensor = full[name].detach()
            layout = layouts[name]
            local = local_value(tensor, layout, mesh.shape, program.coords).clone().contiguous()
            dt = DTensor.from_local(
                local,
                mesh.device_mesh,
                to_dtensor_placements(layout),
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride() if tensor.is_contiguous() else None,
            )
            if name in buffers:
                _register(self, name, dt, buffer=True)
            else:
                _register(self, name, nn.Parameter(dt, requires_grad=full[name].requires_grad))

    @property
    def program(self) -> EmittedProgram:
        return self._program

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        self._check_inputs(flat, spec)
        shape = tuple(self._mesh.shape)
        local_inputs = [
            local_value(x, layout, shape, self._program.coords)
            for x, layout in zip(
                [x for x in flat if isinstance(x, torch.Tensor)], self._program.input_layouts
            )
        ]
        local_params = [self._local_param(name) for name in self._ordered]
        num_outputs = len(self._program.output_layouts)
        outputs = _RunProgram.apply(self._program, num_outputs, *local_params, *local_inputs)
        results = [self._wrap(o, lay) for o, lay in zip(outputs, self._program.output_layouts)]
        return results[0] if len(results) == 1 else tuple(results)

    def _local_param(self, name: str) -> torch.Tensor:
        """This rank's block of program parameter `name`: a part of a fused parameter is a chunk
        of the whole parameter's block (its cut dim is whole there), so autograd sums into it."""
        part = self._program.param_parts.get(name)
        if part is None:
            return _local(_lookup(self, name))
        return part.of(_local(_lookup(self, part.source)))

    def _wrap(self, local: torch.Tensor, layout: Layout) -> Any:
        if layout.is_replicated and len(layout.shape) == 0:
            return local
        assert self._mesh.device_mesh is not None
        return DTensor.from_local(
            local,
            self._mesh.device_mesh,
            to_dtensor_placements(layout),
            run_check=False,
            shape=torch.Size(layout.shape),
            stride=_contiguous_strides(layout.shape),
        )

    def _check_inputs(self, flat: list[Any], spec: Any) -> None:
        if spec != self._in_spec:
            raise InputMismatchError(
                f"inputs have structure {spec}, but the module was compiled for {self._in_spec}",
                hint="call with the same arguments as example_inputs, or parallelize again",
            )
        for index, (value, expected) in enumerate(zip(flat, self._example_specs)):
            if expected is None:
                continue
            got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None
            if got != expected:
                raise InputMismatchError(
                    f"input {index} is {_describe(got)}, but the module was compiled for {_describe(expected)}",
                    hint="shapes are compiled into the plan: pass inputs shaped like example_inputs, "
                    "or call autopar.parallelize again with the new shapes",
                )

    def plan_summary(self) -> str:
        return str(self.report) if self.report is not None else ""


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


def _describe(spec: tuple[tuple[int, ...], torch.dtype] | None) -> str:
    if spec is None:
        return "not a tensor"
    shape, dtype = spec
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _register(root: nn.Module, name: str, value: Any, buffer: bool = False) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part) or not isinstance(getattr(module, part), nn.Module):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if buffer:
        module.register_buffer(leaf, value)
    else:
        module.register_parameter(leaf, value)


def _lookup(root: nn.Module, name: str) -> Any:
    module: Any = root
    for part in name.split("."):
        module = getattr(module, part)
    return module
