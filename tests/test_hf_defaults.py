"""transformers models called the way their docs call them: `model(input_ids=ids, labels=ids)` with
every argument and config value at its default (`use_cache` on, the default attention), the output
a `ModelOutput`. Every rank's program runs in lockstep against the serial call."""

from __future__ import annotations

import os

import pytest
import torch
from pass_fixtures import assert_call_matches_serial

from autopar.core.meta import info
from autopar.passes.trace import trace
from examples.hf_models import SEQ, VOCAB, tiny_causal_lm, tiny_gpt2

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH = 8


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_causal_lm], ids=["gpt2", "llama"])
def test_causal_lm_called_with_defaults_matches_serial(make: object) -> None:
    torch.manual_seed(0)
    model = make()  # type: ignore[operator]
    assert model.config.use_cache  # the library default, left as users leave it
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    compiled = assert_call_matches_serial(model, (2, 2, 2), (), {"input_ids": ids, "labels": ids})
    program = next(iter(compiled.values())).program
    assert program.constants, "the cache's empty tensors are program constants"
    outputs = next(iter(compiled.values())).graph.meta["autopar_signature"].outputs
    assert outputs.dropped == ("DynamicCache",)
    rebuilt = outputs.rebuild([torch.tensor(1.0), torch.zeros(2)])
    assert type(rebuilt).__name__ == "CausalLMOutputWithPast" or hasattr(rebuilt, "logits")
    assert rebuilt.loss == 1.0 and rebuilt.past_key_values is None


def test_an_op_inside_a_library_model_names_the_library_line_and_the_users() -> None:
    """`at:` of an error (NodeInfo.where) names the deepest module, the line of the library's
    modeling code that called the op, and the line of the user's code that led there."""
    torch.manual_seed(0)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    gm = trace(tiny_gpt2(), (), example_kwargs={"input_ids": ids, "labels": ids})
    softmax = next(n for n in gm.graph.nodes if n.target is torch.ops.aten._safe_softmax.default)
    where = info(softmax).where()
    assert where.startswith("transformer.h.0.attn @ "), where
    library, _, user = where.partition(" (from ")
    assert "/transformers/" in library and ".py:" in library, where
    # the call comes from autopar's tracer here: no user frame between it and the library
    assert user == "" or "test_hf_defaults.py" in user, where


class _Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_gpt2()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss  # the user's line


def test_the_users_own_line_follows_the_library_line() -> None:
    torch.manual_seed(0)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    gm = trace(_Wrapper(), (ids,))
    softmax = next(n for n in gm.graph.nodes if n.target is torch.ops.aten._safe_softmax.default)
    where = info(softmax).where()
    assert where.startswith("lm.transformer.h.0.attn @ "), where
    assert "/transformers/" in where.partition(" (from ")[0], where
    assert where.endswith("test_hf_defaults.py:" + str(_USER_LINE) + " in forward)"), where


_USER_LINE = _Wrapper.forward.__code__.co_firstlineno + 1
