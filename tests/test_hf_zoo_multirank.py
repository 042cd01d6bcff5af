"""transformers models of three families on 8 ranks in lockstep, each built by the zoo's toy-config
code (`examples/hf_zoo.py`: library defaults with only the sizes shrunk) and called as its docs call
it, `model(**batch)` with labels: LLaMA (rotary, GQA) on a 2x2x2 mesh and on a 1-D mesh of 8,
Mixtral (top-k experts through transformers' grouped matmul) and ViT (image classification). Two
steps of SGD with momentum: each step's loss, outputs and every gradient of every rank's program
against the serial model, the second from the weights the first step's update left.

Every rank's program runs in one process (`pass_fixtures.assert_compiled_matches_serial`): the numbers
are the programs', and the gloo runtime around them (DTensor parameters, the optimizer on them,
`model(**kwargs)` returning a ModelOutput) is checked on real ranks by `test_hf_multirank.py`.
BERT (masked LM) and T5 (encoder-decoder, dropout in training mode) are checked in lockstep on
2x2x2 by `test_zoo_sweep.py`, from the same builder."""

from __future__ import annotations

import pytest
import torch
from pass_fixtures import assert_compiled_matches_serial, compile_every_rank

from examples import hf_zoo

pytest.importorskip("transformers")

STEPS = 2
CASES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("LlamaForCausalLM", (2, 2, 2)),
    ("MixtralForCausalLM", (2, 2, 2)),
    ("ViTForImageClassification", (2, 2, 2)),
    ("LlamaForCausalLM", (8,)),
)


@pytest.mark.parametrize(("name", "shape"), CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_zoo_family_trains_like_serial_on_8_ranks(name: str, shape: tuple[int, ...]) -> None:
    arch = hf_zoo.find(name)
    model, example, _ = hf_zoo.build_working(arch, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = compile_every_rank(model, shape, (), example)  # as parallelize: from the example call
    for step in range(STEPS):
        # the serial call inside leaves its gradients on the model: the serial update of this step
        assert_compiled_matches_serial(
            compiled, model, shape, (), hf_zoo.batch(arch, model.config, seed=step)
        )
        opt.step()
        opt.zero_grad()
