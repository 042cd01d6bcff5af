"""How many batch chunks each rank runs (`PlanOptions.over_decompose`,
`autopar.planning.overdecompose`): the count the user gives, or "auto": the count whose modeled
step (lowered, decomposed and scheduled like the real one) is shortest, chosen once per program.
A rank choosing for its own coordinates could pick another count than its peers, whose chunks'
collectives then would not match, and every rank would run the trials again for nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.core.errors import AutoparError
from autopar.runtime.agreement import ChoiceAgreement
from autopar.runtime.wire import JsonWire, RefusedPayload, exact_fields, field_of, pairs_of

AUTO_CHUNKS = (1, 2, 4)  # batch chunks per rank that over_decompose="auto" compares


@dataclass(frozen=True)
class ChunkChoice:
    """The chunk count the program runs and, for "auto", the modeled step of each count that fits
    (count, seconds), which the report shows."""

    chunks: int
    steps: tuple[tuple[int, float], ...] = ()


def _encoded(choice: ChunkChoice) -> dict[str, Any]:
    return {"chunks": choice.chunks, "steps": [list(step) for step in choice.steps]}


def _decoded(data: Any) -> ChunkChoice:
    """A choice "auto" can make, else `RefusedPayload`: a count of `AUTO_CHUNKS` among the counts
    modeled, each modeled once."""
    what = "the over-decomposition's chunk count"
    fields = exact_fields(data, frozenset({"chunks", "steps"}), what)
    chunks = field_of(fields, "chunks", int, what)
    steps = pairs_of(fields, "steps", int, what)
    counts = [k for k, _ in steps]
    if not set(counts) <= set(AUTO_CHUNKS) or len(set(counts)) != len(counts) or chunks not in counts:
        raise RefusedPayload(f"{what}: {chunks} chunks among the modeled counts {counts}, not a choice of {AUTO_CHUNKS}")
    return ChunkChoice(chunks, steps)


# how the choice travels between ranks (`runtime.wire`); its `what` names it in messages
OVER_DECOMPOSITION = JsonWire("the over-decomposition's batch chunks", _encoded, _decoded)


def chunk_candidates(over_decompose: int | str) -> list[int]:
    """The chunk counts `over_decompose` asks to compare (one: no choice to make)."""
    if over_decompose == "auto":
        return list(AUTO_CHUNKS)
    if isinstance(over_decompose, int) and not isinstance(over_decompose, bool) and over_decompose >= 1:
        return [over_decompose]
    raise AutoparError(
        f"over_decompose={over_decompose!r}",
        hint='give the number of batch chunks per rank (1: off) or "auto" to let the cost model choose',
    )


def chosen_chunks(
    candidates: Sequence[int],
    step_times: Callable[[Sequence[int]], dict[int, float]],
    agree: ChoiceAgreement | None = None,
) -> ChunkChoice:
    """The chunk count of the program: the only candidate, or the fastest of `step_times(candidates)`
    (the modeled step of each count that fits; ties to fewer chunks), decided where `agree` says
    (None: this rank decides)."""
    if len(candidates) == 1:
        return ChunkChoice(candidates[0])

    def decide() -> ChunkChoice:
        times = step_times(candidates)
        return ChunkChoice(min(times, key=lambda k: (times[k], k)), tuple(sorted(times.items())))

    return agree(decide, OVER_DECOMPOSITION) if agree is not None else decide()
