"""Input values that index out of range (a token id past the vocabulary, a target past the classes)
raise the serial model's IndexError on every rank, before any collective: a training loop that
catches it and skips the batch goes on equal to serial."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from multirank import run_ranks

import autopar
from autopar.core.meta import IndexCheck, signature
from autopar.passes.trace import trace

VOCAB, CLASSES, WIDTH = 32, 6, 16


class TokenClassifier(nn.Module):
    """Embedding -> MLP -> per-token classes, cross-entropy with the default ignore_index."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, 4 * WIDTH)
        self.head = nn.Linear(4 * WIDTH, CLASSES)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.hidden(self.embed(input_ids))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class ShiftedIds(TokenClassifier):
    """Indexes with ids computed from the input: nothing to check on the input itself."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids // 2, labels)


def batch(step: int, bad: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(VOCAB, (4, 8), generator=gen)
    labels = torch.randint(CLASSES, (4, 8), generator=gen)
    labels[0, :2] = -100  # ignored targets are not out of range
    if bad == "token":
        ids[3, 5] = VOCAB
    elif bad == "target":
        labels[1, 1] = CLASSES + 2
    elif bad == "negative":
        ids[0, 0] = -1
    return ids, labels


@pytest.mark.parametrize("decompose", [False, True])
def test_the_trace_finds_the_embedding_ids_and_the_loss_targets(decompose: bool) -> None:
    gm = trace(TokenClassifier(), batch(0), decompose=decompose)
    checks = sorted(signature(gm).index_checks, key=lambda c: c.input_index)
    assert [(c.input_index, c.bound, c.ignored) for c in checks] == [(0, VOCAB, ()), (1, CLASSES, (-100,))]
    assert checks[0].op == "aten.embedding.default" and checks[0].where.startswith("embed @ ")
    assert all(isinstance(c, IndexCheck) and __file__ in c.where for c in checks)


def test_indices_computed_from_an_input_are_not_checked_on_the_input() -> None:
    gm = trace(ShiftedIds(), batch(0), decompose=True)
    assert [c.input_index for c in signature(gm).index_checks] == [1]


def _train(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    torch.manual_seed(0)
    model = TokenClassifier()
    serial = TokenClassifier()
    serial.load_state_dict(model.state_dict())
    pmodel = autopar.parallelize(model, mesh, example_inputs=batch(0))
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    errors, serial_errors = [], []
    for step, bad in enumerate(["", "token", "", "target", "negative", ""]):
        for module, optimizer, caught in ((pmodel, opt, errors), (serial, serial_opt, serial_errors)):
            optimizer.zero_grad()
            try:
                loss = module(*batch(step, bad))
            except IndexError as exc:  # the loop a user writes: skip the bad batch
                caught.append((step, type(exc).__name__, str(exc)))
                continue
            loss.backward()
            optimizer.step()
    err = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(pmodel.parameters(), serial.parameters()))
    return {"errors": errors, "serial_steps": [s for s, _, _ in serial_errors], "param_err": err}


@pytest.mark.multirank
def test_a_loop_that_skips_a_bad_batch_trains_equal_to_serial_on_every_rank() -> None:
    for result in run_ranks(4, _train, timeout=180):
        assert [s for s, _, _ in result["errors"]] == result["serial_steps"] == [1, 3, 4]
        assert all(kind == "IndexOutOfRangeError" for _, kind, _ in result["errors"])
        token, target, negative = (text for _, _, text in result["errors"])
        assert f"input_ids holds {VOCAB}, but aten.embedding.default takes 0 to {VOCAB - 1}" in token, token
        assert "at: embed @ " in token and __file__.split("/")[-1] in token, token
        assert f"labels holds {CLASSES + 2}" in target and "-100, which the model ignores" in target, target
        assert "input_ids holds -1" in negative, negative
        assert result["param_err"] < 1e-5, result["param_err"]


def test_the_error_is_an_index_error_and_an_autopar_error() -> None:
    assert issubclass(autopar.IndexOutOfRangeError, IndexError)
    assert issubclass(autopar.IndexOutOfRangeError, autopar.AutoparError)
