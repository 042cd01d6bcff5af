"""The gradient buckets in the working memory (`planning.working.with_buckets`, counted on the
emitted program by `compiler.emitted_memory`), and a broadcast view's saved bytes
(`core.meta.held_bytes`, `planning.memory.broadcast_source`), issue 36, by hand. Held against the
live heap of gloo ranks by `benchmarks/long_context.py` (docs/long-context.md) and by
tests/test_context_parallel_multirank.py (4 ranks, keys gathered in the balanced order)."""

from __future__ import annotations

import math

import torch

from autopar.compiler.driver import trace_for
from autopar.core.mesh import Mesh
from autopar.core.meta import held_bytes
from autopar.planning.memory import broadcast_source, plan_memory
from autopar.planning.search import search_layouts
from autopar.planning.working import GradientBucket, with_buckets
from autopar.rules.context_parallel import BACKWARD, require_context_parallel
from autopar.rules.registry import default_registry
from examples.zoo import make_llama


def test_a_bucket_holds_its_members_until_the_last_then_its_buffer_and_the_copy() -> None:
    """Members made at "a" (4 bytes) and "c" (6): "a"'s is held through "b" and "c"; after "c"
    the bucket is issued: its concatenation makes the buffer (10) beside the members, which are
    freed after it, and gloo's copy of the buffer (10) is made beside the buffer: one buffer's
    bytes beside the members at most (counting members, buffer and copy together, the model was
    1.14 of a ring plan's live rise on 4 gloo ranks). A bucket with a member no step lists is left
    out."""
    steps = [("a", 10.0), ("b", 20.0), ("c", 30.0), ("d", 5.0)]
    bucket = GradientBucket(("a", "c"), (4.0, 6.0), True, 1)
    stray = GradientBucket(("x",), (100.0,), False, 1)
    assert with_buckets(steps, [bucket, stray]) == [("a", 10.0), ("b", 24.0), ("c", 44.0), ("d", 5.0)]
    nccl = GradientBucket(("a", "c"), (4.0, 6.0), True, 0)  # no copy: the buffer beside the members
    assert with_buckets(steps, [nccl]) == [("a", 10.0), ("b", 24.0), ("c", 44.0), ("d", 5.0)]
    alone = GradientBucket(("b",), (8.0,), False, 0)  # one sum, not concatenated, on NCCL: nothing more
    assert with_buckets(steps, [alone]) == steps


def test_a_bucket_waited_on_later_holds_its_buffer_and_copy_until_then() -> None:
    """The schedule waits on a sum late, to overlap it: gloo holds the collective's input (the
    concatenated buffer, or a lone member) and its copy until the wait. Measured on 4 gloo ranks:
    a bucket issued before an attention backward and waited on after it held 1.6 MiB over it.
    Waited on after "d": the bucket of the test above holds its buffer and copy (20) through "d";
    a lone member (8) made at "a" and waited on after "c" holds itself and gloo's copy (16) through
    "b" and "c"."""
    steps = [("a", 10.0), ("b", 20.0), ("c", 30.0), ("d", 5.0)]
    late = GradientBucket(("a", "c"), (4.0, 6.0), True, 1, released="d")
    assert with_buckets(steps, [late]) == [("a", 10.0), ("b", 24.0), ("c", 44.0), ("d", 25.0)]
    lone = GradientBucket(("a",), (8.0,), False, 1, released="c")
    assert with_buckets(steps, [lone]) == [("a", 18.0), ("b", 36.0), ("c", 46.0), ("d", 5.0)]


def test_a_broadcast_view_holds_the_block_it_expands() -> None:
    """Grouped-query attention's repeated keys: (1, 1, 64, 16) expanded to 4 heads and reshaped
    holds the one head's 4 KiB, not 16; a plain tensor, a transpose and a slice their elements."""
    k = torch.randn(1, 1, 64, 16)
    repeated = k[:, :, None].expand(1, 1, 4, 64, 16).reshape(1, 4, 64, 16)
    assert repeated.numel() * 4 == 16384 and held_bytes(repeated) == 4096
    assert held_bytes(k) == held_bytes(k.transpose(2, 3)) == 4096 and held_bytes(k[:, :, :32]) == 2048
    assert held_bytes(None) == 0


def test_gathered_keys_repeated_for_each_head_are_saved_once() -> None:
    """The zoo's LLaMA (4 query heads, 1 key/value head, sequence 64) with keys and values
    all-gathered on a "cp" axis of 2: backward keeps the gathered keys and values repeated for the
    4 query heads as views of the gathered (1, 1, 64, 16) block, so each is saved at that block's
    4 KiB, not the 16 KiB of the repeated shape."""
    model, batch = make_llama(0, batch_size=1, vocab_size=64, seq_len=64, dim=64, n_layer=1, n_head=4, n_kv_head=1,
                              hidden=128)  # fmt: skip
    mesh = Mesh.from_shape((2,), ("cp",))
    gm = trace_for(model, mesh, batch)
    registry = require_context_parallel(default_registry(), 0, "balanced")
    plan = search_layouts(gm, mesh, registry, memory_limit=math.inf)
    saved = {s.name: s for s in plan_memory(gm, plan, (2,)).saved}
    nodes = {n.name: n for n in gm.graph.nodes}
    repeated = [name for name in saved if broadcast_source(nodes[name], plan) is not None]
    attention = next(n for n in gm.graph.nodes if n.target is BACKWARD)
    assert {a.name for a in attention.all_input_nodes[2:4]} <= set(repeated), repeated  # its k and v
    for name in repeated:
        assert nodes[name].meta["val"].numel() * 4 == 16384 and saved[name].bytes == 4096, (name, saved[name])
