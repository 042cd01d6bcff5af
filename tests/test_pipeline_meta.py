"""A model built on the meta device, pipelined (docs/pipeline.md#a-model-built-on-meta), on 2
ranks run in this process (`autopar.testing.pipeline_lockstep`) and, with tensor axes or
compile=True (stages compiled on process groups), on real gloo ranks: each rank makes only its own stages' tensors, the serial model's values from the same
seed, and trains equal to serial; `autopar.load_checkpoint` fills them from a transformers
`save_pretrained` directory or a DCP checkpoint, each rank reading only its stages' tensors, and a
pipelined checkpoint round-trips through a tensor-only module built on meta."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from multirank import pipelined, run_in_lockstep, run_ranks, train_side_by_side
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.compiler.pipeline import PipelinedModule
from autopar.testing.pipeline_lockstep import LockstepTransport
from examples.models import GPT, GPTConfig, gpt_batch

TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-6}
GPT_CONFIG = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _stored_bytes(module: torch.nn.Module) -> int:
    """The bytes of parameters this rank stores (its blocks)."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for _, p in module.named_parameters()
    )


def _counting_inductor(compiled: list[object]) -> None:
    """Count the programs handed to Inductor into `compiled` (in this process, from now on)."""
    import autopar.runtime.module as module

    by_inductor = module.compiled_by_inductor

    def counting(program: Any) -> Any:
        compiled.append(program)
        return by_inductor(program)

    module.compiled_by_inductor = counting


def _gpt_on_meta(
    rank: int,
    world: int,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    compile: bool = False,
    transport: LockstepTransport | None = None,
    compiled: list[object] | None = None,
) -> dict[str, Any]:
    """`compiled`: the programs Inductor compiles, counted by the caller (every rank in one
    process); else by this rank's process, counted here."""
    if compiled is None:
        compiled = []  # the programs handed to Inductor
        _counting_inductor(compiled)  # this rank's process only
    config = GPTConfig(**GPT_CONFIG)
    batch = gpt_batch(config, 8, torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(0)
    options = autopar.PipelineOptions(microbatches=2, stage_boundaries=["blocks.1"])
    if transport is None:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        pmodel = autopar.parallelize(model, mesh, example_inputs=batch, compile=compile, pipeline=options)
    else:
        pmodel = pipelined(model, world, transport, example_inputs=batch, pipeline=options)
    after = torch.rand(3)
    torch.manual_seed(0)
    serial = GPT(config)
    assert isinstance(pmodel, PipelinedModule)
    ref = dict(serial.named_parameters(remove_duplicate=False))
    mine = [n for n, _ in pmodel.named_parameters()]
    out: dict[str, Any] = {
        "stages": pmodel.stages,
        "names": mine,
        "rng": torch.equal(torch.rand(3), after),  # parallelize leaves the generator where building did
        "init": max(float((_whole(p) - ref[n]).abs().max()) for n, p in pmodel.named_parameters()),
        "real": sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta),
        "stored": _stored_bytes(pmodel),
        "share": sum(ref[n].numel() * ref[n].element_size() for n in mine),  # its stages' tensors, whole
        "materialized": pmodel.materialized_bytes,
    }
    out["losses"] = train_side_by_side([(pmodel, batch), (serial, batch)], steps=2)
    out["params"] = max(float((_whole(p) - ref[n]).abs().max()) for n, p in pmodel.named_parameters())
    out["inductor"] = len(compiled)
    if compile:  # zero-bubble splits the backward Inductor compiles whole: refused before any work
        try:
            autopar.parallelize(
                model, mesh, example_inputs=batch, compile=True,
                pipeline=autopar.PipelineOptions(microbatches=2, schedule="zero-bubble"),
            )  # fmt: skip
            out["zero_bubble"] = "no error"
        except autopar.AutoparError as exc:
            out["zero_bubble"] = str(exc)
    return out


def _check_gpt(results: list[dict[str, Any]], tensor_size: int, compiled: bool = False) -> None:
    for result in results:
        assert result["rng"] and result["init"] == 0.0, result
        assert (result["inductor"] > 0) == compiled, result["inductor"]  # the stages ran through Inductor
        for step in range(2):
            torch.testing.assert_close(result["losses"][2 * step], result["losses"][2 * step + 1], **TOL)
        assert result["params"] < 1e-5, result["params"]
        # no rank holds another stage's weights: stage 0 has block 0 only, stage 1 block 1 and ln_f,
        # both the tied embedding / head (one tensor, two names)
        other = "blocks.1." if result["stages"] == (0,) else "blocks.0."
        assert not any(n.startswith(other) for n in result["names"]), result["names"]
        assert "wte.weight" in result["names"]
        if compiled:  # each stage compiled on one rank: its parallel module made its tensors
            assert result["real"] == [] and result["stored"] == result["share"], result
        elif tensor_size == 1:  # the user's tensors of its stages, whole, and nothing else
            assert set(result["real"]) == set(result["names"]), (result["real"], result["names"])
            assert result["stored"] == result["share"] == result["materialized"], result
        else:  # each stage's parallel module made its own blocks; the user's model stays on meta
            assert result["real"] == [] and result["materialized"] == 0, result
            assert result["stored"] < 0.6 * result["share"], result  # 1/2 of the stage, and what it replicates


def test_a_gpt_built_on_meta_makes_only_its_stages_on_pp2(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp=2, the user's own tensors: rank 0 makes block 0 and the embeddings, rank 1 block 1, ln_f
    and the tied head, each equal to serial's init from the same seed; two SGD-momentum steps
    equal serial's."""
    import autopar.runtime.module as module

    monkeypatch.setattr(module, "compiled_by_inductor", module.compiled_by_inductor)  # undone after the test
    compiled: list[object] = []  # by any rank: none should be
    _counting_inductor(compiled)
    _check_gpt(run_in_lockstep(2, functools.partial(_gpt_on_meta, compiled=compiled), (2,), ("pp",)), 1)
    assert compiled == []


@pytest.mark.multirank
def test_a_gpt_built_on_meta_makes_only_its_blocks_on_pp2_by_tp2() -> None:
    """pp=2 x tp=2: each stage's parallel module makes its blocks of its own tensors (the whole
    model's initialization runs, one module at a time, so the draws are serial's)."""
    _check_gpt(run_ranks(4, _gpt_on_meta, (2, 2), ("pp", "tp"), timeout=300), 2)


@pytest.mark.multirank
def test_compile_true_on_pp2_runs_each_stage_through_inductor_equal_to_serial() -> None:
    """compile=True on a 1-D pp mesh compiles every stage on its rank (as zero-bubble does), its
    programs run by Inductor; built on meta, trained two steps: equal to serial."""
    results = run_ranks(2, _gpt_on_meta, (2,), ("pp",), True, timeout=400)
    _check_gpt(results, 1, compiled=True)
    for result in results:
        assert "zero-bubble pipeline splits each stage's backward" in result["zero_bubble"], result["zero_bubble"]


LLAMA = dict(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
    vocab_size=64,
)  # fmt: skip


def _llama() -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _ids() -> torch.Tensor:
    return torch.randint(0, LLAMA["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(3))


def _pipelined_llama(shape: tuple[int, ...], names: tuple[str, ...]) -> PipelinedModule:
    ids = _ids()
    with torch.device("meta"):
        model = _llama()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pmodel = autopar.parallelize(
        model, mesh, example_inputs=(), example_kwargs={"input_ids": ids, "labels": ids},
        pipeline=autopar.PipelineOptions(microbatches=2),
    )  # fmt: skip
    assert isinstance(pmodel, PipelinedModule)
    return pmodel


def _zero(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()


def _error(module: torch.nn.Module, serial: torch.nn.Module) -> float:
    ref = dict(serial.named_parameters())
    return max(float((_whole(p) - ref[n]).abs().max()) for n, p in module.named_parameters())


def _train(module: torch.nn.Module, serial: torch.nn.Module) -> list[float]:
    ids = _ids()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (module, serial)]
    losses = []
    for _ in range(2):
        for m, opt in zip((module, serial), optimizers, strict=True):
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss.detach()))
    return losses


def _llama_from_checkpoints(rank: int, world: int, root: str, shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    serial = transformers.LlamaForCausalLM.from_pretrained(f"{root}/pretrained")
    serial.train()  # from_pretrained returns a model in eval mode
    pmodel = _pipelined_llama(shape, names)
    out: dict[str, Any] = {"stages": pmodel.stages, "names": [n for n, _ in pmodel.named_parameters()]}
    for kind in ("pretrained", "sharded"):
        _zero(pmodel)  # each load must fill every tensor
        loaded = autopar.load_checkpoint(pmodel, f"{root}/{kind}")
        out[kind] = (loaded.format, sorted(loaded.loaded), loaded.missing, loaded.unexpected, _error(pmodel, serial))
    # the model's own tensors this rank made stay those of its stages (the loads made none)
    out["real"] = sorted(n for n, t in pmodel._model.named_parameters() if not t.is_meta)
    out["losses"] = _train(pmodel, serial)
    out["params"] = _error(pmodel, serial)

    # pipelined -> tensor-only (both built on meta) -> pipelined, through autopar's DCP checkpoints
    autopar.save_checkpoint(pmodel, f"{root}/pipelined")
    with torch.device("meta"):
        other = _llama()
    ids = _ids()
    tensor_only = autopar.parallelize(
        other, init_device_mesh("cpu", (world,), mesh_dim_names=("x",)), example_inputs=(),
        example_kwargs={"input_ids": ids, "labels": ids},
    )  # fmt: skip
    loaded = autopar.load_checkpoint(tensor_only, f"{root}/pipelined")
    out["to_tensor_only"] = (loaded.format, loaded.missing, loaded.unexpected, _error(tensor_only, serial))
    autopar.save_checkpoint(tensor_only, f"{root}/tensor_only")
    again = _pipelined_llama(shape, names)
    loaded = autopar.load_checkpoint(again, f"{root}/tensor_only")
    out["to_pipelined"] = (loaded.format, loaded.missing, loaded.unexpected, _error(again, serial))
    out["next"] = _train(again, serial)[:2]
    return out


@pytest.mark.multirank
@pytest.mark.parametrize(("shape", "names"), [((2,), ("pp",)), ((2, 2), ("pp", "tp"))], ids=["pp2", "pp2xtp2"])
def test_a_llama_built_on_meta_loads_its_stages_from_save_pretrained_and_round_trips(
    tmp_path: Path, shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    """LlamaForCausalLM at its defaults, built on meta on pp=2 (and pp=2 x tp=2, each rank reading
    its blocks): `load_checkpoint` of a `save_pretrained` directory (one file, and sharded) fills
    exactly its stages' tensors on each rank, and training equals the serial model loaded from the
    same files; its DCP checkpoint loads into a tensor-only module built on meta, whose checkpoint
    loads back into a pipelined one."""
    torch.manual_seed(0)
    serial = _llama()
    serial.save_pretrained(tmp_path / "pretrained")
    serial.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    results = run_ranks(math.prod(shape), _llama_from_checkpoints, str(tmp_path), shape, names, timeout=600)
    for result in results:
        for kind in ("pretrained", "sharded"):
            fmt, loaded, missing, unexpected, error = result[kind]
            assert (fmt, missing, unexpected, error) == ("safetensors", [], [], 0.0), (kind, result[kind])
            assert loaded == sorted(result["names"]), (kind, loaded)  # its stages' tensors, no others
        # 1-D: the user's tensors of its stages, whole; with tensor axes the stages' own blocks
        assert result["real"] == (sorted(result["names"]) if len(shape) == 1 else []), result["real"]
        other = "model.layers.1." if result["stages"] == (0,) else "model.layers.0."
        assert not any(n.startswith(other) for n in result["names"]), result["names"]
        for step in range(2):
            torch.testing.assert_close(result["losses"][2 * step], result["losses"][2 * step + 1], **TOL)
        assert result["params"] < 1e-5, result["params"]
        for trip in ("to_tensor_only", "to_pipelined"):
            fmt, missing, unexpected, error = result[trip]
            assert (fmt, missing, unexpected) == ("DCP", [], []) and error < 1e-5, (trip, result[trip])
        torch.testing.assert_close(result["next"][0], result["next"][1], **TOL)


class _Shifted(torch.nn.Module):
    """Adds its root buffer `shift` (the root's: held by stage 0's rank) in the last stage, only
    when the call passes no shift of its own; multiplies by its root parameter `gain` only when the
    call passes no gain."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.register_buffer("shift", torch.empty(8))
        self.gain = torch.nn.Parameter(torch.empty(8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.shift.uniform_(-1, 1)
            self.gain.fill_(1.0)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor | None = None, gain: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x))) * (self.gain if gain is None else gain)
        return F.mse_loss(h + (self.shift if shift is None else shift), y)


def _later_call_reads_another_tensor(
    rank: int, world: int, path: str, transport: LockstepTransport | None = None
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    x, y, shift, gain = (torch.randn(4, 8, generator=g) for _ in range(4))
    with torch.device("meta"):
        model = _Shifted()
    torch.manual_seed(5)  # other weights than the checkpoint's: the load must fill them
    pmodel = pipelined(
        model, world, transport, example_inputs=(x, y, shift), example_kwargs={"gain": gain},
        pipeline=autopar.PipelineOptions(microbatches=2, stage_boundaries=["b"]),
    )  # fmt: skip
    autopar.load_checkpoint(pmodel, path)
    made_first = sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta)
    serial = _Shifted()
    serial.load_state_dict(safetensors.torch.load_file(path))
    after = torch.get_rng_state()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (pmodel, serial)]
    losses = []
    for batch in [(x, y, shift), (x, y), (x, y)]:  # the second call reads the buffer: stage 1 gets it
        for m, opt in zip((pmodel, serial), optimizers, strict=True):
            loss = m(*batch, gain=gain)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    ref = dict(serial.named_parameters())
    try:  # without a gain, stage 1 would train `gain`, whose gradient no stage sums: refused
        pmodel(x, y)
        refused = "no error"
    except autopar.AutoparError as exc:
        refused = str(exc)
    return {
        "refused": refused,
        "made_first": made_first,
        "real": sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta),
        "losses": losses,
        "params": max(float((p.detach() - ref[n]).abs().max()) for n, p in pmodel.named_parameters()),
        "rng": torch.equal(torch.get_rng_state(), after),
    }


def test_a_later_call_reading_a_tensor_another_rank_holds_gets_its_value(tmp_path: Path) -> None:
    """Built on meta on pp=2 and loaded from a checkpoint: the first call passes `shift`, the later
    ones leave it out, so the last stage (rank 1) reads the root's buffer, which rank 0 holds. It is
    sent from rank 0 (the loaded value, not a new init): losses and parameters equal serial's. A
    call leaving out `gain` would have stage 1 train the root's parameter `gain`, which the first
    call did not: refused on every rank."""
    torch.manual_seed(0)
    serial = _Shifted()
    with torch.no_grad():
        serial.shift.fill_(0.75)  # no init draws this: only the checkpoint has it
    path = str(tmp_path / "shifted.safetensors")
    safetensors.torch.save_file(serial.state_dict(), path)
    results = run_in_lockstep(2, _later_call_reads_another_tensor, path)
    assert results[0]["made_first"] == ["a.bias", "a.weight", "gain", "shift"], results[0]["made_first"]
    assert results[1]["made_first"] == ["b.bias", "b.weight"], results[1]["made_first"]
    assert results[1]["real"] == ["b.bias", "b.weight", "shift"], results[1]["real"]
    for result in results:
        for step in range(3):
            torch.testing.assert_close(result["losses"][2 * step], result["losses"][2 * step + 1], **TOL)
        assert result["params"] < 1e-6 and result["rng"], result
        assert "stage 1 trains gain in this call but not in the first" in result["refused"], result["refused"]
