"""Meta-tests: every registered op has a property test, and the oracle rejects wrong rules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from autopar.core.layout import Layout, P, R, Shard
from autopar.rules.base import AxisStrategy, OpCall, RuleRegistry, Strategy, make_call
from autopar.rules.registry import default_registry
from autopar.testing import check_strategy

aten = torch.ops.aten
HERE = Path(__file__).parent

# Ops the GPT/MLP joint graphs need after decomposition; they must have rules.
REQUIRED = [
    aten._log_softmax.default, aten._log_softmax_backward_data.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._to_copy.default, aten._unsafe_view.default, aten.add.Tensor, aten.add.Scalar, aten.addmm.default,
    aten.mm.default, aten.bmm.default, aten.arange.default, aten.arange.start, aten.cat.default,
    aten.detach.default, aten.clone.default, aten.div.Tensor, aten.div.Scalar, aten.embedding.default,
    aten.embedding_dense_backward.default, aten.exp.default, aten.log.default, aten.gather.default,
    aten.gelu.default, aten.gelu_backward.default, aten.relu.default, aten.threshold_backward.default,
    aten.tanh.default, aten.mul.Tensor, aten.mul.Scalar, aten.ne.Scalar, aten.eq.Scalar, aten.neg.default,
    aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar, aten.scalar_tensor.default,
    aten.scatter.value, aten.scatter.src, aten.split.Tensor, aten.split_with_sizes.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.sub.Tensor, aten.sub.Scalar,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.dim, aten.mean.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.view.default, aten.reshape.default, aten.expand.default,
    aten.where.self, aten.zeros_like.default, aten.ones_like.default, aten.full.default, aten.zeros.default,
    aten.ones.default, aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
    aten.nll_loss_forward.default, aten.nll_loss_backward.default, aten.var_mean.correction,
    aten.amax.default, aten.mse_loss.default, aten.mse_loss_backward.default, aten.copy.default,
    aten.alias.default, aten.select.int, aten.slice.Tensor,
]  # fmt: skip

ANCHORS = [
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.embedding.default,
    aten.embedding_dense_backward.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
]  # fmt: skip


def _covered() -> set[object]:
    ops: set[object] = set()
    for path in sorted(HERE.glob("test_rules_*.py")):
        if path.name == Path(__file__).name:
            continue
        spec = importlib.util.spec_from_file_location(f"_coverage_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ops |= set(getattr(module, "COVERED_OPS", []))
    return ops


def test_every_registered_op_has_a_property_test() -> None:
    covered = _covered()  # first: the test modules import the libraries whose custom ops have rules
    registered = set(default_registry().ops())
    assert not registered - covered, f"registered but untested: {sorted(map(str, registered - covered))}"
    assert not covered - registered, f"tested but unregistered: {sorted(map(str, covered - registered))}"


def test_required_ops_and_anchors() -> None:
    registry = default_registry()
    missing = [str(op) for op in REQUIRED if op not in registry]
    assert not missing, missing
    for op in ANCHORS:
        rule = registry.get(op)
        assert rule is not None and rule.anchor, op


def test_registries_are_fresh() -> None:
    a, b = default_registry(), default_registry()
    a.register(aten.mm.default, lambda call: [], family="x")
    assert b.get(aten.mm.default) is not None and b.get(aten.mm.default).family == "matmul"  # type: ignore[union-attr]


def _strategy(call: OpCall, per_axis: list[AxisStrategy]) -> Strategy:
    ins = tuple(
        Layout(tuple(s.inputs[i] for s in per_axis), spec.shape, spec.dtype)
        for i, spec in enumerate(call.inputs)
    )
    outs = tuple(
        Layout(tuple(s.outputs[i] for s in per_axis), spec.shape, spec.dtype)
        for i, spec in enumerate(call.outputs)
    )
    return Strategy(ins, outs)


# Wrong strategies the oracle must reject (so the property tests can fail).
WRONG = [
    # max over a split dim is not a sum of the blocks' maxima
    (aten.amax.default, lambda: (torch.randn(4, 6), [1]), AxisStrategy((Shard(1),), (P,))),
    # a bias replicated on a contraction split is counted g times
    (
        aten.addmm.default,
        lambda: (torch.randn(6), torch.randn(4, 6), torch.randn(6, 6)),
        AxisStrategy((R, Shard(1), Shard(0)), (P,)),
    ),
    # adding a constant to every summand adds it g times
    (aten.add.Scalar, lambda: (torch.randn(4, 6), 1.0), AxisStrategy((P,), (P,))),
    # mul of two pending sums is not the sum of the products
    (aten.mul.Tensor, lambda: (torch.randn(4, 6), torch.randn(4, 6)), AxisStrategy((P, P), (P,))),
    # an inner dim of a merged run is strided in the result
    (aten.view.default, lambda: (torch.randn(4, 6), [24]), AxisStrategy((Shard(1),), (Shard(0),))),
    # a bias added on every rank of an input-channel split is counted g times
    (
        aten.convolution.default,
        lambda: (torch.randn(2, 4, 5), torch.randn(6, 4, 3), torch.randn(6), [1], [0], [1], False, [0], 1),
        AxisStrategy((Shard(1), Shard(1), R), (P,)),
    ),
    # softmax over a split dim normalizes each block separately
    (aten._softmax.default, lambda: (torch.randn(4, 6), 1, False), AxisStrategy((Shard(1),), (Shard(1),))),
]


@pytest.mark.parametrize("op,make_args,axis", WRONG, ids=[str(w[0]) for w in WRONG])
def test_oracle_rejects_wrong_strategies(op: object, make_args: object, axis: AxisStrategy) -> None:
    args = make_args()  # type: ignore[operator]
    call = make_call(op, args, {}, op(*args))  # type: ignore[operator]
    with pytest.raises(AssertionError):
        check_strategy(op, args, {}, _strategy(call, [axis]), (2,), RuleRegistry())
    assert axis not in (default_registry().get(op).strategies(call))  # type: ignore[union-attr]
