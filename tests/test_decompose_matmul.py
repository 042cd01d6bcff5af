"""Decomposed collective matmuls (`autopar.passes.decompose_matmul`): the rewritten graph, and
training steps of every rank in lockstep equal to serial (and to the undecomposed programs)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from pass_fixtures import Coords, compile_every_rank, lockstep_step

from autopar.core.collectives import COLLECTIVES, PIECE_KEY
from autopar.passes.decompose_matmul import DECOMPOSED_KEY
from autopar.testing import assemble
from examples.models import make_gpt, make_mlp

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _pieces(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES and PIECE_KEY in n.meta]


def _assembled_grads(compiled: dict[Coords, object], bwd: dict[Coords, list], shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient put together from the ranks' blocks (fused parts into their source)."""
    first = next(iter(compiled.values())).program  # type: ignore[attr-defined]
    out: dict[str, torch.Tensor] = {}
    for i, (name, lay) in enumerate(zip(first.param_names, first.param_layouts)):
        grad = assemble({c: bwd[c][i] for c in bwd}, lay, shape, atol=1e-5, rtol=1e-5)
        part = first.param_parts.get(name)
        if part is None:
            out[name] = grad
        else:
            whole = out.get(part.source)
            if whole is None:
                sizes = list(grad.shape)
                sizes[part.dim] *= part.count
                whole = out[part.source] = torch.zeros(sizes, dtype=grad.dtype)
            part.of(whole).copy_(grad)
    return out


def _train_in_lockstep(
    make: object, shape: tuple[int, ...], steps: int = 2, **options: object
) -> tuple[list[float], list[float], float, float, dict[Coords, object]]:
    """`steps` SGD-momentum steps of the model serially and of every rank's program in lockstep
    (the ranks' gradients assembled, applied to a copy of the weights): the losses of each, the
    largest gradient and parameter differences, and the compiled programs."""
    serial, batch = make()  # type: ignore[operator]
    parallel = copy.deepcopy(serial)
    compiled = compile_every_rank(parallel, shape, batch, **options)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    losses_s, losses_p, grad_diff = [], [], 0.0
    for _ in range(steps):
        fwd, bwd = lockstep_step(compiled, parallel, shape, batch, {})  # type: ignore[arg-type]
        losses_p.append(max(float(fwd[c][0]) for c in fwd))
        grads = _assembled_grads(compiled, bwd, shape)
        opt_s.zero_grad()
        torch.manual_seed(0)
        loss = serial(*batch)
        loss.backward()
        losses_s.append(float(loss.detach()))
        for (name, p), q in zip(parallel.named_parameters(), serial.parameters()):
            p.grad = grads[name].clone()
            grad_diff = max(grad_diff, float((p.grad - q.grad).abs().max()))  # type: ignore[operator]
        opt_s.step()
        opt_p.step()
    param_diff = max(float((p - q).abs().max()) for p, q in zip(parallel.parameters(), serial.parameters()))
    return losses_s, losses_p, grad_diff, param_diff, compiled  # type: ignore[return-value]


def _decomposed(compiled: dict[Coords, object]) -> list:
    return [r for r in next(iter(compiled.values())).graph.meta[DECOMPOSED_KEY] if r.kept]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model", "shape", "planner"),
    [("gpt", (4,), "greedy"), ("gpt", (2, 2), "search"), ("mlp", (4,), "search")],
)
def test_decomposed_programs_train_as_serial(model: str, shape: tuple[int, ...], planner: str) -> None:
    make = (lambda: make_gpt(0, n_layer=1)) if model == "gpt" else (lambda: make_mlp(0))
    losses_s, losses_p, grad_diff, param_diff, compiled = _train_in_lockstep(
        make, shape, planner=planner, decompose_matmuls="on"
    )
    kinds = {r.kind for r in _decomposed(compiled)}
    assert kinds == {"all_gather", "reduce_scatter"}, kinds
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses_s, losses_p)), (losses_s, losses_p)
    assert grad_diff < 2e-5 and param_diff < 1e-5, (grad_diff, param_diff)
