"""The catalogue of bad inputs: one row per mistake a user can make (mesh, example inputs, call-time
inputs, models, options, dump paths, hardware tables, memory limits), each asserting the
AutoparError subclass and that the message names the offending thing. Rows that need a process
group run together in one forked single-rank job. Faults of other ranks (killed, raising, absent)
are in tests/test_rank_failures.py; ranks whose weights, batches or loads disagree (reordered
rows, samples, tokens; a rank a call out of step) in tests/test_agreement.py; inputs that must
give the serial result (NaN, frozen weights, uneven dims, a frozen dropout, hooks on the parallel
module's parameters) in the lockstep and gloo tests (tests/test_hooks_and_flags.py)."""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks
from test_autograd_functions import Checkpointed, ConfiguredRound, QuantizedMLP, Rounding

import autopar
from autopar.api import compile_for_rank
from autopar.core.errors import (
    CheckpointError,
    IndexOutOfRangeError,
    InitError,
    InternalError,
    MemoryLimitError,
    MeshError,
    MissingRuleError,
    ModelValueError,
    ShardingError,
    TraceError,
    UnknownHardwareError,
    UsageError,
)
from autopar.core.mesh import Mesh
from autopar.passes.trace import DATA_DEPENDENT_HINT
from autopar.passes.trace_errors import NO_EXAMPLE_HINT
from autopar.passes.value_guards import WEIGHT_GUARD_HINT
from examples import torch_models
from examples.models import make_mlp


class ChecksItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if h.sum() > 0:  # Python control flow on a value the weights compute (one on the inputs is a guard)
            return F.cross_entropy(h, y)
        return F.cross_entropy(-h, y)


class Poisson(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return (h + torch.poisson(h.abs())).sum()


class TinyWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, 1))
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.proj(x) * self.scale, y)


MLP, BATCH = make_mlp(0)
MESH2 = Mesh.from_shape((2,))


def _clip_gradient(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.01, 0.01)


def _log_gradients(*args: Any) -> None:
    return None


def _hooked(kind: str) -> nn.Module:
    """A fresh MLP with the user's hook of `kind` on fc1 or its weight."""
    model, _ = make_mlp(0)
    register = {
        "register_hook": lambda: model.fc1.weight.register_hook(_clip_gradient),
        "post_accumulate": lambda: model.fc1.weight.register_post_accumulate_grad_hook(_log_gradients),
        "full_backward": lambda: model.fc1.register_full_backward_hook(_log_gradients),
        "full_backward_pre": lambda: model.fc1.register_full_backward_pre_hook(_log_gradients),
        "old_backward": lambda: model.fc1.register_backward_hook(_log_gradients),
    }
    register[kind]()
    return model


def _with_global_backward_hook() -> Any:
    handle = nn.modules.module.register_module_full_backward_hook(_log_gradients)
    try:
        return _compile()
    finally:
        handle.remove()


def _compile(model: Any = MLP, inputs: Any = BATCH, mesh: Mesh = MESH2, **options: Any) -> Any:
    return compile_for_rank(model, mesh, inputs, coords=options.pop("coords", (0,)), **options)


# (id, call, error class, text the message must contain)
IN_PROCESS: list[tuple[str, Callable[[], Any], type, str]] = [
    ("mesh-empty", lambda: autopar.plan(MLP, (), BATCH), MeshError, "a mesh needs at least one axis"),
    ("mesh-float", lambda: autopar.plan(MLP, (2.0, 2), BATCH), MeshError, "integers, got (2.0, 2)"),
    ("mesh-zero-axis", lambda: autopar.plan(MLP, (0, 2), BATCH), MeshError, ">= 1, got (0, 2)"),
    ("mesh-string", lambda: autopar.plan(MLP, "2x2", BATCH), autopar.AutoparError, "mesh_shape '2x2'"),
    ("world-size-zero", lambda: autopar.plan(MLP, "auto", BATCH, world_size=0), MeshError, "world size must be >= 1, got 0"),
    ("mesh-names-repeat", lambda: Mesh(("x", "x"), (2, 2)), MeshError, "mesh axis names repeat"),
    ("mesh-pipeline-axis", lambda: _compile(mesh=Mesh(("pp", "x"), (2, 2)), coords=(0, 0)), UsageError, 'pipeline axis "pp"'),
    ("schedule-name-without-pp", lambda: autopar.parallelize(MLP, 2, example_inputs=BATCH, pipeline=autopar.PipelineOptions(schedule="1f1b")), UsageError, 'no axis named "pp"'),
    ("hardware-unknown", lambda: autopar.plan(MLP, (2,), BATCH, planning=autopar.PlanOptions(hardware="nope")), UnknownHardwareError, "'nope'"),
    ("hardware-path", lambda: autopar.plan(MLP, (2,), BATCH, planning=autopar.PlanOptions(hardware="/no/such.json")), UnknownHardwareError, "/no/such.json"),
    ("inputs-none", lambda: _compile(inputs=None), UsageError, "example_inputs must be a tuple"),
    ("inputs-none-given", lambda: _compile(inputs=()), TraceError, "missing a required argument: 'x'"),
    ("inputs-a-tensor", lambda: _compile(inputs=BATCH[0]), UsageError, "got Tensor"),
    ("kwargs-a-list", lambda: autopar.plan(MLP, (2,), BATCH, example_kwargs=[1]), UsageError, "example_kwargs must be a dict"),
    ("model-a-function", lambda: _compile(model=lambda x, y: x), UsageError, "model must be an nn.Module, got function"),
    ("planner-unknown", lambda: _compile(planner="fastest"), autopar.AutoparError, "unknown planner 'fastest'"),
    ("over-decompose-negative", lambda: _compile(over_decompose=-1), autopar.AutoparError, "over_decompose=-1"),
    ("over-decompose-word", lambda: _compile(over_decompose="fast"), autopar.AutoparError, "over_decompose='fast'"),
    ("memory-limit-negative", lambda: _compile(memory_limit=-1.0), UsageError, "memory_limit must be"),
    ("memory-limit-too-small", lambda: _compile(memory_limit=1000.0), MemoryLimitError, "no plan fits the memory limit"),
    ("in-flight-negative", lambda: _compile(in_flight_bytes=-5), UsageError, "in_flight_bytes must be"),
    ("coords-outside-mesh", lambda: _compile(coords=(5,)), UsageError, "coords (5,) are not a rank"),
    ("coords-wrong-length", lambda: _compile(coords=(0, 0)), UsageError, "coords (0, 0) are not a rank"),
    ("dump-dir-a-file", lambda: _compile(dump_dir=__file__), UsageError, "cannot write debug dumps to"),
    ("dump-dir-unwritable", lambda: _compile(dump_dir="/proc/autopar-dumps"), UsageError, "/proc/autopar-dumps"),
    ("control-flow-on-a-value", lambda: _compile(model=ChecksItsInput()), TraceError, "that value depends on the model's weights"),
    ("data-dependent-size", lambda: _compile(torch_models.SparseMoE(), torch_models.batch()), TraceError, "SparseMoE"),
    ("custom-autograd-function", lambda: _compile(QuantizedMLP(ConfiguredRound, (Rounding(4.0),)), _mlp_batch()), TraceError, "ConfiguredRound"),
    ("reentrant-checkpoint", lambda: _compile(Checkpointed(True), _grad_batch()), TraceError, "CheckpointFunction"),
    ("random-op-without-rule", lambda: _compile(model=Poisson()), MissingRuleError, "aten.poisson"),
    ("hook-on-parameter", lambda: _compile(model=_hooked("register_hook")), UsageError, "fc1.weight has a gradient hook, test_bad_inputs._clip_gradient (register_hook)"),
    ("hook-post-accumulate-grad", lambda: _compile(model=_hooked("post_accumulate")), UsageError, "_log_gradients (register_post_accumulate_grad_hook)"),
    ("hook-module-full-backward", lambda: _compile(model=_hooked("full_backward")), UsageError, "module fc1 (Linear) has a backward hook, test_bad_inputs._log_gradients (register_full_backward_hook)"),
    ("hook-module-full-backward-site", lambda: _compile(model=_hooked("full_backward")), UsageError, f"at: fc1 (the hook is defined at {__file__}:{_log_gradients.__code__.co_firstlineno})"),
    ("hook-on-parameter-site", lambda: _compile(model=_hooked("register_hook")), UsageError, f"at: fc1.weight (the hook is defined at {__file__}:{_clip_gradient.__code__.co_firstlineno})"),
    ("hook-module-backward-pre", lambda: _compile(model=_hooked("full_backward_pre")), UsageError, "_log_gradients (register_full_backward_pre_hook)"),
    ("hook-module-old-backward", lambda: _compile(model=_hooked("old_backward")), UsageError, "_log_gradients (register_backward_hook)"),
    ("hook-global-module-backward", _with_global_backward_hook, UsageError, "a global module backward hook, test_bad_inputs._log_gradients"),
    ("int32-class-targets", lambda: _compile(inputs=(BATCH[0], BATCH[1].int())), TraceError, "expected target dtype to be Long or Byte, but got Int"),
    ("int32-class-targets-one-rank", lambda: _compile(inputs=(BATCH[0], BATCH[1].int()), mesh=Mesh.from_shape((1,))), TraceError, "but got Int (the class-index targets of the loss at <root> @"),
    ("int32-class-targets-one-rank-eval", lambda: _compile(inputs=(BATCH[0], BATCH[1].int()), mesh=Mesh.from_shape((1,)), forward_only=True), TraceError, "but got Int"),
    ("weight-too-small-to-split", lambda: _compile(model=TinyWeight(), mesh=Mesh.from_shape((2, 2)), coords=(0, 0), memory_limit=1e9, planner="greedy"), ShardingError, "scale"),
]


def _mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=gen), torch.randint(4, (8,), generator=gen)


def _grad_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _mlp_batch()
    return x.requires_grad_(), y


HINTS = {
    "control-flow-on-a-value": WEIGHT_GUARD_HINT,
    "data-dependent-size": DATA_DEPENDENT_HINT,
    "inputs-none-given": NO_EXAMPLE_HINT,
}


@pytest.mark.parametrize(("call", "error", "text"), [row[1:] for row in IN_PROCESS], ids=[row[0] for row in IN_PROCESS])
def test_in_process(call: Callable[[], Any], error: type, text: str, request: pytest.FixtureRequest) -> None:
    with pytest.raises(error) as caught:
        call()
    assert text in str(caught.value), str(caught.value)
    assert not isinstance(caught.value, InternalError)
    assert caught.value.hint, "every error says what to do"
    row = request.node.callspec.id
    if row in HINTS:
        assert caught.value.hint == HINTS[row]


class RawParameter(nn.Module):
    """A parameter made in __init__ with no reset_parameters(): on meta, nothing can initialize it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * self.scale).sum()


def _checkpoint_rows(pmodel: nn.Module, model: nn.Module) -> dict[str, Callable[[], Any]]:
    """Checkpoints gone wrong, written to a fresh directory: absent, foreign, truncated, partial."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = Path(tempfile.mkdtemp())
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    (root / "empty").mkdir()
    (root / "truncated").mkdir()
    save_file(state, str(root / "truncated" / "model.safetensors"))
    whole = (root / "truncated" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    (root / "sharded").mkdir()
    index = {"metadata": {}, "weight_map": {k: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, k in enumerate(state)}}
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({k: v for i, (k, v) in enumerate(state.items()) if i % 2 == 0}, str(root / "sharded" / "model-00001-of-00002.safetensors"))
    first = next(iter(state))
    save_file({**state, first: state[first].t().contiguous()}, str(root / "wrong-shape.safetensors"))
    save_file({k: v for k, v in state.items() if k != first}, str(root / "partial.safetensors"))
    dcp.save({"encoder.weight": torch.zeros(3, 3)}, checkpoint_id=str(root / "foreign"))
    dcp.save(state, checkpoint_id=str(root / "dcp"))
    for data in (root / "dcp").glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:8])
    return {
        "checkpoint-absent": lambda: autopar.load_checkpoint(pmodel, root / "absent"),
        "checkpoint-not-a-checkpoint": lambda: autopar.load_checkpoint(pmodel, root / "empty"),
        "checkpoint-truncated-safetensors": lambda: autopar.load_checkpoint(pmodel, root / "truncated"),
        "checkpoint-shard-absent": lambda: autopar.load_checkpoint(pmodel, root / "sharded"),
        "checkpoint-wrong-shape": lambda: autopar.load_checkpoint(pmodel, root / "wrong-shape.safetensors"),
        "checkpoint-lacks-a-tensor": lambda: autopar.load_checkpoint(pmodel, root / "partial.safetensors"),
        "checkpoint-foreign-dcp": lambda: autopar.load_checkpoint(pmodel, root / "foreign"),
        "checkpoint-truncated-dcp": lambda: autopar.load_checkpoint(pmodel, root / "dcp"),
        "checkpoint-of-a-plain-module": lambda: autopar.load_checkpoint(model, root / "dcp"),  # type: ignore[arg-type]
    }


def _optimizer_slip(model: nn.Module, pmodel: nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
    """The serial model trained beside the parallel one steps as ever; an optimizer over its
    parameters stepping after the parallel module's backward is the slip."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(*batch).backward()
    opt.step()  # serial, beside: its parameters have gradients
    opt.zero_grad()
    pmodel(*batch).backward()
    opt.step()


def _tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def _parallelize_rows(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    """Every row that needs a process group, in one single-rank job: row -> (error type, text)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    model, (x, y) = make_mlp(0)
    rows: dict[str, Callable[[], Any]] = {
        "mesh-not-a-device-mesh": lambda: autopar.parallelize(model, (2, 2), example_inputs=(x, y)),
        "mesh-five-axes": lambda: autopar.parallelize(
            model, init_device_mesh("cpu", (1, 1, 1, 1, 1)), example_inputs=(x, y)
        ),
        "model-on-meta-uninitialized": lambda: autopar.parallelize(
            RawParameter().to("meta"), mesh, example_inputs=(x,)
        ),
        "timeout-zero": lambda: autopar.parallelize(model, mesh, example_inputs=(x, y), timeout=0),
        "inputs-mode-unknown": lambda: autopar.parallelize(model, mesh, example_inputs=(x, y), inputs="sharded"),
        "compile-not-a-bool": lambda: autopar.parallelize(model, mesh, example_inputs=(x, y), compile="inductor"),  # type: ignore[arg-type]
        # no batch at all: transformers' BERT raises its own ValueError on the empty call
        "no-example-inputs-bert": lambda: autopar.parallelize(_tiny_bert(), mesh),
    }
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x, y))
    bad_y = y.clone()
    bad_y[3] = 99
    rows.update(
        {
            "call-target-out-of-range": lambda: pmodel(x, bad_y),
            "call-negative-target": lambda: pmodel(x, y - 20),
            "call-keyword-unknown": lambda: pmodel(x, y, labels=y),
            # with local batches a plain target is one rank's shard: refused, never replicated
            "output-local-plain-target": lambda: F.mse_loss(
                autopar.parallelize(nn.Linear(32, 3), mesh, example_inputs=(x,), inputs="local")(x),
                torch.zeros(len(x), 3),
            ),
        }
    )
    rows["ddp-around-the-parallel-module"] = lambda: nn.parallel.DistributedDataParallel(pmodel)
    rows["optimizer-over-the-original-parameters"] = lambda: _optimizer_slip(model, pmodel, (x, y))
    rows.update(_checkpoint_rows(pmodel, model))
    found = {}
    for name, row in rows.items():
        try:
            row()
            found[name] = ("no error", "")
        except autopar.AutoparError as exc:
            found[name] = (type(exc).__name__, f"{exc}\nhint? {bool(exc.hint)}")
        except Exception as exc:  # a raw error reaching the user: the test fails on it
            found[name] = (f"raw {type(exc).__name__}", str(exc))
    # a keyword-only model (transformers style) given only example_kwargs: example_inputs defaults to ()
    torch.manual_seed(0)
    linear = nn.Linear(32, 3)
    serial = copy.deepcopy(linear)
    by_keyword = autopar.parallelize(linear, mesh, example_kwargs={"input": x})
    found["kwargs-only"] = ("ran", str(float((by_keyword(input=x) - serial(x)).abs().max())))
    return found


WITH_PROCESS_GROUP = {
    "mesh-not-a-device-mesh": (MeshError, "mesh must be a torch DeviceMesh"),
    "mesh-five-axes": (MeshError, "meshes of 1 to 4 axes"),
    "model-on-meta-uninitialized": (InitError, "scale is on the meta device and no initialization writes it"),
    "checkpoint-absent": (CheckpointError, "does not exist"),
    "checkpoint-not-a-checkpoint": (CheckpointError, "without model.safetensors, its index or a .metadata"),
    "checkpoint-truncated-safetensors": (CheckpointError, "is not a readable safetensors file"),
    "checkpoint-shard-absent": (CheckpointError, "which does not exist (1 shard(s) absent)"),
    "checkpoint-wrong-shape": (CheckpointError, "fc1.weight has shape [32, 128] in the checkpoint, but the model's fc1.weight is [128, 32]"),
    "checkpoint-lacks-a-tensor": (CheckpointError, "lacks 1 of the model's tensors"),
    "checkpoint-foreign-dcp": (CheckpointError, "holds none of the model's tensors"),
    "checkpoint-truncated-dcp": (CheckpointError, "reading the torch.distributed.checkpoint"),
    "checkpoint-of-a-plain-module": (CheckpointError, "takes the module autopar.parallelize returned"),
    "timeout-zero": (UsageError, "timeout must be a positive number of seconds, got 0"),
    "inputs-mode-unknown": (UsageError, "inputs must be one of 'global', 'local', got 'sharded'"),
    "compile-not-a-bool": (UsageError, "compile must be True or False, got 'inductor'"),
    "no-example-inputs-bert": (ModelValueError, "hint: " + NO_EXAMPLE_HINT),
    "call-target-out-of-range": (IndexOutOfRangeError, "y holds 99"),
    "call-negative-target": (IndexOutOfRangeError, "y holds -"),
    "call-keyword-unknown": (TraceError, "labels"),
    "optimizer-over-the-original-parameters": (UsageError, "build the optimizer over the parallel module's parameters: torch.optim.SGD(pmodel.parameters()"),
    "ddp-around-the-parallel-module": (UsageError, "DistributedDataParallel around a ParallelModule"),
    "output-local-plain-target": (UsageError, 'called with inputs="local" with a plain tensor of shape [8, 3]'),
}


@pytest.mark.multirank
def test_with_a_process_group() -> None:
    (found,) = run_ranks(1, _parallelize_rows, timeout=180)
    kind, difference = found.pop("kwargs-only")
    assert kind == "ran" and float(difference) < 1e-6, difference
    assert set(found) == set(WITH_PROCESS_GROUP)
    for name, (error, text) in WITH_PROCESS_GROUP.items():
        kind, message = found[name]
        assert kind == error.__name__ or (error is autopar.AutoparError and not kind.startswith("raw")), (name, kind, message)
        assert text in message and "hint? True" in message, (name, message)


def test_the_catalogue_has_at_least_thirty_rows() -> None:
    assert len(IN_PROCESS) + len(WITH_PROCESS_GROUP) >= 30
