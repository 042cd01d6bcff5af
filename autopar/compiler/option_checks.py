"""What the compiler driver refuses before it plans: options that cannot work (`check_options`,
before anything is traced) and option-model pairs the traced graph shows cannot (a "cp" axis
without attention to split, the all-to-all dispatcher without experts it takes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.core.errors import AutoparError, UsageError
from autopar.core.mesh import Mesh
from autopar.core.meta import where_of
from autopar.rules.context_parallel import CP_AXIS, FORWARD
from autopar.rules.routed_experts import ROUTED_OPS


def check_options(
    model: Any, mesh: Mesh, coords: Sequence[int] | None, memory_limit: float | None, in_flight_bytes: int | None
) -> None:
    """Arguments that cannot work, refused by name before anything is traced."""
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model must be an nn.Module, got {type(model).__name__}",
            hint="wrap a function in an nn.Module whose forward calls it",
        )
    if coords is not None:
        coords = tuple(coords)
        if len(coords) != mesh.ndim or any(not 0 <= c < n for c, n in zip(coords, mesh.shape)):
            raise UsageError(
                f"coords {coords} are not a rank of mesh {mesh}",
                hint=f"give one coordinate per axis, each in 0..size-1 of mesh shape {mesh.shape}",
            )
    if "pp" in mesh.axis_names and mesh.shape[mesh.axis_names.index("pp")] > 1:
        raise UsageError(
            "the mesh has a pipeline axis \"pp\": compile_for_rank plans tensor and data axes only; a "
            "pipeline runs through parallelize on a 1-D (\"pp\",) mesh (docs/pipeline.md)",
            hint="name the axis otherwise to use it as a tensor or data axis, or leave it out of the mesh",
        )
    for name, value, least in (("memory_limit", memory_limit, 1), ("in_flight_bytes", in_flight_bytes, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= least):
            raise UsageError(
                f"{name} must be a number of bytes >= {least}, got {value!r}",
                hint=f"for example {name}=40e9, or leave it out",
            )


def check_token_dispatch(gm: fx.GraphModule, mesh: Mesh, token_dispatch: str) -> None:
    """token_dispatch="alltoall" on a model none of whose experts the op could take is an error,
    not a silent all-gather dispatcher."""
    if token_dispatch != "alltoall" or mesh.size == 1:
        return
    if not any(n.op == "call_function" and n.target in ROUTED_OPS for n in gm.graph.nodes):
        raise AutoparError(
            "token_dispatch='alltoall' but the model has no experts module the all-to-all dispatcher takes",
            op="PlanOptions.token_dispatch",
            hint="it takes transformers' gated experts (gate_up_proj (E, 2I, H), down_proj (E, H, I), silu, gelu "
            "or relu, no bias); use token_dispatch='allgather' for other models",
        )


def check_context_parallel(gm: fx.GraphModule, mesh: Mesh) -> None:
    """A "cp" axis asks for the sequence split over it, which needs attention to split. Attention
    with dropout (`dropout_p > 0` in training) is traced as its math (matmul, softmax, dropout),
    not as the attention op: a sequence split could not give serial's numbers for it, so the error
    names the dropout where the model draws one."""
    if CP_AXIS not in mesh.axis_names or mesh.shape[mesh.axis_names.index(CP_AXIS)] == 1:
        return
    if any(node.target is FORWARD for node in gm.graph.nodes):
        return
    draws = [
        node
        for node in gm.graph.nodes
        if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
    ]
    if draws:
        raise UsageError(
            f'mesh {mesh} has a "cp" axis, which asks for context parallelism (the sequence split over '
            "it, attention exchanging keys and values), but the model's attention is not an attention "
            "op the split can take: the model draws random numbers (dropout), and attention with "
            "dropout is traced as its math (matmul, softmax, dropout), whose sequence split could not "
            "give the serial model's numbers",
            op=str(draws[0].target),
            where=where_of(draws[0]),
            hint="set the attention's dropout to 0 (transformers: attention_dropout=0.0; "
            "nn.MultiheadAttention / nn.TransformerEncoderLayer: dropout=0.0), or train without a "
            '"cp" axis (name it otherwise: the search then splits what it prices best)',
        )
    raise UsageError(
        f'mesh {mesh} has a "cp" axis, which asks for context parallelism (the sequence split '
        "over it, attention exchanging keys and values), but the model calls no "
        "scaled_dot_product_attention: there is no sequence for it to split",
        hint='name the axis otherwise (the search then splits what it prices best), or call '
        "torch.nn.functional.scaled_dot_product_attention in the model's attention",
    )
