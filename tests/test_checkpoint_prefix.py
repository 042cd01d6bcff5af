"""`load_checkpoint` of a wrapped model (issue 31 item 5): a user module holding a transformers
model as `self.m` loads that model's `save_pretrained` directory into `m`, found by its names (a
task model's checkpoint or its base model's), or into `prefix=`; equal to the serial wrapper whose
submodule transformers' `from_pretrained` loaded, and training equal after. Which submodule when
several or none match: `find_scope` directly, on names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from multirank import run_ranks
from torch import nn

import autopar
from autopar.runtime.checkpoint_prefix import Scope, find_scope

CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=False,
)


class Wrap(nn.Module):
    """A user's module around a transformers model, with a head and a forward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        self.head = nn.Linear(CONFIG["vocab_size"], 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.m(input_ids=ids).logits).pow(2).mean()


def _ids() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(3))


def _error(pmodel: Any, params: dict[str, torch.Tensor], serial: nn.Module) -> float:
    return max(float((params[n].full_tensor() - q).abs().max()) for n, q in serial.named_parameters())


def _load_wrapped(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    ids = _ids()
    torch.manual_seed(0)
    model = Wrap()
    pmodel = autopar.parallelize(model, mesh, example_inputs=(ids,))
    torch.manual_seed(0)
    serial = Wrap()  # the wrapper's own head as the parallel one's; its model from the directory
    serial.m = transformers.LlamaForCausalLM.from_pretrained(f"{root}/task").train()
    params = dict(pmodel.named_parameters())
    out: dict[str, Any] = {"before": _error(pmodel, params, serial)}
    loaded = autopar.load_checkpoint(pmodel, f"{root}/task")
    out["task"] = (loaded.prefix, loaded.missing, loaded.unexpected, _error(pmodel, params, serial))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(2):
        for module, optimizer in ((pmodel, opt), (serial, serial_opt)):
            optimizer.zero_grad()
            loss = module(ids)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    out["losses"] = losses
    out["trained"] = _error(pmodel, params, serial)
    # the base model's directory (keys without "model."): into m as into the task model itself,
    # where strict names the head the checkpoint lacks; prefix="m.model" takes the base model alone
    try:
        autopar.load_checkpoint(pmodel, f"{root}/base")
    except autopar.CheckpointError as exc:
        out["base strict"] = str(exc)
    loaded = autopar.load_checkpoint(pmodel, f"{root}/base", strict=False)
    serial.m.model.load_state_dict(transformers.LlamaModel.from_pretrained(f"{root}/base").state_dict())
    out["base"] = (loaded.prefix, loaded.missing, loaded.unexpected, _error(pmodel, params, serial))
    out["base alone"] = autopar.load_checkpoint(pmodel, f"{root}/base", prefix="m.model").missing
    out["explicit"] = autopar.load_checkpoint(pmodel, f"{root}/task", prefix="m").prefix
    try:
        autopar.load_checkpoint(pmodel, f"{root}/task", prefix="n")
    except autopar.CheckpointError as exc:
        out["wrong prefix"] = str(exc)
    return out


@pytest.mark.multirank
def test_a_wrapped_transformers_model_loads_its_save_pretrained_directory_equal_to_serial(tmp_path: Path) -> None:
    torch.manual_seed(7)  # weights unlike the wrapper's own: loading must change them
    saved = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    saved.save_pretrained(tmp_path / "task")
    saved.model.save_pretrained(tmp_path / "base")
    for out in run_ranks(2, _load_wrapped, str(tmp_path), timeout=300):
        assert out["before"] > 0.01, out  # the check can fail
        assert out["task"] == ("m", [], [], 0.0), out["task"]
        first, first_serial, second, second_serial = out["losses"]
        assert abs(first - first_serial) < 1e-6 and abs(second - second_serial) < 1e-5, out["losses"]
        assert out["trained"] < 1e-5, out["trained"]
        assert "lacks 1 of the model's tensors (m.lm_head.weight)" in out["base strict"], out["base strict"]
        assert out["base"][:3] == ("m", ["m.lm_head.weight"], []) and out["base"][3] < 1e-5, out["base"]
        assert out["base alone"] == [], out["base alone"]
        assert out["explicit"] == "m"
        assert "no submodule 'n'" in out["wrong prefix"] and "e.g. m" in out["wrong prefix"], out["wrong prefix"]


# ---- which submodule: on names -----------------------------------------------------------------

LLAMA = ["model.embed_tokens.weight", "model.layers.0.w", "model.norm.weight", "lm_head.weight"]
PREFIXES = {"": "", "a": "model", "a.model": "model", "b": "model", "b.model": "model", "head": ""}


def _model(*subs: str) -> list[list[str]]:
    return [[f"{s}.{n}"] for s in subs for n in LLAMA] + [["head.weight"]]


def test_find_scope_picks_the_one_matching_submodule_the_outermost_of_nested_ones() -> None:
    """A task model inside the user's module takes its own checkpoint and its base model's, as it
    would outside it; an exact match wins over a partial one of the same size."""
    one = {k: v for k, v in PREFIXES.items() if not k.startswith("b")}
    tensors = _model("a")
    known = [n[0] for n in tensors]
    assert find_scope(tensors, known, set(LLAMA), one) == Scope("a", "model")
    # the base model's checkpoint: a and a.model match as much of it; a holds a.model
    base = {k.removeprefix("model.") for k in LLAMA if k.startswith("model.")}
    assert find_scope(tensors, known, base, one) == Scope("a", "model")
    # tied embeddings: lm_head is an alias, so a and a.model both match fully; a wraps a.model
    tied = [["a.model.embed_tokens.weight", "a.lm_head.weight"], ["a.model.layers.0.w"], ["a.model.norm.weight"]]
    flat = [n for names in tied for n in names]
    assert find_scope(tied, flat, {k for k in LLAMA if k != "lm_head.weight"}, one) == Scope("a", "model")
    # a base model beside a task model: the base model's checkpoint fits the base model exactly
    side = {"": "", "a": "model", "a.model": "model", "c": "model"}
    beside = [*tensors, *[[f"c.{k}"] for k in base]]
    flat = [n[0] for n in beside]
    assert find_scope(beside, flat, base, side) == Scope("c", "model")
    # the whole model's own checkpoint stays the whole model's
    assert find_scope(tensors, known, set(known), one) == Scope("", "")


def test_find_scope_names_the_candidates_when_several_match_or_none() -> None:
    tensors = _model("a", "b")
    known = [n[0] for n in tensors]
    with pytest.raises(autopar.CheckpointError, match=r"several submodules.*'a'.*'b'") as info:
        find_scope(tensors, known, set(LLAMA), PREFIXES, kind="safetensors")
    assert "prefix=" in (info.value.hint or "")
    assert find_scope(tensors, known, set(LLAMA), PREFIXES, prefix="b") == Scope("b", "model")
    with pytest.raises(autopar.CheckpointError, match="none of the model's tensors") as info:
        find_scope(tensors, known, {"encoder.x", "decoder.y"}, PREFIXES, kind="DCP")
    assert "a, a.model, b, b.model" in (info.value.hint or "") and "prefix=" in (info.value.hint or "")
