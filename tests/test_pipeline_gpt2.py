"""transformers' `GPT2LMHeadModel` at its defaults (tiny sizes; dropout on everywhere, attention's
own `attn_pdrop` inside `scaled_dot_product_attention` included) built on meta, pipelined and
loaded from a `save_pretrained` directory: two SGD-momentum steps with dropout equal the serial
model loaded from the same files, in value (docs/pipeline.md#dropout). On pp=2 every rank runs in
this process (`autopar.testing.pipeline_lockstep`); pp=2 x tp=2 on gloo ranks."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from multirank import pipelined, run_in_lockstep, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler.pipeline import PipelinedModule
from autopar.compiler.pipeline_random import attention_dropped
from autopar.testing.pipeline_lockstep import LockstepTransport

TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-6}
GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _ids() -> torch.Tensor:
    return torch.randint(0, GPT2["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(3))


def _gpt2_from_pretrained(
    rank: int, world: int, root: str, shape: tuple[int, ...], names: tuple[str, ...], transport: LockstepTransport | None = None
) -> dict[str, Any]:
    serial = transformers.GPT2LMHeadModel.from_pretrained(root)
    serial.train()  # from_pretrained returns a model in eval mode: dropout on, as in training
    ids = _ids()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    options = autopar.PipelineOptions(microbatches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        example = {"input_ids": ids, "labels": ids}
        if transport is None:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            pmodel = autopar.parallelize(model, mesh, example_inputs=(), example_kwargs=example, pipeline=options)
        else:
            pmodel = pipelined(model, world, transport, example_kwargs=example, pipeline=options)
        assert isinstance(pmodel, PipelinedModule)
        loaded = autopar.load_checkpoint(pmodel, root)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pmodel, serial)]
        losses, grads, states = [], [], []
        for step in range(2):
            per_model = []
            for m, opt in zip((pmodel, serial), optimizers, strict=True):
                torch.manual_seed(100 + step)  # every rank and the serial model draw from one state
                out = m(input_ids=ids, labels=ids)
                out.loss.backward()
                losses.append(float(out.loss.detach()))
                per_model.append({n: _whole(p.grad) for n, p in m.named_parameters() if p.grad is not None})
                states.append(torch.get_rng_state())
                opt.step()
                opt.zero_grad()
            mine, ref = per_model
            grads.append(max(float((g - ref[n]).abs().max()) for n, g in mine.items()))
    ref_params = dict(serial.named_parameters())
    return {
        "loaded": (loaded.missing, loaded.unexpected),
        "losses": losses,
        "grads": grads,
        "rng": [torch.equal(states[2 * s], states[2 * s + 1]) for s in range(2)],
        "params": max(float((_whole(p) - ref_params[n]).abs().max()) for n, p in pmodel.named_parameters()),
        "warnings": [str(w.message) for w in caught if "autopar pipeline" in str(w.message)],
    }


@pytest.mark.parametrize(
    ("shape", "names"),
    [pytest.param((2,), ("pp",), id="pp2"), pytest.param((2, 2), ("pp", "tp"), id="pp2xtp2", marks=pytest.mark.multirank)],
)
def test_gpt2_at_its_defaults_built_on_meta_trains_with_dropout_equal_to_serial(
    tmp_path: Path, shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    """GPT-2's embedding, residual and attention dropouts (0.1 each, attention's inside SDPA with
    a mask) drawn as the serial step draws them: the loss, every gradient and the parameters after
    two SGD-momentum steps equal the serial model's, the generator ends where serial's does, and no
    warning says a draw is only equal in distribution."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(**GPT2)
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == 0.1  # the defaults
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    if shape == (2,):  # every rank in this process
        results = run_in_lockstep(2, _gpt2_from_pretrained, str(tmp_path), shape, names)
    else:
        results = run_ranks(math.prod(shape), _gpt2_from_pretrained, str(tmp_path), shape, names, timeout=400)
    for result in results:
        assert result["loaded"] == ([], []), result["loaded"]
        assert result["warnings"] == [], result["warnings"]
        for step in range(2):
            torch.testing.assert_close(result["losses"][2 * step], result["losses"][2 * step + 1], **TOL)
        assert max(result["grads"]) < 1e-5 and result["params"] < 1e-5, result
        assert all(result["rng"]), result["rng"]


@pytest.mark.parametrize(
    "arguments",
    [{}, {"is_causal": True}, {"attn_mask": "bool"}, {"attn_mask": "float"}, {"scale": 0.2}, {"enable_gqa": True}],
    ids=["plain", "causal", "bool-mask", "float-mask", "scale", "gqa"],
)
def test_attention_with_a_drawn_mask_is_eager_attention_with_dropout_bit_for_bit(arguments: dict[str, Any]) -> None:
    """`attention_dropped` with the mask eager dropout draws (`bernoulli_(1 - p)` over the
    probabilities' shape, from one generator state) equals eager CPU attention with dropout_p=p:
    output and the gradients of q, k and v, bit for bit; a row masked whole included."""
    g = torch.Generator().manual_seed(0)
    heads_kv = 1 if arguments.get("enable_gqa") else 2
    q = torch.randn(3, 2, 5, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(3, heads_kv, 6, 8, generator=g, requires_grad=True) for _ in range(2))
    kwargs = dict(arguments)
    allowed = torch.ones(3, 1, 5, 6, dtype=torch.bool).tril()
    allowed[0, :, 0] = False  # a row that attends to nothing
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = allowed
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.zeros(3, 1, 5, 6).masked_fill(~allowed, -math.inf)
    torch.manual_seed(1)
    eager = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, **kwargs)
    torch.manual_seed(1)
    keep = torch.empty(3, 2, 5, 6).bernoulli_(0.7).div_(0.7)
    ours = attention_dropped(q, k, v, kwargs.pop("attn_mask", None), keep, **kwargs)
    assert torch.equal(ours, eager)
    weights = torch.randn(eager.shape, generator=g)
    for a, b in zip(torch.autograd.grad((eager * weights).sum(), (q, k, v)), torch.autograd.grad((ours * weights).sum(), (q, k, v))):
        assert torch.equal(a, b)
