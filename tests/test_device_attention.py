"""The attention pair a program calls on a device other than the CPU (autopar.rules.device_attention)
keeps the CPU flash pair's contract: the from-the-definition path is checked here against the CPU
kernels and autograd on random shapes, masks and dtypes; the CUDA flash path runs in
benchmarks/gpu_check.py where a GPU is lent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.rules import device_attention as da


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 9),
    lk=st.integers(1, 9),
    d=st.sampled_from([4, 8]),
    causal=st.booleans(),
    mask=st.sampled_from(["none", "bool", "float"]),
    transposed=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
)
def test_math_pair_equals_the_cpu_kernels_and_autograd(
    b: int, h: int, lq: int, lk: int, d: int, causal: bool, mask: str, transposed: bool, scale: float | None
) -> None:
    if causal and mask != "none":
        return  # torch's SDPA takes one or the other
    gen = torch.Generator().manual_seed(b * 1000 + h * 100 + lq * 10 + lk)

    def rand(length: int) -> torch.Tensor:
        if transposed:  # (B, L, H, D) memory, as attention after a projection and a transpose has it
            return torch.randn(b, length, h, d, generator=gen, dtype=torch.float64).transpose(1, 2)
        return torch.randn(b, h, length, d, generator=gen, dtype=torch.float64)

    q, k, v = rand(lq), rand(lk), rand(lk)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(lq, lk, generator=gen) > 0.3
        attn_mask[:, 0] = True  # torch's kernels differ on rows with every key masked
    elif mask == "float":
        attn_mask = torch.randn(lq, lk, generator=gen, dtype=torch.float64)
    out, lse = da.math_forward(q, k, v, causal, attn_mask=attn_mask, scale=scale)
    additive = attn_mask  # the CPU kernel takes an additive mask of the query's dtype (SDPA converts a bool one)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        additive = torch.zeros(lq, lk, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
    ref_out, ref_lse = da.CPU_FORWARD(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    # later views of the traced graph rely on the layout (a stride of a size-1 dim means nothing)
    assert [s for s, n in zip(out.stride(), out.shape) if n > 1] == [
        s for s, n in zip(ref_out.stride(), ref_out.shape) if n > 1
    ]
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = da.math_backward(grad, q, k, v, out, lse, causal, attn_mask=attn_mask, scale=scale)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=attn_mask, is_causal=causal, scale=scale)
    expected.backward(grad)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)


def test_on_the_cpu_the_pair_is_the_cpu_kernels() -> None:
    q = torch.randn(2, 2, 5, 8)
    out, lse = da.attention_forward(q, q, q, 0.0, True)
    ref = da.CPU_FORWARD(q, q, q, 0.0, True)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    assert not da.flash_fits(q, q, q, 0.0, True, None)  # CUDA half precision only


def test_programs_for_a_cuda_mesh_call_the_device_pair_not_the_cpu_kernels() -> None:
    """The first GPU run found the CPU kernel in a CUDA program ("Could not run
    'aten::_scaled_dot_product_flash_attention_for_cpu' with arguments from the 'CUDA' backend")."""
    from autopar.compiler.driver import compile_for_rank
    from autopar.core.mesh import Mesh
    from examples.zoo import make_llama

    model, batch = make_llama(0)
    for device_type, forward, backward in (
        ("cuda", da.attention_forward, da.attention_backward),
        ("cpu", da.CPU_FORWARD, da.CPU_BACKWARD),
    ):
        mesh = Mesh.from_shape((2, 2), device_type=device_type)
        program = compile_for_rank(model, mesh, batch, coords=(1, 0)).program
        forward_targets = {n.target for n in program.forward.graph.nodes}
        backward_targets = {n.target for n in program.backward.graph.nodes}
        assert forward in forward_targets and backward in backward_targets, device_type
        if device_type == "cuda":
            assert not set(da.ON_DEVICE) & (forward_targets | backward_targets)


def test_the_cudnn_pair_keeps_the_cpu_pairs_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch would run cuDNN's attention (Hopper GPUs), the pair returns the CPU pair's
    (B, H, L) logsumexp, hands cuDNN back its (B, H, L, 1) one, and gives each input's gradient
    its input's shape (checked on meta tensors, whose shapes are cuDNN's; the values were held
    against float64 autograd on an H200 by benchmarks/gpu_check.py)."""
    seen: list[tuple[int, ...]] = []
    backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default

    def recording_backward(*args: object, **kwargs: object) -> object:
        seen.append(tuple(args[5].shape))  # type: ignore[attr-defined]
        return backward(*args, **kwargs)

    monkeypatch.setattr(da, "fused_kernel", lambda *args: "cudnn")
    monkeypatch.setattr(da.aten._scaled_dot_product_cudnn_attention_backward, "default", recording_backward)
    q, k, v = (torch.empty(2, 4, 64, 32, device="meta", dtype=torch.bfloat16) for _ in range(3))
    out, lse = da.attention_forward(q, k, v, 0.0, True)
    assert out.shape == q.shape and lse.shape == (2, 4, 64) and lse.dtype == torch.float32
    grads = da.attention_backward(torch.empty_like(out), q, k, v, out, lse, 0.0, True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert seen == [(2, 4, 64, 1)]
