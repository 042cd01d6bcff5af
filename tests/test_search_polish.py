"""A value whose readers want different layouts is priced once per wanted layout (`search_polish`).

The GPT of benchmarks/plan_quality.py (h = 4096, 32 heads, s = 2048, b = 8, built on the meta
device) on the 1x2x4 planning mesh: heads over y, tokens over z, weights stored split over z too
and gathered per use. attn.proj's forward gathers its input (split by heads) over y and computes
its output split over y. In backward three ops read the output gradient: the weight gradient and
the bias gradient where it lies, the input gradient (gradient @ weight). The search's second round
priced gathering it over y for the input gradient at a third (three readers), so its plan gathered
it (8.39 M elements) and exchanged the gathered weight (4.19 M) to get the input gradient split by
heads; a pending input gradient reduce-scattered into heads moves 8.39 M and nothing else.
"""

from __future__ import annotations

import torch

from autopar.compiler.driver import compile_for_rank
from autopar.core.mesh import Mesh
from examples.models import GPT, GPTConfig

H, HEADS, SEQ, BATCH, VOCAB = 4096, 32, 2048, 8, 512
MESH = (1, 2, 4)  # x, y (heads), z (tokens; weights stored split over it)
T = BATCH * SEQ


def test_attention_projection_moves_the_floor_of_its_layout() -> None:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=HEADS, n_embd=H)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    compiled = compile_for_rank(model, Mesh.from_shape(MESH), (idx, idx), coords=(0, 0, 0))
    proj = [c for c in compiled.report.collectives if c.module_path == "blocks.1.attn.proj"]
    y, z = MESH[1], MESH[2]
    weight = (z - 1) / z * H * H / y  # the weight's block over y gathered over z (and its gradient reduced)
    activation = (y - 1) / y * T / z * H  # the input gathered over y (and its gradient reduced)
    bias = (z - 1) / z * H / y
    kinds = sorted((c.phase, c.kind, c.axis) for c in proj)
    assert kinds == sorted(
        [
            ("forward", "all_gather", "z"),  # weight
            ("forward", "all_gather", "z"),  # bias
            ("forward", "all_gather", "y"),  # input, split by heads
            ("backward", "reduce_scatter", "y"),  # input gradient, into heads
            ("backward", "reduce_scatter", "z"),  # weight gradient
            ("backward", "reduce_scatter", "z"),  # bias gradient
        ]
    ), kinds
    # 29.4 M per rank per layer (33.6 M before: the output gradient gathered, the weight exchanged)
    assert sum(c.elements for c in proj) == 2 * (weight + activation + bias)
