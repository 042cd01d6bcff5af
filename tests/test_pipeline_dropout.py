"""Dropout in a pipeline equals the serial step in value (docs/pipeline.md#dropout): each
microbatch's mask is its rows of the serial batch's mask, drawn from the same generator state on
every rank; loss, every gradient, the parameters after two SGD-momentum steps and the generator
state after each step equal serial's, on 2 ranks run in this process
(`autopar.testing.pipeline_lockstep`) with 1F1B, GPipe and interleaved 1F1B, and on pp=2 x tp=2
gloo ranks with 1F1B and zero-bubble."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import (
    assert_parameters_equal_serial,
    pipelined,
    run_in_lockstep,
    run_ranks,
    seeded_steps_beside_serial,
)
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler.pipeline_random import DropoutMasks, PipelineDropout, RandomOp, attention_dropped
from autopar.compiler.pipeline_split import split_stages
from autopar.testing.pipeline_lockstep import LockstepTransport

TOL = {"rtol": 1e-5, "atol": 1e-6}


class Block(nn.Module):
    """Attention-like probabilities with dropout ([B, H, T, T]) and a dropout after a flatten to
    [B*T, D] (the batch is a factor of dim 0 there)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(16, 32)
        self.out = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)
        self.resid = nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k = self.qk(h).view(b, t, 4, 8).transpose(1, 2).chunk(2, dim=-1)
        probs = self.drop(torch.softmax(q @ k.transpose(-1, -2), dim=-1))  # [b, 4, t, t]
        mixed = (probs @ h.view(b, t, 4, 4).transpose(1, 2)).transpose(1, 2).reshape(b * t, d)
        return h + self.resid(self.out(mixed)).view(b, t, d)


class DropNet(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.emb_drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb_drop(self.emb(idx))
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _compare(rank: int, world: int, case: dict[str, Any], transport: LockstepTransport | None = None) -> None:
    torch.manual_seed(0)
    model = DropNet(case["layers"])
    serial = copy.deepcopy(model)
    idx = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(2))
    options = autopar.PipelineOptions(
        microbatches=case["M"], schedule=case["schedule"], stage_boundaries=case["boundaries"],
        virtual_stages=case.get("v", 1),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: no "in distribution" warning
        if world == 4:  # tensor axes beside pp: each stage a parallel module, the masks its inputs
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
            pmodel = autopar.parallelize(model, mesh, example_inputs=(idx, targets), pipeline=options)
        else:
            pmodel = pipelined(model, world, transport, example_inputs=(idx, targets), pipeline=options)
        sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
        seeded_steps_beside_serial(pmodel, serial, (idx, targets), sgd, TOL, what=str(case))
    assert_parameters_equal_serial(pmodel, serial, TOL, what=str(case))
    torch.manual_seed(7)
    with torch.no_grad():  # training mode without gradients: the serial masks too
        got = pmodel(idx, targets)
    torch.manual_seed(7)
    with torch.no_grad():
        torch.testing.assert_close(got, serial(idx, targets), **TOL)


def _job(rank: int, world: int, cases: list[dict[str, Any]], transport: LockstepTransport | None = None) -> None:
    for case in cases:
        _compare(rank, world, case, transport)


def test_dropout_equals_serial_on_pp2() -> None:
    """1F1B with 3 microbatches of 3, 3 and 2 samples; GPipe; interleaved 1F1B (4 stages on 2
    ranks, the embedding's dropout on stage 0, blocks on stages 1-3)."""
    cases = [
        {"layers": 2, "M": 3, "schedule": "1f1b", "boundaries": ["blocks.1"]},
        {"layers": 2, "M": 4, "schedule": "gpipe", "boundaries": ["blocks.0"]},
        {"layers": 3, "M": 2, "schedule": "interleaved-1f1b", "v": 2, "boundaries": ["blocks.0", "blocks.1", "blocks.2"]},
    ]  # fmt: skip
    run_in_lockstep(2, _job, cases)


@pytest.mark.multirank
def test_dropout_equals_serial_with_tensor_axes_in_each_stage() -> None:
    """pp=2 x tp=2: 1F1B (gradients reduced once per step) and zero-bubble (each backward split)."""
    cases = [
        {"layers": 2, "M": 2, "schedule": "1f1b", "boundaries": ["blocks.1"]},
        {"layers": 2, "M": 2, "schedule": "zero-bubble", "boundaries": ["blocks.1"]},
    ]
    run_ranks(4, _job, cases, timeout=300)


def test_masks_cut_rows_along_the_batch_dim() -> None:
    """In process: microbatch m's rows of a whole-batch mask, along dim 0 or a flattened dim; the
    generator advances as one whole-batch draw per op; inputs that are not row cuts are refused."""
    masks = DropoutMasks()
    whole = [RandomOp(0, "a", (6, 4), torch.float32, 0.5, True), RandomOp(1, "b", (12, 2), torch.float32, 0.25, True)]
    micro = [[(4, 4), (8, 2)], [(2, 4), (4, 2)]]
    torch.manual_seed(3)
    assert masks.draw(whole, {0, 1}, micro, "cpu")
    state = torch.get_rng_state()
    torch.manual_seed(3)
    first = torch.empty(6, 4).bernoulli_(0.5).div_(0.5)
    second = torch.empty(12, 2).bernoulli_(0.75).div_(0.75)
    assert torch.equal(torch.get_rng_state(), state)
    masks.current = 1
    assert torch.equal(masks.rows(0), first[4:]) and torch.equal(masks.rows(1), second[8:])
    masks.current = 0
    assert torch.equal(masks.rows(0), first[:4]) and torch.equal(masks.rows(1), second[:8])
    assert not DropoutMasks().draw(whole[:1], {0}, [[(3, 2)], [(3, 2)]], "cpu")  # two dims differ


def test_attention_dropout_is_drawn_as_serial_on_the_cpu_in_float32_and_warns_below() -> None:
    """In process: dropout inside scaled_dot_product_attention on the CPU in float32 is one of the
    ops the pipeline draws (its mask over the probabilities' [B, H, L, S] shape, the stage's node
    replaced by `attention_dropped`), with no warning; in bfloat16 (whose kernel the pipeline does
    not reproduce) it stays in the graph and the pipeline warns that it draws per microbatch."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(x.shape[0], 6, 3, 16).unbind(2)
            h = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], dropout_p=0.1)[:, 0]
            return F.mse_loss(self.head(h), y)

    x, y = torch.randn(4, 6, 16), torch.randn(4, 6, 4)
    program = split_stages(Attention().train(), [x, y], (x, y), ["head"], 2)
    assert [(op.exact, op.shape, op.p) for op in program.random_ops] == [(True, (4, 1, 6, 6), 0.1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PipelineDropout().adopt([(st.module, st.sources) for st in program.stages], program.random_ops)
    targets = [n.target for st in program.stages for n in st.module.graph.nodes]
    assert attention_dropped in targets and torch.ops.aten.scaled_dot_product_attention.default not in targets

    x16, y16 = x.bfloat16(), y.bfloat16()
    program = split_stages(Attention().bfloat16().train(), [x16, y16], (x16, y16), ["head"], 2)
    assert [op.exact for op in program.random_ops] == [False]
    dropout = PipelineDropout()
    with pytest.warns(UserWarning, match="scaled_dot_product_attention: not a dropout.*in distribution"):
        dropout.adopt([(st.module, st.sources) for st in program.stages], program.random_ops)
