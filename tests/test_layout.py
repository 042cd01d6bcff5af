"""Layout: printed forms, local shapes, nested shard offsets and sizes."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys

import pytest
import torch

from autopar.core.layout import Layout, P, Partial, R, Replicate, Shard
from autopar.testing import all_coords, local_block


def test_placements_print_short() -> None:
    assert (str(Shard(0)), str(Shard(2)), str(Replicate()), str(Partial())) == ("S(0)", "S(2)", "R", "P")
    assert Replicate() == R and Partial() == P


def test_per_axis_str_lists_one_placement_per_mesh_axis() -> None:
    layout = Layout((Shard(0), Shard(1), P), (8, 32))
    assert layout.per_axis_str() == "[S(0), S(1), P]"
    assert str(layout) == "[S(0), S(1), P]"
    assert Layout.replicated((4,), 2).per_axis_str() == "[R, R]"


@pytest.mark.parametrize(
    ("placements", "shape", "dtype", "names", "expected"),
    [
        ((Shard(0), Shard(1), P), (8, 32), torch.float32, ("x", "y", "z"), "f32[8/x, 32/y] +z"),
        (
            (Shard(0), Shard(1), Shard(1), P),
            (8, 32),
            torch.float32,
            ("x", "y", "z", "w"),
            "f32[8/x, 32/yz] +w",
        ),
        ((Shard(1), Shard(1), Shard(0)), (8, 32), torch.float32, ("x", "y", "z"), "f32[8/z, 32/xy]"),
        ((R, P, P), (), torch.float32, ("x", "y", "z"), "f32[] +yz"),
        ((R, R), (3, 5), torch.bfloat16, ("x", "y"), "bf16[3, 5]"),
        ((Shard(0),), (16,), torch.int64, ("dp",), "i64[16/dp]"),
        ((R,), (2,), torch.complex64, ("x",), "complex64[2]"),
    ],
)
def test_per_dim_str(
    placements: tuple, shape: tuple, dtype: torch.dtype, names: tuple, expected: str
) -> None:
    assert Layout(placements, shape, dtype).per_dim_str(names) == expected


def test_shard_dim_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="out of range"):
        Layout((Shard(2),), (4, 4))
    with pytest.raises(ValueError, match="out of range"):
        Layout((Shard(0),), ())


def test_nested_shards_local_shape_and_offsets() -> None:
    mesh = (2, 3, 2)
    # dim 0 split by axes 0 (outer) and 2 (inner): 4 blocks of 3 rows.
    layout = Layout((Shard(0), R, Shard(0)), (12, 6))
    assert layout.shard_axes(0) == (0, 2) and layout.shard_axes(1) == ()
    assert layout.split_factor(0, mesh) == 4
    assert layout.local_shape(mesh) == (3, 6)
    assert layout.local_numel(mesh) == 18 and layout.local_bytes(mesh) == 72
    assert layout.block_index(0, mesh, (1, 2, 0)) == 2
    assert layout.local_offsets(mesh, (1, 2, 0)) == (6, 0)
    assert layout.local_offsets(mesh, (0, 1, 1)) == (3, 0)
    assert layout.local_offsets(mesh, (1, 0, 1)) == (9, 0)

    both = Layout((Shard(1), Shard(0), Shard(1)), (6, 8), torch.float16)
    assert both.local_shape(mesh) == (2, 2)
    assert both.local_offsets(mesh, (1, 2, 1)) == (4, 6)
    assert both.local_offsets(mesh, (0, 1, 1)) == (2, 2)
    assert both.local_bytes(mesh) == 8


@pytest.mark.parametrize(
    "layout",
    [
        Layout((Shard(0), R, Shard(0)), (12, 6)),
        Layout((Shard(1), Shard(0), Shard(1)), (6, 8)),
        Layout((P, Shard(1), R), (4, 6)),
        Layout((Shard(2), Shard(0), Shard(2)), (3, 2, 8)),
    ],
)
def test_blocks_tile_the_tensor_once_per_replica(layout: Layout) -> None:
    mesh = (2, 3, 2)
    full = torch.arange(torch.Size(layout.shape).numel()).reshape(layout.shape)
    counts = torch.zeros(layout.shape, dtype=torch.int64)
    for coords in all_coords(mesh):
        block = local_block(full, layout, mesh, coords)
        assert tuple(block.shape) == layout.local_shape(mesh)
        # the block really starts at local_offsets
        assert block.reshape(-1)[0].item() == full[layout.local_offsets(mesh, coords)].item()
        local_block(counts, layout, mesh, coords).add_(1)
    unsplit = 1
    for a, size in enumerate(mesh):
        if not isinstance(layout.placements[a], Shard):
            unsplit *= size
    assert bool((counts == unsplit).all())


def test_evenness() -> None:
    mesh = (2, 3)
    assert Layout((Shard(0), Shard(1)), (4, 6)).is_even(mesh)
    uneven = Layout((Shard(0), Shard(0)), (4, 6))
    assert uneven.split_factor(0, mesh) == 6
    assert not uneven.is_even(mesh) and uneven.uneven_dims(mesh) == [0]
    assert Layout((Shard(1), Shard(0)), (5, 7)).uneven_dims(mesh) == [0, 1]


def test_with_placement_and_queries() -> None:
    base = Layout.replicated((4, 4), 3)
    assert base.is_replicated and base.partial_axes() == ()
    changed = base.with_placement(1, P).with_placement(2, Shard(1))
    assert changed.placements == (R, P, Shard(1))
    assert base.placements == (R, R, R)  # frozen: the original is untouched
    assert changed.partial_axes() == (1,) and not changed.is_replicated


def test_local_shape_of_every_single_axis_split() -> None:
    mesh = (2, 4)
    for p0, p1 in itertools.product([R, P, Shard(0), Shard(1)], repeat=2):
        layout = Layout((p0, p1), (8, 16))
        rows = 8 // (2 if p0 == Shard(0) else 1) // (4 if p1 == Shard(0) else 1)
        cols = 16 // (2 if p0 == Shard(1) else 1) // (4 if p1 == Shard(1) else 1)
        assert layout.local_shape(mesh) == (rows, cols), layout


def test_layouts_survive_pickling_into_another_process() -> None:
    """Plans are broadcast pickled; string hashes are salted per process, so a layout must not
    carry its cached hash across (under torchrun every unpickled layout compared unequal)."""
    layout = Layout((Shard(1), Shard(0), Partial()), (4, 6))
    code = (
        "import pickle, sys\n"
        "from autopar.core.layout import Layout, Shard, Partial\n"
        "got = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
        "want = Layout((Shard(1), Shard(0), Partial()), (4, 6))\n"
        "print(got == want, hash(got) == hash(want), {want: 1}.get(got))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, pickle.dumps(layout).hex()],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert out.stdout.split() == ["True", "True", "1"], out.stdout + out.stderr
