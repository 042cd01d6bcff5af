"""Axis roles of the greedy pass: which mesh axes split tokens and which split weights.

Matmul-like ops that consume a parameter follow these roles in the greedy pass
(`greedy._Greedy._role_filter`): "token" axes split the activation's rows, "tensor" axes each
split the weight. The batch must divide over the token axes; `batch_error` says why it does not.
"""

from __future__ import annotations

import math

import torch.fx as fx

from autopar.core.errors import ShardingError
from autopar.core.mesh import Mesh
from autopar.core.meta import info

DATA_AXIS_NAMES = ("dp", "data", "ddp", "fsdp", "batch")


def axis_roles(mesh: Mesh) -> tuple[str, ...]:
    """'token' or 'tensor' per axis: by name for data axes, else by position (x, y tensor; z token)."""
    n = mesh.ndim
    by_position = {1: ("tensor",), 2: ("tensor", "tensor"), 3: ("tensor", "tensor", "token")}
    roles = list(by_position.get(n, ("token",) + ("tensor", "tensor") + ("token",) * (n - 3)))
    for a, name in enumerate(mesh.axis_names):
        if name.lower() in DATA_AXIS_NAMES:
            roles[a] = "token"
    return tuple(roles)


def batch_error(gm: fx.GraphModule, mesh: Mesh, roles: tuple[str, ...]) -> ShardingError | None:
    """Why the first input's dim 0 (the batch, which the token axes split) does not divide evenly
    over `roles`' token axes; None if it does. A plan found on another mesh is held to it too."""
    shape = tuple(mesh.shape)
    token_axes = [a for a, r in enumerate(roles) if r == "token" and shape[a] > 1]
    factor = math.prod(shape[a] for a in token_axes)
    first = next((n for n in gm.graph.nodes if n.op == "placeholder" and info(n).role == "input"), None)
    if first is None or factor == 1:
        return None
    val = first.meta["val"]
    if val.dim() >= 1 and val.shape[0] % factor:
        names = "".join(mesh.axis_names[a] for a in token_axes)
        return ShardingError(
            f"the batch dim of input 0 ({val.shape[0]}, shape {list(val.shape)}) is not divisible "
            f"by the token axes {names} of mesh {mesh} ({factor} ranks)",
            op="input",
            layouts=[f"wanted: dim 0 split {factor} ways over {names}"],
            hint=f"use a batch size that is a multiple of {factor}, or a mesh with smaller token axes",
        )
    return None
