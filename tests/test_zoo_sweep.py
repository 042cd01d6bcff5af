"""A fast slice of the transformers zoo sweep (`benchmarks/zoo_sweep.py`): a few architectures of
different families that pass there, built by the same toy-config code (`examples/hf_zoo.py`) and
called as their docs call them, every rank of a 2x2x2 mesh in lockstep against serial. Keeps the
builder honest (a transformers upgrade that breaks it shows here, not hours into a sweep) and
keeps these families passing."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

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


# Models whose Python reads values (issue 34): M2M100 at its default LayerDrop (a guard on each
# layer's random draw, drawn from the serial stream) and BART's sequence classifier (the
# end-of-sequence pick, static at the example's count; the other seven of its family share the
# head, docs/debugging.md "Value guards"). On (2,): the guards, not the mesh, are what is checked
# here, and the two add about 35 s of CPU to the suite (T5ForSequenceClassification, 13 s more,
# is left to the sweep).
GUARDED_CASES = ("M2M100ForConditionalGeneration", "BartForSequenceClassification")


@pytest.mark.parametrize("name", GUARDED_CASES)
def test_model_reading_values_matches_serial_on_2(name: str) -> None:
    model, kwargs, variant = hf_zoo.build_working(hf_zoo.find(name))
    assert variant == 0 and model.training, "built at the sweep's first toy size, in training"
    assert "labels" in kwargs
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(model, (2,), (), kwargs)
    guards = next(iter(compiled.values())).program.value_guards
    assert guards is not None  # traced on the example's values, the conditions kept as guards
    if name.startswith("M2M100"):
        assert model.config.encoder_layerdrop > 0 and guards.draws  # the library's default LayerDrop
        assert any("the random draw at model.encoder" in c for c in guards.conditions), guards.conditions


def test_longformer_at_a_window_below_the_sequence_matches_serial_on_2() -> None:
    """Longformer's classifier at the toy window (8 tokens: two windows in the sequence of 16,
    where the default 512 pads the batch to 512 tokens). Its sliding-window chunks are
    `as_strided` of a query and key whose dims are not in memory order, which no rule places: the
    trace rewrites them into slices and a cat (`passes/trace_export.windows_as_slices`). Its CLS
    token attends globally: the global-token count is a guard."""
    model, kwargs, variant = hf_zoo.build_working(hf_zoo.find("LongformerForSequenceClassification"))
    assert variant == 0 and set(model.config.attention_window) == {8} and hf_zoo.SEQ > 8
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(model, (2,), (), kwargs)
    for run in compiled.values():
        for gm in (run.program.forward, run.program.backward):
            assert torch.ops.aten.as_strided.default not in {n.target for n in gm.graph.nodes}
    assert next(iter(compiled.values())).program.value_guards is not None


def _sweep_module() -> Any:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "zoo_sweep.py"
    spec = importlib.util.spec_from_file_location("zoo_sweep_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _idle_child(conn: Connection) -> None:
    conn.send({"phase": "compile"})
    time.sleep(60)  # waits, spending no CPU: only the wall cap can stop it


def test_a_row_stopped_by_the_wall_cap_does_not_claim_the_cpu_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `--budget-clock cpu` a child past `WALL_CAP` budgets of wall time is killed before its
    CPU budget: its row said "over the 120 CPU s budget" (Zamba at 73 CPU s on a loaded machine);
    it must name the wall cap and the CPU seconds spent."""
    sweep = _sweep_module()
    monkeypatch.setattr(sweep, "WALL_CAP", 2.0)
    row = sweep.run_forked(_idle_child, (), budget_s=1.0, clock="cpu")
    assert row["result"] == "timeout"
    assert "over the wall cap (2 s)" in row["reason"] and "of 1 CPU s" in row["reason"], row["reason"]


def _child_in(phase: dict[str, Any]) -> Callable[[Connection], None]:
    def child(conn: Connection) -> None:
        conn.send(phase)
        time.sleep(60)  # stopped by the 1 s wall budget

    return child


@pytest.mark.parametrize(
    ("phase", "said"),
    [
        ({"phase": "compile"}, "in the compile: trace, plan search, every rank's lowering"),
        ({"phase": "lockstep", "compile_cpu_s": 41.6}, "in the lockstep check, after a compile of 42 CPU s"),
        ({"phase": "check"}, "compile + lockstep check"),  # a child that sends no finer phase (diffusers)
    ],
)
def test_a_stopped_row_says_where_it_was(phase: dict[str, Any], said: str) -> None:
    """A timeout's reason names the phase the child last reported, so a row over its budget says
    whether the compile or the check against serial took it (and the compile's CPU seconds)."""
    sweep = _sweep_module()
    row = sweep.run_forked(_child_in(phase), (), budget_s=1.0)
    assert row["result"] == "timeout"
    assert row["reason"] == f"TIMEOUT: over the 1 s budget ({said})", row["reason"]
