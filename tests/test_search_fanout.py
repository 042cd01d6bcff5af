"""A value read by several ops is redistributed once per wanted layout, and the search prices it so.

The GPT of benchmarks/plan_quality.py (h = 4096, 32 heads, s = 2048, b = 8, built on the meta
device) on the 1x8x8 planning mesh: the search splits heads over y (q, k and v cut from the fused
qkv, each column-parallel) and tokens over z. In backward the input gradients of q, k and v are
pending sums over y, added up, then read three times by the layer norm's backward. insert_comm
reduce-scatters a value once per wanted layout, so the cheapest plan adds the three pending sums
and reduce-scatters their total once. The search's pairwise objective priced one reduce-scatter per
reader (three), so it reduce-scattered the summands instead (two or three per layer); its moves that
share a value's redistribution among its readers (`Problem._count_readers`) find the single one.
"""

from __future__ import annotations

import torch

from autopar.compiler.driver import compile_for_rank
from autopar.core.mesh import Mesh
from examples.models import GPT, GPTConfig

H, HEADS, SEQ, BATCH, VOCAB = 4096, 32, 2048, 8, 512
MESH = (1, 8, 8)
ACTIVATION = BATCH * SEQ * H // (8 * 8)  # a rank's block of the residual stream: tokens / z, hidden / y


def _step_collectives(layers: int) -> list:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=HEADS, n_embd=H)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long)
    compiled = compile_for_rank(model, Mesh.from_shape(MESH), (idx, idx), coords=(0, 0, 0))
    return list(compiled.report.collectives)


def _activation_sums(collectives: list) -> int:
    """Backward collectives that reduce a pending sum of a residual-stream-sized activation."""
    return sum(
        1
        for c in collectives
        if c.phase == "backward"
        and c.kind in ("reduce_scatter", "all_reduce")
        and "+" in c.layout_before
        and c.elements >= 0.5 * ACTIVATION
        and "4096" in c.layout_before
        and "16384/" not in c.layout_before  # not a weight gradient ([4096, 16384/y])
        and not c.layout_before.startswith("f32[4096")
    )


def test_qkv_input_gradient_is_reduced_once_per_layer() -> None:
    three, two = _step_collectives(3), _step_collectives(2)
    # what one more layer adds: the reductions of the two layer norms' input gradients (after
    # attention and after the MLP), one each; before, the q, k, v summands were reduced apart
    assert _activation_sums(three) - _activation_sums(two) == 2
    marginal = sum(c.elements for c in three) - sum(c.elements for c in two)
    # 115.7 M elements per rank per layer (121.2 M before: one more activation reduce-scatter
    # of 7.34 M); Megatron-style tensor parallelism over y with ZeRO-3 weights over z moves at
    # least 102.7 M (comm_volumes.md: 8 activation collectives and 2 weight ones)
    assert 102e6 < marginal < 117e6
