"""Which ready collective takes a communication stream first, on the schedule stage's modeled clock.

The schedule stage (`autopar.passes.schedule`) issues each collective as soon as it is ready; on
one link collectives then queue in issue order, and a collective with slack (a weight prefetch, a
gradient on its way out) issued first holds up one the compute needs next (an activation's
gather). `LinkOrder` prices that choice on the clock, earliest deadline first.
"""

from __future__ import annotations

import bisect

import torch.fx as fx

from autopar.core.collectives import comm_group
from autopar.cost.timeline import StepClock


class LinkOrder:
    """The order in which ready collectives take a communication stream: earliest deadline first,
    on the schedule's modeled clock.

    A collective's deadline is where the compute first needs its result (the first user of its
    wait, in the graph's order, read as compute seconds from the node being placed); a gradient
    on its way out (the tail) has none. A collective ready now is held back when one due sooner
    reaches the same stream before it would end, and the two, priced in either order on the
    clock, wait exposed less with the one due sooner first (`hold`); the link may then idle until
    that one arrives. Deadlines only ever defer to earlier ones, so the collective due first is
    never held, and one held is still issued at once where the compute needs it (the schedule's
    `ensure`). Everything here reads the graph and the clock only: every rank decides alike.
    """

    LOOK = 16  # competitors looked at per decision, the nearest in deadline and arrival

    def __init__(
        self,
        clock: StepClock,
        nodes: list[fx.Node],
        original: dict[fx.Node, int],
        externals: dict[fx.Node, list[fx.Node]],
        tail: set[fx.Node],
        elapsed: list[float],
    ) -> None:
        self.clock = clock
        self.elapsed = elapsed
        end = len(nodes) - 1
        self.ready_at = {c: max((original[i] for i in ext), default=0) for c, ext in externals.items()}
        self.due_at: dict[fx.Node, int] = {}  # tail collectives: none
        for c in externals:
            if c not in tail:
                uses = [original[u] for w in c.users for u in w.users]
                self.due_at[c] = min(uses, default=end)
        self.arriving: dict[str, list[tuple[int, int, fx.Node]]] = {}  # stream -> (ready_at, original, c)
        for c in externals:
            self.arriving.setdefault(clock.stream(c), []).append((self.ready_at[c], original[c], c))
        for entries in self.arriving.values():
            entries.sort(key=lambda e: (e[0], e[1]))
        self.original = original
        self.waiting: dict[str, list[tuple[int, int, fx.Node]]] = {}  # stream -> ready, unissued, by due
        self.is_waiting: set[fx.Node] = set()
        self.held: list[fx.Node] = []
        self.retry: dict[fx.Node, tuple[int, float]] = {}  # held -> (events then, clock time to look again)
        self.events = 0  # collectives issued and waits placed so far

    def ready(self, c: fx.Node) -> None:
        """`c` has every input: from now on it competes for its stream."""
        if c not in self.is_waiting:
            self.is_waiting.add(c)
            bisect.insort(self.waiting.setdefault(self.clock.stream(c), []), (*self._key(c), c), key=lambda e: e[:2])

    def issued(self, c: fx.Node) -> None:
        """`c` is on its stream now: it competes no more."""
        self.events += 1
        if c in self.is_waiting:
            self.is_waiting.discard(c)
            entries = self.waiting[self.clock.stream(c)]
            entries.pop(bisect.bisect_left(entries, self._key(c), key=lambda e: e[:2]))

    def look_again(self, c: fx.Node) -> bool:
        """Whether a held collective's case may have changed: a collective issued or a wait placed
        since it was last priced, or a quarter of its transfer gone by on the clock."""
        events, when = self.retry.get(c, (-1, 0.0))
        return events != self.events or self.clock.now >= when

    def priced(self, c: fx.Node) -> None:
        self.retry[c] = (self.events, self.clock.now + self.clock.duration(c) / 4)

    def _key(self, c: fx.Node) -> tuple[int, int]:
        return (self.due_at.get(c, len(self.elapsed)), self.original[c])

    def hold(
        self, c: fx.Node, cursor: int, emitted: set[fx.Node], in_flight: dict[str, list[fx.Node]]
    ) -> bool:
        """Whether `c`, ready and free to go, should give way to a collective due sooner."""
        clock, elapsed = self.clock, self.elapsed
        stream, now = clock.stream(c), clock.now
        here = elapsed[min(cursor, len(elapsed) - 1)]

        def deadline(x: fx.Node) -> float:
            return now + max(0.0, elapsed[self.due_at[x]] - here) if x in self.due_at else float("inf")

        def late(finish: float, due: float) -> float:
            return max(0.0, finish - due)

        free = clock.free(stream)
        issue_c = clock.issuing(c)
        end_c = max(now + issue_c, free) + clock.duration(c) - issue_c
        due_c, key_c = deadline(c), self._key(c)
        for u, arrive in self._competitors(c, stream, key_c, cursor, here, end_c, emitted, in_flight):
            issue_u = clock.issuing(u)
            due_u, span_u = deadline(u), clock.duration(u) - issue_u
            c_first = late(end_c, due_c) + late(max(arrive + issue_u, end_c) + span_u, due_u)
            end_u = max(arrive + issue_u, free) + span_u
            u_first = late(end_u, due_u) + late(end_u + clock.duration(c) - issue_c, due_c)
            if u_first < c_first * (1 - 1e-9) - 1e-12:
                return True
        return False

    def _competitors(
        self,
        c: fx.Node,
        stream: str,
        key_c: tuple[int, int],
        cursor: int,
        here: float,
        end_c: float,
        emitted: set[fx.Node],
        in_flight: dict[str, list[fx.Node]],
    ) -> list[tuple[fx.Node, float]]:
        """Collectives due before `c` that reach `stream` before `c` would end, with when they do:
        the ready ones (at once, or when their group's collective in flight ends), then the next to
        become ready (after the compute before their last input)."""
        clock, now = self.clock, self.clock.now
        out: list[tuple[fx.Node, float]] = []
        waiting = self.waiting.get(stream, [])
        for due, orig, u in waiting[: self.LOOK]:
            if (due, orig) >= key_c:
                break
            if u is c:
                continue
            group = comm_group(u)
            busy = [clock.ends.get(x, now) for x in in_flight.get(group, ())] if group != comm_group(c) else []
            arrive = max([now, *busy[:1]])
            if arrive < end_c:
                out.append((u, arrive))
        arriving = self.arriving.get(stream, [])
        i = bisect.bisect_left(arriving, cursor, key=lambda e: e[0])
        for ready_at, _orig, u in arriving[i : i + self.LOOK]:
            arrive = now + max(0.0, self.elapsed[ready_at] - here)
            if arrive >= end_c:
                break
            if u in emitted or u in self.is_waiting or self._key(u) >= key_c:
                continue
            out.append((u, arrive))
        return out
