"""What training scripts read off a model besides calling it: `pmodel.config`
(`unet.config.in_channels` in diffusers' scripts), `dtype`, `device`, a submodule set to None;
and for a method of the source model, an AutoparError that is also an AttributeError, naming
where to call it instead (a user probe met a bare AttributeError for each)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from multirank import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from transformers import BertConfig, BertForSequenceClassification

import autopar
from autopar.runtime.source_attributes import ModuleAttributeError


def _job(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    model = BertForSequenceClassification(config)
    ids = torch.randint(64, (2, 8))
    pmodel = autopar.parallelize(model, mesh, example_inputs=(ids,))
    found: dict[str, Any] = {
        "config": pmodel.config is model.config,
        "dtype": pmodel.dtype,
        "device": pmodel.device,
        "hasattr_missing": hasattr(pmodel, "no_such_thing"),
        "default": getattr(pmodel, "num_parameters", "absent"),
    }
    with pytest.raises(ModuleAttributeError) as err:
        pmodel.num_parameters()
    found["method"] = (isinstance(err.value, AttributeError), err.value.message, err.value.hint)
    with pytest.raises(ModuleAttributeError) as err, pmodel.no_sync():  # a DDP loop's accumulation
        pass
    found["no_sync"] = (err.value.message, err.value.hint)
    return found


@pytest.mark.multirank
def test_config_dtype_device_and_a_named_refusal_for_the_sources_methods() -> None:
    (found,) = run_ranks(1, _job, timeout=180)
    assert found["config"] is True
    assert found["dtype"] == torch.float32 and found["device"] == torch.device("cpu")
    assert found["hasattr_missing"] is False and found["default"] == "absent"
    is_attribute_error, message, hint = found["method"]
    assert is_attribute_error
    assert "BertForSequenceClassification.num_parameters is a method of the source model" in message
    assert "model.num_parameters" in hint
    message, hint = found["no_sync"]
    assert "DistributedDataParallel's no_sync()" in message and "BertForSequenceClassification" in message
    assert "(loss / n).backward() on each micro-step" in hint


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        return (self.proj(x) * t).sum()


def _numbers(rank: int, world_size: int) -> list[str]:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    pmodel = autopar.parallelize(_Scaled(), mesh, example_inputs=(torch.randn(2, 8), 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (2, 3, 4, 2):
            pmodel(torch.randn(2, 8), t)
    return [str(w.message) for w in caught if "autopar: input" in str(w.message)]


@pytest.mark.multirank
def test_a_number_that_compiles_a_program_per_value_is_warned_about_once() -> None:
    """A sampling loop passing the timestep as a Python int compiles one program per step (a user
    probe: 20 s each, silently)."""
    (messages,) = run_ranks(1, _numbers, timeout=180)
    assert len(messages) == 1, messages
    assert "input 1 is a Python int that has taken 3 values" in messages[0]
    assert "torch.tensor(t)" in messages[0]


def _int_then_tensor(rank: int, world_size: int) -> tuple[int, list[tuple[str, str]]]:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    pmodel = autopar.parallelize(_Scaled(), mesh, example_inputs=(torch.randn(2, 8), 500))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (500, torch.tensor(0), 0, torch.tensor(3)):  # two ints and 0-d tensors: no warning
            pmodel(torch.randn(2, 8), t)
        before = len([w for w in caught if "autopar: input" in str(w.message)])
        pmodel(torch.randn(2, 8), 7)  # the third int
    return before, [(str(w.message), f"{w.filename}:{w.lineno}") for w in caught if "autopar: input" in str(w.message)]


@pytest.mark.multirank
def test_only_distinct_python_numbers_count_and_the_warning_names_the_callers_line() -> None:
    """A UNet sampling loop called `pmodel(x, 500)`, then `pmodel(x, torch.tensor(0))`, then
    `pmodel(x, 0)`: the tensor's dtype was counted as a third value, and the warning pointed into
    torch's Module.__call__ (a user probe)."""
    ((before, warned),) = run_ranks(1, _int_then_tensor, timeout=180)
    assert before == 0 and len(warned) == 1, (before, warned)
    message, where = warned[0]
    assert "input 1 is a Python int that has taken 3 values" in message
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "# the third int" in text)
    assert where == f"{__file__}:{line}", where
