"""Random ops other than dropout in a pipeline equal the serial step in value
(docs/pipeline.md#dropout): `rand`, `randn_like`, `bernoulli` of probabilities, `bernoulli(x, p)`
with the batch's rows, and a per-call scalar `rand([])`, drawn whole once per step and cut into
each microbatch's rows; loss, every gradient, the parameters after two SGD-momentum steps and the
generator state equal serial's (SGD with momentum and weight decay: `bernoulli`'s zero gradient
for its probabilities reaches their weights, as serial's does) on pp=2 x tp=2 with 1F1B over
microbatches of 3, 3 and 2 samples."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import assert_parameters_equal_serial, run_ranks, seeded_steps_beside_serial
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler.pipeline_random import PipelineDropout, RandomOp, draw_whole
from autopar.compiler.pipeline_split import split_stages

TOL = {"rtol": 1e-5, "atol": 1e-6}


class NoisyBlock(nn.Module):
    """Every kind of draw the pipeline makes exactly, on [B, T, D] activations."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        h = h * torch.rand(b, t, 1)  # rand with the batch's rows
        h = h + 0.1 * torch.randn_like(h)
        h = h * torch.bernoulli(torch.sigmoid(self.gate(h)))  # a tensor of probabilities
        h = h * torch.bernoulli(h.detach(), 0.8) / 0.8  # bernoulli(x, p): only x's shape matters
        return h + self.out(h) * (1 + torch.rand([]))  # a per-call scalar: the batch shares it


class NoisyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(NoisyBlock() for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _compare(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = NoisyNet()
    serial = copy.deepcopy(model)
    idx = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(2))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    options = autopar.PipelineOptions(microbatches=3, schedule="1f1b", stage_boundaries=["blocks.1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: no "in distribution" warning
        pmodel = autopar.parallelize(model, mesh, example_inputs=(idx, targets), pipeline=options)
        sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)
        seeded_steps_beside_serial(pmodel, serial, (idx, targets), sgd, TOL)
    assert_parameters_equal_serial(pmodel, serial, TOL)
    loss = pmodel(idx, targets)  # its gradients go to the parameters once, not kept beside .grad
    loss.backward(retain_graph=True)
    with pytest.raises(autopar.AutoparError, match="already differentiated"):
        loss.backward()


@pytest.mark.multirank
def test_random_ops_equal_serial_with_tensor_axes_in_each_stage() -> None:
    run_ranks(4, _compare, timeout=300)


def test_each_draw_is_the_eager_ops_numbers() -> None:
    """In process: `draw_whole` gives what the eager op draws from the same generator state (the
    stage then takes its rows), and `bernoulli` of probabilities is its uniform draw compared with
    them, in float32 and float64."""
    shape = (6, 5, 7)
    for dtype in (torch.float32, torch.float64):
        probs = torch.rand(shape, dtype=dtype)
        for kind, p in (("rand", 0.0), ("randn", 0.0), ("bernoulli_p", 0.3), ("dropout", 0.25)):
            torch.manual_seed(5)
            if kind == "rand":
                expected = torch.rand(shape, dtype=dtype)
            elif kind == "randn":
                expected = torch.randn_like(probs)
            elif kind == "bernoulli_p":
                expected = torch.bernoulli(probs, p)
            else:
                expected = F.dropout(torch.ones(shape, dtype=dtype), p)
            torch.manual_seed(5)
            assert torch.equal(draw_whole(RandomOp(0, kind, shape, dtype, p, True, kind), "cpu"), expected), (kind, dtype)
        torch.manual_seed(5)
        expected = torch.bernoulli(probs)
        torch.manual_seed(5)
        uniform = draw_whole(RandomOp(0, "b", shape, dtype, 0.0, True, "bernoulli"), "cpu")
        assert torch.equal((uniform < probs).to(dtype), expected), dtype


def test_stage_programs_read_the_draws_as_inputs() -> None:
    """In process: every draw of the model becomes a stage input (no random op is left in a stage
    program) with no warning; `bernoulli` of probabilities becomes a comparison, and a draw the
    pipeline does not reproduce (`randint`) stays in the graph with a warning that names it."""
    idx, targets = torch.randint(0, 32, (6, 6)), torch.randint(0, 32, (6, 6))
    program = split_stages(NoisyNet().train(), [idx, targets], (idx, targets), ["blocks.1"], 2)
    kinds = [op.kind for op in program.random_ops]
    assert kinds == ["rand", "randn", "bernoulli", "bernoulli_p", "rand"] * 2
    assert all(op.exact for op in program.random_ops)
    assert [op.shape for op in program.random_ops[:5]] == [(6, 6, 1), (6, 6, 16), (6, 6, 16), (6, 6, 16), ()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PipelineDropout().adopt([(st.module, st.sources) for st in program.stages], program.random_ops)
    left = [n for st in program.stages for n in st.module.graph.nodes if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert not left, left
    masks = [name for st in program.stages for kind, name in st.sources if kind == "mask"]
    assert sorted(masks) == list(range(10))
    targets_of = [n.target for st in program.stages for n in st.module.graph.nodes]
    assert targets_of.count(torch.ops.aten.lt.Tensor) == 2  # bernoulli of probabilities: rows < them

    class Indices(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h[torch.randint(0, x.shape[0], (x.shape[0],))]).sum()

    x = torch.randn(4, 4)
    program = split_stages(Indices().train(), [x], (x,), ["b"], 2)
    assert [(op.kind, op.exact) for op in program.random_ops] == [("other", False)]
    with pytest.warns(UserWarning, match="randint.*not a dropout, rand, randn or bernoulli.*in distribution"):
        PipelineDropout().adopt([(st.module, st.sources) for st in program.stages], program.random_ops)
