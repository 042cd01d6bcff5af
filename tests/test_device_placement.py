"""Emitted graphs are GPU-ready: compiled for a `cuda` mesh on a machine without a GPU (the trace
and emit's shape check run on CPU fake tensors), every tensor the graphs make is made on the mesh's
device, none on the CPU the trace happened to run on. Inputs and parameters are the mesh's device's
already, so every value the programs compute is there too. (Local ops make their tensors from
their inputs' device or a device argument, which these graphs name.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.compiler.driver import compile_for_rank
from autopar.core.mesh import Mesh
from examples.hf_models import make_hf_llama
from examples.models import make_gpt, make_mlp


class DropoutMLP(nn.Module):
    """Random ops (dropout's mask is drawn by a local op that names its device) and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        scale = torch.tensor([2.0, 0.5]).repeat(4)  # a tensor made from Python data
        return nn.functional.cross_entropy(self.fc2(h) * scale, y)


def _dropout_case() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return DropoutMLP(), (torch.randn(8, 16), torch.randint(0, 8, (8,)))


CASES: dict[str, Callable[[], tuple[Any, tuple[torch.Tensor, ...]]]] = {
    "gpt": lambda: make_gpt(0),
    "llama": lambda: make_hf_llama(0),  # rotary buffers, causal mask factories, position ids
    "mlp-uneven": lambda: make_mlp(0, d_in=36, hidden=67, n_classes=11),  # torch.chunk blocks
    "dropout": _dropout_case,
}


def _devices_named(gm: fx.GraphModule) -> list[tuple[str, torch.device]]:
    return [
        (node.name, value)
        for node in gm.graph.nodes
        for value in pytree.tree_leaves((node.args, node.kwargs))
        if isinstance(value, torch.device)
    ]


def _factories_without_device(gm: fx.GraphModule) -> list[str]:
    """Calls of ops that take a device and were given none (torch would make them on the CPU)."""
    missing = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        names = [a.name for a in schema.arguments]
        if "device" not in names:
            continue
        position = names.index("device")
        given = node.kwargs.get("device", node.args[position] if position < len(node.args) else None)
        if given is None and not any(isinstance(a, fx.Node) for a in node.args[:1]):  # `*_like` follow x
            missing.append(node.name)
    return missing


def _value_devices(gm: fx.GraphModule) -> set[str]:
    return {
        str(leaf.device)
        for node in gm.graph.nodes
        for leaf in pytree.tree_leaves(node.meta.get("val"))
        if isinstance(leaf, torch.Tensor)
    }


@pytest.mark.parametrize("case", list(CASES))
def test_programs_compiled_for_a_cuda_mesh_make_and_compute_everything_on_cuda(case: str) -> None:
    model, batch = CASES[case]()
    mesh = Mesh.from_shape((2, 2, 2), device_type="cuda")
    program = compile_for_rank(model, mesh, batch, coords=(1, 0, 1)).program
    assert program.device_type == "cuda"
    for gm in (program.forward, program.backward):
        named = _devices_named(gm)
        assert all(device.type == "cuda" for _, device in named), [x for x in named if x[1].type != "cuda"]
        assert not _factories_without_device(gm), _factories_without_device(gm)
    if case in ("gpt", "llama", "dropout"):  # graphs that make tensors: the check above saw some
        assert _devices_named(program.forward)


def test_a_cpu_mesh_keeps_its_programs_on_the_cpu() -> None:
    model, batch = make_gpt(0)
    program = compile_for_rank(model, Mesh.from_shape((2, 2, 2)), batch, coords=(0, 0, 0)).program
    assert program.device_type == "cpu"
    assert {device.type for _, device in _devices_named(program.forward)} == {"cpu"}
    assert _value_devices(program.forward) == {"cpu"}  # emit's shape check ran it on the CPU


def test_a_batch_already_on_the_gpu_is_traced_like_the_weights() -> None:
    """What a GPU user passes: `idx.cuda()` beside a model on the GPU. The trace runs on CPU fake
    tensors whatever device the batch is on; the first GPU run of benchmarks/gpu_check.py found
    torch.export refusing the mix (an embedding of cuda ids with CPU fake weights). The batch here
    is a fake cuda tensor, which needs no GPU."""
    model, batch = CASES["llama"]()
    with FakeTensorMode():
        on_gpu = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in batch)
    assert all(t.device.type == "cuda" for t in on_gpu)
    mesh = Mesh.from_shape((2, 2, 2), device_type="cuda")
    program = compile_for_rank(model, mesh, on_gpu, coords=(0, 1, 0)).program
    assert program.device_type == "cuda"
    assert all(device.type == "cuda" for _, device in _devices_named(program.forward))
