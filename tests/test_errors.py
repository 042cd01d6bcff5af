"""Bad input gets an AutoparError a user can act on: what failed, where in their model, what to do."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks

import autopar
import autopar.compiler.lowering as lowering
from autopar.api import compile_for_rank
from autopar.core.errors import InternalError, MeshError, MissingRuleError, ShardingError, TraceError
from autopar.core.mesh import Mesh
from autopar.rules.registry import default_registry
from examples.models import make_mlp


class Tiny(nn.Module):
    def __init__(self, d_in: int = 16, d_out: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x)).sum()


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # Python control flow on a tensor value: not traceable
            return y.sum()
        return (-y).sum()


def test_not_a_device_mesh() -> None:
    model, batch = make_mlp(0)
    with pytest.raises(MeshError, match="must be a torch DeviceMesh") as err:
        autopar.parallelize(model, (2, 2, 2), example_inputs=batch)  # type: ignore[arg-type]
    assert "init_device_mesh" in str(err.value)


def test_batch_not_divisible_by_token_axes() -> None:
    model, (x, y) = make_mlp(0, batch_size=7)
    with pytest.raises(ShardingError, match=r"batch dim of input 0 \(7") as err:
        compile_for_rank(model, Mesh.from_shape((2, 2, 2)), (x, y), coords=(0, 0, 0), planner="greedy")
    assert "multiple of 2" in str(err.value)
    # the search leaves out role assignments whose batch split fails and plans with tensor axes only
    compiled = compile_for_rank(model, Mesh.from_shape((2, 2, 2)), (x, y), coords=(0, 0, 0))
    assert "token" not in compiled.graph.meta["autopar_search"].chosen_roles


def test_weight_too_small_to_split_names_the_parameter() -> None:
    """9 x 7 on 2 ranks is stored in uneven blocks; 5 x 3 cannot give each of 8 ranks a row."""
    model = Tiny(d_in=3, d_out=5)
    with pytest.raises(ShardingError, match=r"parameter fc\.weight of shape \[5, 3\]") as err:
        compile_for_rank(model, Mesh.from_shape((8,)), (torch.randn(8, 3),), coords=(0,))
    assert "x=8" in str(err.value) and "uneven blocks" in str(err.value) and "hint" in str(err.value)


def test_op_without_rule_names_op_module_and_line() -> None:
    registry = default_registry()
    del registry._rules[torch.ops.aten.gelu.default]
    with pytest.raises(MissingRuleError) as err:
        compile_for_rank(Tiny(), Mesh.from_shape((2,)), (torch.randn(4, 16),), coords=(0,), registry=registry)
    message = str(err.value)
    assert "aten.gelu.default" in message
    assert "test_errors.py" in message and "in forward" in message  # the user's source line
    assert "registry.register" in message


class WithNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return (y + torch.poisson(y.abs())).sum()  # a random op with no layout-invariant rule


def test_random_op_without_rule_is_refused_with_its_reason() -> None:
    with pytest.raises(MissingRuleError, match="random op aten.poisson") as err:
        compile_for_rank(WithNoise(), Mesh.from_shape((2,)), (torch.randn(4, 16),), coords=(0,))
    assert "@ " in str(err.value) and "depend on the layout" in str(err.value)


def test_a_branch_on_a_value_the_weights_compute_is_refused_with_its_line() -> None:
    """A branch on the inputs' values is a guard (tests/test_value_guards.py); one on a value the
    weights compute cannot be evaluated before the program runs."""
    with pytest.raises(TraceError) as err:
        compile_for_rank(DataDependent(), Mesh.from_shape((2,)), (torch.randn(4, 8),), coords=(0,))
    message = str(err.value)
    assert "that value depends on the model's weights" in message
    assert "test_errors.py:39" in message  # where in the user's code it reads the value


def test_an_internal_failure_names_the_stage_the_node_and_its_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside a stage (here a KeyError planted in insert_comm) reaches the user as an
    AutoparError naming the stage and the node it was working on, caused by the original."""
    real = lowering.insert_comm
    seen: list[torch.fx.Node] = []

    def broken(gm: torch.fx.GraphModule, *args: object) -> object:
        for node in gm.graph.nodes:
            if node.op == "call_function":
                seen.append(node)
                raise KeyError("_tensor_constant0")
        return real(gm, *args)

    monkeypatch.setattr(lowering, "insert_comm", broken)
    model, batch = make_mlp(0)
    with pytest.raises(InternalError) as err:
        compile_for_rank(model, Mesh.from_shape((2,)), batch, coords=(0,))
    assert err.value.message.startswith("internal error in the propagate / insert_comm stage: KeyError")
    assert err.value.op == str(seen[0].target)
    assert err.value.where is not None and "@" in err.value.where, err.value.where
    assert isinstance(err.value.__cause__, KeyError) and isinstance(err.value, autopar.AutoparError)


def _smaller_batch(rank: int, world_size: int) -> tuple[float, float, list[str], list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    model, batch = make_mlp(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    _, other = make_mlp(0, batch_size=4)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("autopar")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    loss = pmodel(*other)
    return float(loss), float(model(*other)), logged, [why for why, _ in pmodel.programs]


def _mesh_smaller_than_world(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("x",))
    model, batch = make_mlp(0)
    try:
        autopar.parallelize(model, mesh, example_inputs=batch)
    except MeshError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multirank
def test_a_smaller_batch_compiles_another_program_and_says_why() -> None:
    ((loss, serial, logged, programs),) = run_ranks(1, _smaller_batch, timeout=120)
    assert loss == serial
    assert logged == ["autopar: compiling a program for input 0: float32[4, 32] (was float32[8, 32]); "
                      "input 1: int64[4] (was int64[8])"], logged
    assert programs == ["example inputs", logged[0].removeprefix("autopar: compiling a program for ")]


@pytest.mark.multirank
def test_mesh_size_must_equal_world_size() -> None:
    messages = run_ranks(2, _mesh_smaller_than_world, timeout=120)
    for message in messages:
        assert "has 1 ranks but the job has 2" in message, message


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, b: autopar.plan(m, (), b), "a mesh needs at least one axis"),
        (lambda m, b: autopar.plan(m, (2.0, 2), b), "mesh axis sizes must be integers"),
        (lambda m, b: autopar.plan(m, (0, 2), b), "mesh axis sizes must be >= 1"),
        (lambda m, b: autopar.plan(m, (2,), b, planning=autopar.PlanOptions(hardware="nope")), "no hardware table 'nope'; known: a100-calibrated, a100-cluster"),
        (lambda m, b: autopar.plan(m, (2,), None), "example_inputs must be a tuple"),
        (lambda m, b: autopar.plan(m, (2,), b, example_kwargs=[1]), "example_kwargs must be a dict"),
        (
            lambda m, b: compile_for_rank(m, Mesh.from_shape((2,)), b, coords=(0,), dump_dir=__file__),
            "cannot write debug dumps to",
        ),
    ],
    ids=["empty-mesh", "float-mesh", "zero-axis", "unknown-hardware", "inputs-none", "kwargs-list", "dump-dir-file"],
)
def test_bad_arguments_are_autopar_errors_with_a_hint(call: Any, message: str) -> None:
    model, batch = make_mlp(0)
    with pytest.raises(autopar.AutoparError, match=message) as err:
        call(model, batch)
    assert err.value.hint and not isinstance(err.value, InternalError)


def _differing_weights(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    model, batch = make_mlp(rank)  # each rank its own seed: a silent mix without the check
    try:
        autopar.parallelize(model, mesh, example_inputs=batch)
    except autopar.AutoparError as exc:
        return str(exc)
    return "no error"


def _differing_batches(rank: int, world_size: int) -> tuple[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    model, batch = make_mlp(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    same = f"{float(pmodel(*batch)):.6f}"
    _, own = make_mlp(0 if rank == 0 else 5)  # a DistributedSampler's habit: each rank its own batch
    try:
        pmodel(*own)
    except autopar.InputMismatchError as exc:
        return same, str(exc)
    return same, "no error"


def _differing_examples(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    model, _ = make_mlp(0)
    _, own = make_mlp(rank)  # each rank its own example batch
    try:
        autopar.parallelize(model, mesh, example_inputs=own)
    except autopar.InputMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multirank
def test_ranks_whose_example_inputs_differ_are_refused_at_parallelize() -> None:
    for message in run_ranks(2, _differing_examples, timeout=120):
        assert message.startswith("x of example_inputs differs between rank 0 and rank 1"), message
        assert 'inputs="local"' in message, message


@pytest.mark.multirank
def test_ranks_with_different_weights_are_refused_naming_the_first_parameter() -> None:
    first = next(iter(make_mlp(0)[0].named_parameters()))[0]
    for message in run_ranks(2, _differing_weights, timeout=120):
        assert message.startswith(f"{first} differs between rank 0 and rank 1"), message
        assert "manual_seed" in message, message


@pytest.mark.multirank
def test_ranks_that_pass_different_batches_are_refused_on_every_rank() -> None:
    results = run_ranks(2, _differing_batches, timeout=120)
    model, batch = make_mlp(0)
    for same, message in results:
        assert same == f"{float(model(*batch)):.6f}"
        assert "x differs between rank 0 and rank 1" in message, message  # the forward's parameter


def _fingerprints_of(rank: int, world_size: int) -> list[Any]:
    from autopar.runtime.agreement import first_disagreement

    nan_inf = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    moved = nan_inf.clone() if rank == 0 else nan_inf[[1, 0, 2, 3]].clone()  # the NaN elsewhere
    tiny = torch.tensor([1.0, 2.0]) + (2.0**-20 if rank == 1 else 0.0)  # one float32 step above 1
    found = [
        first_disagreement([("same", nan_inf), ("also same", torch.arange(5))]),
        first_disagreement([("same", nan_inf), ("moved", moved)]),
        first_disagreement([("tiny", tiny)]),
        first_disagreement([]),
    ]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autopar.runtime.agreement import stored_disagreement

    mesh = init_device_mesh("cpu", (2,))
    block = torch.arange(6.0).reshape(3, 2) + rank  # each rank's own block: never compared
    base = torch.tensor([[1.0, 2.0], [1.0, 3.0], [0.0, 3.0]])
    row_swapped = base[[1, 0, 2]] if rank == 1 else base  # sums, first and last element agree
    sharded = DTensor.from_local(block, mesh, [Shard(0)], run_check=False)
    replicated = DTensor.from_local(row_swapped, mesh, [Replicate()], run_check=False)
    found += [
        stored_disagreement([("sharded", sharded)]),
        stored_disagreement([("sharded", sharded), ("replicated", replicated)]),
    ]
    return [None if d is None else (d.name, d.rank) for d in found]


@pytest.mark.multirank
def test_fingerprints_agree_on_equal_values_with_nan_and_inf_and_name_the_first_difference() -> None:
    for result in run_ranks(2, _fingerprints_of, timeout=120):
        assert result == [None, ("moved", 1), ("tiny", 1), None, None, ("replicated", 1)], result
