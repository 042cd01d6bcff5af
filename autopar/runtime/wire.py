"""How a decision travels from rank 0 to the other ranks (`agreement.decided_on_rank0`): as bytes
in two broadcasts (the length, then the bytes), read back with nothing executed that rank 0 could
name at will.

A choice made of plain names and numbers (which collective matmuls to decompose, how many batch
chunks to run) travels as JSON, read back by its own validating decoder (`JsonWire`). A plan, a
mesh choice or a pipeline's decision is a tree of autopar's dataclasses; it travels pickled and is
read by an allow-listed unpickler (`allowed_loads`): only autopar's data types (dataclasses,
enums, its errors, layout placements), torch dtypes and a few builtin constructors may be named.
The peer is rank 0 of the same job, not a file; still, a payload is never a way to run code."""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError
from autopar.core.layout import Partial, Replicate, Shard

T = TypeVar("T")

# builtin constructors a pickled value may name (tuples, lists, dicts and sets are opcodes)
_BUILTINS = frozenset({"bool", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "set", "slice", "str", "tuple"})
_PACKAGE = "autopar."


class RefusedPayload(ValueError):
    """A payload that names something the allow-list does not hold, or a JSON choice that is not
    one (a field missing, of the wrong type or out of range)."""


@dataclass(frozen=True)
class JsonWire(Generic[T]):
    """A choice as it travels: `what` it is (for messages, and the key an in-process run keeps it
    under), `encode` to plain JSON data (dicts with string keys, lists, strings, numbers, bools)
    and `decode` back, raising `RefusedPayload` on anything that is not such a choice."""

    what: str
    encode: Callable[[T], Any]
    decode: Callable[[Any], T]

    def dumps(self, value: T) -> str:
        return json.dumps(self.encode(value))

    def loads(self, text: str) -> T:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RefusedPayload(f"not JSON: {exc}") from exc
        return self.decode(data)

    def carried(self, value: T) -> T:
        """`value` as a rank that received it reads it: encoded and decoded again."""
        return self.loads(self.dumps(value))


def field_of(data: Any, name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """`data[name]`, which must be of `kinds` (a bool is not a number here), else `RefusedPayload`."""
    if not isinstance(data, dict) or name not in data:
        raise RefusedPayload(f"{what}: no field {name!r} in {type(data).__name__}")
    value = data[name]
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise RefusedPayload(f"{what}: {name} is a bool, expected {kinds}")
    if not isinstance(value, kinds):
        raise RefusedPayload(f"{what}: {name} is {type(value).__name__}, expected {kinds}")
    return value


def strings_of(data: Any, name: str, what: str) -> tuple[str, ...]:
    """`data[name]`: a list of strings, else `RefusedPayload`."""
    items = field_of(data, name, list, what)
    if not all(isinstance(item, str) for item in items):
        raise RefusedPayload(f"{what}: {name} holds other than strings")
    return tuple(items)


def pairs_of(data: Any, name: str, key: type, what: str) -> tuple[tuple[Any, float], ...]:
    """`data[name]`: a list of [key, number] pairs (a key of type `key`, no bools), else
    `RefusedPayload`."""
    pairs = []
    for item in field_of(data, name, list, what):
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is key and _is_number(item[1])):
            raise RefusedPayload(f"{what}: {name} holds {item!r}, not a [{key.__name__}, number] pair")
        pairs.append((item[0], float(item[1])))
    return tuple(pairs)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def exact_fields(data: Any, names: frozenset[str], what: str) -> dict[str, Any]:
    """`data` as a dict holding exactly the fields `names`, else `RefusedPayload`."""
    if not isinstance(data, dict) or set(data) != names:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise RefusedPayload(f"{what}: expected the fields {sorted(names)}, got {got}")
    return data


def _is_data_type(obj: object) -> bool:
    """autopar's types whose instances are data: dataclasses, enums, errors, layout placements."""
    return isinstance(obj, type) and (
        dataclasses.is_dataclass(obj) or issubclass(obj, (enum.Enum, AutoparError, Shard, Replicate, Partial))
    )


class _AllowListed(pickle._Unpickler):  # the Python unpickler: its BUILD can be checked
    """Resolves only autopar's data types, torch dtypes and builtin constructors; `BUILD` (setting
    an object's state) only on instances of autopar's data types, never on a class, whose
    attributes it would set."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        # a module this process has imported (nothing imported on a payload's word), and no
        # dotted path out of it
        if module.startswith(_PACKAGE) and module in sys.modules and name.isidentifier():
            found = getattr(sys.modules[module], name, None)
            if _is_data_type(found) and getattr(found, "__module__", None) == module:
                return found
        raise RefusedPayload(f"the payload names {module}.{name}, which is not one of autopar's data types")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPayload("the payload holds a persistent id, which no decision holds")

    def _checked_build(self) -> None:
        inst = self.stack[-2]  # type: ignore[attr-defined]  # below the state BUILD sets
        if isinstance(inst, type) or not _is_data_type(type(inst)):
            raise RefusedPayload(f"the payload sets the state of {inst!r}, which is not an instance of autopar's data types")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _checked_build}  # type: ignore[attr-defined,dict-item]


def allowed_loads(data: bytes) -> Any:
    """Unpickle `data` naming only autopar's data types (of modules already imported), torch
    dtypes and builtin constructors, and setting the state of those types' instances only;
    anything else raises `RefusedPayload` before it is called or set. (The Python unpickler, whose
    BUILD can be checked: 0.05-0.1 s for the plan of a 12-layer GPT-2, 2255 nodes, 272 KB.)"""
    try:
        return _AllowListed(io.BytesIO(data)).load()
    except RefusedPayload:
        raise
    except Exception as exc:  # a truncated or malformed payload: refused alike
        raise RefusedPayload(f"unreadable payload: {type(exc).__name__}: {exc}") from exc


def broadcast_bytes(data: bytes | None, group: dist.ProcessGroup | None, device: torch.device) -> bytes:
    """`data` of rank 0 of `group` on every rank of it (None on the others): its length, then its
    bytes, as two tensor broadcasts on `device` (where the group's backend moves tensors)."""
    is_source = dist.get_rank(group) == 0
    if is_source and data is None:
        raise ValueError("rank 0 must give the bytes it broadcasts")
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, group=group, group_src=0)
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, group=group, group_src=0)
    return data if data is not None else buffer.cpu().numpy().tobytes()


def all_gathered(value: Any, group: dist.ProcessGroup | None, device: torch.device) -> list[Any]:
    """`value` (plain JSON data: strings, numbers, None, lists, dicts with string keys; tuples
    arrive as lists) of every rank of `group`, in rank order, each read back by `json.loads`: the
    JSON's lengths, then the JSON padded to the longest, as two tensor all-gathers on `device`.
    What the ranks' checks compare (fingerprints, a trace's digest, a failure's text) is data, and
    is never unpickled."""
    data = json.dumps(value).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(gathered, buffer, group=group)
    return [json.loads(g[:n].cpu().numpy().tobytes()) for g, n in zip(gathered, lengths, strict=True)]
