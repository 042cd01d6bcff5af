"""What a pipeline refuses, before any work, with the reason and what to do instead (in process).

A pipeline runs each microbatch apart and every rank runs the model's own modules: norms with batch
statistics in training, a tensor attribute of a model on meta that no initialization makes, and a
transformers model's tuple output (its cache object inside) cannot give the serial model's numbers
or cannot be exported, and say so. A model on meta itself is cut without allocating it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.compiler.pipeline_split import PipelineSplitError, split_stages


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(torch.relu(self.bn(self.fc1(x)))), y)


def test_batch_statistics_in_training_are_refused_and_eval_pipelines() -> None:
    model = _BatchNormNet()
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    with pytest.raises(PipelineSplitError, match="batch statistics in training \\(bn\\)") as info:
        split_stages(model, list(batch), batch, ["fc2"], 2)
    assert "mesh without 'pp'" in (info.value.hint or "")
    model.eval()
    program = split_stages(model, list(batch), batch, ["fc2"], 2)
    assert len(program.stages) == 2
    model.train()
    model.bn = nn.LayerNorm(16)  # per-sample statistics: exact per microbatch
    assert len(split_stages(model, list(batch), batch, ["fc2"], 2).stages) == 2


def test_a_model_on_meta_is_cut_without_allocating_it() -> None:
    """The export of a model on meta runs on fake tensors: the stages read the model's own names."""
    with torch.device("meta"):
        model = _BatchNormNet().eval()
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    program = split_stages(model, list(batch), batch, ["fc2"], 2)
    assert [set(st.attrs) for st in program.stages] == [
        {"fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"},
        {"fc2.weight", "fc2.bias"},
    ]
    assert all(t.is_meta for t in model.parameters())


class _PlainTensor(_BatchNormNet):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.LayerNorm(16)
        self.scale = torch.tensor(2.0)  # neither a parameter nor a buffer

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.scale, y)


def test_a_plain_tensor_attribute_on_meta_is_refused_with_what_to_do() -> None:
    with torch.device("meta"):
        model = _PlainTensor()
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    with pytest.raises(PipelineSplitError, match="_PlainTensor.scale is a tensor attribute on the meta device") as info:
        split_stages(model, list(batch), batch, ["fc2"], 2)
    assert "register_buffer" in (info.value.hint or "")


def test_a_transformers_tuple_output_names_the_default_call() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    kwargs = {"labels": ids, "return_dict": False}
    with pytest.raises(PipelineSplitError, match="could not trace") as info:
        split_stages(model, [ids, ids], (ids,), ["model.layers.1"], 2, example_kwargs=kwargs)
    assert "return_dict" in (info.value.hint or "")
    program = split_stages(model, [ids, ids], (ids,), ["model.layers.1"], 2, example_kwargs={"labels": ids})
    assert program.output_type is not None and len(program.stages) == 2  # the default call: a ModelOutput


class ReadsValues(nn.Module):
    """A user's model that asserts on its labels and branches on its input's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert (labels >= 0).all(), "labels must be non-negative"
        h = self.first(x)
        h = torch.relu(h) if x.sum() > 0 else torch.tanh(h)
        return F.cross_entropy(self.second(h), labels)


class ReadsActivations(ReadsValues):
    """A branch on a value the weights compute (DETR's `isfinite` on activations)."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = torch.relu(h) if h.sum() > 0 else torch.tanh(h)
        return F.cross_entropy(self.second(h), labels)


def test_a_value_read_on_the_inputs_is_a_guard_one_on_activations_is_refused_naming_the_line() -> None:
    """A branch on the inputs' values is cut out of the stages as a value guard, which the
    pipeline evaluates on the whole batch before any stage runs (tests/test_pipeline_value_guards.py);
    a batch the model's own assert rejects raises that AssertionError, as serial does; a branch on
    a value the weights compute is refused with the user's line (not torch's generated code)."""
    from autopar.core.errors import ModelAssertionError, TraceError
    from autopar.passes.value_guards import WEIGHT_GUARD_HINT

    x, labels = torch.randn(4, 4).abs(), torch.tensor([0, 1, 2, 0])
    program = split_stages(ReadsValues(), [x, labels], (x, labels), ["second"], 2)
    guards = program.value_guards
    assert guards is not None and not any(guards.counts)  # branches, not sizes: the whole batch's
    lines = {c.rsplit(":", 1)[-1] for c in guards.conditions}
    assert lines == {"98 in forward", "100 in forward"}, guards.conditions  # the assert, the branch
    for stage in program.stages:  # the stages read no value: the guards run apart
        targets = {n.target for n in stage.module.graph.nodes}
        assert torch.ops.aten.item.default not in targets
        assert torch.ops.aten._assert_scalar.default not in targets
    assert guards.failing_per_microbatch([x, labels], [x[:2], labels[:2]]) == []
    failing = guards.failing_per_microbatch([-x, labels], [x[:2], labels[:2]])  # the whole batch's branch
    assert failing and all(c.endswith("100 in forward") for c in failing), failing
    with pytest.raises(ModelAssertionError, match="labels must be non-negative"):
        split_stages(ReadsValues(), [x, -labels - 1], (x, -labels - 1), ["second"], 2)
    with pytest.raises(TraceError, match="depends on the model's weights") as refused:
        split_stages(ReadsActivations(), [x, labels], (x, labels), ["second"], 2)
    assert "test_pipeline_refusals.py" in (refused.value.where or "")
    assert refused.value.hint == WEIGHT_GUARD_HINT
