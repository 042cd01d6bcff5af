"""Inputs that require grad get their gradient, equal to serial and laid out like the input:
saliency maps, adversarial examples, a serial generator feeding a parallel discriminator, and a
DTensor input (another parallel module's output) whose gradient keeps its placements."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from multirank import run_ranks
from pass_fixtures import assert_call_matches_serial, is_comm

import autopar
from autopar.core.meta import info, signature
from autopar.passes.trace import trace


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x), y)


class Classifier(nn.Module):
    """A small image classifier: the saliency map is the gradient of a class score by the image."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(image)).flatten(1))


class TopScore(Classifier):
    """The sum of each image's top class score: a scalar to take the saliency gradient of."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return super().forward(image).max(dim=1).values.sum()


def _regression_batch(requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).requires_grad_(requires_grad)
    return x, torch.randn(4, 4, generator=gen)


def test_the_trace_returns_the_gradient_of_an_input_that_requires_grad_after_the_parameters() -> None:
    gm = trace(Regressor(), _regression_batch())
    sig = signature(gm)
    assert sig.input_grads == [0]  # x; y does not require grad
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    assert len(outputs) == sig.num_param_grads_end + 1
    grad_x = outputs[-1]
    assert tuple(grad_x.meta["val"].shape) == (4, 8) and info(grad_x).phase == "backward"


def test_without_an_input_wanting_grad_the_trace_has_no_input_gradient() -> None:
    sig = signature(trace(Regressor(), _regression_batch(requires_grad=False)))
    assert sig.input_grads == []


def test_a_forward_only_trace_computes_no_input_gradient() -> None:
    sig = signature(trace(Regressor(), _regression_batch(), forward_only=True))
    assert sig.input_grads == [] and sig.grad_of == []


@pytest.mark.parametrize("shape", [(2,), (2, 2), (2, 2, 2)])
def test_the_input_gradient_equals_serial_on_every_rank(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    compiled = assert_call_matches_serial(Regressor(), shape, _regression_batch())
    for program in (c.program for c in compiled.values()):
        assert program.input_grads == [0]
        outputs = list(next(n for n in program.backward.graph.nodes if n.op == "output").args[0])
        grad_x = outputs[len(program.param_names)]
        assert tuple(grad_x.meta["val"].shape) == (4, 8)  # whole on every rank, as x is
        # the whole gradient is assembled by a collective the backward graph issues
        assert any(is_comm(n) for n in _ancestors(grad_x)), program.backward.graph


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    seen, todo = [], [node]
    while todo:
        current = todo.pop()
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.append(parent)
                todo.append(parent)
    return seen


def test_a_saliency_map_of_a_convolutional_classifier_equals_serial() -> None:
    torch.manual_seed(0)
    image = torch.randn(4, 3, 8, 8, requires_grad=True)
    assert_call_matches_serial(TopScore(), (2, 2), (image,))


ACTIVATIONS = {
    "leaky-relu": nn.LeakyReLU(0.2),  # a DCGAN discriminator's
    "elu": nn.ELU(),
    "selu": nn.SELU(),
    "celu": nn.CELU(0.5),
    "mish": nn.Mish(),
    "hardsigmoid": nn.Hardsigmoid(),
    "softsign": nn.Softsign(),
}


@pytest.mark.parametrize("activation", list(ACTIVATIONS.values()), ids=list(ACTIVATIONS))
def test_a_discriminator_s_gradient_by_its_input_equals_serial(activation: nn.Module) -> None:
    torch.manual_seed(0)
    discriminator = nn.Sequential(nn.Linear(8, 16), activation, nn.Linear(16, 1))

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.d = discriminator

        def forward(self, fake: torch.Tensor) -> torch.Tensor:
            return F.softplus(-self.d(fake)).mean()

    assert_call_matches_serial(Loss(), (2, 2), (torch.randn(4, 8, requires_grad=True),))


def test_gradients_of_input_embeddings_through_repeated_transformer_blocks_equal_serial() -> None:
    """Adversarial training on embeddings calls a transformers model with `inputs_embeds`."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    embeds = torch.randn(2, 8, 32, requires_grad=True)
    labels = torch.randint(0, 64, (2, 8))
    assert_call_matches_serial(model, (2, 2), (), {"inputs_embeds": embeds, "labels": labels})


def _train_with_input_gradients(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    torch.manual_seed(0)
    model, serial = Classifier(), Classifier()
    serial.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    images, targets = torch.randn(4, 3, 8, 8, generator=gen), torch.tensor([1, 2, 3, 4])
    pmodel = autopar.parallelize(model, mesh, example_inputs=(images,))
    result: dict[str, Any] = {}

    # a saliency map: the gradient of each image's target score by the image, as its tutorial writes it
    maps = []
    for module in (pmodel, serial):
        image = images.clone().requires_grad_()
        logits = module(image)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        logits.gather(1, targets[:, None]).sum().backward()
        maps.append(image.grad)
    result["saliency"] = float((maps[0] - maps[1]).abs().max())
    pmodel.zero_grad()
    serial.zero_grad()

    # adversarial training: a step on images moved along their loss gradient, SGD with momentum
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(2):
        step_losses = []
        for module, optimizer in ((pmodel, opt), (serial, serial_opt)):
            image = images.clone().requires_grad_()
            logits = module(image)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            (grad,) = torch.autograd.grad(F.cross_entropy(logits, targets), image)
            optimizer.zero_grad()
            logits = module(images + 0.5 * grad)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            loss = F.cross_entropy(logits, targets)
            loss.backward()
            optimizer.step()
            step_losses.append(float(loss))
        losses.append(step_losses)
    result["losses"] = losses
    result["params"] = max(
        float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters())
    )

    # a serial generator feeding the parallel discriminator: the generator's gradient flows through
    torch.manual_seed(2)
    generator, serial_generator = nn.Linear(16, 3 * 64), nn.Linear(16, 3 * 64)
    serial_generator.load_state_dict(generator.state_dict())
    noise = torch.randn(4, 16, generator=gen)
    scores = []
    for module, g in ((pmodel, generator), (serial, serial_generator)):
        score = module(g(noise).view(4, 3, 8, 8))
        score = score.full_tensor() if hasattr(score, "full_tensor") else score
        F.softplus(-score).mean().backward()
        scores.append(g.weight.grad)
    result["generator"] = float((scores[0] - scores[1]).abs().max())

    # a DTensor input: its gradient is a DTensor with the input's placements
    image = distribute_tensor(images, mesh, [Shard(0), Replicate()]).requires_grad_()
    logits = pmodel(image)
    (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).sum().backward()
    plain = images.clone().requires_grad_()
    serial(plain).sum().backward()
    result["dtensor"] = (type(image.grad).__name__, tuple(map(str, image.grad.placements)))
    result["dtensor_err"] = float((image.grad.full_tensor() - plain.grad).abs().max())
    result["programs"] = [why for why, _ in pmodel.programs]

    # another parallel module's output as the example and as the input; one tensor passed twice
    pregressor = autopar.parallelize(TwoInputs(), mesh, example_inputs=(pmodel(images), pmodel(images)))
    serial_regressor = TwoInputs()
    serial_regressor.load_state_dict({k: v.full_tensor() for k, v in pregressor.state_dict().items()})
    features = images.clone().requires_grad_()
    pregressor(pmodel(features), pmodel(features)).backward()
    plain = images.clone().requires_grad_()
    serial_regressor(serial(plain), serial(plain)).backward()
    result["chained"] = float((features.grad - plain.grad).abs().max())
    logits = torch.randn(4, 10, generator=gen)
    twice, serial_twice = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    pregressor(twice, twice).backward()
    serial_regressor(serial_twice, serial_twice).backward()
    result["twice"] = float((twice.grad - serial_twice.grad).abs().max())
    # a program traced for one tensor passed twice reads it once: other tensors get their own program
    half, other = torch.randn(2, 10, generator=gen), torch.randn(2, 10, generator=gen)
    pregressor(half, half)  # compiles a program for 2 rows that reads its one tensor once
    result["distinct"] = (float(pregressor(half, other)), float(serial_regressor(half, other)))
    return result


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(10, 8), nn.Linear(10, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.a(x)) * self.b(y)).pow(2).mean()


@pytest.mark.multirank
def test_saliency_adversarial_steps_a_generator_and_dtensor_inputs_equal_serial_on_gloo() -> None:
    for result in run_ranks(4, _train_with_input_gradients, timeout=300):
        assert result["saliency"] < 1e-6, result["saliency"]
        for parallel, serial in result["losses"]:
            assert abs(parallel - serial) < 1e-5, result["losses"]
        assert result["params"] < 1e-5, result["params"]
        assert result["generator"] < 1e-6, result["generator"]
        assert result["dtensor"] == ("DTensor", ("S(0)", "R")), result["dtensor"]
        assert result["dtensor_err"] < 1e-6, result["dtensor_err"]
        assert result["chained"] < 1e-6, result["chained"]
        assert result["twice"] < 1e-6, result["twice"]
        assert abs(result["distinct"][0] - result["distinct"][1]) < 1e-6, result["distinct"]
        # one program for inputs without gradient, one for inputs that want one
        assert result["programs"] == [
            "example inputs",
            "input 0: float32[4, 3, 8, 8] requiring grad (was float32[4, 3, 8, 8])",
        ], result["programs"]
