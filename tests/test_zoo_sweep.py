"""A fast slice of the transformers zoo sweep (`benchmarks/zoo_sweep.py`): a few architectures of
different families that pass there, built by the same toy-config code (`examples/hf_zoo.py`) and
called as their docs call them, every rank of a 2x2x2 mesh in lockstep against serial. Keeps the
builder honest (a transformers upgrade that breaks it shows here, not hours into a sweep) and
keeps these families passing."""

from __future__ import annotations

import pytest
import torch
from pass_fixtures import assert_call_matches_serial

from examples import hf_zoo

pytest.importorskip("transformers")

# One encoder-only masked LM, one sequence classifier, one decoder, and T5 in training mode (its
# dropouts once drew out of the serial order when the schedule stage ran one ahead of another).
CASES = ("BertForMaskedLM", "DistilBertForSequenceClassification", "Qwen2ForCausalLM", "T5ForConditionalGeneration")


def test_the_zoo_lists_every_task_once_per_class() -> None:
    archs = hf_zoo.architectures()
    assert {a.task for a in archs} == set(hf_zoo.TASKS)
    assert len({a.model_class for a in archs}) == len(archs)
    assert all(a.model_class.endswith(hf_zoo.TASKS[a.task][1]) for a in archs)


@pytest.mark.parametrize("name", CASES)
def test_toy_model_matches_serial_on_2x2x2(name: str) -> None:
    model, kwargs, variant = hf_zoo.build_working(hf_zoo.find(name))
    assert variant == 0, "built at the sweep's first toy size"
    assert getattr(model.config, "use_cache", True) is not False  # library defaults left alone
    assert kwargs["input_ids"].shape == (hf_zoo.BATCH, hf_zoo.SEQ)
    torch.manual_seed(0)
    assert_call_matches_serial(model, (2, 2, 2), (), kwargs)
