"""Property tests: elementwise ops with broadcasting and Partial linearity, against the oracle."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules.registry import default_registry
from autopar.testing.strategies import (
    check_random_strategies,
    mesh_shapes,
    random_tensor,
    seeds,
    tensor_shapes,
)

# Each op of a family gets its own examples (sampling the op would leave some untested).
PER_OP = settings(max_examples=8, deadline=None)

aten = torch.ops.aten
REGISTRY = default_registry()

# op -> argument kinds: "f" float, "+" positive float, "b" bool, "i" int64 (tensors, broadcast
# against one output shape), or a plain Python value passed as is.
ARGS: dict[object, tuple[object, ...]] = {
    aten.exp.default: ("f",),
    aten.log.default: ("+",),
    aten.log1p.default: ("+",),
    aten.expm1.default: ("f",),
    aten.sqrt.default: ("+",),
    aten.rsqrt.default: ("+",),
    aten.reciprocal.default: ("+",),
    aten.abs.default: ("f",),
    aten.sin.default: ("f",),
    aten.cos.default: ("f",),
    aten.erf.default: ("f",),
    aten.sigmoid.default: ("f",),
    aten.silu.default: ("f",),
    aten.sign.default: ("f",),
    aten.pow.Tensor_Scalar: ("f", 2),
    aten.pow.Scalar: (2.0, "f"),
    aten.floor.default: ("f",),
    aten.ceil.default: ("f",),
    aten.trunc.default: ("f",),
    aten.round.default: ("f",),
    aten.add.Scalar: ("f", 1.5),
    aten.sub.Scalar: ("f", 1.5),
    aten.rsub.Scalar: ("f", 1.5),
    aten.clamp.default: ("f", -0.5, 0.5),
    aten.clamp_min.default: ("f", -0.25),
    aten.clamp_max.default: ("f", 0.25),
    aten.clamp.Tensor: ("f", "f", "f"),
    aten.clamp_min.Tensor: ("f", "f"),
    aten.clamp_max.Tensor: ("f", "f"),
    aten.logical_not.default: ("b",),
    aten.isnan.default: ("f",),
    aten.bitwise_not.default: ("i",),
    aten.eq.Scalar: ("i", 1),
    aten.ne.Scalar: ("i", 1),
    aten.lt.Scalar: ("f", 0.0),
    aten.le.Scalar: ("f", 0.0),
    aten.gt.Scalar: ("f", 0.0),
    aten.ge.Scalar: ("f", 0.0),
    aten.eq.Tensor: ("i", "i"),
    aten.ne.Tensor: ("i", "i"),
    aten.lt.Tensor: ("f", "f"),
    aten.le.Tensor: ("f", "f"),
    aten.gt.Tensor: ("f", "f"),
    aten.ge.Tensor: ("f", "f"),
    aten.logical_and.default: ("b", "b"),
    aten.logical_or.default: ("b", "b"),
    aten.bitwise_and.Tensor: ("b", "b"),
    aten.bitwise_or.Tensor: ("i", "i"),
    aten.maximum.default: ("f", "f"),
    aten.minimum.default: ("f", "f"),
    aten.pow.Tensor_Tensor: ("+", "f"),
    aten.floor_divide.default: ("f", "+"),
    aten.remainder.Scalar: ("i", 7),
    aten.remainder.Tensor: ("f", "+"),
    aten.hardtanh.default: ("f", -0.5, 0.5),
    aten.hardswish.default: ("f",),
    aten.softplus.default: ("f", 1.0, 20.0),
    aten.hardtanh_backward.default: ("f", "f", -0.5, 0.5),
    aten.hardswish_backward.default: ("f", "f"),
    aten.softplus_backward.default: ("f", "f", 1.0, 20.0),
    aten.leaky_relu.default: ("f", 0.01),
    aten.elu.default: ("f", 1.0, 1.0, 1.0),
    aten.celu.default: ("f", 0.5),
    aten.mish.default: ("f",),
    aten.hardsigmoid.default: ("f",),
    aten.sgn.default: ("f",),
    aten.leaky_relu_backward.default: ("f", "f", 0.01, False),
    aten.elu_backward.default: ("f", 1.0, 1.0, 1.0, False, "f"),
    aten.mish_backward.default: ("f", "f"),
    aten.hardsigmoid_backward.default: ("f", "f"),
    aten.neg.default: ("f",),
    aten.mul.Scalar: ("f", 3.0),
    aten.div.Scalar: ("f", 4.0),
    aten.add.Tensor: ("f", "f"),
    aten.sub.Tensor: ("f", "f"),
    aten.mul.Tensor: ("f", "f"),
    aten.div.Tensor: ("f", "+"),
    aten.where.self: ("b", "f", "f"),
    aten.addcmul.default: ("f", "f", "f"),
    aten.addcdiv.default: ("f", "f", "+"),
    aten.sigmoid_backward.default: ("f", "f"),
    aten.tanh_backward.default: ("f", "f"),
    aten.silu_backward.default: ("f", "f"),
    # activations registered by the nn family, elementwise all the same
    aten.gelu.default: ("f",),
    aten.relu.default: ("f",),
    aten.tanh.default: ("f",),
    aten.gelu_backward.default: ("f", "f"),
    aten.threshold_backward.default: ("f", "f", 0.0),
}
# Same-shape-only ops (no broadcasting in their kernels' contract).
SAME_SHAPE = {
    aten.leaky_relu_backward.default,
    aten.elu_backward.default,
    aten.mish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.hardtanh_backward.default,
    aten.hardswish_backward.default,
    aten.softplus_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
    aten.silu_backward.default,
    aten.gelu_backward.default,
    aten.threshold_backward.default,
}
# Integer variants exercising Partial integer sums.
INT_ARGS: dict[object, tuple[object, ...]] = {
    aten.add.Tensor: ("i", "i"),
    aten.mul.Tensor: ("i", "i"),
    aten.sub.Tensor: ("i", "f"),
}

COMPLEX_OPS = [aten.polar.default, aten._conj.default, aten.resolve_conj.default]
COVERED_OPS = [*ARGS, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.div.Tensor_mode, *COMPLEX_OPS]


@st.composite
def broadcast_shape(draw: st.DrawFn, out: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to `out`: leading dims dropped, some dims set to 1."""
    drop = draw(st.integers(0, len(out)))
    kept = out[drop:]
    return tuple(1 if s != 1 and draw(st.integers(0, 3)) == 0 else s for s in kept)


def _maker(g: torch.Generator) -> Callable[[object, tuple[int, ...]], object]:
    def make(kind: object, shape: tuple[int, ...]) -> object:
        if kind == "f":
            return random_tensor(shape, generator=g)
        if kind == "+":
            return random_tensor(shape, generator=g).abs() + 0.5
        if kind == "b":
            return random_tensor(shape, torch.bool, generator=g)
        if kind == "i":
            return random_tensor(shape, torch.int64, generator=g)
        return kind

    return make


@pytest.mark.parametrize("op", list(ARGS) + list(INT_ARGS), ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_pointwise(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    kinds = INT_ARGS[op] if op in INT_ARGS and data.draw(st.booleans()) else ARGS[op]
    make = _maker(torch.Generator().manual_seed(data.draw(seeds())))
    out = data.draw(tensor_shapes(mesh, min_dims=0, max_dims=3))
    tensor_kinds = [k for k in kinds if k in ("f", "+", "b", "i")]
    full_at = data.draw(st.integers(0, max(len(tensor_kinds) - 1, 0)))
    args, t = [], 0
    for kind in kinds:
        if kind in ("f", "+", "b", "i"):
            same = op in SAME_SHAPE or t == full_at
            args.append(make(kind, out if same else data.draw(broadcast_shape(out))))
            t += 1
        else:
            args.append(kind)
    assert check_random_strategies(data, op, tuple(args), {}, mesh, REGISTRY)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(), value=st.sampled_from([0.0, 2.5]))
def test_masked_fill(data: st.DataObject, mesh: tuple[int, ...], value: float) -> None:
    make = _maker(torch.Generator().manual_seed(data.draw(seeds())))
    out = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    x, mask = make("f", out), make("b", data.draw(broadcast_shape(out)))
    assert check_random_strategies(data, aten.masked_fill.Scalar, (x, mask, value), {}, mesh, REGISTRY)
    as_tensor = torch.tensor(value, dtype=x.dtype)  # masked_fill(mask, tensor): the Tensor overload
    assert check_random_strategies(data, aten.masked_fill.Tensor, (x, mask, as_tensor), {}, mesh, REGISTRY)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), mesh=mesh_shapes(), mode=st.sampled_from(["floor", "trunc"]), ints=st.booleans())
def test_div_with_rounding(data: st.DataObject, mesh: tuple[int, ...], mode: str, ints: bool) -> None:
    """Rounded division, not linear: Wav2Vec2's conv output lengths from its attention mask,
    `torch.div(length - kernel, stride, rounding_mode="floor")` on integers (a user probe's
    MissingRuleError), and on floats."""
    make = _maker(torch.Generator().manual_seed(data.draw(seeds())))
    out = data.draw(tensor_shapes(mesh, min_dims=0, max_dims=3))
    divisor_shape = data.draw(broadcast_shape(out))
    if ints:
        x, y = make("i", out), make("i", divisor_shape).abs() + 1  # type: ignore[operator]
    else:
        x, y = make("f", out), make("+", divisor_shape)
    assert check_random_strategies(data, aten.div.Tensor_mode, (x, y), {"rounding_mode": mode}, mesh, REGISTRY)


@pytest.mark.parametrize("op", COMPLEX_OPS, ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes())
def test_complex(data: st.DataObject, mesh: tuple[int, ...], op: object) -> None:
    """Complex rotary embeddings (DeepSeek-V2): polar(abs, angle) and the conjugate its backward takes."""
    g = torch.Generator().manual_seed(data.draw(seeds()))
    shape = data.draw(tensor_shapes(mesh, min_dims=1, max_dims=3))
    re, im = random_tensor(shape, generator=g), random_tensor(shape, generator=g)
    args = (re.abs() + 0.1, im) if op == aten.polar.default else (torch.complex(re, im),)
    assert check_random_strategies(data, op, args, {}, mesh, REGISTRY)


@pytest.mark.parametrize("op", [aten.addcmul.default, aten.addcdiv.default], ids=str)
@PER_OP
@given(data=st.data(), mesh=mesh_shapes(), value=st.sampled_from([0.5, -2.0]))
def test_addcmul_addcdiv_with_a_value(data: st.DataObject, mesh: tuple[int, ...], op: object, value: float) -> None:
    """`value=` scales the product only: the Partial pairs stay linear (timm's GRN passes none)."""
    make = _maker(torch.Generator().manual_seed(data.draw(seeds())))
    out = data.draw(tensor_shapes(mesh, min_dims=0, max_dims=3))
    args = (make("f", out), make("f", data.draw(broadcast_shape(out))), make("+", data.draw(broadcast_shape(out))))
    assert check_random_strategies(data, op, args, {"value": value}, mesh, REGISTRY)
