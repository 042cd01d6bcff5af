"""Value guards on a pipeline (issue 34; docs/debugging.md#value-guards): a model whose Python
reads its inputs' values (an `assert` on the labels, a branch on the inputs' sum, BART's
end-of-sequence check) trains on a "pp" mesh equal to serial on batches taking either branch, and
a batch the model rejects raises the model's own error on every rank before any stage runs,
instead of one rank raising while its peers wait in a send. On pp=2 every rank runs in this
process (`autopar.testing.pipeline_lockstep`: a rank left waiting there is a deadlock named at
once); pp=2 x tp=2 on real gloo ranks, under autopar's collective timeout."""

from __future__ import annotations

import copy
import functools
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multirank import pipelined, run_ranks, run_scenarios_in_lockstep
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler.pipeline_split import PipelineSplitError
from autopar.core.errors import ModelAssertionError, ModelValueError
from autopar.testing.pipeline_lockstep import LockstepTransport

BRANCH_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith("# BRANCH_LINE"))

TIMEOUT_S = 90  # autopar's collective timeout: a rank left waiting for a peer would fail after it


class Checks(nn.Module):
    """An assert on the labels and a branch on the inputs' sum, both read by Python; the branch
    lies in the first stage and the loss in the second. `threshold`: the sum the branch compares."""

    def __init__(self, threshold: float = 0.0) -> None:
        super().__init__()
        self.threshold = threshold
        self.first = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert (y >= 0).all(), "labels must be non-negative"
        h = torch.relu(self.first(x))
        if x.sum() > self.threshold:  # BRANCH_LINE
            h = h * 2
        else:
            h = h - 1
        return F.cross_entropy(self.head(torch.tanh(self.mid(h))), y)


def _batch(signs: tuple[float, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 samples in [0, 1), the k-th of `len(signs)` equal row blocks scaled by `signs[k]`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(8, 8, generator=gen)
    for k, sign in enumerate(signs):
        x[k * 8 // len(signs) : (k + 1) * 8 // len(signs)] *= sign
    return x, torch.randint(4, (8,), generator=gen)


# every microbatch positive; every one negative; microbatch 0 positive and 1 negative with the
# whole batch positive (served by the first batch's program: a branch is the whole batch's)
BATCHES = [((1.0,), 0), ((-1.0,), 1), ((3.0, -1.0), 2), ((1.0,), 3)]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_both_branches(
    rank: int, world: int, case: dict[str, Any], transport: LockstepTransport | None = None
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Checks()
    serial = copy.deepcopy(model)
    batches = [_batch(signs, seed) for signs, seed in BATCHES]
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=("mid",))
    if transport is None:
        mesh = init_device_mesh("cpu", case["shape"], mesh_dim_names=case["names"])
        pmodel = autopar.parallelize(model, mesh, example_inputs=batches[0], timeout=TIMEOUT_S, pipeline=options)
    else:
        pmodel = pipelined(model, world, transport, example_inputs=batches[0], pipeline=options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pmodel, serial)]
    losses = []
    for batch in batches:
        for module, optimizer in zip((pmodel, serial), optimizers):
            optimizer.zero_grad()
            loss = module(*batch)
            loss.backward()
            optimizer.step()
            losses.append(float(_whole(loss.detach())))
    own = dict(serial.named_parameters())
    worst = max(float((_whole(p.detach()) - own[name].detach()).abs().max()) for name, p in pmodel.named_parameters())
    # a batch the model's assert rejects: its AssertionError on every rank, before any stage runs
    x, y = _batch((1.0,), 4)
    started = time.monotonic()
    try:
        pmodel(x, y - 4)
        raised = ""
    except ModelAssertionError as exc:
        raised = str(exc)
    seconds = time.monotonic() - started
    after = float(_whole(pmodel(x, y).detach()))  # no rank is left behind: the next call runs
    return {
        "losses": losses, "worst": worst, "raised": raised, "seconds": seconds, "after": after,
        "expected_after": float(serial(x, y)), "variants": sorted(len(v) for v in pmodel._programs.values()),
    }  # fmt: skip


PP2 = {"shape": (2,), "names": ("pp",)}
ON_TWO_RANKS = pytest.mark.xdist_group("pipeline_value_guards_on_two_ranks")  # one worker runs the fixture once


@pytest.fixture(scope="module")
def on_two_ranks() -> dict[str, list[Any]]:
    """This file's pp=2 jobs, each one's ranks run in this process (each test checks its own
    scenario)."""
    scenarios = {"branches": functools.partial(_train_both_branches, case=PP2), "split": _refuse_split_branch, "bart": _bart}
    return run_scenarios_in_lockstep(2, scenarios)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(PP2, id="pp2", marks=ON_TWO_RANKS),
        pytest.param({"shape": (2, 2), "names": ("pp", "tp")}, id="pp2xtp2", marks=pytest.mark.multirank),
    ],
)
def test_both_branches_train_equal_to_serial_and_a_rejected_batch_raises_on_every_rank(
    request: pytest.FixtureRequest, case: dict[str, Any]
) -> None:
    if case == PP2:
        results = request.getfixturevalue("on_two_ranks")["branches"]
    else:
        results = run_ranks(math.prod(case["shape"]), _train_both_branches, case, timeout=400)
    for result in results:
        pairs = list(zip(result["losses"][0::2], result["losses"][1::2]))
        assert all(abs(p - s) <= 1e-5 * max(1.0, abs(s)) for p, s in pairs), pairs
        assert result["worst"] < 1e-5, result["worst"]
        assert "labels must be non-negative" in result["raised"], result["raised"]
        assert result["seconds"] < TIMEOUT_S / 3, result["seconds"]  # well before any rank's timeout
        assert abs(result["after"] - result["expected_after"]) < 1e-5
        assert result["variants"] == [2], result["variants"]  # one program per branch, one shape


def _refuse_split_branch(rank: int, world: int, transport: LockstepTransport | None = None) -> list[str]:
    torch.manual_seed(0)
    model = Checks(threshold=40.0)
    low = _batch((1.0,), 0)
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=("mid",))
    pmodel = pipelined(model, world, transport, example_inputs=low, pipeline=options)
    pmodel(*low)
    x, y = low
    x = torch.full_like(x, 0.7)  # each microbatch sums to 22.4, the whole batch to 44.8: above 40
    try:
        pmodel(x, y)
    except PipelineSplitError as exc:
        return [exc.message, exc.where or ""]
    return []


@ON_TWO_RANKS
def test_a_branch_no_microbatch_takes_as_the_whole_batch_is_refused_on_every_rank(on_two_ranks: dict[str, list[Any]]) -> None:
    """Each microbatch's rows alone go below the threshold, the whole batch above it: no program
    traced on a microbatch takes the serial branch, so the call is refused, the same on every
    rank and before any stage runs."""
    for message, where in on_two_ranks["split"]:
        assert "takes another branch at" in message and f"test_pipeline_value_guards.py:{BRANCH_LINE}" in where, (message, where)


def _bart(rank: int, world: int, transport: LockstepTransport | None = None) -> dict[str, Any]:
    import transformers

    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BartForSequenceClassification(config)
    serial = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 64, (4, 8), generator=gen)
    ids[:, -1] = config.eos_token_id
    labels = torch.tensor([0, 1, 2, 0])
    pmodel = pipelined(
        model, world, transport, example_kwargs={"input_ids": ids, "labels": labels},
        pipeline=autopar.PipelineOptions(microbatches=2),
    )  # fmt: skip
    state = torch.random.get_rng_state()
    loss = float(pmodel(input_ids=ids, labels=labels).loss.detach())
    torch.random.set_rng_state(state)
    expected = float(serial(input_ids=ids, labels=labels).loss.detach())
    out: dict[str, Any] = {"loss": loss, "expected": expected}
    for name, rows in (("one_row", [0]), ("one_microbatch", [2, 3])):
        bad = ids.clone()
        bad[rows, 3] = config.eos_token_id  # those rows have two end-of-sequence tokens, the others one
        started = time.monotonic()
        try:
            pmodel(input_ids=bad, labels=labels)
            out[name] = ""
        except ModelValueError as exc:
            out[name] = str(exc)
        out[name + "_seconds"] = time.monotonic() - started
    return out


@ON_TWO_RANKS
def test_bart_classifier_on_a_pipeline_raises_the_models_value_error_for_uneven_eos_counts(
    on_two_ranks: dict[str, list[Any]],
) -> None:
    """transformers' BART sequence classifier at its defaults (dropout on) on pp=2: one step equals
    serial; a batch whose rows have different end-of-sequence counts raises BART's ValueError on
    every rank, also where each microbatch alone is even (only the whole batch is not)."""
    for result in on_two_ranks["bart"]:
        assert abs(result["loss"] - result["expected"]) < 1e-5, result
        for name in ("one_row", "one_microbatch"):
            assert "same number of <eos> tokens" in result[name], result[name]
            assert result[name + "_seconds"] < TIMEOUT_S / 3, result
