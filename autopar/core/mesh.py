"""The mesh as the compiler sees it: named axes with sizes, optionally backed by a DeviceMesh."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autopar.core.errors import MeshError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Mesh:
    """Axis names and sizes; `device_mesh` is absent when planning without processes.

    The last `in_process` axes are not ranks: over-decomposition runs their "ranks" (batch chunks)
    one after another inside each process, so their redistributions are local tensor ops.
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    device_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    in_process: int = 0
    # the process groups collectives use per rank axis (autopar's own, with its timeout); None: the
    # DeviceMesh's
    group_names: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    # where the programs run ("cpu", "cuda", ...): the device mesh's, or given when planning a job
    # on another machine; emitted graphs make their tensors there
    device_type: str = field(default="cpu", compare=False)

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.shape):
            raise MeshError(
                f"mesh has {len(self.shape)} axes but {len(self.axis_names)} names",
                hint="give one name per mesh axis",
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise MeshError(f"mesh axis names repeat: {self.axis_names}", hint="name each axis once")
        if not self.shape:
            raise MeshError("a mesh needs at least one axis", hint="for one rank, use the shape (1,)")
        if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in self.shape):
            raise MeshError(f"mesh axis sizes must be integers, got {self.shape}", hint="for example (2, 2, 2)")
        if any(s < 1 for s in self.shape):
            raise MeshError(
                f"mesh axis sizes must be >= 1, got {self.shape}", hint="every axis holds at least one rank"
            )

    @staticmethod
    def from_shape(shape: tuple[int, ...], names: tuple[str, ...] | None = None, device_type: str = "cpu") -> Mesh:
        names = tuple(names) if names else default_axis_names(len(shape))
        return Mesh(names, tuple(shape), device_type=device_type)

    @staticmethod
    def from_device_mesh(device_mesh: DeviceMesh) -> Mesh:
        names = device_mesh.mesh_dim_names or default_axis_names(device_mesh.ndim)
        return Mesh(tuple(names), tuple(device_mesh.shape), device_mesh, device_type=device_mesh.device_type)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def device_ndim(self) -> int:
        """Axes whose coordinates are ranks (all but the in-process ones)."""
        return self.ndim - self.in_process

    def is_in_process(self, axis: int) -> bool:
        return axis >= self.device_ndim

    def with_chunks(self, chunks: int, name: str = "chunk") -> Mesh:
        """This mesh with one more, in-process axis of `chunks` batch chunks (over-decomposition)."""
        return Mesh(
            (*self.axis_names, name),
            (*self.shape, chunks),
            self.device_mesh,
            self.in_process + 1,
            self.group_names,
            self.device_type,
        )

    def coords_of(self, rank_in_mesh: int) -> tuple[int, ...]:
        """Row-major coordinates of the rank's position in the mesh (DeviceMesh convention)."""
        coords = []
        for size in reversed(self.shape):
            coords.append(rank_in_mesh % size)
            rank_in_mesh //= size
        return tuple(reversed(coords))

    def my_coords(self) -> tuple[int, ...]:
        if self.device_mesh is None:
            return (0,) * self.ndim
        coords = self.device_mesh.get_coordinate()
        if coords is None:
            raise MeshError("this rank is not part of the mesh", hint="build the mesh over all ranks")
        return (*coords, *(0,) * self.in_process)

    def comm_group(self, axis: int) -> str:
        """The group a collective over `axis` is emitted with: the axis's process group, or
        "<name>" where it has none (a planning-only mesh, an axis of one rank)."""
        if self.device_mesh is None or self.shape[axis] == 1:
            return f"<{self.axis_names[axis]}>"
        return self.group_name(axis)

    def group_name(self, axis: int) -> str:
        if self.is_in_process(axis):
            return f"<{self.axis_names[axis]}>"
        if self.group_names is not None:
            return self.group_names[axis]
        if self.device_mesh is None:
            raise MeshError("this mesh has no process groups (planning-only mesh)")
        return self.device_mesh.get_group(axis).group_name

    def __str__(self) -> str:
        axes = [f"{n}={s}" for n, s in zip(self.axis_names, self.shape)]
        for a in range(self.device_ndim, self.ndim):
            axes[a] += " in-process"
        return "(" + ", ".join(axes) + ")"


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """x, y, z for the tensor axes; a fourth leading axis is the data-parallel one."""
    if ndim == 4:
        return ("dp", "x", "y", "z")
    if ndim <= 3:
        return ("x", "y", "z")[:ndim]
    return tuple(f"a{i}" for i in range(ndim))
