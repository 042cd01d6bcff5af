"""End to end on 8 ranks in lockstep: the model zoo and two transformers GPT-2s against serial, on
a 2x2x2 mesh and a 1-D mesh of 8. transformers' LlamaForCausalLM (grouped-query attention, rotary
tables) on the same two meshes is `test_hf_zoo_multirank.py`'s, called as its docs call it.

Every rank's program runs in one process (`pass_fixtures.assert_compiled_matches_serial`), compiled
once from the first batch as `parallelize` compiles it; then two AdamW steps, each checking the
loss, every output and every parameter gradient assembled from the ranks' blocks against the
serial model, the second step from the weights the first step's update left. The gloo runtime
around the programs (DTensor parameters, the optimizer on them, parameter names) is checked on
real ranks by `test_parallelize_multirank.py` and `test_hf_multirank.py`.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pass_fixtures import assert_compiled_matches_serial, compile_every_rank

from examples import zoo

STEPS = 2
# One layer has every op of two (compiling dominates the test's time).
LAYERS = 1
MESHES = [(2, 2, 2), (8,)]
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
ZOO = ("llama", "bert", "vit", "mixer")
HF = ("hf_gpt2", "hf_gpt2_vocab")  # the last: vocabulary 50257, uneven blocks


def _makers() -> dict[str, Callable[..., tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]]:
    makers: dict[str, Any] = dict(zoo.MAKERS)
    if HAVE_TRANSFORMERS:
        from examples import hf_models

        makers.update(hf_models.MAKERS)
    return makers


@pytest.mark.parametrize("name", ZOO + HF)
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_zoo_matches_serial(shape: tuple[int, ...], name: str) -> None:
    if name in HF and not HAVE_TRANSFORMERS:
        pytest.skip("transformers is not installed (pip install -e '.[test]')")
    make = functools.partial(_makers()[name], n_layer=LAYERS)
    model, batch = make(0)
    compiled = compile_every_rank(model, shape, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        if step:
            batch = make(100 + step)[1]
        # the serial call inside leaves its gradients on the model: the serial update of this step
        assert_compiled_matches_serial(compiled, model, shape, batch)
        opt.step()
        opt.zero_grad()
