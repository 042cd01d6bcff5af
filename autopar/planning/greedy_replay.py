"""The greedy pass over repeated blocks: a block whose inputs stand as the block before's did gets
that block's choices again, renamed, without choosing them again.

A traced transformer is block 1 copied for blocks 2..N-1 (`passes.repeats`, nodes renamed by
`core.meta.copy_name`), and the greedy pass (`greedy._Greedy`) walks every copy node by node. Each
of its decisions is a function of the graph and of the *state* of the nodes it looks at: their
layouts, strategies, notes, deferral kinds, whether a tangent is still pending, and the forced
strategies of a seed. The memo (`GreedyMemo.choices`) already answers a repeated question, but
building the question (inputs' layouts, readers and their keys) still costs a few hundred
microseconds per node, per pass, and the screen and the search run hundreds of passes.

So the pass records, while it walks one run of a block (its forward, or its backward), every
node state it touches, as it was before the first touch, and every write it makes. A later run
of the same nodes of another block (the copy `shift` blocks on) is replayed from that record when
every recorded node, renamed by the shift, stands now as it stood then: the pass, being a
function of those states and of the graph (equal under the renaming: the copies are one block's
nodes), would make the same writes renamed; they are applied in the same order. Where a renamed
node would fall outside the copied blocks (block 1's forward reads block 0's output, which has no
copy name), or any state differs, the run is walked as usual (and recorded, for the runs after).
`tests/test_greedy_replay.py` compares the replayed pass with the plain one, field for field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.fx as fx

from autopar.core.meta import REPEATS_KEY, copy_name
from autopar.core.plan import Plan
from autopar.core.strategy import Strategy

_COPY = re.compile(r"^(.*)_b(\d+)$")
MISSING: Any = object()  # a key absent from a recorded dict (distinct from any stored value)


@dataclass(frozen=True)
class Run:
    """Consecutive call nodes of one block: `start` and `stop` index the graph's node list."""

    start: int
    stop: int
    block: int
    bases: tuple[str, ...]  # block 1's names of its nodes


# a node's place in the copies: every copy's name (index = block; index 0 unused) and its block
Place = tuple[tuple[str, ...], int]


@dataclass
class Blocks:
    """Where the copied blocks lie in a graph: per node name its place, and the runs of call
    nodes of one block. Worked out once per graph (`blocks_of`)."""

    nodes: list[fx.Node]
    by_name: dict[str, fx.Node]
    place: dict[str, Place]
    count: int
    runs: dict[int, Run]  # by start index

    def rename(self, name: str, shift: int) -> str | None:
        """`name` in the block `shift` on (None: it falls outside blocks 1..count-1); a name
        outside the blocks is shared by every copy and stays."""
        found = self.place.get(name)
        if found is None:
            return name
        row, block = found
        block += shift
        return row[block] if 1 <= block < self.count else None


def blocks_of(gm: fx.GraphModule) -> Blocks | None:
    """The copied blocks of a graph traced with one repeated group (None: no replay)."""
    groups = gm.meta.get(REPEATS_KEY, ())
    if len(groups) != 1:
        return None
    count = groups[0].count
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    place: dict[str, Place] = {}
    for n in nodes:
        if n.op in ("placeholder", "call_function") and copy_name(n.name, 2) in by_name:
            row = ("", n.name, *(copy_name(n.name, k) for k in range(2, count)))
            if any(name not in by_name for name in row[2:]):
                return None
            for k in range(1, count):
                place[row[k]] = (row, k)
    runs: dict[int, Run] = {}
    i = 0
    while i < len(nodes):
        found = place.get(nodes[i].name) if nodes[i].op == "call_function" else None
        if found is None:
            i += 1
            continue
        j = i
        while (
            j < len(nodes)
            and nodes[j].op == "call_function"
            and place.get(nodes[j].name, ((), -1))[1] == found[1]
        ):
            j += 1
        runs[i] = Run(i, j, found[1], tuple(place[n.name][0][1] for n in nodes[i:j]))
        i = j
    return Blocks(nodes, by_name, place, count, runs)


@dataclass
class Record:
    """One run walked: per touched node and dict, its value before the first touch; the writes in
    order (dict, operation, key, value)."""

    block: int
    before: dict[tuple[str, str], Any] = field(default_factory=dict)
    writes: list[tuple[str, str, str, Any]] = field(default_factory=list)


class Tracked(MutableMapping[Any, Any]):
    """A dict of the pass seen through a record: keys are node names, or nodes (`by_node`)."""

    def __init__(self, name: str, data: dict[Any, Any], record: Record, by_node: bool) -> None:
        self.name, self.data, self.record, self.by_node = name, data, record, by_node

    def _key(self, key: Any) -> str:
        name: str = key.name if self.by_node else key
        if (self.name, name) not in self.record.before:
            self.record.before[(self.name, name)] = self.data.get(key, MISSING)
        return name

    def __getitem__(self, key: Any) -> Any:
        self._key(key)
        return self.data[key]

    def get(self, key: Any, default: Any = None) -> Any:
        self._key(key)
        return self.data.get(key, default)

    def __contains__(self, key: object) -> bool:
        self._key(key)
        return key in self.data

    def __setitem__(self, key: Any, value: Any) -> None:
        self.record.writes.append((self.name, "set", self._key(key), value))
        self.data[key] = value

    def __delitem__(self, key: Any) -> None:
        self.record.writes.append((self.name, "del", self._key(key), None))
        del self.data[key]

    def pop(self, key: Any, *default: Any) -> Any:
        self.record.writes.append((self.name, "pop", self._key(key), None))
        return self.data.pop(key, *default)

    def setdefault(self, key: Any, value: Any = None) -> Any:
        self.record.writes.append((self.name, "setdefault", self._key(key), value))
        return self.data.setdefault(key, value)

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("a recorded run does not iterate the pass's dicts")

    def __len__(self) -> int:
        raise TypeError("a recorded run does not size the pass's dicts")


class TrackedSet:
    """A set of nodes of the pass (pending tangents) seen through a record."""

    def __init__(self, name: str, data: set[fx.Node], record: Record) -> None:
        self.name, self.data, self.record = name, data, record

    def _key(self, node: fx.Node) -> str:
        if (self.name, node.name) not in self.record.before:
            self.record.before[(self.name, node.name)] = node in self.data
        return node.name

    def __contains__(self, node: fx.Node) -> bool:
        self._key(node)
        return node in self.data

    def add(self, node: fx.Node) -> None:
        self.record.writes.append((self.name, "add", self._key(node), None))
        self.data.add(node)

    def discard(self, node: fx.Node) -> None:
        self.record.writes.append((self.name, "discard", self._key(node), None))
        self.data.discard(node)


class TrackedList:
    """The pass's list of decided node names, appended to only."""

    def __init__(self, name: str, data: list[str], record: Record) -> None:
        self.name, self.data, self.record = name, data, record

    def append(self, value: str) -> None:
        self.record.writes.append((self.name, "append", "", value))
        self.data.append(value)


# values holding a node name, per dict: renamed with their key (`resolved_by`: (node, input index))
NAMED_VALUES = frozenset({"resolved_by"})
_FIXED: Place = ((), 0)  # a name shared by every copy


@dataclass
class Compiled:
    """A record with every name at its place: renamed for any shift by indexing."""

    block: int
    before: list[tuple[str, Place, str, Any, Place | None]]  # dict, place, name, value (its name's place)
    writes: list[tuple[str, str, Place, str, Any, Place | None]]  # dict, op, place, key, value, ...
    # the shifts that rename every name of the record (its keys and named values) into the copies
    shifts: range = range(0)


def compiled(record: Record, blocks: Blocks) -> Compiled:
    place = blocks.place

    def value_place(dict_name: str, value: Any) -> Place | None:
        if dict_name in NAMED_VALUES and value is not MISSING and value is not None:
            return place.get(value[0], _FIXED)
        return None

    before = [
        (d, place.get(name, _FIXED), name, was, value_place(d, was))
        for (d, name), was in record.before.items()
    ]
    writes: list[tuple[str, str, Place, str, Any, Place | None]] = []
    for d, op, name, value in record.writes:
        if d == "decided":
            writes.append((d, op, place.get(value, _FIXED), value, value, None))
        else:
            writes.append((d, op, place.get(name, _FIXED), name, value, value_place(d, value)))
    # a name of block k renames by `shift` into block k + shift, which must lie in 1..count-1
    places = [p for _, at, _, _, named in before for p in (at, named)]
    places += [p for _, _, at, _, _, named in writes for p in (at, named)]
    blocks_seen = [p[1] for p in places if p is not None and p[1]]
    low, high = (
        (1 - min(blocks_seen), blocks.count - 1 - max(blocks_seen))
        if blocks_seen
        else (-blocks.count, blocks.count)
    )
    return Compiled(record.block, before, writes, range(low, high + 1))


def _moved(at: Place, name: str, block: int) -> str | None:
    """A name at `at` in `block` (its block plus the shift; a shared name stays)."""
    row, k = at
    if not k:
        return name
    return row[block] if 0 < block < len(row) else None


def matches(record: Compiled, shift: int, state: Callable[[str, str], Any]) -> bool:
    """Whether every node the record touched stands, renamed `shift` blocks on, as it stood before
    the recorded run touched it (`state(dict, name)`: its value now, MISSING if absent), and every
    write renames (a replay writes nothing it cannot name: `Compiled.shifts`)."""
    if shift not in record.shifts:
        return False
    for dict_name, (row, k), name, was, named in record.before:
        renamed = row[k + shift] if k else name
        if named is not None:
            was = (named[0][named[1] + shift] if named[1] else was[0], was[1])
        now = state(dict_name, renamed)
        if now is not was and now != was:
            return False
    return True


def replay(
    record: Compiled,
    blocks: Blocks,
    shift: int,
    dicts: dict[str, dict[Any, Any]],
    node_keyed: frozenset[str],
    sets: dict[str, set[fx.Node]],
    lists: dict[str, list[str]],
) -> None:
    """Apply the record's writes renamed `shift` blocks on, in order (`matches` held)."""
    by_name = blocks.by_name
    for dict_name, op, at, name, value, named in record.writes:
        renamed = _moved(at, name, at[1] + shift)
        assert renamed is not None
        if dict_name in lists:
            lists[dict_name].append(renamed)
            continue
        if dict_name in sets:
            if op == "add":
                sets[dict_name].add(by_name[renamed])
            else:
                sets[dict_name].discard(by_name[renamed])
            continue
        target = dicts[dict_name]
        key: Any = by_name[renamed] if dict_name in node_keyed else renamed
        if named is not None:
            value = (_moved(named, value[0], named[1] + shift), value[1])
        if op == "set":
            target[key] = value
        elif op == "setdefault":
            target.setdefault(key, value)
        elif op == "pop":
            target.pop(key, None)
        else:
            del target[key]


class PassState(Protocol):
    """What `walk` reads and swaps of the greedy pass (`greedy._Greedy`)."""

    plan: Plan
    deferred: dict[fx.Node, str]
    tangents: set[fx.Node]
    forced: dict[str, Strategy]
    readers: Any  # `greedy_ahead.Readers`: its layouts, deferred, tangents and forced are the pass's

    def visit(self, node: fx.Node) -> None: ...


def walk(p: PassState, blocks: Blocks) -> int:
    """Lay out the graph's nodes in order (`p.visit`), each run of a copied block replayed from the
    record of the same run of another block where the nodes it touched stand alike; the number of
    runs replayed. Runs of blocks 2..N-2 are recorded: block 1 reads block 0's output and block
    N-1's output is read after the blocks, values with no copy name that a shift would rename."""
    records: dict[tuple[str, ...], Compiled] = {}
    nodes, i, replayed = blocks.nodes, 0, 0
    plan = p.plan
    dicts: dict[str, dict[Any, Any]] = {
        "layouts": plan.layouts, "strategies": plan.strategies, "notes": plan.notes,
        "deferred_inputs": plan.deferred_inputs, "resolved_by": plan.resolved_by,
        "stored_from": plan.stored_from, "deferred": p.deferred, "forced": p.forced,
    }  # fmt: skip
    by_name = blocks.by_name

    def state(dict_name: str, name: str) -> Any:  # a node's entry now (MISSING where absent)
        if dict_name == "tangents":
            return by_name[name] in p.tangents
        if dict_name == "deferred":
            return p.deferred.get(by_name[name], MISSING)
        return dicts[dict_name].get(name, MISSING)

    while i < len(nodes):
        run = blocks.runs.get(i)
        if run is None:
            p.visit(nodes[i])
            i += 1
            continue
        record = records.get(run.bases)
        shift = run.block - record.block if record is not None else 0
        if record is not None and shift and matches(record, shift, state):
            replay(
                record,
                blocks,
                shift,
                dicts,
                frozenset({"deferred"}),
                {"tangents": p.tangents},
                {"decided": plan.decided},
            )
            replayed += 1
        elif 2 <= run.block <= blocks.count - 2:
            records[run.bases] = compiled(_recorded(p, run, blocks), blocks)
        else:
            for node in nodes[run.start : run.stop]:
                p.visit(node)
        i = run.stop
    return replayed


def _recorded(p: PassState, run: Run, blocks: Blocks) -> Record:
    """Walk a run with the pass's state seen through a record of what it touches and writes."""
    record = Record(run.block)
    plan, readers = p.plan, p.readers
    plain = (plan.layouts, plan.strategies, plan.notes, plan.deferred_inputs, plan.resolved_by,
             plan.stored_from, plan.decided, p.deferred, p.tangents, p.forced)  # fmt: skip
    layouts = Tracked("layouts", plan.layouts, record, False)
    deferred = Tracked("deferred", p.deferred, record, True)
    tangents = TrackedSet("tangents", p.tangents, record)
    forced = Tracked("forced", p.forced, record, False)
    plan.layouts = layouts  # type: ignore[assignment]
    plan.strategies = Tracked("strategies", plan.strategies, record, False)  # type: ignore[assignment]
    plan.notes = Tracked("notes", plan.notes, record, False)  # type: ignore[assignment]
    plan.deferred_inputs = Tracked("deferred_inputs", plan.deferred_inputs, record, False)  # type: ignore[assignment]
    plan.resolved_by = Tracked("resolved_by", plan.resolved_by, record, False)  # type: ignore[assignment]
    plan.stored_from = Tracked("stored_from", plan.stored_from, record, False)  # type: ignore[assignment]
    plan.decided = TrackedList("decided", plan.decided, record)  # type: ignore[assignment]
    p.deferred, p.tangents, p.forced = deferred, tangents, forced  # type: ignore[assignment]
    readers.layouts, readers.deferred, readers.tangents, readers.forced = layouts, deferred, tangents, forced  # type: ignore[assignment]
    try:
        for node in blocks.nodes[run.start : run.stop]:
            p.visit(node)
    finally:
        (plan.layouts, plan.strategies, plan.notes, plan.deferred_inputs, plan.resolved_by,
         plan.stored_from, plan.decided, p.deferred, p.tangents, p.forced) = plain  # fmt: skip
        readers.layouts, readers.deferred, readers.tangents, readers.forced = (
            plan.layouts,
            p.deferred,
            p.tangents,
            p.forced,
        )
    return record
