"""Agreement checks that see reorderings: a weight row swapped on one rank, two samples or two
tokens swapped in one rank's batch, a rank a call out of step, and ranks that loaded different
weights (`load_state_dict`, `load_checkpoint`): each is refused on every rank, naming the tensor
and the rank, where the sums and end elements alone agree (checked below: each case is built so)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks

import autopar


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.proj(self.norm(self.emb(ids))).flatten(0, 1), labels.flatten())


def _model_and_batches() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = TokenModel()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(32, (8, 6), generator=gen), torch.randint(32, (8, 6), generator=gen)) for _ in range(3)]
    return model, batches


def _refused(call: Any) -> str:
    try:
        call()
    except autopar.AutoparError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _plain_sums_agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """What the old fingerprint saw: the sum, the sum of magnitudes, the first and last element."""
    fa, fb = a.reshape(-1).double(), b.reshape(-1).double()
    return bool(fa.sum() == fb.sum() and fa.abs().sum() == fb.abs().sum() and fa[0] == fb[0] and fa[-1] == fb[-1])


def _swapped(x: torch.Tensor, i: int, j: int, dim: int = 0) -> torch.Tensor:
    order = list(range(x.shape[dim]))
    order[i], order[j] = j, i
    return x.index_select(dim, torch.tensor(order)).contiguous()


def _job(rank: int, world_size: int) -> dict[str, Any]:
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    found: dict[str, Any] = {}
    model, batches = _model_and_batches()
    (ids, labels), second, _ = batches
    # a weight row swapped on rank 1 before parallelize
    mixed, _ = _model_and_batches()
    if rank == 1:
        with torch.no_grad():
            mixed.emb.weight.copy_(_swapped(mixed.emb.weight, 3, 4))
    found["unseen before"] = [
        _plain_sums_agree(model.emb.weight, _swapped(model.emb.weight, 3, 4)),
        _plain_sums_agree(ids, _swapped(ids, 2, 5)),
        _plain_sums_agree(ids, _swapped(ids, 1, 2, dim=1)),
    ]
    found["weight row"] = _refused(lambda: autopar.parallelize(mixed, mesh, example_inputs=(ids, labels)))
    pmodel = autopar.parallelize(model, mesh, example_inputs=(ids, labels))
    # samples 2 and 5 swapped in rank 1's batch; two tokens swapped in one of its sequences
    sample = (_swapped(ids, 2, 5), _swapped(labels, 2, 5)) if rank == 1 else (ids, labels)
    found["sample swap"] = _refused(lambda: pmodel(*sample))
    tokens = (_swapped(ids, 1, 2, dim=1), labels) if rank == 1 else (ids, labels)
    found["token swap"] = _refused(lambda: pmodel(*tokens))
    # rank 1 passes the labels by keyword where rank 0 passes them by position (was a timeout naming nobody)
    found["keyword call"] = _refused(lambda: pmodel(ids, labels=labels) if rank == 1 else pmodel(ids, labels))
    pmodel(ids, labels)  # in step again: agreed
    # rank 1 repeats the batch of the previous call while the others go on to the next
    found["a call behind"] = _refused(lambda: pmodel(*((ids, labels) if rank == 1 else second)))
    # each rank loads a state dict of its own (whole tensors, as the serial model's)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 1:
        state["emb.weight"] = _swapped(state["emb.weight"], 3, 4)
    found["load_state_dict"] = _refused(lambda: pmodel.load_state_dict(state))
    # each rank loads another file (rank 1's: the weights of another step)
    root = Path(tempfile.mkdtemp(prefix=f"autopar-agree-{rank}-"))
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file({k: v + rank for k, v in weights.items()}, str(root / "model.safetensors"))
    found["load_checkpoint"] = _refused(lambda: autopar.load_checkpoint(pmodel, root))
    # a call that failed on rank 1 alone (a 0-d tensor where the shards' rows go) puts it a call ahead
    half = slice(4 * rank, 4 * rank + 4)
    local = autopar.parallelize(model, mesh, example_inputs=(ids[half], labels[half]), inputs="local")
    local(ids[half], labels[half])
    if rank == 1:
        found["alone"] = _refused(lambda: local(ids[0, 0], labels[half]))
    found["out of step"] = _refused(lambda: local(ids[half], labels[half]))
    return found


@pytest.mark.multirank
def test_reorderings_and_ranks_out_of_step_are_named() -> None:
    results = run_ranks(2, _job, timeout=180)
    for found in results:
        assert found["unseen before"] == [True, True, True], found  # the cases the old check missed
        assert "emb.weight differs between rank 0 and rank 1" in found["weight row"], found["weight row"]
        assert "InputMismatchError: ids differs between rank 0 and rank 1" in found["sample swap"], found
        assert "InputMismatchError: ids differs between rank 0 and rank 1" in found["token swap"], found
        assert "rank 1 calls the module differently from rank 0" in found["keyword call"], found["keyword call"]
        assert "rank 1 is 1 call behind the others" in found["a call behind"], found["a call behind"]
        assert "after load_state_dict, emb.weight of the state dict differs between rank 0 and rank 1" in found["load_state_dict"], found
        assert "after load_checkpoint, a sample of the checkpoint's files differs between rank 0 and rank 1" in found["load_checkpoint"], found
        assert "InputMismatchError: rank 0 is 1 call(s) behind the others" in found["out of step"], found


def _gated_order(*targets: Any) -> list[str]:
    """The node names of a chain of `targets` (each a call on the previous value) once gated."""
    from autopar.runtime.call_checks import gate_forward

    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    for target in targets:
        args = (value, "sum", "0") if "c10d" in str(target) else (value,)
        value = graph.call_function(target, args)
    graph.output((value,))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    gate = gate_forward(gm)
    assert gate_forward(gm) is gate  # once per graph
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


def test_the_input_check_settles_before_the_first_node_that_may_communicate() -> None:
    """`gate_forward`: right before the forward's first collective (ATen ops before it run while
    the check's all-reduce travels), before a custom op (it may exchange tokens), and before the
    output of a forward that has neither."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    assert _gated_order(aten.relu.default, c10d.all_reduce.default, aten.neg.default) == [
        "relu.default", "settle_gate", "all_reduce.default", "neg.default",
    ]  # fmt: skip
    assert _gated_order(aten.relu.default, torch.ops.autopar.ctc_loss.default) == [
        "relu.default", "settle_gate", "ctc_loss.default",
    ]  # fmt: skip
    assert _gated_order(aten.relu.default, aten.neg.default) == ["relu.default", "neg.default", "settle_gate"]
