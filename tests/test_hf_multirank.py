"""transformers' GPT-2 called as its docs call it: default config (dropout on, `use_cache` on),
`out = model(input_ids=ids, labels=ids)`, `out.loss.backward()`; SGD with momentum against the
serial model, every rank seeded alike before each call (as every rank of a job is), the serial call
from the same seed. Then what a training script does next: a smaller last batch, an evaluation
under `eval()` + `torch.no_grad()` without labels, and back to training.

On (2, 2, 2) every rank's programs run in lockstep (loss, logits, every gradient, the parameters
after the steps); on 2 real gloo ranks the runtime around them (the output types, the programs its
cache compiles for each call, DTensor parameters and their sharded storage) with the same numbers
checked again."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from multirank import run_ranks
from pass_fixtures import compile_every_rank
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from train_fixtures import forward_in_lockstep, hf_step_in_lockstep

import autopar
from examples.hf_models import tiny_gpt2

transformers = pytest.importorskip("transformers")

STEPS = 3
VOCAB, SEQ, BATCH = 64, 16, 8
GLOO_RANKS = 2


def _batch(step: int) -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    model = tiny_gpt2()
    serial = copy.deepcopy(model)
    ids = _batch(0)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids})
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    serial_params = dict(serial.named_parameters())
    result: dict[str, Any] = {"losses": [], "logits_err": 0.0, "grad_err": 0.0, "param_err": 0.0}
    for step in range(STEPS + 2):
        ids = _batch(step) if step < STEPS else _batch(step)[:4]  # the last, smaller batch (twice)
        torch.manual_seed(step)
        out = pmodel(input_ids=ids, labels=ids)
        torch.manual_seed(step)
        want = serial(input_ids=ids, labels=ids)
        logits_type = "DTensor" if isinstance(out.logits, DTensor) else type(out.logits).__name__
        result["types"] = (type(out).__name__, logits_type, out.past_key_values)
        out.loss.backward()
        want.loss.backward()
        result["losses"].append((float(out.loss), float(want.loss)))
        result["logits_err"] = max(result["logits_err"], float((out.logits.full_tensor() - want.logits).abs().max()))
        for name, p in pmodel.named_parameters():
            grad = p.grad.full_tensor()
            expected = serial_params[name].grad
            result["grad_err"] = max(result["grad_err"], float((grad - expected).abs().max()))
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        serial_opt.zero_grad()
    pmodel.eval()
    serial.eval()
    with torch.no_grad():
        out = pmodel(input_ids=_batch(9))
        want = serial(input_ids=_batch(9))
    result["eval"] = (out.loss, float((out.logits.full_tensor() - want.logits).abs().max()))
    pmodel.train()
    serial.train()
    torch.manual_seed(7)
    pmodel(input_ids=_batch(7), labels=_batch(7)).loss.backward()
    torch.manual_seed(7)
    serial(input_ids=_batch(7), labels=_batch(7)).loss.backward()
    opt.step()
    serial_opt.step()
    result["programs"] = [why for why, _ in pmodel.programs]
    for name, p in pmodel.named_parameters():
        result["param_err"] = max(result["param_err"], float((p.full_tensor() - serial_params[name]).abs().max()))
    result["names_match"] = [n for n, _ in pmodel.named_parameters()] == list(serial_params)
    result["stored_fraction"] = sum(p.to_local().numel() for p in pmodel.parameters()) / sum(
        p.numel() for p in serial.parameters()
    )
    return result


def _kwargs(step: int, labels: bool = True) -> dict[str, torch.Tensor]:
    """The gloo job's call at `step` (7: after the evaluation, 9: the evaluation), one tensor passed twice."""
    ids = _batch(step)[:4] if STEPS <= step < STEPS + 2 else _batch(step)
    return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}


def test_gpt2_called_with_defaults_trains_like_serial_on_2x2x2_in_lockstep() -> None:
    """The gloo job's calls, every rank's programs in lockstep on (2, 2, 2): one program per
    argument structure and shape (as the runtime's cache compiles them), stepped by SGD with
    momentum from the weights the ranks' gradients updated; the evaluation's logits equal."""
    shape = (2, 2, 2)
    torch.manual_seed(0)
    model = tiny_gpt2()
    assert model.config.use_cache and model.config.resid_pdrop > 0  # the library's defaults
    parallel = copy.deepcopy(model)
    opt = torch.optim.SGD(parallel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    whole = compile_every_rank(model, shape, (), _kwargs(0))
    smaller = compile_every_rank(model, shape, (), _kwargs(STEPS))
    for step in [*range(STEPS + 2), 7]:  # the steps, the smaller batch twice, then after evaluation
        compiled = smaller if STEPS <= step < STEPS + 2 else whole
        hf_step_in_lockstep(compiled, parallel, model, _kwargs(step), shape, f"step {step}")
        opt.step()
        serial_opt.step()
        opt.zero_grad()
        if step == STEPS + 1:
            model.eval()
            parallel.eval()
            evaluation = compile_every_rank(model, shape, (), _kwargs(9, labels=False), forward_only=True)
            (logits,) = forward_in_lockstep(evaluation, parallel, _kwargs(9, labels=False), shape)
            with torch.no_grad():
                want = model(**_kwargs(9, labels=False))
            assert want.loss is None
            torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=1e-5)
            model.train()
            parallel.train()
    params = dict(parallel.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.multirank
def test_gpt2_called_with_defaults_trains_like_serial_on_gloo_ranks() -> None:
    for rank, r in enumerate(run_ranks(GLOO_RANKS, _job, timeout=600)):
        assert r["types"] == ("CausalLMOutputWithCrossAttentions", DTensor.__name__, None), rank
        for loss, serial_loss in r["losses"]:
            assert loss == pytest.approx(serial_loss, rel=1e-5, abs=1e-6), (rank, r["losses"])
        assert r["logits_err"] < 1e-4, (rank, r["logits_err"])
        assert r["grad_err"] < 1e-4, (rank, r["grad_err"])
        assert r["param_err"] < 1e-4, (rank, r["param_err"])
        assert r["names_match"], rank
        assert r["eval"][0] is None and r["eval"][1] < 1e-4, (rank, r["eval"])
        assert r["programs"] == [  # least recently used first
            "example inputs",  # input_ids=ids, labels=ids: one tensor passed twice
            "input 0: int64[4, 16] (was int64[8, 16]); "
            "input 1: int64[4, 16], the tensor of input 0 (was int64[8, 16], the tensor of input 0)",
            "another structure of arguments; eval() mode; torch.no_grad(): forward only",
            # training again passes two tensors (equal values): a program traced for one tensor
            # passed twice reads it once, so these get their own
            "another structure of arguments; train() mode; gradients on",
        ], (rank, r["programs"])
        assert r["stored_fraction"] < 0.7, (rank, r["stored_fraction"])  # most weights split in two
