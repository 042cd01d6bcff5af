"""The graph's collective nodes: which ops they are and what bucketing records on them.

insert_comm emits torch's functional collectives; the schedule stage may merge several into one
bucket and records the members on the merged node. The cost model's timeline and the reports read
those records, so they are vocabulary rather than a pass's internals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.core.redistribute import CommStep

c10d = torch.ops._c10d_functional
COLLECTIVES = (
    c10d.all_gather_into_tensor.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce.default,
    c10d.all_reduce_.default,  # a bucket's sum, in place on the buffer it just concatenated
    c10d.all_to_all_single.default,
)

BUCKET_KEY = "autopar_bucket"  # node.meta of a merged collective: its members, in buffer order
BYTES_KEY = "autopar_local_bytes"  # node.meta of the buffer nodes bucketing adds: local size in bytes
# node.meta of a piece of a decomposed collective matmul (`passes.decompose_matmul`): on a
# collective, the piece it carries (bucketing never merges pieces, which are there to overlap);
# on a rank-local matmul piece, its flops (the modeled timeline prices it as a matmul)
PIECE_KEY = "autopar_piece"
MATMUL_FLOPS_KEY = "autopar_matmul_flops"
DECOMPOSED_KEY = "autopar_decomposed"  # gm.meta: the pairs the decomposition considered (DecomposedPair)
# gm.meta: modeled step (seconds) of each set of pairs the "auto" choice compared, by its name
DECOMPOSED_STEPS_KEY = "autopar_decomposed_steps"


@dataclass(frozen=True)
class BucketMember:
    """One collective folded into a bucket (for reports: its own step, node name and module)."""

    name: str
    step: CommStep
    module_path: str


def functional_sums(gm: fx.GraphModule) -> None:
    """`gm` with its in-place all-reduces (a bucket's sum on the buffer it concatenated) as the
    functional op, for `torch.compile`: AOT autograd's functionalization refuses a custom op whose
    output aliases its input, and Inductor's reinplacing pass turns the functional op back into
    the in-place one where the input is not read again (a bucket's buffer is not)."""
    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=c10d.all_reduce_.default):
        node.target = c10d.all_reduce.default
        changed = True
    if changed:
        gm.recompile()


def comm_group(collective: fx.Node) -> str:
    """The process group a functional collective runs on (its last argument)."""
    return str(collective.args[-1])


def bucket_members(node: fx.Node) -> tuple[BucketMember, ...]:
    """The collectives a merged collective stands for (empty for an ordinary one)."""
    return tuple(node.meta.get(BUCKET_KEY, ()))


@dataclass(frozen=True)
class DecomposedPair:
    """One collective-matmul pair the pass considered: what it is, how it was priced, whether kept."""

    collective: str  # node name of the original collective
    kind: str  # "all_gather" or "reduce_scatter"
    matmuls: tuple[str, ...]  # node names of the matmuls it feeds (is fed by)
    dims: tuple[str, ...]  # per matmul, the dim its pieces cut: "M" (rows), "N" (columns), "K" (contracted)
    where: str  # module path @ source line of the collective
    chunks: int
    before: float  # modeled seconds of the pair on the step's critical path, undecomposed
    after: float  # the same, decomposed
    kept: bool

    def describe(self) -> str:
        verdict = "decomposed" if self.kept else "kept whole"
        return (
            f"{self.kind} {self.collective} -> {', '.join(f'{m} ({d})' for m, d in zip(self.matmuls, self.dims))} "
            f"[{self.where}]: {verdict}, "
            f"{self.chunks} pieces, {self.before * 1e6:.4g} us -> {self.after * 1e6:.4g} us modeled"
        )
