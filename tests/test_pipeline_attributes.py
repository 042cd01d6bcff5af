"""What a pipelined module answers besides its parameters, as the tensor-only module does
(`runtime/source_attributes.py`): the source model's plain attributes (`pmodel.config`, which
transformers and diffusers scripts read) and `dtype`; for a method of the source, a DDP habit or
`full_state_dict()` (README's way to the serial model, which a pipelined module has not), an
`AutoparError` that is an AttributeError and says what to do. Before, each was a bare
AttributeError (found by user16's probes). Both ranks run in this process (lockstep)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from multirank import pipelined, run_in_lockstep, run_ranks

import autopar
from autopar.runtime.source_attributes import ModuleAttributeError
from autopar.testing.pipeline_lockstep import LockstepTransport

transformers = pytest.importorskip("transformers")


def _attributes(rank: int, world: int, transport: LockstepTransport | None = None) -> dict[str, Any]:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (4, 8))
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=["model.layers.1"])
    pmodel = pipelined(model, world, transport, example_kwargs={"input_ids": ids, "labels": ids}, pipeline=options)
    found: dict[str, Any] = {
        "config": pmodel.config is model.config,
        "vocab": pmodel.config.vocab_size,
        "dtype": pmodel.dtype,
        "hasattr": hasattr(pmodel, "no_such_thing"),
        "default": getattr(pmodel, "no_such_thing", "default"),
    }
    for name in ("full_state_dict", "generate", "no_sync", "no_such_thing"):
        try:
            getattr(pmodel, name)
            found[name] = None
        except AttributeError as error:
            found[name] = (type(error), str(error), getattr(error, "hint", None))
    return found


def test_a_pipelined_module_answers_the_source_attributes_and_says_what_it_lacks() -> None:
    for found in run_in_lockstep(2, _attributes):
        assert found["config"] and found["vocab"] == 64 and found["dtype"] == torch.float32, found
        assert found["hasattr"] is False and found["default"] == "default", found
        for name in ("full_state_dict", "generate", "no_sync", "no_such_thing"):
            kind, text, hint = found[name]
            assert issubclass(kind, ModuleAttributeError) and hint, (name, found[name])
        assert "save_checkpoint" in found["full_state_dict"][2], found["full_state_dict"]
        assert "save_checkpoint" in found["generate"][2], found["generate"]
        assert "no_sync" in found["no_sync"][1] and "backward" in found["no_sync"][2], found["no_sync"]
        assert "check the name" in found["no_such_thing"][2], found["no_such_thing"]


def _late_hooks(rank: int, world: int, transport: LockstepTransport | None = None) -> dict[str, list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 8)
    options = autopar.PipelineOptions(microbatches=2, schedule="gpipe", stage_boundaries=["2"])
    pmodel = pipelined(model, world, transport, example_inputs=(x,), pipeline=options)

    def call() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pmodel(x).sum().backward()
        return [str(w.message) for w in caught if issubclass(w.category, autopar.OriginalModelWarning)]

    found = {"first": call()}
    pmodel.eval()
    pmodel.train()
    found["own flags"] = call()
    model.eval()  # the original's mode: not followed (pmodel keeps its own), said as on a tensor-only module
    found["original eval"] = call()
    model.train()
    found["original train again"] = call()
    model[2].register_forward_hook(lambda m, a, o: o * 100)  # the serial model's output changes
    found["hooked"] = call()
    found["again"] = call()  # once per change
    return found


def test_a_forward_hook_on_the_original_model_after_parallelize_is_said_on_a_pipeline() -> None:
    """The pipeline runs the stage programs exported before the hook: it never runs, and serial
    would (silently different before: no warning on a pipelined module)."""
    for found in run_in_lockstep(2, _late_hooks):
        assert found["first"] == [] and found["own flags"] == [] and found["again"] == [], found
        (said,) = found["original eval"]  # silent before: pmodel trained on in training mode
        assert "model.eval() was called" in said and "call pmodel.eval()" in said, said
        assert found["original train again"] == [], found  # back as at parallelize
        (said,) = found["hooked"]
        assert "a forward hook was added to or removed from model.2" in said, said


def _frozen(rank: int, world: int, transport: LockstepTransport | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
        torch.nn.Linear(16, 4),
    )  # fmt: skip
    model[1].eval()  # a frozen dropout and a frozen BatchNorm: the fine-tuning habit, before parallelize
    model[3].eval()
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    options = autopar.PipelineOptions(microbatches=2, schedule="gpipe", stage_boundaries=["2"])
    pmodel = pipelined(model, world, transport, example_inputs=(x,), pipeline=options)
    found: dict[str, Any] = {"flags kept": [m.training for m in model]}
    for m in (serial, pmodel):
        torch.manual_seed(1)
        loss = F.mse_loss(m(x), y)
        loss.backward()
        found.setdefault("losses", []).append(loss.detach())
    sp = dict(serial.named_parameters())
    found["grads"] = {name: (sp[name].grad, p.grad) for name, p in pmodel.named_parameters()}
    found["flags after"] = [m.training for m in model]
    for target in ("", "1", "0.weight", "4.weight", "nope.weight"):
        try:
            got = pmodel.get_parameter(target) if "." in target else pmodel.get_submodule(target)
            found[target] = got is pmodel if not target else got is dict(pmodel.named_parameters())[target]
        except AttributeError as error:
            found[target] = (type(error), str(error), getattr(error, "hint", None))
    return found


def test_a_pipeline_keeps_the_submodule_modes_the_model_had_and_answers_get_submodule() -> None:
    """A dropout and a BatchNorm put in eval() before parallelize stay so in the stage programs (the
    dropout ran, loss 1.827 for serial's 1.759, and the BatchNorm was refused as training), the
    model's own flags are left as the user set them (all reset to train before), and
    `get_submodule` / `get_parameter` answer or say why (torch's bare AttributeError before)."""
    for rank, found in enumerate(run_in_lockstep(2, _frozen)):
        want = [True, False, True, False, True]
        assert found["flags kept"] == want and found["flags after"] == want, found
        serial_loss, loss = found["losses"]
        torch.testing.assert_close(loss, serial_loss, rtol=0, atol=1e-6)
        assert found["grads"], found
        for name, (want_grad, grad) in found["grads"].items():
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6, msg=name)
        assert found[""] is True, found[""]
        kind, text, hint = found["1"]
        assert issubclass(kind, ModuleAttributeError) and "no submodule '1'" in text and "before parallelize" in hint
        mine, other = ("0.weight", "4.weight") if rank == 0 else ("4.weight", "0.weight")
        assert found[mine] is True, found[mine]
        kind, text, hint = found[other]
        assert issubclass(kind, ModuleAttributeError) and "another rank's stage" in text, found[other]
        assert "not a parameter of the model" in found["nope.weight"][1] and "check the name" in found["nope.weight"][2]


class _Doubling(torch.nn.Module):
    """A mode branch with no random op: the stage programs of its two modes take the same arguments."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.training else x


def _frozen_then_trained(rank: int, world: int) -> list[tuple[float, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), _Doubling(),
                                torch.nn.Linear(16, 4))
    model[3].eval()  # frozen before parallelize; pmodel.train() (as model.train()) unfreezes it
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "x"))
    options = autopar.PipelineOptions(microbatches=2, schedule="gpipe", stage_boundaries=["2"])
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), pipeline=options)
    found = []
    for m in (serial, pmodel):
        frozen = F.mse_loss(m(x), y).item()
        m.eval()
        m.train()
        found.append((frozen, F.mse_loss(m(x), y).item()))
    return found


@pytest.mark.multirank
def test_tensor_axes_beside_pp_compile_the_program_of_each_module_mode() -> None:
    """pp=2 x 2: the stage programs after pmodel.train() (every module training) are other
    variants than those of the frozen submodule at parallelize, so each stage's parallel module
    compiles them; with the same arguments it ran the frozen program again (1.7296 for serial's
    1.9216) before."""
    for serial, parallel in run_ranks(4, _frozen_then_trained, timeout=300):
        assert serial[0] != serial[1], serial  # the branch changes the loss
        for want, got in zip(serial, parallel, strict=True):
            assert abs(want - got) <= 1e-6 * max(1.0, abs(want)), (serial, parallel)


class _NormEval(torch.nn.Sequential):
    """A model whose own train() keeps its BatchNorms in eval (mmdet's `norm_eval` backbones)."""

    def train(self, mode: bool = True) -> _NormEval:
        super().train(mode)
        for m in self.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.eval()
        return self


def _norm_eval(rank: int, world: int, transport: LockstepTransport | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _NormEval(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.train()
    serial = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    options = autopar.PipelineOptions(microbatches=2, schedule="gpipe", stage_boundaries=["2"])
    pmodel = pipelined(model, world, transport, example_inputs=(x,), pipeline=options)
    found: dict[str, Any] = {}
    for m in (serial, pmodel):
        m.eval()
        m.train()  # the model's own train(): its BatchNorm stays in eval
        found.setdefault("losses", []).append(F.mse_loss(m(x), y).detach())
    found["flags"] = [m.training for m in model.modules()]
    return found


def test_pmodel_train_runs_the_models_own_train() -> None:
    """`pmodel.train()` takes each submodule's mode from the model's own `train()` (an override that
    keeps BatchNorms frozen); before, it set every module training, and the call was refused as
    BatchNorm in training where serial trains with it frozen. The model's flags are left as they were."""
    for found in run_in_lockstep(2, _norm_eval):
        serial_loss, loss = found["losses"]
        torch.testing.assert_close(loss, serial_loss, rtol=0, atol=1e-6)
        assert found["flags"] == [True, True, False, True, True], found["flags"]
