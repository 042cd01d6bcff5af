"""Decisions made once on rank 0 and broadcast, so that every rank runs the identical plan.

A failure travels with the broadcast: a rank whose decision raised never leaves the others waiting
in a collective; every rank raises the same error instead.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.core.errors import AutoparError, InternalError, RankFailureError
from autopar.runtime.wire import JsonWire, RefusedPayload, all_gathered, allowed_loads, broadcast_bytes

T = TypeVar("T")


class ChoiceAgreement(Protocol):
    """How the ranks of one program settle a choice the compiler makes once per program (which
    collective matmuls to decompose, how many batch chunks to run): given the function that
    decides at this rank and how the choice travels (`JsonWire`: its name and JSON form), the
    choice every rank applies. A choice made by each rank for its own coordinates could differ
    between ranks, and their collectives would no longer match. `parallelize`: rank 0 decides and
    broadcasts (`decided_on_rank0`); an in-process run of every rank: the first rank compiled
    decides."""

    def __call__(self, decide: Callable[[], T], wire: JsonWire[T]) -> T: ...


def choice_on_rank0(group: dist.ProcessGroup | None = None) -> ChoiceAgreement:
    """The `ChoiceAgreement` of a job: rank 0 of `group` decides, every rank applies its choice."""

    def agree(decide: Callable[[], T], wire: JsonWire[T]) -> T:
        return decided_on_rank0(decide, wire.what, group, wire)

    return agree


def decided_on_rank0(
    decide: Callable[[], T], what: str, group: dist.ProcessGroup | None = None, wire: JsonWire[T] | None = None
) -> T:
    """`decide()` on rank 0 of `group` (default: all ranks), its result (or its error) on every
    rank of the group. An AutoparError (a plan that cannot fit, an op without a rule) is raised
    alike on every rank; any other failure of rank 0 (an InternalError too) is rank 0's own,
    raised there with its traceback, and a `RankFailureError` naming rank 0 and the error on the
    others. Without a process group (one process: every pipeline rank run there, in the tests'
    `autopar.testing.pipeline_lockstep`) there is nobody to agree with: `decide()` itself, read
    back through the same encoding a job's ranks read it through.

    The result travels as `wire`'s JSON, read back by its decoder on every rank, rank 0 too (so
    all apply the same value); without a wire, pickled and read by the allow-listed unpickler
    (`wire.allowed_loads`). Rank 0 reads its own payload back before sending it: a result that
    could not be read is rank 0's failure, raised as one on every rank, not a refusal on the
    others alone."""
    if group is None and not dist.is_initialized():
        alone = decide()
        _, payload = _read(pickle.dumps(("value", wire.dumps(alone) if wire is not None else alone)))
        return wire.loads(payload) if wire is not None else payload  # type: ignore[no-any-return]
    data: bytes | None = None
    own: BaseException | None = None
    value: Any = None
    source = dist.get_rank(group) == 0
    if source:
        try:
            value = decide()
            payload = wire.dumps(value) if wire is not None else value
            data = pickle.dumps(("value", payload))
            _, payload = _read(data)
            if wire is not None:
                value = wire.loads(payload)
        except Exception as exc:  # every rank must hear about it, whatever it is
            own = exc
            if isinstance(exc, AutoparError) and not isinstance(exc, InternalError):
                data = _error_payload(exc)  # raised alike on every rank
            else:
                data = _error_payload(f"{type(exc).__name__}: {exc}")
    data = broadcast_bytes(data, group, collective_device(group))
    if own is not None:  # rank 0 raises its own error, with its traceback
        if isinstance(own, AutoparError):
            raise own
        raise AutoparError(f"{what} failed on rank 0: {type(own).__name__}: {own}") from own
    if source:
        return value  # type: ignore[no-any-return]
    try:
        kind, payload = _read(data)
        if kind == "value":
            return wire.loads(payload) if wire is not None else payload  # type: ignore[no-any-return]
    except RefusedPayload as exc:
        raise AutoparError(
            f"rank 0 sent {what} in a form this rank refuses to read: {exc}",
            hint="every rank must run the same autopar version; otherwise this is a bug in autopar, please report it",
        ) from exc
    if isinstance(payload, AutoparError):
        raise payload
    raise RankFailureError(
        f"rank 0 failed in {what}, inside parallelize: {payload}",
        hint="the error and its traceback are in rank 0's log",
    )


def _read(data: bytes) -> tuple[str, Any]:
    """The (kind, payload) pair rank 0 sent: ("value", the result or its JSON) or ("error", an
    AutoparError or a failure's text)."""
    message = allowed_loads(data)
    if not (isinstance(message, tuple) and len(message) == 2 and message[0] in ("value", "error")):
        raise RefusedPayload(f"expected ('value' | 'error', payload), got {type(message).__name__}")
    return message


def _error_payload(error: AutoparError | str) -> bytes:
    """The pickled error rank 0 sends; an error that cannot be pickled, or read back (a value of
    another type among its attributes), travels as its text."""
    try:
        data = pickle.dumps(("error", error))
        _read(data)
    except Exception:  # noqa: BLE001 - whatever stops it, the text still travels
        return pickle.dumps(("error", f"{type(error).__name__}: {error}"))
    return data


Fingerprint = tuple[float, ...]
# Position weights: element i = r * _ROW + j of a flattened tensor counts u_k(j) * v_k(r) times in
# sum k, u and v being Weyl sequences (multiples of the golden ratio's and sqrt 2's fractional
# parts, plus 1/2: the same on every rank, never zero, never a pattern that a row swap or a
# transposition keeps), so moving a value changes these sums where the plain sums do not see it.
# As a product, the sums are one matrix-vector pass over the tensor viewed as rows of _ROW.
_WEIGHTS = (0.6180339887498949, 0.41421356237309515)
_ROW = 1024
_ROWS_AT_ONCE = 1024  # a float64 copy of this many rows at a time: 8 MB


def _weights(positions: torch.Tensor, shift: int) -> torch.Tensor:
    """Weights (len(positions), 2) for 1-based positions: frac(p * a) + 1/2, a from `_WEIGHTS`
    rotated by `shift` (rows and columns use the two constants in opposite order)."""
    consts = torch.tensor(_WEIGHTS[shift:] + _WEIGHTS[:shift], dtype=torch.float64, device=positions.device)
    return torch.frac(positions.to(torch.float64)[:, None] * consts) + 0.5


def _position_sums(flat: torch.Tensor) -> list[float]:
    full = flat.numel() // _ROW
    device = flat.device
    columns = _weights(torch.arange(1, _ROW + 1, device=device), 0)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for start in range(0, full, _ROWS_AT_ONCE):
        stop = min(full, start + _ROWS_AT_ONCE)
        rows = flat[start * _ROW : stop * _ROW].view(stop - start, _ROW).to(torch.float64)
        sums += ((rows @ columns) * _weights(torch.arange(start + 1, stop + 1, device=device), 1)).sum(0)
    tail = flat[full * _ROW :].to(torch.float64)
    if tail.numel():
        row = _weights(torch.tensor([full + 1], device=device), 1)
        sums += (tail[:, None] * columns[: tail.numel()]).sum(0) * row[0]
    return [float(v) for v in sums]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """Six float64 numbers that change with any single value and with any reordering of values:
    the sum, the sum of magnitudes, the first and last element, and two sums of each element times
    a weight of its position (`_WEIGHTS`). Integer inputs (token ids) are read as float64, exact
    below 2**53."""
    if tensor.numel() == 0:
        return (0.0,) * 6
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return (
        float(flat.sum(dtype=torch.float64)),
        float(flat.abs().sum(dtype=torch.float64)),
        float(flat[0]),
        float(flat[-1]),
        *_position_sums(flat),
    )


@dataclass(frozen=True)
class Disagreement:
    """A tensor (or count) whose value differs between ranks: its name, a rank that differs from
    the first rank holding it, and every rank's fingerprint of it (None where a rank holds no
    copy of that block)."""

    name: str
    rank: int
    values: list[Fingerprint | None]
    first: int = 0  # the rank `rank` differs from


def first_disagreement(
    named: Sequence[tuple[str, torch.Tensor | Fingerprint]], group: dist.ProcessGroup | None = None
) -> Disagreement | None:
    """The first of `named` (tensors, or their fingerprints) whose value differs between ranks,
    and a rank that differs from rank 0; None when all agree. Every rank gets the same answer.

    One all-reduce of the fingerprints (the largest of each number and of its negation: all ranks
    agree exactly when both give the same value) decides; only when some differ does an
    all-gather find which and where."""
    return first_disagreement_among_holders([(n, t, 0, 1) for n, t in named], group)


def first_disagreement_among_holders(
    named: Sequence[tuple[str, torch.Tensor | Fingerprint, int, int]], group: dist.ProcessGroup | None = None
) -> Disagreement | None:
    """Like `first_disagreement` for tensors of which each rank holds one block: `(name, this
    rank's block or its fingerprint, which block it is, how many blocks there are)`; ranks that
    hold the same block must agree on it, and blocks are never compared with each other. Still
    one all-reduce for all of them together."""
    return PendingAgreement(named, group).result()


class PendingAgreement:
    """`first_disagreement_among_holders` in two halves, so that a rank can compute while the
    all-reduce travels: made, it fingerprints and issues the all-reduce without waiting;
    `result()` waits and, only where some differ, all-gathers to find which and where. Every rank
    must call `result()` before its next collective on `group` (the all-gather of a disagreement
    is one) and gets the same answer."""

    def __init__(
        self, named: Sequence[tuple[str, torch.Tensor | Fingerprint, int, int]], group: dist.ProcessGroup | None
    ) -> None:
        self.named = list(named)
        self.group = group
        self.mine = [fingerprint(t) if isinstance(t, torch.Tensor) else t for _, t, _, _ in named]
        self.slots = [(slot, count) for _, _, slot, count in named]
        self.reduced = _agreement_buffer(self.mine, self.slots, collective_device(group))
        self.work = dist.all_reduce(self.reduced, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def result(self) -> Disagreement | None:
        if self.work is not None:
            self.work.wait()
        if _agreed(self.reduced):
            return None
        everyone = all_gathered((self.mine, [slot for slot, _ in self.slots]), self.group, collective_device(self.group))
        for index, (name, _, _, count) in enumerate(self.named):
            held = [(rank, tuple(prints[index]), where[index]) for rank, (prints, where) in enumerate(everyone)]
            for block in range(count):
                holders = [(rank, value) for rank, value, at in held if at == block]
                for rank, value in holders[1:]:
                    if not _same(value, holders[0][1]):
                        values = [value if at == block else None for _, value, at in held]
                        return Disagreement(name, rank, values, holders[0][0])
        return None


def stored_disagreement(
    named: Sequence[tuple[str, torch.Tensor | Fingerprint]], group: dist.ProcessGroup | None = None
) -> Disagreement | None:
    """The first of a parallel module's stored tensors (DTensors: each rank holds a block) whose
    copies differ between the ranks that hold the same block (replicas along the mesh axes it is
    not split on): what loading different checkpoints, or different state dicts, on different
    ranks leaves. A block held by one rank only has nothing to be compared with. A tensor with a
    partial placement (partial sums differ by design) is skipped; a plain tensor (or its
    fingerprint) is one whole value that every rank must agree on."""
    entries: list[tuple[str, torch.Tensor | Fingerprint, int, int]] = []
    for name, value in named:
        if not isinstance(value, DTensor):
            entries.append((name, value, 0, 1))
            continue
        if any(p.is_partial() for p in value.placements):
            continue
        coords = value.device_mesh.get_coordinate()
        if coords is None:  # this rank is outside the tensor's mesh
            continue
        slot, count = 0, 1
        for axis, placement in enumerate(value.placements):
            if placement.is_shard():
                size = value.device_mesh.size(axis)
                slot, count = slot * size + coords[axis], count * size
        entries.append((name, value.to_local(), slot, count))
    return first_disagreement_among_holders(entries, group)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where autopar's own small check tensors must be for a collective on `group`: NCCL moves
    only CUDA tensors; gloo and mixed backends take CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agreement_buffer(
    prints: Sequence[Fingerprint], slots: Sequence[tuple[int, int]], device: torch.device
) -> torch.Tensor:
    """What the agreement's one all-reduce (MAX) takes: each fingerprint goes in its block's place
    among its tensor's blocks; the places of blocks this rank does not hold read -inf, so the
    largest of each number and of its negation come from the ranks holding that block only."""
    values: list[float] = []
    present: list[bool] = []
    for fp, (slot, count) in zip(prints, slots, strict=True):
        for block in range(count):
            values += fp if block == slot else [0.0] * len(fp)
            present += [block == slot] * len(fp)
    numbers = torch.tensor(values, dtype=torch.float64, device=device)
    held = torch.tensor(present, dtype=torch.bool, device=device).repeat(4)
    nan = torch.isnan(numbers)
    numbers = torch.where(nan, 0.0, numbers)  # NaN equals NaN here, as in `_same`
    both = torch.cat([numbers, -numbers, nan.double(), -nan.double()])
    return torch.where(held, both, -torch.inf)


def _agreed(both: torch.Tensor) -> bool:
    """Whether every rank holding a block agrees, from the all-reduced `_agreement_buffer`: the
    largest of each number equals minus the largest of its negation."""
    half = both.numel() // 2
    largest, smallest = both[:half].chunk(2), both[half:].chunk(2)
    unheld = largest[0] == -torch.inf  # no rank holds that block: nothing to compare
    return bool(
        ((largest[0] == -largest[1]) | unheld).all() and ((smallest[0] == -smallest[1]) | unheld).all()
    )


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(a, b))  # NaN equals NaN here
