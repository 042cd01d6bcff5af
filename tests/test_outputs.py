"""Outputs used as torchvision's, timm's and diffusers' loops use them: the loss and the metrics
computed outside the model, with plain targets, equal to serial on every rank.

One gloo launch per mesh ((2,) and 2x2) runs everything: the losses torch offers on outputs of every
layout the plan can give (split on the batch, on the classes, partial sums, replicated), a
classifier, a regression and a diffusion-style noise prediction trained two SGD-with-momentum steps
beside the serial model, and reading the values of a non-scalar output.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._C._distributed_c10d as c10d
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks

import autopar

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]

# each computed on (logits [4, 6], class targets [4], float targets [4, 6]) as a user writes it
LOSSES: dict[str, Loss] = {
    "cross_entropy": lambda d, y, yf: F.cross_entropy(d, y),
    "label_smoothing": lambda d, y, yf: F.cross_entropy(d, y, label_smoothing=0.1),
    "class_weights": lambda d, y, yf: F.cross_entropy(d, y, weight=torch.arange(1.0, 7.0)),
    "ignore_index": lambda d, y, yf: F.cross_entropy(d, torch.where(y == 0, -100, y)),
    "per_sample": lambda d, y, yf: F.cross_entropy(d, y, reduction="none").sum(),
    "soft_targets": lambda d, y, yf: F.cross_entropy(d, yf.softmax(-1)),
    "nll_log_softmax": lambda d, y, yf: F.nll_loss(F.log_softmax(d, -1), y),
    "mse": lambda d, y, yf: F.mse_loss(d, yf),
    "mse_sum": lambda d, y, yf: F.mse_loss(d, yf, reduction="sum"),
    "mse_weighted": lambda d, y, yf: (F.mse_loss(d, yf, reduction="none") * yf).sum(),
    "l1": lambda d, y, yf: F.l1_loss(d, yf),
    "smooth_l1": lambda d, y, yf: F.smooth_l1_loss(d, yf),
    "huber": lambda d, y, yf: F.huber_loss(d, yf),
    "bce_with_logits": lambda d, y, yf: F.binary_cross_entropy_with_logits(d, yf.sigmoid()),
    "bce": lambda d, y, yf: F.binary_cross_entropy(d.sigmoid(), yf.sigmoid()),
    "kl_div": lambda d, y, yf: F.kl_div(F.log_softmax(d, -1), yf.softmax(-1), reduction="batchmean"),
    "cosine_embedding": lambda d, y, yf: F.cosine_embedding_loss(d, yf, torch.ones(4)),
    "gather": lambda d, y, yf: d[torch.arange(4), y].sum(),
    "weights_ignore_smoothing": lambda d, y, yf: F.cross_entropy(
        d, torch.where(y == 0, -100, y), weight=torch.arange(1.0, 7.0), label_smoothing=0.2
    ),
    "segmentation": lambda d, y, yf: F.cross_entropy(  # nll_loss2d: [N, C, H, W] and [N, H, W]
        d.reshape(2, 2, 6).permute(0, 2, 1)[..., None],
        torch.where(y == 0, -100, y).view(2, 2, 1),
        weight=torch.arange(1.0, 7.0),
    ),
    "nll_sum": lambda d, y, yf: F.nll_loss(d.log_softmax(-1), y, reduction="sum"),
    "all_ignored": lambda d, y, yf: F.cross_entropy(d, torch.full((4,), -100)).nan_to_num(7.0),
    "norms": lambda d, y, yf: d.norm(dim=-1).mean() + d.var() + d.std(-1).sum(),
    "accuracy": lambda d, y, yf: (d.argmax(-1) == y).float().mean().item(),
    "top2": lambda d, y, yf: (d.topk(2, -1).indices == y[:, None]).any(-1).sum().item(),
    "sum_item": lambda d, y, yf: round(d.sum().item(), 4),
    "tolist": lambda d, y, yf: [[round(v, 4) for v in row] for row in (d * 2).tolist()],
    "numpy": lambda d, y, yf: d.detach().numpy().round(4).tolist(),
    "bool": lambda d, y, yf: bool((d > 2.0).any()),
    "in_place": lambda d, y, yf: d.mul(1).clamp_(max=0.5).masked_fill_(yf > 1, 0).sum(),
    "sort_median": lambda d, y, yf: d.sort(-1).values[:, :2].sum() + d.median(-1).values.sum(),
    "cdist_einsum": lambda d, y, yf: torch.cdist(d, yf).sum() + torch.einsum("ij,ij->i", d, yf).sum(),
    "multi_margin": lambda d, y, yf: F.multi_margin_loss(d, y),
    "gaussian_nll": lambda d, y, yf: F.gaussian_nll_loss(d, yf, torch.ones(4, 6)),
    "equal_allclose": lambda d, y, yf: torch.equal(d, d * 1) and torch.allclose(d, d + 1e-9),
    "iterate": lambda d, y, yf: [round(float(v), 4) for v in d[:, 0]],
}


def _loss_table(mesh: Any) -> dict[str, dict[str, Any]]:
    """Every loss on an output of every layout: (loss equal, input gradient equal) or the value."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from autopar.runtime.outputs import as_output

    torch.manual_seed(0)
    x, y, yf = torch.randn(4, 6), torch.tensor([1, 0, 5, 2]), torch.randn(4, 6)
    kinds = [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)]
    if mesh.ndim == 2:
        kinds = [(Shard(0), Shard(1)), (Shard(1), Partial()), (Partial(), Shard(0)), (Replicate(), Shard(0))]
    table: dict[str, dict[str, Any]] = {}
    for placements in kinds:
        whole = [Replicate() if p.is_partial() else p for p in placements]
        parts = 1
        for axis, p in enumerate(placements):
            parts *= mesh.size(axis) if p.is_partial() else 1
        local = distribute_tensor(x, mesh, whole).to_local() / parts
        row = table[",".join(map(str, placements))] = {}
        for name, fn in LOSSES.items():
            leaf = DTensor.from_local(
                local, mesh, placements, shape=x.shape, stride=x.stride()
            ).requires_grad_()
            serial = x.clone().requires_grad_()
            value, expected = fn(as_output(leaf * 1), y, yf), fn(serial, y, yf)
            if not isinstance(value, torch.Tensor):
                row[name] = value == expected or (value, expected)
                continue
            value.backward()
            expected.backward()
            assert leaf.grad is not None and serial.grad is not None
            loss_ok = type(value) is torch.Tensor and abs(value.item() - expected.item()) < 1e-5
            row[name] = (loss_ok, bool(torch.allclose(leaf.grad.full_tensor(), serial.grad, atol=1e-6)))
    # a plain gradient given to backward() is the whole gradient, as in serial
    leaf = distribute_tensor(x, mesh, [Shard(0)] * mesh.ndim).requires_grad_()
    as_output(leaf * 2).backward(yf)
    assert leaf.grad is not None
    table["plain-gradient"] = {"equal": bool(torch.allclose(leaf.grad.full_tensor(), 2 * yf))}
    # a slice across a split dim is a gathered copy: writing into it is refused, not lost
    split = as_output(distribute_tensor(x, mesh, [Shard(1)] * mesh.ndim) * 1)
    try:
        split[:, 0] = 0.0
        table["write-into-gathered-view"] = {"refused": "no error"}
    except autopar.AutoparError as exc:
        table["write-into-gathered-view"] = {"refused": "gathered" in str(exc)}
    return table


def _collectives_on_batch_split(mesh: Any) -> dict[str, dict[str, int]]:
    """The collectives of each loss (forward and backward) on logits split on the batch: the
    logits stay split, so a scalar all-reduce and no gather."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.runtime.outputs import as_output

    x, y, yf = torch.randn(8, 6), torch.randint(0, 6, (8,)), torch.randn(8, 6)
    counts = {}
    for name in (
        "cross_entropy",
        "weights_ignore_smoothing",
        "mse",
        "smooth_l1",
        "bce_with_logits",
        "accuracy",
    ):
        leaf = distribute_tensor(x, mesh, [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)).requires_grad_()
        with CommDebugMode() as comm:
            value = LOSSES[name](as_output(leaf * 1), y, yf)
            if isinstance(value, torch.Tensor):
                value.backward()
        counts[name] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return counts


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 16, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(F.max_pool2d(F.relu(self.conv(image)), 2).flatten(1))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NoisePredictor(nn.Module):
    """A diffusion denoiser in miniature: convolutions conditioned on a timestep embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.time = nn.Embedding(50, 8)
        self.inp = nn.Conv2d(3, 8, 3, padding=1)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.inp(noisy)) + self.time(t)[:, :, None, None]
        return self.out(F.silu(self.mid(h)))


def _side_by_side(
    mesh: Any, model: nn.Module, batch: tuple[torch.Tensor, ...], loss_fn: Callable[..., Any], target: Any
) -> dict[str, Any]:
    """Two SGD-with-momentum steps with the loss outside the model, parallel beside serial:
    the largest loss, gradient and parameter differences, and the metric of each."""
    serial = type(model)()
    serial.load_state_dict(model.state_dict())
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch)
    popt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    metrics = []
    layouts: set[tuple[str, ...]] = set()
    for _ in range(2):
        losses = []
        for module, opt in ((pmodel, popt), (serial, sopt)):
            opt.zero_grad()
            out = module(*batch)
            loss = loss_fn(out, target)
            loss.backward()
            losses.append(loss)
            if module is pmodel:
                layouts.add(tuple(str(p) for p in out.placements))
            if isinstance(target, torch.Tensor) and target.dtype == torch.long:
                metrics.append((out.argmax(-1) == target).float().mean().item())
        worst["loss"] = max(worst["loss"], abs(losses[0].item() - losses[1].item()))
        assert type(losses[0]) is torch.Tensor, type(losses[0])  # a plain tensor, as serial's
        for (name, p), q in zip(pmodel.named_parameters(), serial.parameters()):
            assert p.grad is not None and q.grad is not None, name
            worst["grad"] = max(worst["grad"], float((p.grad.full_tensor() - q.grad).abs().max()))
        popt.step()
        sopt.step()
    for p, q in zip(pmodel.parameters(), serial.parameters()):
        worst["param"] = max(worst["param"], float((p.full_tensor() - q).abs().max()))
    return {"worst": worst, "metrics": metrics, "layouts": layouts}


class PerSample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(x), y, reduction="none")


def _body(rank: int, world_size: int, shape: tuple[int, ...]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", shape)
    result: dict[str, Any] = {"losses": _loss_table(mesh)}
    if mesh.ndim == 1:
        result["collectives"] = _collectives_on_batch_split(mesh)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    images, labels = torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    result["classifier"] = _side_by_side(mesh, Classifier(), (images,), F.cross_entropy, labels)
    x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 5, generator=gen)
    result["regression"] = _side_by_side(mesh, Regressor(), (x,), F.mse_loss, y)
    clean, noise = torch.randn(8, 3, 8, 8, generator=gen), torch.randn(8, 3, 8, 8, generator=gen)
    t = torch.randint(0, 50, (8,), generator=gen)
    noisy = 0.8 * clean + 0.6 * noise
    result["diffusion"] = _side_by_side(mesh, NoisePredictor(), (noisy, t), F.mse_loss, noise)

    # a non-scalar output's values, read as a user reads them
    model = PerSample()
    serial = PerSample()
    serial.load_state_dict(model.state_dict())
    labels = torch.randint(0, 10, (8,), generator=gen)
    out = autopar.parallelize(model, mesh, example_inputs=(x, labels))(x, labels)
    expected = serial(x, labels)
    result["placements"] = [str(p) for p in out.placements]
    result["reads"] = {
        "sum_item": (out.sum().item(), expected.sum().item()),
        "tolist": (out.tolist(), expected.tolist()),
        "numpy": (out.detach().numpy().tolist(), expected.detach().numpy().tolist()),
        "max_float": (float(out.max()), float(expected.max())),
        "compare": (bool((out > 1.0).all()), bool((expected > 1.0).all())),
    }
    # argmax along every dim, a split one included, and over all: serial's indices, and no
    # collective left unwaited (torch's registry of in-flight collectives does not grow)
    in_flight = c10d._get_work_registry_size()
    for d in range(out.dim()):
        result["reads"][f"argmax_{d}"] = (out.argmax(d).tolist(), expected.argmax(d).tolist())
    result["reads"]["argmax_all"] = (int(out.argmax()), int(expected.argmax()))
    if mesh.ndim == 2:  # the layout a ("dp", "cp") plan gives a language model's logits
        from torch.distributed.tensor import Shard, distribute_tensor

        from autopar.runtime.outputs import OutputTensor

        logits = torch.randn(2, 16, 100, generator=gen)
        split = distribute_tensor(logits, mesh, [Shard(2), Shard(0)])
        held = OutputTensor(split._local_tensor, split._spec, requires_grad=False)  # type: ignore[call-arg]
        result["reads"]["argmax_classes"] = (held.argmax(-1).tolist(), logits.argmax(-1).tolist())
    result["unwaited"] = c10d._get_work_registry_size() - in_flight
    if mesh.ndim == 1:
        result["local"] = _local_inputs(mesh, rank, x, labels)
    return result


def _local_inputs(mesh: Any, rank: int, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """With inputs="local" a plain tensor is this rank's shard: mixing one with an output is
    refused with what to do; DTensor targets and the values read out equal serial."""
    from torch.distributed.tensor import DTensor, Shard

    model, serial = PerSample(), PerSample()
    serial.load_state_dict(model.state_dict())
    xs, ys = x.chunk(mesh.size())[rank], labels.chunk(mesh.size())[rank]
    out = autopar.parallelize(model, mesh, example_inputs=(xs, ys), inputs="local")(xs, ys)
    expected = serial(x, labels)
    weights = torch.linspace(0.5, 2.0, 8)
    try:
        (out * weights.chunk(mesh.size())[rank]).sum()
        refused = "no error"
    except autopar.AutoparError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    weighted = (out * DTensor.from_local(weights.chunk(mesh.size())[rank], mesh, [Shard(0)])).sum()
    return {
        "refused": refused,
        "weighted": (weighted.item(), (expected * weights).sum().item()),
        "sum_item": (out.sum().item(), expected.sum().item()),
        "tolist": (out.tolist(), expected.tolist()),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_losses_and_metrics_outside_the_model_equal_serial_on_every_rank(shape: tuple[int, ...]) -> None:
    results = run_ranks(len(shape) * 2 if shape == (2, 2) else 2, _body, shape, timeout=300)
    for result in results:
        for placements, row in result["losses"].items():
            wrong = {name: v for name, v in row.items() if v not in (True, (True, True))}
            assert not wrong, (placements, wrong)
        for name, counts in result.get("collectives", {}).items():
            assert counts == {"all_reduce": 1}, (name, counts)
        for name in ("classifier", "regression", "diffusion"):
            worst = result[name]["worst"]
            assert worst["loss"] < 1e-5 and worst["grad"] < 1e-5 and worst["param"] < 1e-5, (
                name,
                result[name],
            )
        metrics = result["classifier"]["metrics"]
        assert metrics[0::2] == metrics[1::2], metrics  # accuracy from argmax, parallel vs serial
        for name, (value, expected) in result["reads"].items():
            assert torch.allclose(torch.tensor(value), torch.tensor(expected), atol=1e-5), (
                name,
                value,
                expected,
            )
    assert all(r["reads"] == results[0]["reads"] for r in results), "ranks read different values"
    assert all(r["unwaited"] == 0 for r in results), [r["unwaited"] for r in results]
    for result in results:
        if "local" in result:
            local = result.pop("local")
            refused = local.pop("refused")
            assert refused.startswith("UsageError") and 'inputs="local"' in refused, refused
            for name, (value, expected) in local.items():
                assert torch.allclose(torch.tensor(value), torch.tensor(expected), atol=1e-5), (name, local)
