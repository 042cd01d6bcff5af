"""Models whose Python reads a tensor's value (issue 34 item 1): the trace takes the branch the
example's values take and keeps the condition as a guard, evaluated on every call's global inputs
before any collective; a batch that goes the other way gets its own program, and a failing
`assert` raises as in serial. Conditions that are not functions of the inputs alone are refused."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multirank import run_ranks, run_scenarios
from pass_fixtures import assert_call_matches_serial
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.compiler.driver import compile_for_rank
from autopar.core.mesh import Mesh
from autopar.passes.random_guards import RANDOM_ORDER_HINT
from autopar.passes.trace_errors import DATA_DEPENDENT_HINT
from autopar.passes.value_guards import WEIGHT_GUARD_HINT, reading_real_values


def _line(marker: str) -> str:
    """`test_value_guards.py:<n>`, n the line of this file marked `# line: <marker>`."""
    lines = Path(__file__).read_text().splitlines()
    return f"test_value_guards.py:{next(i for i, text in enumerate(lines, 1) if text.endswith(f'# line: {marker}'))}"


class _Checks(nn.Module):
    """An `assert` on the labels, a branch on the inputs' sum, both read by Python."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert (y >= 0).all(), "negative label"  # line: ASSERT
        h = torch.relu(self.proj(x))
        if x.sum() > 0:  # line: BRANCH
            h = h * 2
        return F.cross_entropy(self.head(h), y)


def _batch(sign: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return sign * torch.rand(8, 16, generator=gen), torch.randint(4, (8,), generator=gen)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_branch_the_example_takes_runs_equal_to_serial_with_the_guards_out_of_the_program(
    sign: float,
) -> None:
    torch.manual_seed(0)
    model = _Checks()
    compiled = assert_call_matches_serial(model, (2, 2), _batch(sign))
    for run in compiled.values():
        guards = run.program.value_guards
        assert guards is not None and guards.inputs == (0, 1)
        assert any(_line("ASSERT") in c for c in guards.conditions), guards.conditions
        assert any(_line("BRANCH") in c for c in guards.conditions), guards.conditions
        # the distributed program reads no value: the guards run apart, on the global inputs
        for gm in (run.program.forward, run.program.backward):
            targets = {n.target for n in gm.graph.nodes}
            assert torch.ops.aten.item.default not in targets
            assert torch.ops.aten._assert_scalar.default not in targets
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None
    assert guards.hold(list(_batch(sign, seed=1)))
    assert not guards.hold(list(_batch(-sign, seed=1)))
    assert all(_line("BRANCH") in c for c in guards.failing(list(_batch(-sign, seed=1))))
    x, y = _batch(sign, seed=1)
    assert not guards.hold([x, y - 4])  # the assert's condition is a guard too


class _ChecksItsActivations(nn.Module):
    """A check on a value the weights compute (DETR's `isfinite` on activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if not torch.isfinite(h).all():  # line: ACTIVATIONS
            raise ValueError("non-finite activations")
        return F.cross_entropy(h, y)


class _DrawsByValues(nn.Module):
    """A branch decided by a draw after `multinomial` of activations, which moves the generator by
    an amount its values decide: no replay can reach the decision before the program runs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        picked = torch.multinomial(torch.softmax(h, -1), 1)  # line: DRAW
        if torch.rand([]) >= 0.5:
            h = h * 2
        return F.cross_entropy(h, y) + picked.sum() * 0


class _SplitByRouter(nn.Module):
    """Rows per expert read by Python and fed to `split` (JetMoE's `expert_size.tolist()`): a
    size the router's weights set anew every step, which no guard can pin."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 16, 4) / 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        expert = self.router(x).argmax(-1)
        rows = F.one_hot(expert, 4).sum(0).tolist()  # line: ROUTED
        pieces = x[expert.argsort()].split(rows)
        return F.cross_entropy(torch.cat([p @ self.experts[i] for i, p in enumerate(pieces)]), y)


@pytest.mark.parametrize(
    ("model", "line", "says", "hint"),
    [
        (_ChecksItsActivations(), _line("ACTIVATIONS"), "depends on the model's weights", WEIGHT_GUARD_HINT),
        (_SplitByRouter(), _line("ROUTED"), "uses it as a size", DATA_DEPENDENT_HINT),
        (_DrawsByValues(), _line("DRAW"), "input values decide", RANDOM_ORDER_HINT),
    ],
)
def test_a_value_not_computed_from_the_inputs_alone_is_refused_naming_the_line(
    model: nn.Module, line: str, says: str, hint: str
) -> None:
    with pytest.raises(autopar.TraceError) as err:
        compile_for_rank(model, Mesh.from_shape((2,)), _batch(1.0), coords=(0,))
    assert says in str(err.value) and err.value.hint == hint, str(err.value)
    assert err.value.where is not None and line in err.value.where, err.value.where


class _HitExperts(nn.Module):
    """LongcatFlash's experts: Python iterates over the experts the router hit (`nonzero` of the
    routed tokens' one-hot), a count the router's weights set, which torch.export cannot size."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16, 4) / 4)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], 4)
        hit = (F.one_hot(expert, 4).sum(0) > 0).nonzero()
        for e in hit:  # line: HIT
            rows = torch.where(expert == e)[0]
            out = out.index_add(0, rows, x[rows] @ self.weight[int(e.item())])
        return out


class _LoopsOverHitExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.moe = _HitExperts()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.moe(x, self.router(x).argmax(-1)), y)


def test_a_loop_over_a_weight_sized_tensor_is_refused_naming_op_module_and_line() -> None:
    """Where torch.export itself fails on a data-dependent size (LongcatFlash's loop over the hit
    experts: iterating unbinds a tensor of `nonzero`'s size), the refusal still names the op
    torch failed in, the module path and the line, with the data-dependent hint."""
    with pytest.raises(autopar.TraceError) as err:
        compile_for_rank(_LoopsOverHitExperts(), Mesh.from_shape((2,)), _batch(1.0), coords=(0,))
    assert "data-dependent" in str(err.value) and err.value.hint == DATA_DEPENDENT_HINT, str(err.value)
    assert err.value.op == "unbind" and "op: unbind" in str(err.value), str(err.value)
    assert err.value.where is not None and err.value.where.startswith("moe @ "), err.value.where
    assert _line("HIT") in err.value.where, err.value.where


def _stepped_errors(
    step: int, loss: torch.Tensor, want: torch.Tensor, pmodel: nn.Module, serial: nn.Module, opts: tuple[Any, Any]
) -> list[float]:
    """The loss's and every gradient's difference from serial after both backwards (a layer that
    the step skips has no gradient, in serial too), then both optimizers stepped and zeroed."""
    grads = {n: p.grad for n, p in serial.named_parameters()}
    errors = [abs(float(loss) - float(want))]
    for n, p in pmodel.named_parameters():
        assert (p.grad is None) == (grads[n] is None), (step, n)
        if p.grad is not None:
            errors.append(float((p.grad.full_tensor() - grads[n]).abs().max()))
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return errors


def _job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = _Checks()
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(model, mesh, example_inputs=_batch(1.0))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    errors: list[float] = []
    for step, sign in enumerate([1.0, -1.0, 1.0, -1.0]):
        batch = _batch(sign, seed=step + 1)
        loss, want = pmodel(*batch), serial(*batch)
        loss.backward()
        want.backward()
        errors += _stepped_errors(step, loss, want, pmodel, serial, (opt, serial_opt))
    params = dict(serial.named_parameters())
    errors += [float((p.full_tensor() - params[n]).abs().max()) for n, p in pmodel.named_parameters()]
    x, y = _batch(1.0, seed=9)
    with pytest.raises(AssertionError, match="negative label") as err:  # as serial raises it
        pmodel(x, y - 4)
    assert isinstance(err.value, autopar.ModelAssertionError) and _line("ASSERT") in str(err.value.where)
    with pytest.raises(AssertionError, match="negative label"):  # again: the failure compiled nothing
        pmodel(x, y - 4)
    return {"max_error": max(errors), "programs": [why for why, _ in pmodel.programs]}


class _OneGlobalToken(nn.Module):
    """Longformer's global-attention count, read by Python in an `==` test: one token a row
    (a classifier's CLS) takes its own path, more take a weighted sum. The export on the
    example's values records the test as an `Eq` guard, held on one side or the other.
    `read_again`: the count is read a second time, by `.item()`, as the size of a slice (as
    Longformer pads to the most global tokens of a row), which gets its own guard."""

    def __init__(self, read_again: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.glob = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.read_again = read_again

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        count = mask.sum(1).max()
        if count == 1:  # line: EQ
            g = self.glob(h[:, 0])
        else:
            g = (h * mask[..., None]).sum(1)
        if self.read_again:
            g = g + h[:, : int(count.item())].mean(1)  # line: AGAIN
        return F.cross_entropy(self.head(h.mean(1) + g), y)


def _count_batch(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(4, 8, dtype=torch.long)
    mask[:, :count] = 1  # `count` global tokens at the start of every row
    return torch.randn(4, 8, 8, generator=gen), mask, torch.randint(3, (4,), generator=gen)


@pytest.mark.parametrize("read_again", [False, True])
@pytest.mark.parametrize("count", [1, 2])
def test_an_eq_guard_holds_only_on_its_side(count: int, read_again: bool) -> None:
    """Each side of the `==` equals serial, and its guard holds on batches of its side only: the
    program traced on one global token never serves two, nor the other way round. The count read
    again as a size is pinned by a guard of its own: a program made for two tokens never serves
    three."""
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(_OneGlobalToken(read_again), (2,), _count_batch(count))
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None and any(_line("EQ") in c for c in guards.conditions), guards
    lines = (_line("EQ"), _line("AGAIN")) if read_again else (_line("EQ"),)
    assert all(any(line in c for line in lines) for c in guards.conditions), guards.conditions
    assert any(_line("AGAIN") in c for c in guards.conditions) == read_again, guards.conditions
    assert guards.hold(list(_count_batch(count, seed=1)))
    assert not guards.hold(list(_count_batch(3 - count, seed=1)))
    assert guards.hold(list(_count_batch(3, seed=1))) == (count == 2 and not read_again)
    if read_again:
        assert any(_line("AGAIN") in c for c in guards.failing(list(_count_batch(3, seed=1))))
    for run in compiled.values():  # the reads run apart, in the guards
        assert torch.ops.aten.item.default not in {n.target for n in run.program.forward.graph.nodes}


def _global_count_job(rank: int, world_size: int) -> dict[str, Any]:
    """The user's loop with batches on both sides of the `Eq` guard, alternating, against serial,
    the count read again as a size: each count compiles its own program once, and each call runs
    the program of its count."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = _OneGlobalToken(read_again=True)
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(model, mesh, example_inputs=_count_batch(1))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    errors: list[float] = []
    for step, count in enumerate([1, 2, 1, 3, 2]):
        batch = _count_batch(count, seed=step + 1)
        loss, want = pmodel(*batch), serial(*batch)
        loss.backward()
        want.backward()
        errors += _stepped_errors(step, loss, want, pmodel, serial, (opt, serial_opt))
    params = dict(serial.named_parameters())
    errors += [float((p.full_tensor() - params[n]).abs().max()) for n, p in pmodel.named_parameters()]
    return {"max_error": max(errors), "programs": [why for why, _ in pmodel.programs]}


@pytest.fixture(scope="module")
def on_two_ranks() -> dict[str, list[dict[str, Any]]]:
    """This file's two gloo jobs, run in one forked job (each test checks its own)."""
    return run_scenarios(
        2, {"branches": _job, "layerdrop": _layerdrop_job, "global_count": _global_count_job}, timeout=600
    )


@pytest.mark.multirank
def test_each_branch_gets_its_program_and_trains_like_serial_on_two_ranks(on_two_ranks: dict[str, list[Any]]) -> None:
    for rank, result in enumerate(on_two_ranks["branches"]):
        assert result["max_error"] < 1e-5, (rank, result)
        # compiled once per branch, not per call
        first, other = result["programs"]
        assert first == "example inputs", (rank, result)
        assert other.startswith("new input values (the value Python reads at") and "decides another branch" in other
        assert _line("BRANCH") in other, (rank, result)


@pytest.mark.multirank
def test_a_flipped_eq_guard_compiles_the_other_side_once_and_trains_like_serial_on_two_ranks(
    on_two_ranks: dict[str, list[Any]],
) -> None:
    for rank, result in enumerate(on_two_ranks["global_count"]):
        assert result["max_error"] < 1e-5, (rank, result)
        # three programs for five calls: 1, 2, 1, 3, 2 global tokens, a program per count read
        first, two, three = result["programs"]
        assert first == "example inputs" and two.startswith("new input values"), (rank, result)
        assert _line("EQ") in two and "decides another branch" in two, (rank, result)
        # three global tokens fail the example's `==` (as two do) and the second read's guard of
        # the program for two: a program of their own, never the one for two
        assert three.startswith("new input values") and _line("EQ") in three, (rank, result)


class _LayerDrop(nn.Module):
    """LayerDrop as transformers' M2M100 writes it: each layer skipped when a draw says so, the
    draws interleaved with the kept layers' dropout masks (which move the generator)."""

    def __init__(self, layers: int = 4, layerdrop: float = 0.5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))
        self.head = nn.Linear(16, 4)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = x + F.dropout(torch.relu(layer(x)), 0.1, self.training)
        return F.cross_entropy(self.head(x), y)


def _layerdrop_job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = _LayerDrop()
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(model, mesh, example_inputs=_batch(1.0))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    errors: list[float] = []
    same_stream = []
    for step in range(4):
        batch = _batch(1.0, seed=step + 1)
        before = torch.random.get_rng_state()
        loss = pmodel(*batch)
        loss.backward()
        after = torch.random.get_rng_state()
        torch.random.set_rng_state(before)
        want = serial(*batch)
        want.backward()
        same_stream.append(torch.equal(after, torch.random.get_rng_state()))
        errors += _stepped_errors(step, loss, want, pmodel, serial, (opt, serial_opt))
    params = dict(serial.named_parameters())
    errors += [float((p.full_tensor() - params[n]).abs().max()) for n, p in pmodel.named_parameters()]
    return {"max_error": max(errors), "same_stream": same_stream, "programs": [why for why, _ in pmodel.programs]}


@pytest.mark.multirank
def test_layerdrop_draws_each_step_from_the_serial_stream_and_trains_like_serial_on_two_ranks(
    on_two_ranks: dict[str, list[Any]],
) -> None:
    results = on_two_ranks["layerdrop"]
    for rank, result in enumerate(results):
        assert result["max_error"] < 1e-5, (rank, result)
        assert all(result["same_stream"]), (rank, result)  # the generator ends where serial's does
        programs = result["programs"]
        assert len(programs) > 1, (rank, result)  # more than one outcome drawn, each its program
        assert all("the random draw at" in why and "test_value_guards.py:" in why for why in programs[1:]), programs
    assert results[0]["programs"] == results[1]["programs"]


class _UpdatesItsLabels(nn.Module):
    """FSMT's `shift_tokens_right`: -100 in the labels replaced in place by the pad id."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.masked_fill_(y == -100, 0)
        return F.cross_entropy(self.head(x), y)


def _labels_with_ignored(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(1.0, seed)
    y[::3] = -100
    return x, y


def test_an_input_the_forward_writes_into_comes_out_as_serial_leaves_it() -> None:
    """Compiling leaves the caller's labels as they were; the program's outputs hold the labels'
    new value (each rank's block, assembled), equal to what serial leaves in the tensor."""
    x, y = _labels_with_ignored(0)
    before = y.clone()
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(_UpdatesItsLabels(), (2,), (x, y))
    assert not torch.equal(y, before) and not (y == -100).any()  # serial's call wrote into it
    program = next(iter(compiled.values())).program
    assert program.input_updates == [1] and len(program.output_layouts) == 2


def _writes_back_job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = _UpdatesItsLabels()
    serial = copy.deepcopy(model)
    pmodel = autopar.parallelize(model, mesh, example_inputs=_labels_with_ignored(0))
    errors: list[float] = []
    labels_equal = []
    for step in range(2):
        x, y = _labels_with_ignored(step + 1)
        x_serial, y_serial = x.clone(), y.clone()
        loss, want = pmodel(x, y), serial(x_serial, y_serial)
        errors.append(abs(float(loss) - float(want)))
        labels_equal.append(torch.equal(y, y_serial) and not (y == -100).any())  # as serial leaves them
    return {"max_error": max(errors), "labels_equal": labels_equal}


@pytest.mark.multirank
def test_the_callers_input_is_written_back_on_two_ranks() -> None:
    for rank, result in enumerate(run_ranks(2, _writes_back_job, timeout=300)):
        assert result["max_error"] < 1e-6 and result["labels_equal"] == [True, True], (rank, result)


class _GlobalTokens(nn.Module):
    """Longformer's encoder: a branch on whether any token is marked global, read from the mask
    through a tensor the forward makes (a constant of the program, not a weight), and a chunk
    count that `torch.div` makes of Python ints and Python reads as a size."""

    def __init__(self) -> None:
        super().__init__()
        self.local = nn.Linear(8, 8)
        self.glob = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        marked = mask * torch.tensor(2)
        h = self.local(x)
        if (marked > 2).flatten().any().item():  # line: GLOBAL
            h = h + self.glob(x)
        chunks = torch.div(x.size(1), 4, rounding_mode="trunc") - 1
        h = h.view(x.size(0), int(chunks) + 1, -1, h.size(-1)).mean(2)
        return F.cross_entropy(self.head(h.mean(1)), y)


def _global_batch(marked: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(4, 8, dtype=torch.long)
    if marked:
        mask[:, 0] = 2  # the first token of every row attends globally
    return torch.randn(4, 8, 8, generator=gen), mask, torch.randint(3, (4,), generator=gen)


@pytest.mark.parametrize("marked", [False, True])
def test_a_flag_read_through_a_constant_the_forward_makes_is_a_guard(marked: bool) -> None:
    """The constant (`torch.tensor(2)`) is the same in every call, so the flag is a function of
    the inputs: a guard, not a refusal as a weight would be; the chunk count's read, which no
    input decides, is dropped from the program. Each branch equals serial; the other batch fails
    the guard (another program)."""
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(_GlobalTokens(), (2,), _global_batch(marked))
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None and any(_line("GLOBAL") in c for c in guards.conditions), guards
    assert guards.hold(list(_global_batch(marked, seed=1)))
    assert not guards.hold(list(_global_batch(not marked, seed=1)))
    for run in compiled.values():
        targets = {n.target for n in run.program.forward.graph.nodes}
        assert torch.ops.aten.item.default not in targets


class _ReadsThroughData(nn.Module):
    """A branch on an input read through `.data` (I-BERT reads its activations' range so):
    `.data` makes a tensor without dispatching an op, which torch.export would lift as a constant;
    the trace reads it as `detach()`, so the condition is a guard on the input like any other."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if x.data.max() > 0.5:  # line: DATA
            h = h * 2
        return F.cross_entropy(h, y)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_a_branch_on_an_inputs_data_is_a_guard(scale: float) -> None:
    torch.manual_seed(0)
    x, y = _batch(1.0)
    compiled = assert_call_matches_serial(_ReadsThroughData(), (2,), (x * scale, y))
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None and any(_line("DATA") in c for c in guards.conditions), guards
    assert guards.hold([x * scale, y]) and not guards.hold([x * (1.25 - scale), y])


def test_a_trace_on_real_values_reads_the_parameters_values() -> None:
    """torch 2.13's real-value propagation fakes an `nn.Parameter` with uninitialized memory as its
    real value; `reading_real_values` makes it the parameter's own, so a value computed from the
    weights is the same on every trace (it made `_DrawsByValues` fail now and then)."""
    weight = nn.Parameter(torch.arange(6.0).reshape(2, 3))
    with reading_real_values():
        fake = FakeTensorMode().from_tensor(weight, static_shapes=True)
    assert torch.equal(fake.real_tensor, weight.detach())
